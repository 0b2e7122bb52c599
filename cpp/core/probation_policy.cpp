// ProbationEvictionPolicy: LRU with an adaptive probation for blocks not reused since they were
// stored (eviction_policy.h documents the rules; docs/eviction-policies.md the measurements that
// chose them).
#include <algorithm>
#include <bit>
#include <stdexcept>
#include <string>

#include "kvoff/block_pool.h"
#include "kvoff/eviction_policy.h"
#include "kvoff/key.h"
#include "two_list_victims.h"

namespace kvoff {

namespace {

constexpr std::size_t kList[3] = {0, 0, 1};  // List -> ghost list index (kNone unused)

std::size_t list_index(ProbationEvictionPolicy::List list) noexcept {
  return kList[static_cast<std::size_t>(list)];
}

}  // namespace

ProbationEvictionPolicy::ProbationEvictionPolicy(std::uint32_t capacity)
    : capacity_(capacity),
      probation_head_(capacity),
      protected_head_(capacity + 1),
      budget_(capacity) {
  if (capacity == 0 || static_cast<std::int64_t>(capacity) > kMaxNumBlocks) {
    throw std::invalid_argument("an eviction policy needs a capacity of 1..2^31-1 slots, got " +
                                std::to_string(capacity));
  }
  const std::uint64_t c = capacity;
  window_ = static_cast<std::uint32_t>((c + 3) / 4);
  step_ = static_cast<std::uint32_t>((c + window_ - 1) / window_);
  // Ghosts record eviction epochs of 2^shift evictions in 16 bits: the horizon 2c spans at
  // most 2^14 epochs, so ages (modulo 2^16) are exact up to one epoch and never alias.
  const std::uint64_t horizon = 2 * c;
  epoch_shift_ = static_cast<std::uint32_t>(
      std::bit_width(horizon) > 14 ? std::bit_width(horizon) - 14 : 0);
  horizon_epochs_ = static_cast<std::uint32_t>((horizon + (std::uint64_t{1} << epoch_shift_) - 1) >>
                                               epoch_shift_);
  window_epochs_ = static_cast<std::uint32_t>((window_ + (std::uint64_t{1} << epoch_shift_) - 1) >>
                                              epoch_shift_);
  nodes_.assign(c + 2, Node{0, 0, 0, 0, List::kNone});
  nodes_[probation_head_] = Node{probation_head_, probation_head_, 0, 0, List::kNone};
  nodes_[protected_head_] = Node{protected_head_, protected_head_, 0, 0, List::kNone};
  ghost_sets_.assign(ghost_sets_for(capacity), GhostSet{});
}

std::uint64_t ProbationEvictionPolicy::memory_bytes(std::uint32_t capacity) noexcept {
  return (std::uint64_t{capacity} + 2) * sizeof(Node) +
         std::uint64_t{ghost_sets_for(capacity)} * sizeof(GhostSet);
}

void ProbationEvictionPolicy::check_slot(std::uint32_t slot, const char* op) const {
  if (slot >= capacity_) {
    throw std::out_of_range(std::string("probation ") + op + ": slot " + std::to_string(slot) +
                            " is out of range for capacity " + std::to_string(capacity_));
  }
}

void ProbationEvictionPolicy::check_tracked(std::uint32_t slot, const char* op) const {
  check_slot(slot, op);
  if (nodes_[slot].list == List::kNone) {
    throw std::invalid_argument(std::string("probation ") + op + ": slot " +
                                std::to_string(slot) + " is not tracked; insert it first");
  }
}

void ProbationEvictionPolicy::link_most_recent(std::uint32_t slot, List list) noexcept {
  const std::uint32_t head = list == List::kProbation ? probation_head_ : protected_head_;
  const std::uint32_t last = nodes_[head].prev;
  Node& node = nodes_[slot];
  node.prev = last;
  node.next = head;
  node.stamp = ++clock_;
  nodes_[last].next = slot;
  nodes_[head].prev = slot;
  nodes_[slot].list = list;
  ++(list == List::kProbation ? probation_size_ : protected_size_);
}

void ProbationEvictionPolicy::unlink(std::uint32_t slot) noexcept {
  // Two 4-byte loads (see LRUEvictionPolicy::unlink: store-to-load forwarding).
  const std::uint32_t prev = nodes_[slot].prev;
  const std::uint32_t next = nodes_[slot].next;
  nodes_[prev].next = next;
  nodes_[next].prev = prev;
  --(nodes_[slot].list == List::kProbation ? probation_size_ : protected_size_);
  nodes_[slot].list = List::kNone;
}

std::size_t ProbationEvictionPolicy::set_index(std::uint64_t hash) const noexcept {
  return static_cast<std::size_t>(hash) & (ghost_sets_.size() - 1);  // a power of two
}

std::uint16_t ProbationEvictionPolicy::tag_of(std::uint64_t hash) noexcept {
  const auto tag = static_cast<std::uint16_t>(hash >> 48);  // bits the set index does not use
  return tag == 0 ? 1 : tag;                                 // 0 marks an empty way
}

std::size_t ProbationEvictionPolicy::ghost_sets_for(std::uint32_t capacity) noexcept {
  return static_cast<std::size_t>(
      std::max<std::uint64_t>(1, std::bit_ceil(std::uint64_t{capacity}) / 2));
}

std::size_t ProbationEvictionPolicy::ghost_set_of(std::string_view key,
                                                  std::uint32_t capacity) noexcept {
  return static_cast<std::size_t>(hash_key(key)) & (ghost_sets_for(capacity) - 1);
}

std::uint16_t ProbationEvictionPolicy::ghost_tag_of(std::string_view key) noexcept {
  return tag_of(hash_key(key));
}

std::uint16_t ProbationEvictionPolicy::epoch(std::size_t list) const noexcept {
  return static_cast<std::uint16_t>(evictions_[list] >> epoch_shift_);
}

void ProbationEvictionPolicy::add_ghost(std::uint64_t hash, List list) noexcept {
  const std::size_t l = list_index(list);
  ++evictions_[l];
  const std::uint16_t now = epoch(l);
  const std::uint16_t tag = tag_of(hash);
  GhostSet& set = ghost_sets_[set_index(hash)];
  // The way to (over)write: the key's own ghost, else an empty way, else the oldest ghost.
  std::size_t way = 0;
  std::uint32_t oldest_age = 0;
  for (std::size_t w = 0; w < kGhostWays; ++w) {
    if (set.tag[l][w] == tag) {
      way = w;
      break;
    }
    const std::uint32_t age = set.tag[l][w] == 0
                                  ? 0x10000u
                                  : static_cast<std::uint16_t>(now - set.epoch[l][w]);
    if (age > oldest_age || w == 0) {
      way = w;
      oldest_age = age;
    }
  }
  set.tag[l][way] = tag;
  set.epoch[l][way] = now;
}

void ProbationEvictionPolicy::insert(std::uint32_t slot, std::string_view key) {
  check_slot(slot, "insert");
  if (nodes_[slot].list != List::kNone) {
    throw std::invalid_argument("probation insert: slot " + std::to_string(slot) +
                                " is already tracked; erase it before inserting it again");
  }
  const std::uint64_t hash = hash_key(key);
  const std::uint16_t tag = tag_of(hash);
  GhostSet& set = ghost_sets_[set_index(hash)];
  List list = List::kProbation;
  for (std::size_t l = 0; l < 2; ++l) {
    const std::uint16_t now = epoch(l);
    for (std::size_t w = 0; w < kGhostWays; ++w) {
      if (set.tag[l][w] != tag) {
        continue;
      }
      set.tag[l][w] = 0;  // the key is back: its ghost goes
      const std::uint16_t age = now - set.epoch[l][w];
      if (age >= horizon_epochs_) {
        continue;  // expired
      }
      if (age < window_epochs_) {  // a marginal hit: W more slots for list l would have kept it
        budget_ = l == 0 ? static_cast<std::uint32_t>(std::min<std::uint64_t>(
                               capacity_, std::uint64_t{budget_} + step_))
                         : (budget_ > step_ ? budget_ - step_ : 0);
      }
      list = List::kProtected;  // second sight
    }
  }
  nodes_[slot].hash = hash;
  link_most_recent(slot, list);
}

void ProbationEvictionPolicy::touch(std::uint32_t slot) {
  check_tracked(slot, "touch");
  unlink(slot);
  link_most_recent(slot, List::kProtected);
}

void ProbationEvictionPolicy::touch_pending(std::uint32_t slot) {
  check_tracked(slot, "touch_pending");
  const List list = nodes_[slot].list;
  unlink(slot);
  link_most_recent(slot, list);
}

void ProbationEvictionPolicy::erase(std::uint32_t slot, std::string_view /*key*/,
                                    bool evicted) {
  check_tracked(slot, "erase");
  const List list = nodes_[slot].list;
  unlink(slot);
  if (evicted) {
    add_ghost(nodes_[slot].hash, list);  // hash_key of the key inserted into this slot
  }
}

void ProbationEvictionPolicy::prefetch(std::uint32_t slot) const noexcept {
#if defined(__GNUC__) || defined(__clang__)
  if (slot < capacity_) {
    __builtin_prefetch(&nodes_[slot]);
  }
#else
  (void)slot;
#endif
}

void ProbationEvictionPolicy::prefetch_key(std::uint64_t key_hash) const noexcept {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(&ghost_sets_[set_index(key_hash)]);
#else
  (void)key_hash;
#endif
}

void ProbationEvictionPolicy::prefetch_evict(std::uint32_t slot) const noexcept {
#if defined(__GNUC__) || defined(__clang__)
  if (slot < capacity_) {
    __builtin_prefetch(&ghost_sets_[set_index(nodes_[slot].hash)], 1);
  }
#else
  (void)slot;
#endif
}

std::size_t ProbationEvictionPolicy::select_victims(std::size_t count, SlotPredicate can_evict,
                                                    std::vector<std::uint32_t>& out) const {
  // Probation first while it is over its budget; otherwise the older of the two lists' least
  // recent evictable blocks (by stamp).
  const auto choose = [this](std::size_t taken_p, const auto& peek_p, const auto& peek_r) {
    const auto p = peek_p();
    if (p && probation_size_ - taken_p > budget_) return 0;
    const auto r = peek_r();
    if (!p && !r) return -1;
    return p && (!r || nodes_[*p].stamp < nodes_[*r].stamp) ? 0 : 1;
  };
  return detail::select_from_two_lists(
      count, can_evict, probation_head_, protected_head_,
      [this](std::uint32_t s) { return nodes_[s].next; }, choose, out);
}

std::vector<std::uint32_t> ProbationEvictionPolicy::slots(List list) const {
  std::vector<std::uint32_t> out;
  if (list != List::kProbation && list != List::kProtected) {
    return out;
  }
  const std::uint32_t head = list == List::kProbation ? probation_head_ : protected_head_;
  for (std::uint32_t s = nodes_[head].next; s != head; s = nodes_[s].next) {
    out.push_back(s);
  }
  return out;
}

std::pair<ProbationEvictionPolicy::List, std::uint32_t> ProbationEvictionPolicy::ghost_of(
    std::string_view key) const noexcept {
  const std::uint64_t hash = hash_key(key);
  const std::uint16_t tag = tag_of(hash);
  const GhostSet& set = ghost_sets_[set_index(hash)];
  std::pair<List, std::uint32_t> best{List::kNone, 0};
  for (std::size_t l = 0; l < 2; ++l) {
    const std::uint16_t now = epoch(l);
    for (std::size_t w = 0; w < kGhostWays; ++w) {
      if (set.tag[l][w] != tag) {
        continue;
      }
      const std::uint16_t age = now - set.epoch[l][w];
      if (age < horizon_epochs_ && (best.first == List::kNone || age < best.second)) {
        best = {l == 0 ? List::kProbation : List::kProtected, age};
      }
    }
  }
  return best;
}

}  // namespace kvoff
