// Runs of adjacent blocks: the unit one copy call can move in one piece.
// Pure C++ (no torch, no CUDA): shared by the CPU kernel and the CUDA copy-call path.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

namespace kvoff {

/// `len` blocks whose source ids are src, src+1, ... and destination ids dst, dst+1, ...
struct BlockRun {
  std::int64_t src;  ///< first source block id
  std::int64_t dst;  ///< first destination block id
  std::int64_t len;  ///< blocks (>= 1)
};

/// Cuts `n` (src_ids[i], dst_ids[i]) pairs into maximal runs where both ids go up by one,
/// each at most `max_len` blocks long (max_len >= 1). Returns an empty vector when n == 0.
/// O(n) time; the runs cover the pairs in order.
inline std::vector<BlockRun> make_block_runs(
    const std::int64_t* src_ids, const std::int64_t* dst_ids, std::int64_t n,
    std::int64_t max_len = std::numeric_limits<std::int64_t>::max()) {
  std::vector<BlockRun> runs;
  if (n <= 0) {
    return runs;
  }
  BlockRun cur{src_ids[0], dst_ids[0], 1};
  for (std::int64_t i = 1; i < n; ++i) {
    if (src_ids[i] == cur.src + cur.len && dst_ids[i] == cur.dst + cur.len && cur.len < max_len) {
      ++cur.len;
    } else {
      runs.push_back(cur);
      cur = BlockRun{src_ids[i], dst_ids[i], 1};
    }
  }
  runs.push_back(cur);
  return runs;
}

}  // namespace kvoff
