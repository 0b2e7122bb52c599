// Argument validation for torch.ops.kvoff.copy_blocks; see checks.h for the contract.
#include "checks.h"

#include <c10/core/Layout.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvoff::ops {
namespace {

constexpr const char* kOp = "kvoff.copy_blocks: ";

// "torch.float16" rather than c10's "Half", so messages read like the Python the user wrote.
std::string dtype_name(c10::ScalarType t) {
  return "torch." + std::string(c10::getDtypeNames(t).first);
}

// "torch.sparse_coo" rather than c10's "Sparse", as Python prints tensor.layout.
std::string layout_name(c10::Layout layout) {
  switch (layout) {
    case c10::kStrided:
      return "torch.strided";
    case c10::kSparse:
      return "torch.sparse_coo";
    case c10::kSparseCsr:
      return "torch.sparse_csr";
    case c10::kSparseCsc:
      return "torch.sparse_csc";
    case c10::kSparseBsr:
      return "torch.sparse_bsr";
    case c10::kSparseBsc:
      return "torch.sparse_bsc";
    case c10::kMkldnn:
      return "torch._mkldnn";
    case c10::kJagged:
      return "torch.jagged";
    default:
      return "layout " + std::to_string(static_cast<int>(layout));
  }
}

// Row layout of one block tensor: dim 0 indexes blocks, dims 1.. form one contiguous row.
struct RowLayout {
  int64_t row_numel = 0;
};

RowLayout check_block_tensor(const at::Tensor& t, const char* side, size_t k) {
  TORCH_CHECK_VALUE(t.defined(), kOp, side, "[", k,
                    "] is an undefined tensor; pass a tensor whose dim 0 indexes blocks.");
  // First: strides (read below) do not exist for sparse layouts.
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided, kOp, side, "[", k, "] is a ",
                    layout_name(t.layout()), " tensor (shape ", t.sizes(),
                    "); block tensors must be dense (torch.strided) with dim 0 = blocks. "
                    "Convert it with .to_dense(), or allocate the cache as a dense tensor.");
  TORCH_CHECK_VALUE(t.dim() >= 1, kOp, side, "[", k,
                    "] is a 0-d tensor; block tensors need dim 0 = blocks, "
                    "for example view it as (num_blocks, -1).");
  int64_t row_numel = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    const int64_t size = t.size(d);
    // Dims of size 1 may carry any stride; they do not affect the layout of the row.
    TORCH_CHECK_VALUE(size == 1 || t.stride(d) == row_numel || t.numel() == 0, kOp, side, "[",
                      k, "] rows are not contiguous: shape ", t.sizes(), ", strides ",
                      t.strides(), " (dim ", d, " has stride ", t.stride(d), ", expected ",
                      row_numel,
                      "). Every row (dims 1..) must be one contiguous run of memory; only "
                      "stride(0) may exceed the row. Pass a tensor whose rows are contiguous, "
                      "for example a view of a contiguous cache, or call .contiguous().");
    row_numel *= size;
  }
  if (t.size(0) > 1 && row_numel > 0) {
    TORCH_CHECK_VALUE(t.stride(0) >= row_numel, kOp, side, "[", k, "] has stride(0) = ",
                      t.stride(0), " elements, smaller than its row of ", row_numel,
                      " elements (shape ", t.sizes(), ", strides ", t.strides(),
                      "), so its rows overlap. Pass a tensor whose blocks do not overlap "
                      "(stride(0) >= product of sizes[1:]).");
  }
  return RowLayout{row_numel};
}

void check_ids_tensor(const at::Tensor& ids, const char* name) {
  TORCH_CHECK_VALUE(ids.defined(), kOp, name,
                    " is an undefined tensor; pass a 1-D int64 CPU tensor.");
  TORCH_CHECK_VALUE(ids.layout() == c10::kStrided, kOp, name, " is a ",
                    layout_name(ids.layout()), " tensor (shape ", ids.sizes(),
                    "); block ids must be a dense 1-D int64 CPU tensor. Convert them with "
                    ".to_dense(), or pass a list of ints.");
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong, kOp, name, " has dtype ",
                    dtype_name(ids.scalar_type()),
                    "; block ids must be torch.int64. Convert them with .to(torch.int64) "
                    "(kvoff.copy_blocks accepts Python lists and converts them for you).");
  TORCH_CHECK(ids.device().is_cpu(), kOp, name, " is on ", ids.device(),
              "; block ids must be a CPU tensor (the host plans the copy). Move them with "
              ".cpu().");
  TORCH_CHECK_VALUE(ids.dim() == 1, kOp, name, " has shape ", ids.sizes(),
                    "; block ids must be a 1-D tensor. Flatten it with .reshape(-1).");
}

// Checks that every tensor of one list is on the same device; returns that device.
c10::Device common_device(at::TensorList tensors, const char* side) {
  const c10::Device device = tensors[0].device();
  for (size_t k = 1; k < tensors.size(); ++k) {
    TORCH_CHECK(tensors[k].device() == device, kOp, side, "[", k, "] is on ",
                tensors[k].device(), " but ", side, "[0] is on ", device, "; every ", side,
                " tensor must be on one device. Move ", side, "[", k, "] with .to(\"",
                device, "\").");
  }
  return device;
}

void check_pinned(at::TensorList tensors, const char* side, c10::Device gpu) {
  for (size_t k = 0; k < tensors.size(); ++k) {
    TORCH_CHECK(tensors[k].numel() == 0 || tensors[k].is_pinned(), kOp, side, "[", k,
                "] is a CPU tensor that is not pinned (page-locked); copies between the CPU "
                "and ", gpu,
                " need pinned host memory. Allocate it with torch.empty(..., pin_memory=True) "
                "or call .pin_memory() once, up front.");
  }
}

void check_devices(at::TensorList src, at::TensorList dst, c10::Device src_device,
                   c10::Device dst_device, DeviceRule rule) {
  if (rule == DeviceRule::kCpu) {
    TORCH_CHECK(src_device.is_cpu() && dst_device.is_cpu(), kOp,
                "the CPU kernel copies between CPU tensors, but src is on ", src_device,
                " and dst is on ", dst_device,
                ". Put both sides on the CPU, or use a CUDA build of kvoff for GPU tensors.");
    return;
  }
  // DeviceRule::kCuda
  const bool src_gpu = src_device.is_cuda();
  const bool dst_gpu = dst_device.is_cuda();
  TORCH_CHECK((src_gpu || src_device.is_cpu()) && (dst_gpu || dst_device.is_cpu()), kOp,
              "the CUDA kernel copies between CUDA and pinned CPU tensors, but src is on ",
              src_device, " and dst is on ", dst_device, ". Move the tensors to cuda or cpu.");
  TORCH_CHECK(src_gpu || dst_gpu, kOp, "the CUDA kernel needs a CUDA tensor on one side, but "
              "src and dst are both on the CPU. Call copy_blocks with CPU tensors only "
              "(the CPU kernel handles that).");
  if (src_gpu && dst_gpu) {
    TORCH_CHECK(src_device == dst_device, kOp, "GPU-to-GPU copies must stay on one device, "
                "but src is on ", src_device, " and dst is on ", dst_device,
                ". Move one side with .to(\"", dst_device, "\"), or copy through pinned CPU "
                "memory.");
  } else if (src_gpu) {
    check_pinned(dst, "dst", src_device);
  } else {
    check_pinned(src, "src", dst_device);
  }
}

// Range check of one id list against the smallest size(0) over the tensors of its side.
void check_ids_in_range(const int64_t* ids, int64_t n, at::TensorList tensors, const char* name,
                        const char* side) {
  if (n == 0) {
    return;
  }
  size_t k_min = 0;
  for (size_t k = 1; k < tensors.size(); ++k) {
    if (tensors[k].size(0) < tensors[k_min].size(0)) {
      k_min = k;
    }
  }
  const int64_t rows = tensors[k_min].size(0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    if (id >= 0 && id < rows) [[likely]] {
      continue;
    }
    TORCH_CHECK_INDEX(id >= 0, kOp, name, "[", i, "] = ", id,
                      " is negative; block ids are row indices in [0, size(0)) of every ",
                      side, " tensor (negative indexing is not supported).");
    TORCH_CHECK_INDEX(false, kOp, name, "[", i, "] = ", id, " is out of range for ", side, "[",
                      k_min, "] with ", rows, " blocks (shape ", tensors[k_min].sizes(), "); ",
                      (rows > 0 ? c10::str("valid ids are 0..", rows - 1)
                                : std::string("it has no blocks, so no id is valid")),
                      ". Pass ids that exist in every ", side, " tensor.");
  }
}

[[noreturn]] void fail_duplicate(const int64_t* ids, int64_t second) {
  int64_t first = 0;
  while (ids[first] != ids[second]) {
    ++first;
  }
  TORCH_CHECK_VALUE(false, kOp, "dst_block_ids[", second, "] = ", ids[second],
                    " repeats dst_block_ids[", first, "] = ", ids[first],
                    "; each destination block may be written once per call (two writes to "
                    "one block would race). Remove the duplicate (src, dst) id pair.");
  // Unreachable; TORCH_CHECK_VALUE(false, ...) always throws.
  throw std::logic_error("unreachable");
}

// Rejects repeated destination ids. All ids are already known to lie in [0, rows).
void check_no_duplicates(const int64_t* ids, int64_t n, int64_t rows) {
  if (n < 2) {
    return;
  }
  if (n <= 16) {
    for (int64_t i = 1; i < n; ++i) {
      for (int64_t j = 0; j < i; ++j) {
        if (ids[i] == ids[j]) {
          fail_duplicate(ids, i);
        }
      }
    }
    return;
  }
  // A bitmap over [0, rows) costs rows / 8 bytes; use it when that is small next to the ids,
  // otherwise sort a copy.
  if (rows / 64 <= 4 * n) {
    std::vector<uint64_t> seen(static_cast<size_t>((rows + 63) / 64), 0);
    for (int64_t i = 0; i < n; ++i) {
      const auto id = static_cast<uint64_t>(ids[i]);
      const uint64_t bit = uint64_t{1} << (id & 63);
      uint64_t& word = seen[id >> 6];
      if (word & bit) {
        fail_duplicate(ids, i);
      }
      word |= bit;
    }
    return;
  }
  std::vector<std::pair<int64_t, int64_t>> sorted(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    sorted[static_cast<size_t>(i)] = {ids[i], i};
  }
  std::sort(sorted.begin(), sorted.end());
  int64_t second = -1;
  for (size_t i = 1; i < sorted.size(); ++i) {
    // The later position of each equal run is sorted[i].second (pairs sort by position).
    if (sorted[i].first == sorted[i - 1].first && (second < 0 || sorted[i].second < second)) {
      second = sorted[i].second;
    }
  }
  if (second >= 0) {
    fail_duplicate(ids, second);
  }
}

}  // namespace

void check_copy_blocks_layouts(at::TensorList src, at::TensorList dst,
                               const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids,
                               c10::string_view mechanism, int64_t kernel_blocks) {
  // Every check up to the layouts runs in the order of check_copy_blocks_args, so the first
  // error is the one a dense call would get.
  (void)check_copy_blocks_args(src, dst, src_block_ids, dst_block_ids, mechanism, kernel_blocks,
                               DeviceRule::kCpu);
  TORCH_CHECK(false, kOp, "internal error: dispatched to the kernel for non-dense tensors, but "
              "every tensor argument is dense. Please report this.");
  throw std::logic_error("unreachable");  // TORCH_CHECK(false, ...) always throws
}

Mechanism parse_mechanism(c10::string_view name) {
  constexpr Mechanism kAll[] = {Mechanism::kAuto, Mechanism::kMemcpy, Mechanism::kBatch,
                                Mechanism::kKernel, Mechanism::kPerBlock};
  static_assert(std::size(kAll) == std::size(kMechanismNames));
  for (size_t i = 0; i < std::size(kAll); ++i) {
    if (name == kMechanismNames[i]) {
      return kAll[i];
    }
  }
  TORCH_CHECK_VALUE(false, kOp, "mechanism='", std::string(name.data(), name.size()),
                    "' is not one of 'auto', 'memcpy', 'batch', 'kernel', 'per_block'. "
                    "Pass one of these names (kvoff.ops.MECHANISMS), or 'auto' to let kvoff "
                    "choose.");
  return Mechanism::kAuto;  // unreachable
}

CopyBlocksArgs check_copy_blocks_args(at::TensorList src, at::TensorList dst,
                                      const at::Tensor& src_block_ids,
                                      const at::Tensor& dst_block_ids,
                                      c10::string_view mechanism, int64_t kernel_blocks,
                                      DeviceRule rule) {
  CopyBlocksArgs args;

  // 0. The options.
  args.mechanism = parse_mechanism(mechanism);
  TORCH_CHECK_VALUE(kernel_blocks >= 0, kOp, "kernel_blocks=", kernel_blocks,
                    " is negative; pass 0 for the default grid-size cap (10% of the GPU's "
                    "SMs) or a positive number of thread blocks.");
  args.kernel_blocks = kernel_blocks;

  // 1. The lists.
  TORCH_CHECK_VALUE(!src.empty(), kOp,
                    "src is an empty list; pass one tensor per layer (or per K/V half).");
  TORCH_CHECK_VALUE(src.size() == dst.size(), kOp, "src has ", src.size(),
                    " tensors but dst has ", dst.size(),
                    "; pass one dst tensor for every src tensor (pair k copies src[k] -> dst[k]).");

  // 2. Each tensor, then each pair.
  std::vector<int64_t> row_numels(src.size());
  for (size_t k = 0; k < src.size(); ++k) {
    const RowLayout s = check_block_tensor(src[k], "src", k);
    const RowLayout d = check_block_tensor(dst[k], "dst", k);
    TORCH_CHECK_VALUE(src[k].scalar_type() == dst[k].scalar_type(), kOp, "pair ", k, ": src[", k,
                      "] is ", dtype_name(src[k].scalar_type()), " but dst[", k, "] is ",
                      dtype_name(dst[k].scalar_type()),
                      "; both tensors of a pair must have the same dtype (bytes are copied, not "
                      "converted). Allocate or view dst[", k, "] with src[", k, "]'s dtype.");
    TORCH_CHECK_VALUE(s.row_numel == d.row_numel, kOp, "pair ", k, ": a row of src[", k,
                      "] has ", s.row_numel, " elements (shape ", src[k].sizes(),
                      ") but a row of dst[", k, "] has ", d.row_numel, " (shape ",
                      dst[k].sizes(),
                      "); both tensors of a pair must have the same row size (product of "
                      "sizes[1:]). Check that pair ", k,
                      " pairs the same layer on both sides.");
    row_numels[k] = s.row_numel;
  }

  // 3. Devices.
  args.src_device = common_device(src, "src");
  args.dst_device = common_device(dst, "dst");

  // 4. The ids: metadata, then values (read on the host), then the device rule (which may
  //    query pinnedness), all before anything is copied.
  check_ids_tensor(src_block_ids, "src_block_ids");
  check_ids_tensor(dst_block_ids, "dst_block_ids");
  TORCH_CHECK_VALUE(src_block_ids.numel() == dst_block_ids.numel(), kOp, "src_block_ids has ",
                    src_block_ids.numel(), " ids but dst_block_ids has ", dst_block_ids.numel(),
                    "; pass one destination id for every source id.");
  args.num_ids = src_block_ids.numel();
  if (src_block_ids.is_contiguous()) {
    args.src_ids = src_block_ids.const_data_ptr<int64_t>();
  } else {
    args.src_ids_holder = src_block_ids.contiguous();
    args.src_ids = args.src_ids_holder.const_data_ptr<int64_t>();
  }
  if (dst_block_ids.is_contiguous()) {
    args.dst_ids = dst_block_ids.const_data_ptr<int64_t>();
  } else {
    args.dst_ids_holder = dst_block_ids.contiguous();
    args.dst_ids = args.dst_ids_holder.const_data_ptr<int64_t>();
  }
  check_ids_in_range(args.src_ids, args.num_ids, src, "src_block_ids", "src");
  check_ids_in_range(args.dst_ids, args.num_ids, dst, "dst_block_ids", "dst");
  if (args.num_ids > 1) {
    int64_t dst_rows = dst[0].size(0);
    for (const at::Tensor& t : dst) {
      dst_rows = std::min(dst_rows, t.size(0));
    }
    check_no_duplicates(args.dst_ids, args.num_ids, dst_rows);
  }
  check_devices(src, dst, args.src_device, args.dst_device, rule);

  // 5. The byte layout.
  args.pairs.resize(src.size());
  for (size_t k = 0; k < src.size(); ++k) {
    const int64_t elem = static_cast<int64_t>(src[k].element_size());
    PairLayout& p = args.pairs[k];
    p.src = static_cast<const char*>(src[k].const_data_ptr());
    p.dst = static_cast<char*>(dst[k].mutable_data_ptr());
    p.row_bytes = row_numels[k] * elem;
    p.src_stride_bytes = src[k].stride(0) * elem;
    p.dst_stride_bytes = dst[k].stride(0) * elem;
    args.total_bytes += p.row_bytes * args.num_ids;
  }
  return args;
}

}  // namespace kvoff::ops
