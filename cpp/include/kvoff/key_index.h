// The key index: block key -> CPU block id (slot), with each slot's key and a caller payload.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "kvoff/key.h"

namespace kvoff {

/// Maps block keys (byte strings) to slots in [0, num_slots), at most one key per slot, and
/// keeps 8 bytes of caller data (the payload) per slot next to the key.
///
/// Layout, chosen so a lookup touches two cache lines: an open-addressing bucket array with
/// linear probing and backward-shift deletion (no tombstones), sized once to a power of two
/// >= 2 x num_slots so it never rehashes; each bucket is 8 bytes (32 bits of the key's hash and
/// the slot). Each slot has one 64-byte record holding its key (inline up to kInlineKeyBytes
/// bytes, longer keys on the heap), the key's hash tag and the payload. Memory: about 80 bytes
/// per slot plus the bytes of keys longer than 48. find_many overlaps the cache misses of a
/// batch of keys (prefetching buckets, then records).
///
/// Not thread-safe.
class KeyIndex {
 public:
  /// Returned by find() when the key is not in the index.
  static constexpr std::uint32_t kNotFound = 0xffffffffu;
  /// Keys up to this many bytes are stored inside the slot's record (no allocation).
  static constexpr std::size_t kInlineKeyBytes = 48;

  /// Creates an empty index for slots [0, num_slots).
  /// Throws std::invalid_argument when num_slots is 0 or above kMaxNumBlocks (2^31-1).
  explicit KeyIndex(std::uint32_t num_slots);
  ~KeyIndex();
  KeyIndex(const KeyIndex&) = delete;
  KeyIndex& operator=(const KeyIndex&) = delete;

  /// Number of slots the index was created for.
  std::uint32_t num_slots() const noexcept { return num_slots_; }
  /// Number of keys in the index.
  std::uint32_t size() const noexcept { return size_; }

  /// Slot of `key`, or kNotFound. `hash` must be hash_key(key). O(1) expected.
  std::uint32_t find(std::string_view key, std::uint64_t hash) const noexcept;
  /// Slot of `key`, or kNotFound.
  std::uint32_t find(std::string_view key) const noexcept { return find(key, hash_key(key)); }

  /// Batch find: for i < count, hashes[i] = hash_key(keys[i]) and slots[i] = find(keys[i])
  /// (kNotFound when absent). Same result as calling find per key, but the memory accesses of
  /// up to 16 keys are in flight at once, and the records of found slots are prefetched.
  void find_many(const std::string_view* keys, std::size_t count, std::uint64_t* hashes,
                 std::uint32_t* slots) const noexcept;

  /// Hint that `slot` is about to be erased: prefetches its bucket. Unchecked: slot <
  /// num_slots (any slot, holding a key or not).
  void prefetch_erase(std::uint32_t slot) const noexcept;

  /// Adds `key` -> `slot`, with a zero payload. `hash` must be hash_key(key).
  /// Throws std::out_of_range when slot >= num_slots, std::invalid_argument when the key is
  /// empty, the slot already holds a key or the key is already in the index (naming it in hex);
  /// the index is unchanged then.
  void insert(std::uint32_t slot, std::string_view key, std::uint64_t hash);

  /// Removes the key held by `slot`. Throws std::out_of_range when slot >= num_slots and
  /// std::invalid_argument when the slot holds no key; the index is unchanged then.
  void erase(std::uint32_t slot);

  /// Whether `slot` holds a key. Throws std::out_of_range when slot >= num_slots.
  bool holds(std::uint32_t slot) const;

  /// The key held by `slot` (valid until the slot is erased). Unchecked: the slot must hold a
  /// key.
  std::string_view key(std::uint32_t slot) const noexcept {
    const Record& r = records_[slot];
    return {r.len <= kInlineKeyBytes ? r.bytes : r.heap, r.len};
  }

  /// The caller's 8 bytes for `slot` (zero after insert). Unchecked: slot < num_slots.
  std::uint64_t& payload(std::uint32_t slot) noexcept { return records_[slot].payload; }
  /// The caller's 8 bytes for `slot`. Unchecked: slot < num_slots.
  std::uint64_t payload(std::uint32_t slot) const noexcept { return records_[slot].payload; }

 private:
  struct alignas(64) Record {
    std::uint64_t payload;
    std::uint32_t len;  // 0: holds no key (keys are never empty)
    std::uint32_t tag;
    union {
      char bytes[kInlineKeyBytes];
      char* heap;  // when len > kInlineKeyBytes
    };
  };
  static_assert(sizeof(Record) == 64);

  static constexpr std::uint32_t tag_of(std::uint64_t hash) noexcept {
    return static_cast<std::uint32_t>(hash ^ (hash >> 32));
  }
  bool record_equals(std::uint32_t slot, std::string_view key) const noexcept {
    return records_[slot].len == key.size() && this->key(slot) == key;
  }
  std::uint32_t probe_from(std::uint64_t bucket, std::uint32_t tag,
                           std::string_view key) const noexcept;

  std::uint32_t num_slots_;
  std::uint32_t size_ = 0;
  std::uint64_t mask_;                 // buckets_.size() - 1
  std::vector<std::uint64_t> buckets_;  // 0 = empty, else (tag << 32) | (slot + 1)
  std::vector<Record> records_;         // per slot
};

}  // namespace kvoff
