// CPU kernel of torch.ops.kvoff.copy_blocks: a parallel memcpy of block rows.
//
// The ids are first cut into runs: stretches where both the source and the destination ids
// go up by one, capped at kRunBytes so one long run still spreads over threads. A work item is
// one (pair, run); items are ordered pair-major and split over threads by at::parallel_for
// with a grain of about kGrainBytes, so a small call runs inline on the calling thread. An
// item is one memcpy when both tensors of the pair store rows back to back
// (stride(0) == row), and one memcpy per row otherwise.
//
// mechanism: "per_block" is the naive baseline of the benchmarks, one std::memcpy per row per
// pair, sequentially on the calling thread (no runs, no parallel_for); every other name
// ("auto", "memcpy", "batch", "kernel") runs the parallel run-coalesced memcpy above. The name
// is validated as on the GPU; kernel_blocks is validated (>= 0) and otherwise ignored.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "checks.h"
#include "kvoff/block_runs.h"

namespace kvoff::ops {
namespace {

// Bytes a thread should copy at least before another thread is woken for the rest.
constexpr int64_t kGrainBytes = int64_t{256} << 10;
// Longest run of adjacent blocks (in bytes of the widest pair) that one work item copies.
constexpr int64_t kRunBytes = int64_t{1} << 20;

inline void copy_run(const PairLayout& p, const BlockRun& r) {
  const char* s = p.src + r.src * p.src_stride_bytes;
  char* d = p.dst + r.dst * p.dst_stride_bytes;
  if (p.src_stride_bytes == p.row_bytes && p.dst_stride_bytes == p.row_bytes) {
    std::memcpy(d, s, static_cast<size_t>(r.len * p.row_bytes));
    return;
  }
  for (int64_t j = 0; j < r.len; ++j) {
    std::memcpy(d, s, static_cast<size_t>(p.row_bytes));
    s += p.src_stride_bytes;
    d += p.dst_stride_bytes;
  }
}

// The "per_block" baseline: one memcpy per row per pair, in order, on the calling thread.
void copy_per_block(const CopyBlocksArgs& args) {
  for (const PairLayout& p : args.pairs) {
    for (int64_t i = 0; i < args.num_ids; ++i) {
      std::memcpy(p.dst + args.dst_ids[i] * p.dst_stride_bytes,
                  p.src + args.src_ids[i] * p.src_stride_bytes,
                  static_cast<size_t>(p.row_bytes));
    }
  }
}

void copy_blocks_cpu(at::TensorList src, at::TensorList dst, const at::Tensor& src_block_ids,
                     const at::Tensor& dst_block_ids, c10::string_view mechanism,
                     int64_t kernel_blocks) {
  const CopyBlocksArgs args = check_copy_blocks_args(src, dst, src_block_ids, dst_block_ids,
                                                     mechanism, kernel_blocks, DeviceRule::kCpu);
  if (args.num_ids == 0 || args.total_bytes == 0) {
    return;
  }
  if (args.mechanism == Mechanism::kPerBlock) {
    copy_per_block(args);
    return;
  }

  int64_t max_row_bytes = 1;
  for (const PairLayout& p : args.pairs) {
    max_row_bytes = std::max(max_row_bytes, p.row_bytes);
  }
  const std::vector<BlockRun> runs = make_block_runs(args.src_ids, args.dst_ids, args.num_ids,
                                          std::max<int64_t>(1, kRunBytes / max_row_bytes));

  const auto num_runs = static_cast<int64_t>(runs.size());
  const auto num_items = static_cast<int64_t>(args.pairs.size()) * num_runs;
  const int64_t bytes_per_item = std::max<int64_t>(1, args.total_bytes / num_items);
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / bytes_per_item);

  const PairLayout* pairs = args.pairs.data();
  const BlockRun* run_data = runs.data();
  at::parallel_for(0, num_items, grain, [&](int64_t begin, int64_t end) {
    int64_t k = begin / num_runs;
    int64_t r = begin % num_runs;
    for (int64_t item = begin; item < end; ++item) {
      copy_run(pairs[k], run_data[r]);
      if (++r == num_runs) {
        r = 0;
        ++k;
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvoff, CPU, m) {
  m.impl("copy_blocks", &copy_blocks_cpu);
}

}  // namespace kvoff::ops
