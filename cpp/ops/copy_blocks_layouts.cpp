// torch.ops.kvoff.copy_blocks for tensors that are not dense. The dispatcher sends a call with
// a sparse (COO or compressed) or mkldnn tensor anywhere in its arguments to the kernel of that
// layout's dispatch key, never to the CPU or CUDA kernel; without one registered here, torch
// would raise its generic NotImplementedError ("Could not run 'kvoff::copy_blocks' with
// arguments from the 'SparseCPU' backend"). This kernel raises the op's own ValueError instead,
// naming the argument and its layout, before anything is copied.
#include <torch/library.h>

#include "checks.h"

namespace kvoff::ops {
namespace {

void copy_blocks_not_dense(at::TensorList src, at::TensorList dst,
                           const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids,
                           c10::string_view mechanism, int64_t kernel_blocks) {
  check_copy_blocks_layouts(src, dst, src_block_ids, dst_block_ids, mechanism, kernel_blocks);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvoff, SparseCPU, m) { m.impl("copy_blocks", &copy_blocks_not_dense); }
TORCH_LIBRARY_IMPL(kvoff, SparseCUDA, m) { m.impl("copy_blocks", &copy_blocks_not_dense); }
TORCH_LIBRARY_IMPL(kvoff, SparseCsrCPU, m) { m.impl("copy_blocks", &copy_blocks_not_dense); }
TORCH_LIBRARY_IMPL(kvoff, SparseCsrCUDA, m) { m.impl("copy_blocks", &copy_blocks_not_dense); }
TORCH_LIBRARY_IMPL(kvoff, MkldnnCPU, m) { m.impl("copy_blocks", &copy_blocks_not_dense); }

}  // namespace kvoff::ops
