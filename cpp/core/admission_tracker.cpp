#include "kvoff/admission_tracker.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "kvoff/block_pool.h"

namespace kvoff {

namespace {

std::uint32_t checked_capacity(std::uint32_t capacity) {
  if (capacity == 0 || static_cast<std::int64_t>(capacity) > kMaxNumBlocks) {
    throw std::invalid_argument("AdmissionTracker: capacity=" + std::to_string(capacity) +
                                " is out of range; pass 1 .. 2^31-1 keys");
  }
  return capacity;
}

// How many keys ahead find_all prefetches the index bucket.
constexpr std::size_t kFindAhead = 16;

}  // namespace

std::uint64_t AdmissionTracker::memory_bytes(std::uint32_t capacity) noexcept {
  return KeyIndex::memory_bytes(capacity) + (std::uint64_t{capacity} + 1) * sizeof(Links);
}

AdmissionTracker::AdmissionTracker(std::uint32_t capacity)
    : index_(checked_capacity(capacity)), sentinel_(capacity) {
  links_.assign(std::size_t{capacity} + 1, Links{capacity, capacity});  // empty: sentinel only
}

std::uint32_t AdmissionTracker::next_stamp() noexcept {
  if (++stamp_ == 0) {  // wrapped after 2^32 calls: clear the stale stamps once
    for (std::uint32_t e = 0; e < next_unused_; ++e) {
      index_.payload(e) &= kLow32;
    }
    stamp_ = 1;
  }
  return stamp_;
}

void AdmissionTracker::unlink(std::uint32_t e) noexcept {
  const Links l = links_[e];
  links_[l.prev].next = l.next;
  links_[l.next].prev = l.prev;
}

void AdmissionTracker::link_most_recent(std::uint32_t e) noexcept {
  const std::uint32_t first = links_[sentinel_].next;
  links_[e] = Links{sentinel_, first};
  links_[first].prev = e;
  links_[sentinel_].next = e;
}

void AdmissionTracker::add_offers(std::uint32_t e, std::uint32_t stamp,
                                  std::uint32_t offers) noexcept {
  std::uint64_t& p = index_.payload(e);
  if (static_cast<std::uint32_t>(p >> 32) != stamp) {
    p = (p & kLow32) | (static_cast<std::uint64_t>(stamp) << 32);
    ++protected_;
  }
  const auto count = static_cast<std::uint32_t>(p);
  const std::uint32_t room = std::numeric_limits<std::uint32_t>::max() - count;
  p += std::min(offers, room);  // saturates: only the comparison with a threshold matters
}

void AdmissionTracker::find_all(std::span<const std::string_view> keys,
                                const std::uint64_t* hashes,
                                std::uint32_t* entries) const noexcept {
  const std::size_t n = keys.size();
  for (std::size_t k = 0; k < std::min(n, kFindAhead); ++k) {
    index_.prefetch_insert(hashes[k]);  // the key's home bucket
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (i + kFindAhead < n) {
      index_.prefetch_insert(hashes[i + kFindAhead]);
    }
    entries[i] = index_.find(keys[i], hashes[i]);
  }
}

std::uint32_t AdmissionTracker::count_of(std::string_view key) const noexcept {
  if (key.empty()) {
    return 0;
  }
  const std::uint32_t e = index_.find(key);
  return e == KeyIndex::kNotFound ? 0 : count(e);
}

void AdmissionTracker::record(std::span<const std::string_view> keys,
                              const std::uint64_t* hashes, std::span<std::uint32_t> entries) {
  const std::uint32_t stamp = next_stamp();
  protected_ = 0;
  const std::uint32_t cap = capacity();
  // 1. Tracked keys: one offer per occurrence; they are protected for the rest of the call.
  std::size_t untracked = 0;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (entries[i] == kNotTracked) {
      ++untracked;
    } else {
      add_offers(entries[i], stamp, 1);
    }
  }
  // When step 2 may evict, the protected entries go to the most recent end first, so that the
  // least recent end holds unprotected entries only (each eviction is then O(1)).
  if (untracked > cap - next_unused_) {
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (entries[i] != kNotTracked) {
        unlink(entries[i]);
        link_most_recent(entries[i]);
      }
    }
  }
  // 2. Untracked keys, head first (the head gets room first when the tracker is full).
  if (untracked > 0) {
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (entries[i] != kNotTracked) {
        continue;
      }
      std::uint32_t e = index_.find(keys[i], hashes[i]);
      if (e != KeyIndex::kNotFound) {  // added by an earlier occurrence in this call
        add_offers(e, stamp, 1);
        entries[i] = e;
        continue;
      }
      if (spare_ != kNotTracked) {
        e = std::exchange(spare_, kNotTracked);
      } else if (next_unused_ < cap) {
        e = next_unused_++;
      } else if (protected_ < index_.size()) {
        e = links_[sentinel_].prev;  // the least recently offered entry: unprotected (above)
        unlink(e);
        index_.erase(e);
      } else {
        continue;  // every entry is a key of this call: this one is not tracked
      }
      try {
        index_.insert_absent(e, keys[i], hashes[i]);  // found absent just above
      } catch (...) {  // std::bad_alloc (a key longer than 40 bytes): the slot stays free
        spare_ = e;
        throw;
      }
      add_offers(e, stamp, 1);
      link_most_recent(e);
      entries[i] = e;
    }
  }
  // 3. The call's keys become the most recently offered, last to first: keys[0] ends the most
  //    recent (a repeated key takes the place of its first occurrence).
  for (std::size_t i = keys.size(); i-- > 0;) {
    if (entries[i] != kNotTracked) {
      unlink(entries[i]);
      link_most_recent(entries[i]);
    }
  }
}

}  // namespace kvoff
