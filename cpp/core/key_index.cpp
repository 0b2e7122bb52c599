#include "kvoff/key_index.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "kvoff/block_pool.h"

namespace kvoff {

namespace {

std::string slot_range_message(std::uint32_t slot, std::uint32_t num_slots) {
  return "slot " + std::to_string(slot) + " is out of range for a key index of " +
         std::to_string(num_slots) + " slots (valid: 0.." + std::to_string(num_slots - 1) + ")";
}

}  // namespace

std::uint64_t KeyIndex::bucket_count(std::uint32_t num_slots) noexcept {
  std::uint64_t buckets = 8;
  while (buckets < 4 * static_cast<std::uint64_t>(num_slots)) {  // load factor <= 1/4
    buckets <<= 1;
  }
  return buckets;
}

std::uint64_t KeyIndex::memory_bytes(std::uint32_t num_slots) noexcept {
  return bucket_count(num_slots) * sizeof(std::uint64_t) +
         std::uint64_t{num_slots} * sizeof(Record);
}

KeyIndex::KeyIndex(std::uint32_t num_slots) : num_slots_(num_slots), mask_(0) {
  if (num_slots == 0 || static_cast<std::int64_t>(num_slots) > kMaxNumBlocks) {
    throw std::invalid_argument("KeyIndex needs 1..2^31-1 slots, got " +
                                std::to_string(num_slots));
  }
  const std::uint64_t buckets = bucket_count(num_slots);
  mask_ = buckets - 1;
  buckets_.assign(buckets, 0);
  records_.resize(num_slots);
  for (Record& r : records_) {
    r.payload = 0;
    r.len = 0;
    r.tag = 0;
    r.extra = 0;
    r.unused = 0;
  }
}

KeyIndex::~KeyIndex() {
  for (Record& r : records_) {
    if (r.len > kInlineKeyBytes) {
      delete[] r.heap;
    }
  }
}

std::uint32_t KeyIndex::probe_from(std::uint64_t i, std::uint32_t tag,
                                   std::string_view key) const noexcept {
  for (;; i = (i + 1) & mask_) {
    const std::uint64_t b = buckets_[i];
    if (b == 0) {
      return kNotFound;
    }
    if (static_cast<std::uint32_t>(b >> 32) == tag) {
      const auto slot = static_cast<std::uint32_t>(b) - 1;
      if (record_equals(slot, key)) {
        return slot;
      }
    }
  }
}

std::uint32_t KeyIndex::find(std::string_view key, std::uint64_t hash) const noexcept {
  const std::uint32_t tag = tag_of(hash);
  return probe_from(tag & mask_, tag, key);
}

void KeyIndex::find_many(const std::string_view* keys, std::size_t count, std::uint64_t* hashes,
                         std::uint32_t* slots) const noexcept {
  find_each(keys, count, [hashes, slots](std::size_t i, std::uint32_t slot, std::uint64_t hash) {
    hashes[i] = hash;
    slots[i] = slot;
    return true;
  });
}

void KeyIndex::prefetch_erase(std::uint32_t slot) const noexcept {
  prefetch(&buckets_[records_[slot].tag & mask_]);
}

bool KeyIndex::holds(std::uint32_t slot) const {
  if (slot >= num_slots_) {
    throw std::out_of_range(slot_range_message(slot, num_slots_));
  }
  return records_[slot].len != 0;
}

void KeyIndex::place(std::uint32_t slot, std::string_view key, std::uint32_t tag,
                     std::uint64_t bucket) {
  Record& r = records_[slot];
  if (key.size() > kInlineKeyBytes) {
    r.heap = new char[key.size()];
    std::memcpy(r.heap, key.data(), key.size());
  } else {
    std::memcpy(r.bytes, key.data(), key.size());
  }
  r.len = static_cast<std::uint32_t>(key.size());
  r.tag = tag;
  r.payload = 0;
  r.extra = 0;
  buckets_[bucket] =
      (static_cast<std::uint64_t>(tag) << 32) | (static_cast<std::uint64_t>(slot) + 1);
  ++size_;
}

void KeyIndex::insert(std::uint32_t slot, std::string_view key, std::uint64_t hash) {
  if (holds(slot)) {
    throw std::invalid_argument("slot " + std::to_string(slot) + " already holds key " +
                                key_to_hex(this->key(slot)) + " (hex); erase it first");
  }
  if (key.empty() || key.size() > 0xffffffffu) {
    throw std::invalid_argument("keys must be 1 to 2^32-1 bytes long, got " +
                                std::to_string(key.size()) + " bytes");
  }
  const std::uint32_t tag = tag_of(hash);
  std::uint64_t i = tag & mask_;
  for (;; i = (i + 1) & mask_) {
    const std::uint64_t b = buckets_[i];
    if (b == 0) {
      break;
    }
    if (static_cast<std::uint32_t>(b >> 32) == tag &&
        record_equals(static_cast<std::uint32_t>(b) - 1, key)) {
      throw std::invalid_argument("key " + key_to_hex(key) +
                                  " (hex) is already in the index (slot " +
                                  std::to_string(static_cast<std::uint32_t>(b) - 1) + ")");
    }
  }
  place(slot, key, tag, i);
}

void KeyIndex::insert_absent(std::uint32_t slot, std::string_view key, std::uint64_t hash) {
  const std::uint32_t tag = tag_of(hash);
  std::uint64_t i = tag & mask_;
  while (buckets_[i] != 0) {
    i = (i + 1) & mask_;
  }
  place(slot, key, tag, i);
}

void KeyIndex::erase(std::uint32_t slot) {
  if (!holds(slot)) {
    throw std::invalid_argument("slot " + std::to_string(slot) +
                                " holds no key; erase only slots that were inserted");
  }
  Record& r = records_[slot];
  const std::uint64_t want =
      (static_cast<std::uint64_t>(r.tag) << 32) | (static_cast<std::uint64_t>(slot) + 1);
  std::uint64_t hole = r.tag & mask_;
  while (buckets_[hole] != want) {
    hole = (hole + 1) & mask_;
  }
  // Backward-shift deletion: pull later entries of the probe run into the hole when the hole
  // lies between their home bucket and their position, so no tombstones are needed.
  for (std::uint64_t j = (hole + 1) & mask_;; j = (j + 1) & mask_) {
    const std::uint64_t b = buckets_[j];
    if (b == 0) {
      break;
    }
    const std::uint64_t home = (b >> 32) & mask_;
    if (((j - home) & mask_) >= ((j - hole) & mask_)) {
      buckets_[hole] = b;
      hole = j;
    }
  }
  buckets_[hole] = 0;
  if (r.len > kInlineKeyBytes) {
    delete[] r.heap;
  }
  r.len = 0;
  r.payload = 0;
  r.extra = 0;
  --size_;
}

}  // namespace kvoff
