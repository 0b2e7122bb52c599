// Argument validation for torch.ops.kvoff.copy_blocks, shared by the CPU kernel
// (copy_blocks_cpu.cpp) and the CUDA glue (cuda/torch/copy_blocks_cuda.cpp).
//
// Everything is validated before a single byte moves, so a rejected call leaves every
// destination tensor unchanged. Error types (as seen from Python):
//
//   ValueError   (TORCH_CHECK_VALUE)  an unknown mechanism name, a negative kernel_blocks,
//                                     list lengths, tensors or ids that are not dense
//                                     (sparse, mkldnn), tensor ranks, dtypes within a pair, row
//                                     sizes, row layout (contiguity, stride(0)), id dtype,
//                                     shape and lengths, duplicate destination ids
//   IndexError   (TORCH_CHECK_INDEX)  negative or out-of-range block ids
//   RuntimeError (TORCH_CHECK)        devices: mixed devices within src or dst, ids not on the
//                                     CPU, unsupported device combinations, unpinned host
//                                     memory in a CPU<->GPU copy; CUDA failures (CUDA glue)
//
// Every message starts with "kvoff.copy_blocks: ", names the offending value (pair index, id
// position and value, shapes, dtypes, devices) and says how to fix it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <vector>

namespace kvoff::ops {

// One (src[k], dst[k]) pair after validation, in bytes.
struct PairLayout {
  const char* src = nullptr;     // address of row 0 of src[k]
  char* dst = nullptr;           // address of row 0 of dst[k]
  int64_t row_bytes = 0;         // bytes of one row (sizes[1:] x element size)
  int64_t src_stride_bytes = 0;  // bytes between consecutive rows of src[k]
  int64_t dst_stride_bytes = 0;  // bytes between consecutive rows of dst[k]
};

// The copy mechanism of one call (the op's `mechanism` string). What each one does on the
// GPU is in cuda/kernels/copy_blocks.h; the CPU kernel runs kPerBlock as one memcpy per row
// on the calling thread and every other mechanism as its parallel run-coalesced memcpy.
enum class Mechanism : uint8_t { kAuto, kMemcpy, kBatch, kKernel, kPerBlock };

// The accepted names, in Mechanism order (kvoff.ops.MECHANISMS lists the same).
inline constexpr const char* kMechanismNames[] = {"auto", "memcpy", "batch", "kernel",
                                                  "per_block"};

// Parses a mechanism name; an unknown one raises ValueError naming it and the choices.
Mechanism parse_mechanism(c10::string_view name);

// Which device combinations the calling kernel accepts.
enum class DeviceRule {
  kCpu,   // CPU kernel: every src and dst tensor on the CPU
  kCuda,  // CUDA kernel: GPU->GPU (one device), GPU->pinned CPU, pinned CPU->GPU
};

// A validated copy_blocks call. The ids are contiguous int64 CPU arrays of num_ids entries
// (views into the caller's id tensors, or into the owned contiguous copies below).
struct CopyBlocksArgs {
  std::vector<PairLayout> pairs;
  const int64_t* src_ids = nullptr;
  const int64_t* dst_ids = nullptr;
  int64_t num_ids = 0;
  int64_t total_bytes = 0;  // bytes copied by the whole call
  c10::Device src_device{c10::kCPU};
  c10::Device dst_device{c10::kCPU};
  Mechanism mechanism = Mechanism::kAuto;
  int64_t kernel_blocks = 0;  // >= 0; 0 = the default grid-size cap
  // Keep contiguous copies of the ids alive when the caller passed strided ids.
  at::Tensor src_ids_holder;
  at::Tensor dst_ids_holder;
};

// Validates every argument of copy_blocks (see the file comment) and returns the byte layout.
// The mechanism name and kernel_blocks are checked first. Throws c10::Error subclasses
// (ValueError / IndexError / RuntimeError in Python).
CopyBlocksArgs check_copy_blocks_args(at::TensorList src, at::TensorList dst,
                                      const at::Tensor& src_block_ids,
                                      const at::Tensor& dst_block_ids,
                                      c10::string_view mechanism, int64_t kernel_blocks,
                                      DeviceRule rule);

// The kernel of the dispatch keys of non-dense tensors (SparseCPU, SparseCsrCPU, MkldnnCPU
// and their CUDA twins; copy_blocks_layouts.cpp): a call with a sparse tensor anywhere in it
// reaches this instead of a dense kernel, which raises the ValueError that names it (or an
// earlier error of check_copy_blocks_args). Never returns.
[[noreturn]] void check_copy_blocks_layouts(at::TensorList src, at::TensorList dst,
                                            const at::Tensor& src_block_ids,
                                            const at::Tensor& dst_block_ids,
                                            c10::string_view mechanism, int64_t kernel_blocks);

}  // namespace kvoff::ops
