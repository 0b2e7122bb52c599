// Multi-layer block copies on raw pointers; see copy_blocks.h for the contract.
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

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kMaxGrid = 1024;

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

template <typename V>
__device__ __forceinline__ void copy_row(const char* __restrict__ src, char* __restrict__ dst,
                                         int64_t n) {
  const V* __restrict__ s = reinterpret_cast<const V*>(src);
  V* __restrict__ d = reinterpret_cast<V*>(dst);
  int64_t j = threadIdx.x;
  // Several loads in flight per thread before the stores: host memory has a long latency.
  for (; j + (kUnroll - 1) * static_cast<int64_t>(blockDim.x) < n;
       j += kUnroll * static_cast<int64_t>(blockDim.x)) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      v[u] = s[j + u * static_cast<int64_t>(blockDim.x)];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      d[j + u * static_cast<int64_t>(blockDim.x)] = v[u];
    }
  }
  for (; j < n; j += blockDim.x) {
    d[j] = s[j];
  }
}

__global__ void gather_scatter_rows(const DevicePair* __restrict__ pairs,
                                    const int64_t* __restrict__ src_ids,
                                    const int64_t* __restrict__ dst_ids, int64_t num_ids,
                                    int64_t num_items) {
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    const int64_t k = item / num_ids;
    const int64_t i = item - k * num_ids;
    const DevicePair p = pairs[k];
    const char* s = p.src + src_ids[i] * p.src_stride;
    char* d = p.dst + dst_ids[i] * p.dst_stride;
    switch (p.vec_bytes) {
      case 16:
        copy_row<uint4>(s, d, p.row_vecs);
        break;
      case 8:
        copy_row<uint2>(s, d, p.row_vecs);
        break;
      case 4:
        copy_row<uint32_t>(s, d, p.row_vecs);
        break;
      default:
        copy_row<unsigned char>(s, d, p.row_vecs);
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
  const auto grid = static_cast<unsigned int>(num_items < kMaxGrid ? num_items : kMaxGrid);
  gather_scatter_rows<<<grid, kThreads, 0, stream>>>(dev_table, dev_src_ids, dev_dst_ids,
                                                     p.num_ids, num_items);
  KVOFF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

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

void copy_blocks(const CopyBlocksParams& params, CopyMethod method, void* workspace,
                 size_t workspace_bytes, cudaStream_t stream) {
  check_params(params);
  if (params.num_pairs == 0 || params.num_ids == 0 || total_bytes(params) == 0) {
    return;
  }
  method = choose_copy_method(params, method);
  if (method == CopyMethod::kMemcpy) {
    copy_with_memcpy(params, stream);
  } else {
    copy_with_kernel(params, workspace, workspace_bytes, stream);
  }
}

}  // namespace kvoff::kernels
