// Multi-layer block copies on raw pointers; see copy_blocks.h for the contract.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "copy_blocks.h"
#include "kvoff/block_runs.h"
#include "cuda_check.h"

namespace kvoff::kernels {
namespace {

int64_t count_runs(const int64_t* src_ids, const int64_t* dst_ids, int64_t n) {
  int64_t runs = n > 0 ? 1 : 0;
  for (int64_t i = 1; i < n; ++i) {
    if (src_ids[i] != src_ids[i - 1] + 1 || dst_ids[i] != dst_ids[i - 1] + 1) {
      ++runs;
    }
  }
  return runs;
}

int64_t total_bytes(const CopyBlocksParams& p) {
  int64_t bytes = 0;
  for (int64_t k = 0; k < p.num_pairs; ++k) {
    bytes += p.pairs[k].row_bytes * p.num_ids;
  }
  return bytes;
}

void check_params(const CopyBlocksParams& p) {
  if (p.num_pairs < 0 || p.num_ids < 0) {
    throw std::invalid_argument("kvoff::kernels::copy_blocks: negative num_pairs (" +
                                std::to_string(p.num_pairs) + ") or num_ids (" +
                                std::to_string(p.num_ids) + ")");
  }
  if ((p.num_pairs > 0 && p.pairs == nullptr) ||
      (p.num_ids > 0 && (p.src_ids == nullptr || p.dst_ids == nullptr))) {
    throw std::invalid_argument(
        "kvoff::kernels::copy_blocks: null pairs or id arrays with non-zero counts");
  }
  if (p.kernel_blocks < 0) {
    throw std::invalid_argument("kvoff::kernels::copy_blocks: kernel_blocks = " +
                                std::to_string(p.kernel_blocks) +
                                " is negative; pass 0 (default) or a positive grid-size cap");
  }
}

// ---- kMemcpy ----

// Pitches above this are rejected by cudaMemcpy2DAsync (cudaDevAttrMaxPitch is 2^31 - 1 on
// current GPUs); such runs are copied row by row.
constexpr int64_t kMaxPitch = INT_MAX;

void copy_with_memcpy(const CopyBlocksParams& p, cudaStream_t stream) {
  const std::vector<BlockRun> runs = make_block_runs(p.src_ids, p.dst_ids, p.num_ids);
  for (int64_t k = 0; k < p.num_pairs; ++k) {
    const CopyPair& pair = p.pairs[k];
    if (pair.row_bytes == 0) {
      continue;
    }
    const auto* src = static_cast<const char*>(pair.src);
    auto* dst = static_cast<char*>(pair.dst);
    const auto row = static_cast<size_t>(pair.row_bytes);
    const bool dense = pair.src_stride_bytes == pair.row_bytes &&
                       pair.dst_stride_bytes == pair.row_bytes;
    const bool pitch_ok = pair.src_stride_bytes <= kMaxPitch && pair.dst_stride_bytes <= kMaxPitch;
    for (const BlockRun& r : runs) {
      const char* s = src + r.src * pair.src_stride_bytes;
      char* d = dst + r.dst * pair.dst_stride_bytes;
      if (r.len == 1 || dense) {
        KVOFF_CUDA_CHECK(cudaMemcpyAsync(d, s, row * static_cast<size_t>(r.len),
                                         cudaMemcpyDefault, stream));
      } else if (pitch_ok) {
        KVOFF_CUDA_CHECK(cudaMemcpy2DAsync(d, static_cast<size_t>(pair.dst_stride_bytes), s,
                                           static_cast<size_t>(pair.src_stride_bytes), row,
                                           static_cast<size_t>(r.len), cudaMemcpyDefault,
                                           stream));
      } else {
        for (int64_t j = 0; j < r.len; ++j) {
          KVOFF_CUDA_CHECK(cudaMemcpyAsync(d + j * pair.dst_stride_bytes,
                                           s + j * pair.src_stride_bytes, row,
                                           cudaMemcpyDefault, stream));
        }
      }
    }
  }
}

// ---- kPerBlock ----

void copy_per_block(const CopyBlocksParams& p, cudaStream_t stream) {
  for (int64_t k = 0; k < p.num_pairs; ++k) {
    const CopyPair& pair = p.pairs[k];
    if (pair.row_bytes == 0) {
      continue;
    }
    const auto* src = static_cast<const char*>(pair.src);
    auto* dst = static_cast<char*>(pair.dst);
    for (int64_t i = 0; i < p.num_ids; ++i) {
      KVOFF_CUDA_CHECK(cudaMemcpyAsync(dst + p.dst_ids[i] * pair.dst_stride_bytes,
                                       src + p.src_ids[i] * pair.src_stride_bytes,
                                       static_cast<size_t>(pair.row_bytes), cudaMemcpyDefault,
                                       stream));
    }
  }
}

// ---- kBatch ----

// 0: not decided yet (versions only), 1: supported, 2: refused by the driver.
std::atomic<int> g_batch_state{0};

bool batch_versions_ok() {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return driver >= 12080;
#else
  return false;
#endif
}

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
bool is_legacy_stream(cudaStream_t stream) {
  return stream == nullptr || stream == cudaStreamLegacy;
}

cudaMemLocation location_hint(MemoryKind kind, int device) {
  cudaMemLocation loc{};
  if (kind == MemoryKind::kDevice) {
    loc.type = cudaMemLocationTypeDevice;
    loc.id = device;
  } else {
    loc.type = cudaMemLocationTypeHost;
    loc.id = 0;  // ignored for the host
  }
  return loc;
}

// Returns false (and copies nothing) when the driver refuses the batch API; throws on any
// other failure.
bool try_copy_with_batch(const CopyBlocksParams& p, cudaStream_t stream) {
  const std::vector<BlockRun> runs = make_block_runs(p.src_ids, p.dst_ids, p.num_ids);
  std::vector<void*> dsts;
  std::vector<void*> srcs;  // void*: CUDA 12.8/12.9 declare `void**`, CUDA 13 `const void* const*`
  std::vector<size_t> sizes;
  dsts.reserve(runs.size() * static_cast<size_t>(p.num_pairs));
  srcs.reserve(dsts.capacity());
  sizes.reserve(dsts.capacity());
  for (int64_t k = 0; k < p.num_pairs; ++k) {
    const CopyPair& pair = p.pairs[k];
    if (pair.row_bytes == 0) {
      continue;
    }
    const auto* src = static_cast<const char*>(pair.src);
    auto* dst = static_cast<char*>(pair.dst);
    const bool dense = pair.src_stride_bytes == pair.row_bytes &&
                       pair.dst_stride_bytes == pair.row_bytes;
    for (const BlockRun& r : runs) {
      const char* s = src + r.src * pair.src_stride_bytes;
      char* d = dst + r.dst * pair.dst_stride_bytes;
      if (r.len == 1 || dense) {
        dsts.push_back(d);
        srcs.push_back(const_cast<char*>(s));
        sizes.push_back(static_cast<size_t>(pair.row_bytes * r.len));
      } else {  // the batch API copies 1-D ranges: one entry per row of a strided run
        for (int64_t j = 0; j < r.len; ++j) {
          dsts.push_back(d + j * pair.dst_stride_bytes);
          srcs.push_back(const_cast<char*>(s + j * pair.src_stride_bytes));
          sizes.push_back(static_cast<size_t>(pair.row_bytes));
        }
      }
    }
  }
  if (sizes.empty()) {
    return true;
  }
  int device = 0;
  KVOFF_CUDA_CHECK(cudaGetDevice(&device));
  // One attribute set for every copy (attrsIdxs = {0}): sources read in stream order (they
  // may be written by earlier work on `stream`); location hints name where each side lives
  // (the driver uses them only for managed or pageable memory); prefer overlapping with
  // compute, since offloading runs beside the model (a hint the driver may ignore).
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.srcLocHint = location_hint(p.src_kind, device);
  attr.dstLocHint = location_hint(p.dst_kind, device);
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_idx = 0;
#if CUDART_VERSION >= 13000
  const cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(),
                                               sizes.size(), &attr, &attr_idx, 1, stream);
#else
  size_t fail_idx = SIZE_MAX;
  const cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(),
                                               sizes.size(), &attr, &attr_idx, 1, &fail_idx,
                                               stream);
#endif
  if (err == cudaErrorNotSupported || err == cudaErrorCallRequiresNewerDriver) {
    (void)cudaGetLastError();  // not sticky; clear it so later checks do not see it
    g_batch_state.store(2, std::memory_order_relaxed);
    return false;
  }
  KVOFF_CUDA_CHECK(err);
  g_batch_state.store(1, std::memory_order_relaxed);
  return true;
}
#endif  // CUDART_VERSION >= 12080

// ---- kKernel ----

struct DevicePair {
  const char* src;     // device-accessible address of source row 0
  char* dst;           // device-accessible address of destination row 0
  int64_t row_vecs;    // row length in units of vec_bytes
  int64_t src_stride;  // bytes
  int64_t dst_stride;  // bytes
  int32_t vec_bytes;   // 16, 8, 4 or 1
  int32_t pad;
};

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = kKernelThreads / kWarpSize;
// Vector loads in flight per lane before its stores: 8 x 16 B per lane, 4 KiB per warp.
constexpr int kUnroll = 8;
// Grid cap when kernel_blocks is larger than the work needs (blocks beyond the items idle).
constexpr int64_t kMaxGrid = int64_t{1} << 16;

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// One warp copies n elements of type V: each lane issues kUnroll loads, then kUnroll stores,
// so that kUnroll x 32 loads per warp wait on memory at once. The last (partial) stretch uses
// guarded loads, still all in flight together.
template <typename V>
__device__ __forceinline__ void warp_copy_row(const char* __restrict__ src,
                                              char* __restrict__ dst, int64_t n, int lane) {
  const V* __restrict__ s = reinterpret_cast<const V*>(src);
  V* __restrict__ d = reinterpret_cast<V*>(dst);
  constexpr int64_t kStep = int64_t{kUnroll} * kWarpSize;
  int64_t base = 0;
  for (; base + kStep <= n; base += kStep) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      v[u] = s[base + u * kWarpSize + lane];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      d[base + u * kWarpSize + lane] = v[u];
    }
  }
  if (base < n) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = base + u * kWarpSize + lane;
      if (j < n) {
        v[u] = s[j];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = base + u * kWarpSize + lane;
      if (j < n) {
        d[j] = v[u];
      }
    }
  }
}

// Items are (pair, row) in pair-major order; warp w of the grid copies items w, w + W, ...
// (W = warps in the grid). Every branch below is uniform across a warp.
__global__ void __launch_bounds__(kKernelThreads)
    gather_scatter_rows(const DevicePair* __restrict__ pairs,
                        const int64_t* __restrict__ src_ids,
                        const int64_t* __restrict__ dst_ids, int64_t num_ids,
                        int64_t num_items) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
  for (int64_t item = warp; item < num_items; item += num_warps) {
    const int64_t k = item / num_ids;
    const int64_t i = item - k * num_ids;
    const DevicePair p = pairs[k];
    const char* s = p.src + src_ids[i] * p.src_stride;
    char* d = p.dst + dst_ids[i] * p.dst_stride;
    switch (p.vec_bytes) {
      case 16:
        warp_copy_row<uint4>(s, d, p.row_vecs, lane);
        break;
      case 8:
        warp_copy_row<uint2>(s, d, p.row_vecs, lane);
        break;
      case 4:
        warp_copy_row<uint32_t>(s, d, p.row_vecs, lane);
        break;
      default:
        warp_copy_row<unsigned char>(s, d, p.row_vecs, lane);
        break;
    }
  }
}

const char* device_address(const void* ptr, MemoryKind kind) {
  if (kind == MemoryKind::kDevice) {
    return static_cast<const char*>(ptr);
  }
  void* mapped = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&mapped, const_cast<void*>(ptr), 0);
  if (err == cudaSuccess) {
    return static_cast<const char*>(mapped);
  }
  // Some drivers only accept the start of a pinned allocation; the pointer attributes resolve
  // any address inside one.
  (void)cudaGetLastError();
  cudaPointerAttributes attr{};
  KVOFF_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
  if (attr.devicePointer == nullptr) {
    throw CudaError(err, "host memory at " + std::to_string(reinterpret_cast<uintptr_t>(ptr)) +
                             " is not pinned and mapped for the device "
                             "(cudaHostGetDevicePointer: " + cudaGetErrorString(err) +
                             "); allocate it with cudaHostAlloc / pin_memory=True or register "
                             "it with cudaHostRegister");
  }
  return static_cast<const char*>(attr.devicePointer);
}

int32_t vector_bytes(uintptr_t bits) {
  if (bits % 16 == 0) {
    return 16;
  }
  if (bits % 8 == 0) {
    return 8;
  }
  if (bits % 4 == 0) {
    return 4;
  }
  return 1;
}

void copy_with_kernel(const CopyBlocksParams& p, void* workspace, size_t workspace_bytes,
                      cudaStream_t stream) {
  const size_t needed = kernel_workspace_bytes(p.num_pairs, p.num_ids);
  if (workspace == nullptr || workspace_bytes < needed) {
    throw std::invalid_argument("kvoff::kernels::copy_blocks: the kernel method needs " +
                                std::to_string(needed) + " bytes of device workspace, got " +
                                std::to_string(workspace_bytes));
  }
  // Host image of the workspace: the pair table, then the source ids, then the destination ids.
  const size_t table_bytes = align_up(sizeof(DevicePair) * static_cast<size_t>(p.num_pairs), 16);
  const size_t ids_bytes = sizeof(int64_t) * static_cast<size_t>(p.num_ids);
  std::vector<unsigned char> host(needed);
  auto* table = reinterpret_cast<DevicePair*>(host.data());
  for (int64_t k = 0; k < p.num_pairs; ++k) {
    const CopyPair& in = p.pairs[k];
    DevicePair out{};
    if (in.row_bytes > 0) {  // an empty row may come with a null base pointer
      out.src = device_address(in.src, p.src_kind);
      out.dst = const_cast<char*>(device_address(in.dst, p.dst_kind));
    }
    out.src_stride = in.src_stride_bytes;
    out.dst_stride = in.dst_stride_bytes;
    const uintptr_t bits = reinterpret_cast<uintptr_t>(out.src) |
                           reinterpret_cast<uintptr_t>(out.dst) |
                           static_cast<uintptr_t>(in.row_bytes) |
                           static_cast<uintptr_t>(in.src_stride_bytes) |
                           static_cast<uintptr_t>(in.dst_stride_bytes);
    out.vec_bytes = vector_bytes(bits);
    out.row_vecs = in.row_bytes / out.vec_bytes;
    std::memcpy(&table[k], &out, sizeof(out));
  }
  std::memcpy(host.data() + table_bytes, p.src_ids, ids_bytes);
  std::memcpy(host.data() + table_bytes + ids_bytes, p.dst_ids, ids_bytes);
  // From pageable memory: the runtime stages the bytes before returning, so `host` may go.
  KVOFF_CUDA_CHECK(cudaMemcpyAsync(workspace, host.data(), needed, cudaMemcpyHostToDevice,
                                   stream));

  auto* base = static_cast<unsigned char*>(workspace);
  const auto* dev_table = reinterpret_cast<const DevicePair*>(base);
  const auto* dev_src_ids = reinterpret_cast<const int64_t*>(base + table_bytes);
  const auto* dev_dst_ids = reinterpret_cast<const int64_t*>(base + table_bytes + ids_bytes);
  const int64_t num_items = p.num_pairs * p.num_ids;
  int64_t cap = p.kernel_blocks;
  if (cap == 0) {
    int device = 0;
    KVOFF_CUDA_CHECK(cudaGetDevice(&device));
    cap = default_kernel_blocks(device);
  }
  // No more blocks than there are items for their warps, nor than kMaxGrid.
  const int64_t needed_blocks = (num_items + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t grid = std::max<int64_t>(1, std::min({cap, needed_blocks, kMaxGrid}));
  gather_scatter_rows<<<static_cast<unsigned int>(grid), kKernelThreads, 0, stream>>>(
      dev_table, dev_src_ids, dev_dst_ids, p.num_ids, num_items);
  KVOFF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

const char* copy_method_name(CopyMethod method) {
  switch (method) {
    case CopyMethod::kAuto:
      return "auto";
    case CopyMethod::kMemcpy:
      return "memcpy";
    case CopyMethod::kBatch:
      return "batch";
    case CopyMethod::kKernel:
      return "kernel";
    case CopyMethod::kPerBlock:
      return "per_block";
  }
  return "unknown";
}

int default_kernel_blocks(int device) {
  int sms = 0;
  KVOFF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return std::max(1, sms / 10);  // floor(0.10 * SMs)
}

bool batch_copy_supported() {
  const int state = g_batch_state.load(std::memory_order_relaxed);
  if (state != 0) {
    return state == 1;
  }
  return batch_versions_ok();
}

size_t kernel_workspace_bytes(int64_t num_pairs, int64_t num_ids) {
  if (num_pairs <= 0 || num_ids <= 0) {
    return 0;
  }
  return align_up(sizeof(DevicePair) * static_cast<size_t>(num_pairs), 16) +
         2 * sizeof(int64_t) * static_cast<size_t>(num_ids);
}

CopyMethod choose_copy_method(const CopyBlocksParams& params, CopyMethod method) {
  if (method != CopyMethod::kAuto) {
    return method;
  }
  check_params(params);
  const int64_t calls = params.num_pairs * count_runs(params.src_ids, params.dst_ids,
                                                      params.num_ids);
  if (calls == 0) {
    return CopyMethod::kMemcpy;  // nothing to copy; needs no workspace
  }
  return total_bytes(params) / calls >= kMinBytesPerCopyCall ? CopyMethod::kMemcpy
                                                               : CopyMethod::kKernel;
}

CopyMethod copy_blocks(const CopyBlocksParams& params, CopyMethod method, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream) {
  check_params(params);
  method = choose_copy_method(params, method);
  if (params.num_pairs == 0 || params.num_ids == 0 || total_bytes(params) == 0) {
    return method;
  }
  switch (method) {
    case CopyMethod::kBatch:
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
      // The legacy NULL stream is refused by the batch API (cudaErrorInvalidValue): such a
      // call falls back without asking the driver, and without changing the cached verdict.
      if (!is_legacy_stream(stream) && batch_copy_supported() &&
          try_copy_with_batch(params, stream)) {
        return CopyMethod::kBatch;
      }
#endif
      copy_with_memcpy(params, stream);
      return CopyMethod::kMemcpy;
    case CopyMethod::kKernel:
      copy_with_kernel(params, workspace, workspace_bytes, stream);
      return CopyMethod::kKernel;
    case CopyMethod::kPerBlock:
      copy_per_block(params, stream);
      return CopyMethod::kPerBlock;
    case CopyMethod::kMemcpy:
    case CopyMethod::kAuto:  // resolved above; never reached
      break;
  }
  copy_with_memcpy(params, stream);
  return CopyMethod::kMemcpy;
}

}  // namespace kvoff::kernels
