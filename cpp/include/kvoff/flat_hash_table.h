// A flat open-addressing table keyed by 64-bit hashes, for the scheduler's per-step lookups
// (internal: the scheduler's request index and its idle set).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace kvoff::detail {

/// Entries (hash, value) in one power-of-two array: linear probing, load factor <= 1/2,
/// backward-shift deletion (no tombstones), so a lookup reads one or two adjacent cache lines
/// where a node-based map reads a bucket, a node and the key. Several entries may share a hash:
/// `match(value)` tells them apart. Hash 0 marks an empty entry and is never stored (callers map
/// it to 1). Not thread-safe.
template <class Value>
class FlatHashTable {
 public:
  /// The value of the first entry with `hash` whose value satisfies `match` (nullptr: none).
  template <class Match>
  Value* find(std::uint64_t hash, Match&& match) noexcept {
    const std::size_t mask = entries_.size() - 1;
    for (std::size_t i = hash & mask;; i = (i + 1) & mask) {
      Entry& e = entries_[i];
      if (e.hash == hash && match(e.value)) return &e.value;
      if (e.hash == 0) return nullptr;
    }
  }
  template <class Match>
  const Value* find(std::uint64_t hash, Match&& match) const noexcept {
    return const_cast<FlatHashTable*>(this)->find(hash, std::forward<Match>(match));
  }

  /// Adds an entry (even when one with the same hash exists). Throws std::bad_alloc (the
  /// table is then unchanged).
  void insert(std::uint64_t hash, Value value) {
    reserve_one();
    place(hash, std::move(value));
  }

  /// Grows the table now if one more entry would need it, so that the next insert cannot
  /// throw. Throws std::bad_alloc (the table is then unchanged).
  void reserve_one() {
    if (2 * (size_ + 1) <= entries_.size()) return;  // keep the load factor <= 1/2
    std::vector<Entry> grown(2 * entries_.size());
    grown.swap(entries_);
    size_ = 0;
    for (Entry& e : grown) {
      if (e.hash != 0) place(e.hash, std::move(e.value));
    }
  }

  /// Removes the first entry with `hash` whose value satisfies `match`; false when none.
  template <class Match>
  bool erase(std::uint64_t hash, Match&& match) noexcept {
    const std::size_t mask = entries_.size() - 1;
    std::size_t i = hash & mask;
    while (!(entries_[i].hash == hash && match(entries_[i].value))) {
      if (entries_[i].hash == 0) return false;
      i = (i + 1) & mask;
    }
    // Backward shift: later entries of the run move into the hole when their home position
    // allows it, so that every entry stays reachable from its home without tombstones.
    for (std::size_t j = (i + 1) & mask; entries_[j].hash != 0; j = (j + 1) & mask) {
      const std::size_t home = entries_[j].hash & mask;
      if (((j - home) & mask) >= ((j - i) & mask)) {
        entries_[i] = std::move(entries_[j]);
        i = j;
      }
    }
    entries_[i] = Entry{};
    --size_;
    return true;
  }

  /// Starts fetching the cache line where the probe for `hash` begins (a hint).
  void prefetch(std::uint64_t hash) const noexcept {
    __builtin_prefetch(&entries_[hash & (entries_.size() - 1)]);
  }

  std::size_t size() const noexcept { return size_; }

 private:
  struct Entry {
    std::uint64_t hash = 0;
    Value value{};
  };
  void place(std::uint64_t hash, Value value) noexcept {
    const std::size_t mask = entries_.size() - 1;
    std::size_t i = hash & mask;
    while (entries_[i].hash != 0) i = (i + 1) & mask;
    entries_[i] = Entry{hash, std::move(value)};
    ++size_;
  }
  std::vector<Entry> entries_ = std::vector<Entry>(64);  // a power of two
  std::size_t size_ = 0;
};

}  // namespace kvoff::detail
