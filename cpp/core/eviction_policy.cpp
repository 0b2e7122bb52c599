#include "kvoff/eviction_policy.h"

#include <array>
#include <stdexcept>

#include "kvoff/block_pool.h"

namespace kvoff {

// ---------------------------------------------------------------------------------------- LRU

LRUEvictionPolicy::LRUEvictionPolicy(std::uint32_t capacity) : capacity_(capacity), head_(capacity) {
  if (capacity == 0 || static_cast<std::int64_t>(capacity) > kMaxNumBlocks) {
    throw std::invalid_argument("an eviction policy needs a capacity of 1..2^31-1 slots, got " +
                                std::to_string(capacity));
  }
  nodes_.assign(static_cast<std::size_t>(capacity) + 1, Node{kUnlinked, kUnlinked});
  nodes_[head_] = Node{head_, head_};
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
  const Node n = nodes_[slot];
  nodes_[n.prev].next = n.next;
  nodes_[n.next].prev = n.prev;
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

// ----------------------------------------------------------------------------------- registry

namespace {

using Factory = std::unique_ptr<EvictionPolicy> (*)(std::uint32_t capacity);

struct Registration {
  std::string_view name;
  Factory make;
};

// Add new policies here (name, factory). The first entry is the default.
constexpr std::array<Registration, 1> kPolicies{{
    {"lru", [](std::uint32_t capacity) -> std::unique_ptr<EvictionPolicy> {
       return std::make_unique<LRUEvictionPolicy>(capacity);
     }},
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
