// Every schema of torch.ops.kvoff, in one TORCH_LIBRARY block. Kernels register separately:
//   CPU   cpp/ops/copy_blocks_cpu.cpp         (TORCH_LIBRARY_IMPL(kvoff, CPU, m))
//   CUDA  cuda/torch/copy_blocks_cuda.cpp     (TORCH_LIBRARY_IMPL(kvoff, CUDA, m); CUDA builds)
//   not dense (sparse, mkldnn) cpp/ops/copy_blocks_layouts.cpp (raises the layout error)
//   fake  kvoff/ops.py                        (torch.library.register_fake)
#include <torch/library.h>

#ifdef KVOFF_WITH_CUDA
namespace kvoff::ops {
bool batch_copy_supported_cuda();  // cuda/torch/copy_blocks_cuda.cpp
}  // namespace kvoff::ops
#endif

namespace {

// torch.ops.kvoff.batch_copy_supported: whether mechanism="batch" runs cudaMemcpyBatchAsync
// here rather than falling back to "memcpy". False in CPU builds.
bool batch_copy_supported() {
#ifdef KVOFF_WITH_CUDA
  return kvoff::ops::batch_copy_supported_cuda();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(kvoff, m) {
  // Multi-layer block copy: for every pair k and every i, row src_block_ids[i] of src[k] is
  // copied to row dst_block_ids[i] of dst[k]. dst is mutated in place; nothing is returned.
  // mechanism: "auto", "memcpy", "batch", "kernel" or "per_block"; kernel_blocks: the grid-size
  // cap of the "kernel" mechanism (0 = 10% of the SMs). Documented in kvoff/ops.py
  // (kvoff.copy_blocks).
  m.def(
      "copy_blocks(Tensor[] src, Tensor(a!)[] dst, Tensor src_block_ids, "
      "Tensor dst_block_ids, str mechanism=\"auto\", int kernel_blocks=0) -> ()");
  // No tensor arguments, so one kernel for every backend (CatchAll). Documented in
  // kvoff/ops.py (kvoff.ops.batch_copy_supported).
  m.def("batch_copy_supported() -> bool", &batch_copy_supported);
}
