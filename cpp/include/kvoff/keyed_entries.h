// Entries found by key and reused through a free list (internal: an engine's stores and loads
// on a node pool, NodePoolStores and NodePoolLoads).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kvoff/flat_hash_table.h"
#include "kvoff/key.h"

namespace kvoff::detail {

/// Entries of type `Entry` (which has `std::string key` and `std::uint64_t key_hash`) in one
/// vector, found by key through a FlatHashTable. An entry taken out goes to a free list and is
/// reused with its key's memory, so an engine's few hundred keys a step allocate nothing once
/// warm. Indexes stay valid while the entry is in use. Not thread-safe.
template <class Entry>
class KeyedEntries {
 public:
  static constexpr std::uint32_t kNone = 0xFFFFFFFFu;

  /// The table's hash of `key`: never 0 (an empty bucket), with no bit forced (a bucket is its
  /// low bits).
  static std::uint64_t hash(std::string_view key) noexcept {
    const std::uint64_t h = hash_key(key);
    return h == 0 ? 1 : h;
  }

  /// The entry of `key` (kNone: none); `hash` is hash(key).
  std::uint32_t find(std::string_view key, std::uint64_t hash) const noexcept {
    const std::uint32_t* e =
        by_key_.find(hash, [&](std::uint32_t i) { return entries_[i].key == key; });
    return e == nullptr ? kNone : *e;
  }
  std::uint32_t find(std::string_view key) const noexcept { return find(key, hash(key)); }

  /// A new entry for `key` (`hash` is hash(key)), found by key from now on; its other fields
  /// are as its last use left them. Throws std::bad_alloc, changing nothing.
  std::uint32_t add(std::string_view key, std::uint64_t hash) {
    by_key_.reserve_one();
    std::uint32_t e;
    if (free_.empty()) {
      entries_.emplace_back();
      e = static_cast<std::uint32_t>(entries_.size() - 1);
    } else {
      e = free_.back();
      free_.pop_back();
    }
    Entry& f = entries_[e];
    f.key.assign(key);  // an earlier use's memory: no allocation
    f.key_hash = hash;
    by_key_.insert(hash, e);  // cannot throw: reserved above
    return e;
  }

  /// Entry `e` is no longer found by key (release() hands it out again; until then its key's
  /// bytes stay as they are).
  void unindex(std::uint32_t e) noexcept {
    by_key_.erase(entries_[e].key_hash, [&](std::uint32_t x) { return x == e; });
  }
  /// Entry `e`, unindexed, may be reused by add().
  void release(std::uint32_t e) { free_.push_back(e); }

  /// Room for `n` more entries without moving them (so references stay valid across adds).
  void reserve(std::size_t n) { entries_.reserve(entries_.size() + n); }

  Entry& operator[](std::uint32_t e) noexcept { return entries_[e]; }
  const Entry& operator[](std::uint32_t e) const noexcept { return entries_[e]; }
  /// Entries found by key.
  std::size_t size() const noexcept { return by_key_.size(); }

 private:
  std::vector<Entry> entries_;
  std::vector<std::uint32_t> free_;
  FlatHashTable<std::uint32_t> by_key_;
};

}  // namespace kvoff::detail
