// The store-admission tracker of CPUOffloadingManager's store_threshold filter: how many times
// each recently offered key was offered to prepare_store (vLLM's store_threshold /
// max_tracker_size, docs/design.md invariants 6 and 8).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kvoff/key_index.h"
#include "kvoff/large_page_allocator.h"

namespace kvoff {

/// A bounded map key -> offer count, ordered by recency of offer; at most `capacity` keys.
///
/// Entries are slots of a KeyIndex of `capacity` slots, so the tracker keeps each key's full
/// bytes (inline up to 40 bytes) and never confuses two keys: a 64-bit hash alone would need
/// 16 bytes per entry instead of ~100, but a collision would store a block on another key's
/// offers (a false admission), and the KeyIndex is already tuned for the manager's key
/// lookups (pipelined, huge pages, no rehash). The recency order is an intrusive doubly linked
/// list over the slots (8 bytes per entry). Memory: memory_bytes(capacity), all allocated by
/// the constructor (about 104 bytes per entry plus the bytes of keys longer than 40; 64,000
/// entries: about 6.6 MB); no allocation afterwards (but for keys longer than 40 bytes).
///
/// Two-phase use, so that a refused prepare_store changes nothing (invariant 6):
/// find_all() only reads; record() then applies one call's offers.
/// Not thread-safe.
class AdmissionTracker {
 public:
  /// Returned by find_all() for a key that is not tracked.
  static constexpr std::uint32_t kNotTracked = KeyIndex::kNotFound;

  /// An empty tracker of at most `capacity` keys.
  /// Throws std::invalid_argument when capacity is 0 or above kMaxNumBlocks (2^31-1);
  /// std::bad_alloc when memory runs out (nothing stays allocated then).
  explicit AdmissionTracker(std::uint32_t capacity);
  /// Bytes the constructor allocates for `capacity` entries (index and recency links).
  /// Allocates nothing, checks nothing.
  static std::uint64_t memory_bytes(std::uint32_t capacity) noexcept;
  AdmissionTracker(const AdmissionTracker&) = delete;
  AdmissionTracker& operator=(const AdmissionTracker&) = delete;

  /// Most keys tracked at once.
  std::uint32_t capacity() const noexcept { return index_.num_slots(); }
  /// Keys tracked now.
  std::uint32_t size() const noexcept { return index_.size(); }

  /// For i < keys.size(): entries[i] = the entry of keys[i], or kNotTracked. `hashes[i]` must
  /// be hash_key(keys[i]). Changes nothing; the bucket of the key 16 positions ahead is
  /// prefetched while one is looked up.
  void find_all(std::span<const std::string_view> keys, const std::uint64_t* hashes,
                std::uint32_t* entries) const noexcept;
  /// Offers counted for an entry from find_all (not kNotTracked).
  std::uint32_t count(std::uint32_t entry) const noexcept {
    return static_cast<std::uint32_t>(index_.payload(entry));
  }
  /// Offers counted for `key`: 0 when it is not tracked.
  std::uint32_t count_of(std::string_view key) const noexcept;

  /// Records one offer of every key of one call, each occurrence counting once:
  ///  * a tracked key's count grows by its occurrences (saturating at 2^32-1);
  ///  * an untracked key is added with its occurrences as count, first evicting the least
  ///    recently offered entry that is not a key of this call when the tracker is full; when
  ///    every entry is a key of this call, the key is not tracked. Keys earlier in the call
  ///    get room first (a prefix's head before its tail);
  ///  * then the call's keys become the most recently offered, keys[0] the most recent of all,
  ///    so that among keys offered together a prefix's tail leaves the tracker before its
  ///    head (invariant 8).
  /// `entries` must be what find_all() gave for `keys` and `hashes`, with no record() in
  /// between; they are updated (each key's entry after the call, kNotTracked for a key that
  /// could not be tracked). O(1) per key; no allocation (but for keys longer than 40 bytes:
  /// std::bad_alloc may leave some offers unrecorded).
  void record(std::span<const std::string_view> keys, const std::uint64_t* hashes,
              std::span<std::uint32_t> entries);

 private:
  // Payload of an entry's KeyIndex record: low 32 bits the count, high 32 bits the stamp of the
  // last record() that offered it (its keys are protected from eviction within that call).
  static constexpr std::uint64_t kLow32 = 0xffffffffULL;
  struct Links {
    std::uint32_t prev;
    std::uint32_t next;
  };
  std::uint32_t next_stamp() noexcept;
  void unlink(std::uint32_t e) noexcept;
  void link_most_recent(std::uint32_t e) noexcept;
  void add_offers(std::uint32_t e, std::uint32_t stamp, std::uint32_t offers) noexcept;

  KeyIndex index_;
  // Per entry, plus a sentinel at [capacity]: next = toward less recent (sentinel.next = most
  // recent), prev = toward more recent (sentinel.prev = least recent).
  std::vector<Links, LargePageAllocator<Links>> links_;
  std::uint32_t sentinel_;
  std::uint32_t next_unused_ = 0;  // entries [next_unused_, capacity) were never used
  std::uint32_t spare_ = kNotTracked;  // a free entry (an insert that threw left it)
  std::uint32_t stamp_ = 0;
  std::uint32_t protected_ = 0;    // entries stamped by the current record() call
};

}  // namespace kvoff
