// Multi-layer block copies on raw pointers and a cudaStream_t (no torch).
//
// A call copies, for every pair k and every i, the row src_ids[i] of pair k's source to the
// row dst_ids[i] of pair k's destination. A row is row_bytes contiguous bytes; consecutive rows
// of a tensor are stride bytes apart (stride >= row_bytes). Either side of a call may be device
// memory or pinned (page-locked, mapped) host memory; every pointer of one side has the same
// kind. Arguments are expected to be validated by the caller (cpp/ops/checks.h does it for the
// torch op): ids in range, no repeated destination id, sources and destinations disjoint.
//
// Mechanisms (CopyMethod):
//   kMemcpy    one cudaMemcpyAsync per run of blocks whose source and destination ids are both
//              consecutive (cudaMemcpy2DAsync when the rows of a run are strided), per pair.
//   kBatch     ONE cudaMemcpyBatchAsync call for every run of every pair (a strided run becomes
//              one entry per row: the batch API copies 1-D ranges only). Needs CUDA >= 12.8 at
//              build time and a driver >= 12.8 at run time, and a stream other than the legacy
//              NULL stream; when any of these is missing the call falls back to kMemcpy (see
//              batch_copy_supported()). Saves the ~2 us per copy call (docs/design.md) of kMemcpy.
//   kKernel    one gather/scatter kernel launch for all pairs and blocks, on a bounded grid of
//              at most `kernel_blocks` thread blocks (default: 10% of the SMs), so that the
//              copy leaves the other SMs to compute. Work is split at warp granularity: each
//              warp copies one (pair, row) item at a time, grid-striding over all items.
//              16-byte vector accesses when the row, both strides and both base pointers are
//              16-byte aligned (8, 4 or 1 byte otherwise); several loads in flight per lane
//              before the stores (host memory has microseconds of latency). Pinned host memory
//              is accessed through its device pointer (cudaHostGetDevicePointer). Needs a
//              device workspace of kernel_workspace_bytes() bytes for the pair table and ids.
//   kPerBlock  the naive baseline for benchmarks: one cudaMemcpyAsync per block per pair, no
//              coalescing of adjacent blocks.
// kAuto picks kMemcpy when the copy calls would move at least kMinBytesPerCopyCall bytes each
// on average, else kKernel (a compiled-in rule; the Python side usually resolves "auto" from
// measured thresholds and passes a concrete method).
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
enum class CopyMethod : uint8_t { kAuto, kMemcpy, kBatch, kKernel, kPerBlock };

// "auto", "memcpy", "batch", "kernel" or "per_block" (the names of the torch op's mechanism).
const char* copy_method_name(CopyMethod method);

struct CopyBlocksParams {
  const CopyPair* pairs = nullptr;  // host array of num_pairs entries
  int64_t num_pairs = 0;
  const int64_t* src_ids = nullptr;  // host arrays of num_ids entries
  const int64_t* dst_ids = nullptr;
  int64_t num_ids = 0;
  MemoryKind src_kind = MemoryKind::kDevice;
  MemoryKind dst_kind = MemoryKind::kDevice;
  // kKernel only: the most thread blocks the kernel may use (its grid-size cap); 0 means
  // default_kernel_blocks() of the current device. Ignored by the other methods.
  int64_t kernel_blocks = 0;
};

// Threads per block of the kKernel kernel: 16 warps. With the grid capped at a few blocks, a
// block this large keeps enough 16-byte loads in flight (16 warps x 32 lanes x kUnroll) to
// cover host-memory latency from few SMs, while one block still fits any SM's register file
// at the kernel's register use.
inline constexpr int kKernelThreads = 512;

// Default grid-size cap of kKernel: max(1, floor(0.10 * multiProcessorCount)) of `device`
// (13 on a 132-SM H100), so the copy kernel occupies at most 10% of the SMs.
int default_kernel_blocks(int device);

// Whether kBatch can run in this process: built against CUDA >= 12.8, a driver >= 12.8
// (cudaDriverGetVersion >= 12080), and no earlier batch call in this process was refused as
// unsupported (cudaErrorNotSupported, cudaErrorCallRequiresNewerDriver). The verdict is cached
// per process; before the first batch call it rests on the versions alone.
bool batch_copy_supported();

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
// parameters (a missing workspace, negative sizes or kernel_blocks).
// Returns the method that ran: kAuto resolved, and kMemcpy when kBatch fell back.
CopyMethod copy_blocks(const CopyBlocksParams& params, CopyMethod method, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream);

}  // namespace kvoff::kernels
