// The key index: block key -> CPU block id (slot), with each slot's key and a caller payload.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kvoff/key.h"
#include "kvoff/large_page_allocator.h"

namespace kvoff {

/// Maps block keys (byte strings) to slots in [0, num_slots), at most one key per slot, and
/// keeps 12 bytes of caller data (the 8-byte payload and 4-byte extra) per slot next to the key.
///
/// Layout, chosen so a lookup touches two cache lines: an open-addressing bucket array with
/// linear probing and backward-shift deletion (no tombstones), sized once to a power of two
/// >= 4 x num_slots so it never rehashes and probe runs stay short (load factor <= 1/4: a miss
/// usually ends at its home bucket, which keeps the probe loops' branches predictable; measured
/// 20-30% faster than <= 1/2 for 16 more bytes per slot); each bucket is 8 bytes (32 bits of the
/// key's hash and the slot). Each slot has one 64-byte record holding its key (inline up to
/// kInlineKeyBytes bytes, longer keys on the heap), the key's hash tag, the payload and the
/// extra. Memory: about 96 bytes per slot plus the bytes of keys longer than 40. Both arrays
/// are backed by huge pages where the OS allows (LargePageAllocator), so random accesses rarely
/// miss the TLB.
/// find_each and find_many overlap the cache misses of a batch of keys: a software pipeline
/// hashes key i + 2 * kFindAhead and prefetches its home bucket, probes the buckets of key
/// i + kFindAhead and prefetches its candidate record, and confirms key i.
///
/// Not thread-safe.
class KeyIndex {
 public:
  /// Returned by find() when the key is not in the index.
  static constexpr std::uint32_t kNotFound = 0xffffffffu;
  /// Keys up to this many bytes are stored inside the slot's record (no allocation).
  static constexpr std::size_t kInlineKeyBytes = 40;

  /// Creates an empty index for slots [0, num_slots).
  /// Throws std::invalid_argument when num_slots is 0 or above kMaxNumBlocks (2^31-1).
  explicit KeyIndex(std::uint32_t num_slots);
  /// Bytes the constructor allocates for `num_slots` slots (buckets and records; keys longer
  /// than kInlineKeyBytes add their bytes later). Allocates nothing, checks nothing.
  static std::uint64_t memory_bytes(std::uint32_t num_slots) noexcept;
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
  /// (kNotFound when absent). Same result as calling find per key, with the memory accesses of
  /// the next 2 * kFindAhead keys in flight (see find_each).
  void find_many(const std::string_view* keys, std::size_t count, std::uint64_t* hashes,
                 std::uint32_t* slots) const noexcept;

  /// How many keys ahead of the one being confirmed the pipeline prefetches records (buckets:
  /// twice as far).
  static constexpr std::size_t kFindAhead = 32;

  /// Pipelined batch find with early exit: for i = 0, 1, ..., count-1 calls
  /// `visit(i, slot, hash)` (slot = find(keys[i]) or kNotFound, hash = hash_key(keys[i])) in
  /// order, until it returns false. Returns the number of keys visited. While key i is visited
  /// the buckets of keys up to i + 2 * kFindAhead and the records of keys up to i + kFindAhead
  /// are being fetched, so a batch costs about one memory latency per 2 * kFindAhead keys
  /// rather than two per key. Stopping early wastes at most 2 * kFindAhead hashes and
  /// prefetches. `visit` must not modify the index.
  template <typename Visit>
  std::size_t find_each(const std::string_view* keys, std::size_t count, Visit&& visit) const {
    constexpr std::size_t kRing = 128;  // > 2 * kFindAhead, a power of two
    static_assert(kRing > 2 * kFindAhead && (kRing & (kRing - 1)) == 0);
    std::uint64_t hash[kRing];
    std::uint64_t pos[kRing];
    std::uint32_t candidate[kRing];
    const auto stage1 = [&](std::size_t k) noexcept {  // hash, prefetch the home bucket
      const std::uint64_t h = hash_key(keys[k]);
      hash[k % kRing] = h;
      pos[k % kRing] = tag_of(h) & mask_;
      prefetch(&buckets_[pos[k % kRing]]);
    };
    const auto stage2 = [&](std::size_t k) noexcept {  // first tag match, prefetch its record
      const std::uint32_t tag = tag_of(hash[k % kRing]);
      std::uint64_t i = pos[k % kRing];
      std::uint32_t c = kNotFound;
      for (;; i = (i + 1) & mask_) {
        const std::uint64_t b = buckets_[i];
        if (b == 0) {
          break;
        }
        if (static_cast<std::uint32_t>(b >> 32) == tag) {
          c = static_cast<std::uint32_t>(b) - 1;
          prefetch(&records_[c]);
          break;
        }
      }
      pos[k % kRing] = i;
      candidate[k % kRing] = c;
    };
    const std::size_t lead1 = count < 2 * kFindAhead ? count : 2 * kFindAhead;
    const std::size_t lead2 = count < kFindAhead ? count : kFindAhead;
    for (std::size_t k = 0; k < lead1; ++k) {
      stage1(k);
    }
    for (std::size_t k = 0; k < lead2; ++k) {
      stage2(k);
    }
    for (std::size_t k = 0; k < count; ++k) {
      if (k + 2 * kFindAhead < count) {
        stage1(k + 2 * kFindAhead);
      }
      if (k + kFindAhead < count) {
        stage2(k + kFindAhead);
      }
      std::uint32_t slot = candidate[k % kRing];
      if (slot != kNotFound && !record_equals(slot, keys[k])) {  // tag collision: go on
        slot = probe_from((pos[k % kRing] + 1) & mask_, tag_of(hash[k % kRing]), keys[k]);
      }
      if (!visit(k, slot, hash[k % kRing])) {
        return k + 1;
      }
    }
    return count;
  }

  /// Hint that a key with hash `hash` is about to be inserted: prefetches its home bucket.
  void prefetch_insert(std::uint64_t hash) const noexcept {
    prefetch(&buckets_[tag_of(hash) & mask_]);
  }

  /// Hint that `slot`'s record is about to be read. Unchecked: slot < num_slots.
  void prefetch_record(std::uint32_t slot) const noexcept { prefetch(&records_[slot]); }

  /// Hint that `slot` is about to be erased: prefetches its bucket. Unchecked: slot <
  /// num_slots (any slot, holding a key or not).
  void prefetch_erase(std::uint32_t slot) const noexcept;

  /// Adds `key` -> `slot`, with a zero payload. `hash` must be hash_key(key).
  /// Throws std::out_of_range when slot >= num_slots, std::invalid_argument when the key is
  /// empty, the slot already holds a key or the key is already in the index (naming it in hex);
  /// the index is unchanged then.
  void insert(std::uint32_t slot, std::string_view key, std::uint64_t hash);

  /// insert() without its checks, for a caller that has just found the key absent (find or
  /// find_each with the same hash, no insert in between): adds `key` -> `slot` with a zero
  /// payload. Unchecked preconditions: slot < num_slots and holds no key, 1 <= key.size() <
  /// 2^32, key not in the index, hash == hash_key(key). Throws std::bad_alloc only (keys longer
  /// than kInlineKeyBytes).
  void insert_absent(std::uint32_t slot, std::string_view key, std::uint64_t hash);

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
  /// 4 more bytes of caller data for `slot`, in the same cache line (zero after insert).
  /// Unchecked: slot < num_slots.
  std::uint32_t& extra(std::uint32_t slot) noexcept { return records_[slot].extra; }
  /// 4 more bytes of caller data for `slot`. Unchecked: slot < num_slots.
  std::uint32_t extra(std::uint32_t slot) const noexcept { return records_[slot].extra; }

 private:
  /// Writes `key` (tag `tag`) into `slot`'s record and points empty bucket `bucket` at it.
  void place(std::uint32_t slot, std::string_view key, std::uint32_t tag, std::uint64_t bucket);
  struct alignas(64) Record {
    std::uint64_t payload;
    std::uint32_t len;  // 0: holds no key (keys are never empty)
    std::uint32_t tag;
    std::uint32_t extra;
    std::uint32_t unused;
    union {
      char bytes[kInlineKeyBytes];
      char* heap;  // when len > kInlineKeyBytes
    };
  };
  static_assert(sizeof(Record) == 64);
  /// Buckets of an index of `num_slots` slots: a power of two >= max(8, 4 x num_slots).
  static std::uint64_t bucket_count(std::uint32_t num_slots) noexcept;

  static void prefetch(const void* p) noexcept {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p);
#else
    (void)p;
#endif
  }
  static constexpr std::uint32_t tag_of(std::uint64_t hash) noexcept {
    return static_cast<std::uint32_t>(hash ^ (hash >> 32));
  }
  bool record_equals(std::uint32_t slot, std::string_view key) const noexcept {
    const Record& r = records_[slot];
    if (r.len != key.size()) {
      return false;
    }
    if (r.len > kInlineKeyBytes) {
      return this->key(slot) == key;
    }
    // Inline keys (the common 9- and 33-byte keys): 8-byte word compares instead of a memcmp
    // call; the last word overlaps the previous one rather than reading past either key.
    const char* a = r.bytes;
    const char* b = key.data();
    const std::size_t n = key.size();
    if (n < 8) {
      return detail::load_le_partial(a, n) == detail::load_le_partial(b, n);
    }
    std::uint64_t diff = 0;
    for (std::size_t i = 0; i + 8 < n; i += 8) {
      diff |= detail::load_le64(a + i) ^ detail::load_le64(b + i);
    }
    diff |= detail::load_le64(a + n - 8) ^ detail::load_le64(b + n - 8);
    return diff == 0;
  }
  std::uint32_t probe_from(std::uint64_t bucket, std::uint32_t tag,
                           std::string_view key) const noexcept;

  std::uint32_t num_slots_;
  std::uint32_t size_ = 0;
  std::uint64_t mask_;                 // buckets_.size() - 1
  // 0 = empty, else (tag << 32) | (slot + 1)
  std::vector<std::uint64_t, LargePageAllocator<std::uint64_t>> buckets_;
  std::vector<Record, LargePageAllocator<Record>> records_;  // per slot
};

}  // namespace kvoff
