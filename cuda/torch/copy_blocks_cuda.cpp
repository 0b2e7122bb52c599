// CUDA glue of torch.ops.kvoff.copy_blocks (CUDA builds only): validates with the checks shared
// with the CPU kernel, then enqueues the torch-free launcher (cuda/kernels/copy_blocks.cu) on
// the current CUDA stream of the GPU side's device. Handles GPU->GPU (one device),
// GPU->pinned CPU and pinned CPU->GPU. The copy is asynchronous: synchronize the stream (or
// record an event) before reading a CPU destination.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "checks.h"
#include "copy_blocks.h"
#include "cuda_check.h"

namespace kvoff::ops {
namespace {

kernels::CopyMethod to_copy_method(Mechanism m) {
  switch (m) {
    case Mechanism::kAuto:
      return kernels::CopyMethod::kAuto;
    case Mechanism::kMemcpy:
      return kernels::CopyMethod::kMemcpy;
    case Mechanism::kBatch:
      return kernels::CopyMethod::kBatch;
    case Mechanism::kKernel:
      return kernels::CopyMethod::kKernel;
    case Mechanism::kPerBlock:
      return kernels::CopyMethod::kPerBlock;
  }
  return kernels::CopyMethod::kAuto;
}

void copy_blocks_cuda(at::TensorList src, at::TensorList dst, const at::Tensor& src_block_ids,
                      const at::Tensor& dst_block_ids, c10::string_view mechanism,
                      int64_t kernel_blocks) {
  const CopyBlocksArgs args = check_copy_blocks_args(src, dst, src_block_ids, dst_block_ids,
                                                     mechanism, kernel_blocks,
                                                     DeviceRule::kCuda);
  const c10::Device gpu = args.src_device.is_cuda() ? args.src_device : args.dst_device;
  const c10::cuda::CUDAGuard guard(gpu);
  if (args.num_ids == 0 || args.total_bytes == 0) {
    return;
  }

  std::vector<kernels::CopyPair> pairs(args.pairs.size());
  for (size_t k = 0; k < pairs.size(); ++k) {
    const PairLayout& p = args.pairs[k];
    pairs[k] = kernels::CopyPair{p.src, p.dst, p.row_bytes, p.src_stride_bytes,
                                 p.dst_stride_bytes};
  }
  kernels::CopyBlocksParams params;
  params.pairs = pairs.data();
  params.num_pairs = static_cast<int64_t>(pairs.size());
  params.src_ids = args.src_ids;
  params.dst_ids = args.dst_ids;
  params.num_ids = args.num_ids;
  params.src_kind =
      args.src_device.is_cuda() ? kernels::MemoryKind::kDevice : kernels::MemoryKind::kPinnedHost;
  params.dst_kind =
      args.dst_device.is_cuda() ? kernels::MemoryKind::kDevice : kernels::MemoryKind::kPinnedHost;
  params.kernel_blocks = args.kernel_blocks;

  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(gpu.index());
  const kernels::CopyMethod method =
      kernels::choose_copy_method(params, to_copy_method(args.mechanism));
  at::Tensor workspace;  // from torch's caching allocator, in stream order on `stream`
  const size_t workspace_bytes =
      method == kernels::CopyMethod::kKernel
          ? kernels::kernel_workspace_bytes(params.num_pairs, params.num_ids)
          : 0;
  if (workspace_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(workspace_bytes)},
                          at::TensorOptions().dtype(at::kByte).device(gpu));
  }
  try {
    kernels::copy_blocks(params, method, workspace_bytes > 0 ? workspace.data_ptr() : nullptr,
                         workspace_bytes, stream.stream());
  } catch (const kernels::CudaError& e) {
    TORCH_CHECK(false, "kvoff.copy_blocks: copying ", args.num_ids, " blocks of ",
                pairs.size(), " tensor pairs from ", args.src_device, " to ", args.dst_device,
                " with mechanism '", kernels::copy_method_name(method), "' failed: ", e.what());
  }
}

}  // namespace

// torch.ops.kvoff.batch_copy_supported in CUDA builds (called from cpp/ops/ops.cpp): false
// without a visible GPU, else the per-process verdict of kernels::batch_copy_supported() taken
// with the current device selected.
bool batch_copy_supported_cuda() {
  if (c10::cuda::device_count() == 0) {
    return false;
  }
  return kernels::batch_copy_supported();
}

TORCH_LIBRARY_IMPL(kvoff, CUDA, m) {
  m.impl("copy_blocks", &copy_blocks_cuda);
}

}  // namespace kvoff::ops
