// A counting Bloom filter of block keys in memory the caller provides (a node pool's shared
// memory file), so that engines answer "not in the pool" without asking the pool.
//
// One writer (the node pool's serving thread) adds a key when its index takes it (stored or
// being stored) and removes it when the index drops it (evicted, a failed store); any number of
// readers, in other processes, ask may_contain. A key added and not removed is always "maybe";
// "no" is wrong only for a key whose add has not yet been seen by the reader, the same answer a
// look-up sent to the pool a moment earlier would have had. "Maybe" for an absent key (a false
// positive) costs the reader a round trip to the pool, nothing else.
//
// Layout of the memory: a 64-byte header, then one 8-bit counter per cell. A key's cells are
// kProbes positions g_i = h1 + i * h2 (mod cells) from hash_key (double hashing, Kirsch and
// Mitzenmacher, "Less hashing, same performance", 2006). A counter that reaches 255 stays there
// (it is never decremented again), so overflow can only add false positives. With
// kCellsPerKey = 16 cells per key of capacity and 4 probes, the false positive rate at capacity
// is (1 - e^(-4/16))^4 = 0.24 % (Bloom's formula; Broder and Mitzenmacher, "Network
// applications of Bloom filters", 2004, section 2.1).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "kvoff/key.h"

namespace kvoff {

class KeyFilter {
 public:
  /// "KVOFFKF\0" as a little-endian word: the header's first 8 bytes.
  static constexpr std::uint64_t kMagic = 0x00464b46464f564bULL;
  /// The format of cells and probes. Readers use a filter only of their own format, so it
  /// changes whenever hash_key or the probing changes (test_key_filter.cpp pins hash_key).
  static constexpr std::uint32_t kFormat = 1;
  static constexpr std::size_t kHeaderBytes = 64;
  static constexpr std::uint32_t kProbes = 4;
  static constexpr std::size_t kCellsPerKey = 16;
  static constexpr std::uint8_t kSaturated = 255;

  /// Bytes of memory a filter for `capacity` keys (>= 1) needs: the header and
  /// kCellsPerKey * capacity cells.
  static std::size_t bytes_for(std::size_t capacity) noexcept;

  /// Formats `memory` as an empty filter (the writer's side): every cell 0, the header written
  /// last, with `epoch` (an id the writer's readers check, e.g. random per pool start).
  /// Throws std::invalid_argument when `memory` is smaller than bytes_for(1).
  static KeyFilter create(std::span<std::byte> memory, std::uint64_t epoch);

  /// A reader's view of memory that create() formatted, possibly in another process.
  /// Throws std::invalid_argument when the header is not a filter of kFormat, or says more
  /// cells than `memory` holds.
  static KeyFilter attach(std::span<const std::byte> memory);

  /// Counts `key` in (writer only). Saturated cells stay saturated.
  void add(std::string_view key) noexcept;

  /// Counts `key` out (writer only); false, and nothing changed, when one of its cells is 0
  /// (the key was never added: a caller's bug, which must not make other keys "no").
  bool remove(std::string_view key) noexcept;

  /// False: `key` is not in the writer's index (as of the writer's last add or remove that
  /// this thread can see). True: it may be.
  bool may_contain(std::string_view key) const noexcept;

  /// may_contain of a batch: the position of the first key that may be in the writer's
  /// index, or keys.size() when none may. The first cell of the keys a few positions ahead is
  /// prefetched, so the cache misses of many keys overlap (an engine checks a step's stores,
  /// hundreds of keys, in one call).
  std::size_t first_maybe(std::span<const std::string_view> keys) const noexcept;

  std::size_t num_cells() const noexcept { return cells_; }
  std::uint64_t epoch() const noexcept;
  /// Cells not 0 (a scan of every cell: for status, not for the hot path).
  std::size_t nonzero_cells() const noexcept;

 private:
  KeyFilter(std::byte* base, std::size_t cells) noexcept : base_(base), cells_(cells) {}
  template <typename F>
  void for_each_cell(std::string_view key, F&& f) const noexcept {
    for_each_cell(hash_key(key), f);
  }
  // The cells of the key whose hash_key is `h1`; `f(cell index)` returns false to stop.
  template <typename F>
  void for_each_cell(std::uint64_t h1, F&& f) const noexcept;
  bool may_contain_hash(std::uint64_t h1) const noexcept;
  std::atomic_ref<std::uint8_t> cell(std::size_t i) const noexcept;

  std::byte* base_;  // the header; the cells follow it
  std::size_t cells_;
};

}  // namespace kvoff
