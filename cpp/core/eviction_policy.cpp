#include "kvoff/eviction_policy.h"

#include <algorithm>
#include <array>
#include <stdexcept>

#include "kvoff/block_pool.h"
#include "kvoff/key.h"
#include "two_list_victims.h"

namespace kvoff {

// ---------------------------------------------------------------------------------------- LRU

LRUEvictionPolicy::LRUEvictionPolicy(std::uint32_t capacity)
    : capacity_(capacity), head_(capacity) {
  if (capacity == 0 || static_cast<std::int64_t>(capacity) > kMaxNumBlocks) {
    throw std::invalid_argument("an eviction policy needs a capacity of 1..2^31-1 slots, got " +
                                std::to_string(capacity));
  }
  nodes_.assign(static_cast<std::size_t>(capacity) + 1, Node{kUnlinked, kUnlinked});
  nodes_[head_] = Node{head_, head_};
}

std::uint64_t LRUEvictionPolicy::memory_bytes(std::uint32_t capacity) noexcept {
  return (std::uint64_t{capacity} + 1) * sizeof(Node);
}

void LRUEvictionPolicy::check_tracked(std::uint32_t slot, const char* op) const {
  if (slot >= capacity_) {
    throw std::out_of_range(std::string("lru ") + op + ": slot " + std::to_string(slot) +
                            " is out of range for capacity " + std::to_string(capacity_));
  }
  if (nodes_[slot].prev == kUnlinked) {
    throw std::invalid_argument(std::string("lru ") + op + ": slot " + std::to_string(slot) +
                                " is not tracked; insert it first");
  }
}

void LRUEvictionPolicy::link_most_recent(std::uint32_t slot) noexcept {
  const std::uint32_t last = nodes_[head_].prev;
  nodes_[slot] = Node{last, head_};
  nodes_[last].next = slot;
  nodes_[head_].prev = slot;
}

void LRUEvictionPolicy::unlink(std::uint32_t slot) noexcept {
  // Two 4-byte loads, not one 8-byte load of the node: when victims are erased in list order,
  // the previous erase has just stored this node's prev field, and an 8-byte load overlapping
  // a pending 4-byte store cannot be forwarded from the store buffer (it waits for the store to
  // reach the cache, ~20 cycles per erase). Each 4-byte load either matches that store exactly
  // or misses it.
  const std::uint32_t prev = nodes_[slot].prev;
  const std::uint32_t next = nodes_[slot].next;
  nodes_[prev].next = next;
  nodes_[next].prev = prev;
}

void LRUEvictionPolicy::insert(std::uint32_t slot, std::string_view /*key*/) {
  if (slot >= capacity_) {
    throw std::out_of_range("lru insert: slot " + std::to_string(slot) +
                            " is out of range for capacity " + std::to_string(capacity_));
  }
  if (nodes_[slot].prev != kUnlinked) {
    throw std::invalid_argument("lru insert: slot " + std::to_string(slot) +
                                " is already tracked; erase it before inserting it again");
  }
  link_most_recent(slot);
  ++size_;
}

void LRUEvictionPolicy::touch(std::uint32_t slot) {
  check_tracked(slot, "touch");
  if (nodes_[head_].prev == slot) {
    return;  // already the most recent
  }
  unlink(slot);
  link_most_recent(slot);
}

void LRUEvictionPolicy::erase(std::uint32_t slot, std::string_view /*key*/, bool /*evicted*/) {
  check_tracked(slot, "erase");
  unlink(slot);
  nodes_[slot] = Node{kUnlinked, kUnlinked};
  --size_;
}

void LRUEvictionPolicy::prefetch(std::uint32_t slot) const noexcept {
#if defined(__GNUC__) || defined(__clang__)
  if (slot < capacity_) {
    __builtin_prefetch(&nodes_[slot]);
  }
#else
  (void)slot;
#endif
}

std::size_t LRUEvictionPolicy::select_victims(std::size_t count, SlotPredicate can_evict,
                                              std::vector<std::uint32_t>& out) const {
  std::size_t found = 0;
  for (std::uint32_t s = nodes_[head_].next; s != head_ && found < count; s = nodes_[s].next) {
    if (can_evict(s)) {
      out.push_back(s);
      ++found;
    }
  }
  return found;
}

// ---------------------------------------------------------------------------------------- ARC

namespace {

#if defined(__SIZEOF_INT128__)
__extension__ typedef unsigned __int128 Uint128;
#endif

std::string arc_range_error(const char* op, std::uint32_t slot, std::uint32_t capacity) {
  return std::string("arc ") + op + ": slot " + std::to_string(slot) +
         " is out of range for capacity " + std::to_string(capacity);
}

}  // namespace

ARCEvictionPolicy::ARCEvictionPolicy(std::uint32_t capacity)
    : capacity_(capacity),
      t1_head_(capacity),
      t2_head_(capacity + 1),
      b1_head_(2 * capacity),
      b2_head_(2 * capacity + 1),
      ghost_free_(0) {
  if (capacity == 0 || static_cast<std::int64_t>(capacity) > kMaxNumBlocks) {
    throw std::invalid_argument("an eviction policy needs a capacity of 1..2^31-1 slots, got " +
                                std::to_string(capacity));
  }
  const std::size_t c = capacity;
  links_.assign(c + 2, Link{0, 0});
  links_[t1_head_] = Link{t1_head_, t1_head_};
  links_[t2_head_] = Link{t2_head_, t2_head_};
  where_.assign(c, List::kNone);

  ghost_nodes_.resize(2 * c + 2);
  for (std::size_t i = 0; i < 2 * c; ++i) {  // free list 0 -> 1 -> ... -> 2c-1 -> end
    ghost_nodes_[i] = Ghost{0, 0, static_cast<std::uint32_t>(i + 1)};
  }
  ghost_nodes_[2 * c - 1].next = b1_head_;
  ghost_nodes_[b1_head_] = Ghost{0, b1_head_, b1_head_};
  ghost_nodes_[b2_head_] = Ghost{0, b2_head_, b2_head_};
  ghost_list_.assign(2 * c + 2, List::kNone);
  buckets_.assign(3 * c + 1, b1_head_);
}

std::uint64_t ARCEvictionPolicy::memory_bytes(std::uint32_t capacity) noexcept {
  const std::uint64_t c = capacity;
  return (c + 2) * sizeof(Link) + c * sizeof(List) + (2 * c + 2) * (sizeof(Ghost) + sizeof(List)) +
         (3 * c + 1) * sizeof(std::uint32_t);
}

void ARCEvictionPolicy::check_slot(std::uint32_t slot, const char* op) const {
  if (slot >= capacity_) {
    throw std::out_of_range(arc_range_error(op, slot, capacity_));
  }
}

void ARCEvictionPolicy::check_tracked(std::uint32_t slot, const char* op) const {
  check_slot(slot, op);
  if (where_[slot] == List::kNone) {
    throw std::invalid_argument(std::string("arc ") + op + ": slot " + std::to_string(slot) +
                                " is not tracked; insert it first");
  }
}

void ARCEvictionPolicy::link_most_recent(std::uint32_t slot, List list) noexcept {
  const std::uint32_t head = list == List::kT1 ? t1_head_ : t2_head_;
  const std::uint32_t last = links_[head].prev;
  links_[slot] = Link{last, head};
  links_[last].next = slot;
  links_[head].prev = slot;
  where_[slot] = list;
  ++(list == List::kT1 ? t1_size_ : t2_size_);
}

void ARCEvictionPolicy::unlink(std::uint32_t slot) noexcept {
  const Link n = links_[slot];
  links_[n.prev].next = n.next;
  links_[n.next].prev = n.prev;
  --(where_[slot] == List::kT1 ? t1_size_ : t2_size_);
  where_[slot] = List::kNone;
}

std::size_t ARCEvictionPolicy::home_bucket(std::uint64_t hash) const noexcept {
#if defined(__SIZEOF_INT128__)
  return static_cast<std::size_t>((static_cast<Uint128>(hash) * buckets_.size()) >> 64);
#else
  return static_cast<std::size_t>(hash % buckets_.size());
#endif
}

std::uint32_t ARCEvictionPolicy::find_ghost(std::uint64_t hash) const noexcept {
  const std::size_t n = buckets_.size();
  for (std::size_t b = home_bucket(hash);; b = b + 1 == n ? 0 : b + 1) {
    const std::uint32_t node = buckets_[b];
    if (node == b1_head_ || ghost_nodes_[node].hash == hash) {
      return node;
    }
  }
}

void ARCEvictionPolicy::add_ghost(std::uint64_t hash, List list) noexcept {
  const std::uint32_t existing = find_ghost(hash);
  if (existing != b1_head_) {
    remove_ghost(existing);  // a hash collision: keep one ghost per hash
  }
  // The bounds leave a free node: ghosts <= 2c - resident, and the evicted slot was resident.
  const std::uint32_t node = ghost_free_;
  ghost_free_ = ghost_nodes_[node].next;
  const std::uint32_t head = list == List::kB1 ? b1_head_ : b2_head_;
  const std::uint32_t last = ghost_nodes_[head].prev;
  ghost_nodes_[node] = Ghost{hash, last, head};
  ghost_nodes_[last].next = node;
  ghost_nodes_[head].prev = node;
  ghost_list_[node] = list;
  ++(list == List::kB1 ? b1_size_ : b2_size_);
  const std::size_t n = buckets_.size();
  std::size_t b = home_bucket(hash);
  while (buckets_[b] != b1_head_) {
    b = b + 1 == n ? 0 : b + 1;
  }
  buckets_[b] = node;
}

void ARCEvictionPolicy::remove_ghost(std::uint32_t node) noexcept {
  // Bucket: find it, then shift later entries of the probe run back (no tombstones).
  const std::size_t n = buckets_.size();
  std::size_t hole = home_bucket(ghost_nodes_[node].hash);
  while (buckets_[hole] != node) {
    hole = hole + 1 == n ? 0 : hole + 1;
  }
  for (std::size_t j = hole;;) {
    j = j + 1 == n ? 0 : j + 1;
    const std::uint32_t other = buckets_[j];
    if (other == b1_head_) {
      break;
    }
    const std::size_t home = home_bucket(ghost_nodes_[other].hash);
    // `other` may move into the hole unless its home lies cyclically in (hole, j].
    const bool home_after_hole =
        hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
    if (!home_after_hole) {
      buckets_[hole] = other;
      hole = j;
    }
  }
  buckets_[hole] = b1_head_;
  // List and free list.
  const Ghost g = ghost_nodes_[node];
  ghost_nodes_[g.prev].next = g.next;
  ghost_nodes_[g.next].prev = g.prev;
  --(ghost_list_[node] == List::kB1 ? b1_size_ : b2_size_);
  ghost_list_[node] = List::kNone;
  ghost_nodes_[node].next = ghost_free_;
  ghost_free_ = node;
}

void ARCEvictionPolicy::drop_least_recent_ghost(List list) noexcept {
  const std::uint32_t head = list == List::kB1 ? b1_head_ : b2_head_;
  const std::uint32_t node = ghost_nodes_[head].next;
  if (node != head) {
    remove_ghost(node);
  }
}

void ARCEvictionPolicy::insert(std::uint32_t slot, std::string_view key) {
  check_slot(slot, "insert");
  if (where_[slot] != List::kNone) {
    throw std::invalid_argument("arc insert: slot " + std::to_string(slot) +
                                " is already tracked; erase it before inserting it again");
  }
  const std::uint64_t hash = hash_key(key);
  const std::uint32_t ghost = find_ghost(hash);
  if (ghost != b1_head_) {
    // Cases II and III: a ghost hit adapts p and the key enters T2.
    const std::size_t b1 = b1_size_;
    const std::size_t b2 = b2_size_;
    if (ghost_list_[ghost] == List::kB1) {
      const std::size_t delta = std::max<std::size_t>(1, b2 / b1);
      p_ = static_cast<std::uint32_t>(std::min<std::size_t>(capacity_, p_ + delta));
    } else {
      const std::size_t delta = std::max<std::size_t>(1, b1 / b2);
      p_ = delta >= p_ ? 0 : static_cast<std::uint32_t>(p_ - delta);
    }
    remove_ghost(ghost);
    link_most_recent(slot, List::kT2);
    return;
  }
  // Case IV: a new key enters T1; drop ghosts so the bounds still hold after it is added.
  const std::size_t c = capacity_;
  while (t1_size_ + b1_size_ >= c && b1_size_ > 0) {
    drop_least_recent_ghost(List::kB1);
  }
  while (t1_size_ + t2_size_ + b1_size_ + b2_size_ >= 2 * c && b1_size_ + b2_size_ > 0) {
    drop_least_recent_ghost(b2_size_ > 0 ? List::kB2 : List::kB1);
  }
  link_most_recent(slot, List::kT1);
}

void ARCEvictionPolicy::touch(std::uint32_t slot) {
  check_tracked(slot, "touch");
  if (where_[slot] == List::kT2 && links_[t2_head_].prev == slot) {
    return;  // already the most recent of T2
  }
  unlink(slot);
  link_most_recent(slot, List::kT2);
}

void ARCEvictionPolicy::touch_pending(std::uint32_t slot) {
  check_tracked(slot, "touch_pending");
  const List list = where_[slot];
  const std::uint32_t head = list == List::kT1 ? t1_head_ : t2_head_;
  if (links_[head].prev == slot) return;  // already the most recent of its list
  unlink(slot);
  link_most_recent(slot, list);
}

void ARCEvictionPolicy::erase(std::uint32_t slot, std::string_view key, bool evicted) {
  check_tracked(slot, "erase");
  const List from = where_[slot];
  unlink(slot);
  if (evicted) {
    add_ghost(hash_key(key), from == List::kT1 ? List::kB1 : List::kB2);
  }
}

void ARCEvictionPolicy::prefetch(std::uint32_t slot) const noexcept {
#if defined(__GNUC__) || defined(__clang__)
  if (slot < capacity_) {
    __builtin_prefetch(&links_[slot]);
    __builtin_prefetch(&where_[slot]);
  }
#else
  (void)slot;
#endif
}

std::size_t ARCEvictionPolicy::select_victims(std::size_t count, SlotPredicate can_evict,
                                              std::vector<std::uint32_t>& out) const {
  // T1 while it holds more than its target p (ARC's REPLACE), else T2; the other list when the
  // preferred one has nothing evictable.
  const auto choose = [this](std::size_t taken_t1, const auto& peek_t1, const auto& peek_t2) {
    const bool t1_first = t1_size_ - taken_t1 > p_;
    if (t1_first ? peek_t1() : peek_t2()) return t1_first ? 0 : 1;
    if (t1_first ? peek_t2() : peek_t1()) return t1_first ? 1 : 0;
    return -1;
  };
  return detail::select_from_two_lists(
      count, can_evict, t1_head_, t2_head_, [this](std::uint32_t s) { return links_[s].next; },
      choose, out);
}

ARCEvictionPolicy::List ARCEvictionPolicy::ghost_of(std::string_view key) const noexcept {
  const std::uint32_t node = find_ghost(hash_key(key));
  return node == b1_head_ ? List::kNone : ghost_list_[node];
}

std::vector<std::uint32_t> ARCEvictionPolicy::slots(List list) const {
  std::vector<std::uint32_t> out;
  if (list != List::kT1 && list != List::kT2) {
    return out;
  }
  const std::uint32_t head = list == List::kT1 ? t1_head_ : t2_head_;
  for (std::uint32_t s = links_[head].next; s != head; s = links_[s].next) {
    out.push_back(s);
  }
  return out;
}

std::vector<std::uint64_t> ARCEvictionPolicy::ghosts(List list) const {
  std::vector<std::uint64_t> out;
  if (list != List::kB1 && list != List::kB2) {
    return out;
  }
  const std::uint32_t head = list == List::kB1 ? b1_head_ : b2_head_;
  for (std::uint32_t g = ghost_nodes_[head].next; g != head; g = ghost_nodes_[g].next) {
    out.push_back(ghost_nodes_[g].hash);
  }
  return out;
}

// ----------------------------------------------------------------------------------- registry

namespace {

using Factory = std::unique_ptr<EvictionPolicy> (*)(std::uint32_t capacity);

struct Registration {
  std::string_view name;
  Factory make;
  std::uint64_t (*memory_bytes)(std::uint32_t capacity) noexcept;
};

// Add new policies here (name, factory). The first entry is the default.
constexpr std::array<Registration, 3> kPolicies{{
    {"lru", [](std::uint32_t capacity) -> std::unique_ptr<EvictionPolicy> {
       return std::make_unique<LRUEvictionPolicy>(capacity);
     },
     &LRUEvictionPolicy::memory_bytes},
    {"arc", [](std::uint32_t capacity) -> std::unique_ptr<EvictionPolicy> {
       return std::make_unique<ARCEvictionPolicy>(capacity);
     },
     &ARCEvictionPolicy::memory_bytes},
    {"probation", [](std::uint32_t capacity) -> std::unique_ptr<EvictionPolicy> {
       return std::make_unique<ProbationEvictionPolicy>(capacity);
     },
     &ProbationEvictionPolicy::memory_bytes},
}};

}  // namespace

std::vector<std::string> eviction_policy_names() {
  std::vector<std::string> names;
  names.reserve(kPolicies.size());
  for (const auto& p : kPolicies) {
    names.emplace_back(p.name);
  }
  return names;
}

std::uint64_t eviction_policy_memory_bytes(std::string_view name,
                                           std::uint32_t capacity) noexcept {
  for (const auto& p : kPolicies) {
    if (p.name == name) {
      return p.memory_bytes(capacity);
    }
  }
  return 0;
}

std::unique_ptr<EvictionPolicy> make_eviction_policy(std::string_view name,
                                                     std::uint32_t capacity) {
  for (const auto& p : kPolicies) {
    if (p.name == name) {
      return p.make(capacity);
    }
  }
  std::string choices;
  for (const auto& p : kPolicies) {
    choices += choices.empty() ? "'" : ", '";
    choices += p.name;
    choices += "'";
  }
  throw std::invalid_argument("unknown eviction_policy '" + std::string(name) +
                              "'; choose one of: " + choices);
}

}  // namespace kvoff
