// Every schema of torch.ops.kvoff, in one TORCH_LIBRARY block. Kernels register separately:
//   CPU   cpp/ops/copy_blocks_cpu.cpp         (TORCH_LIBRARY_IMPL(kvoff, CPU, m))
//   CUDA  cuda/torch/copy_blocks_cuda.cpp     (TORCH_LIBRARY_IMPL(kvoff, CUDA, m); CUDA builds)
//   fake  kvoff/ops.py                        (torch.library.register_fake)
#include <torch/library.h>

TORCH_LIBRARY(kvoff, m) {
  // Multi-layer block copy: for every pair k and every i, row src_block_ids[i] of src[k] is
  // copied to row dst_block_ids[i] of dst[k]. dst is mutated in place; nothing is returned.
  // Documented in kvoff/ops.py (kvoff.copy_blocks).
  m.def(
      "copy_blocks(Tensor[] src, Tensor(a!)[] dst, Tensor src_block_ids, "
      "Tensor dst_block_ids) -> ()");
}
