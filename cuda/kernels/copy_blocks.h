// Multi-layer block copies on raw pointers and a cudaStream_t (no torch).
//
// A call copies, for every pair k and every i, the row src_ids[i] of pair k's source to the
// row dst_ids[i] of pair k's destination. A row is row_bytes contiguous bytes; consecutive rows
// of a tensor are stride bytes apart (stride >= row_bytes). Either side of a call may be device
// memory or pinned (page-locked, mapped) host memory; every pointer of one side has the same
// kind. Arguments are expected to be validated by the caller (cpp/ops/checks.h does it for the
// torch op): ids in range, no repeated destination id, sources and destinations disjoint.
//
// Two mechanisms:
//   kMemcpy  one cudaMemcpyAsync per run of blocks whose source and destination ids are both
//            consecutive (cudaMemcpy2DAsync when the rows of a run are strided), per pair.
//   kKernel  one gather/scatter kernel launch for all pairs and blocks: one thread block per
//            (pair, block) row, 16-byte vector accesses when the row, both strides and both
//            base pointers are 16-byte aligned (8, 4 or 1 byte otherwise). Pinned host memory
//            is accessed through its device pointer (cudaHostGetDevicePointer). Needs a device
//            workspace of kernel_workspace_bytes() bytes for the pair table and the ids.
// kAuto picks kMemcpy when the copy calls would move at least kMinBytesPerCopyCall bytes each
// on average, else kKernel.
//
// Every CUDA call is checked: failures throw kvoff::kernels::CudaError (cuda_check.h).
// The copies are asynchronous with respect to the host: the caller synchronizes `stream`
// (or records an event) before reading the destination or reusing the source.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kvoff::kernels {

struct CopyPair {
  const void* src = nullptr;     // row 0 of the source (device or pinned host address)
  void* dst = nullptr;           // row 0 of the destination
  int64_t row_bytes = 0;         // bytes of one row
  int64_t src_stride_bytes = 0;  // bytes between consecutive source rows
  int64_t dst_stride_bytes = 0;  // bytes between consecutive destination rows
};

enum class MemoryKind : uint8_t { kDevice, kPinnedHost };
enum class CopyMethod : uint8_t { kAuto, kMemcpy, kKernel };

struct CopyBlocksParams {
  const CopyPair* pairs = nullptr;  // host array of num_pairs entries
  int64_t num_pairs = 0;
  const int64_t* src_ids = nullptr;  // host arrays of num_ids entries
  const int64_t* dst_ids = nullptr;
  int64_t num_ids = 0;
  MemoryKind src_kind = MemoryKind::kDevice;
  MemoryKind dst_kind = MemoryKind::kDevice;
};

// Average bytes per copy call from which kAuto prefers copy calls over the kernel.
inline constexpr int64_t kMinBytesPerCopyCall = int64_t{256} << 10;

// Resolves kAuto for these parameters (kMemcpy or kKernel); other methods are returned as is.
CopyMethod choose_copy_method(const CopyBlocksParams& params,
                              CopyMethod method = CopyMethod::kAuto);

// Bytes of device workspace that copy_blocks needs for CopyMethod::kKernel (0 for kMemcpy).
size_t kernel_workspace_bytes(int64_t num_pairs, int64_t num_ids);

// Enqueues the copies on `stream` (the current device must own `stream` and the device
// memory). `workspace` is device memory of at least kernel_workspace_bytes() bytes, usable in
// stream order on `stream`; it is needed only when the resolved method is kKernel (pass nullptr
// and 0 otherwise). Throws CudaError on a CUDA failure and std::invalid_argument on bad
// parameters (a missing workspace, negative sizes).
void copy_blocks(const CopyBlocksParams& params, CopyMethod method, void* workspace,
                 size_t workspace_bytes, cudaStream_t stream);

}  // namespace kvoff::kernels
