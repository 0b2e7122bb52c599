// Eviction policies: which stored block to drop when the CPU pool is full.
//
// A policy tracks a set of slots (CPU block ids) in its own order and proposes victims; the
// offloading manager decides which slots may be evicted (ready, not pinned by a load, not part
// of the current store) and commits the evictions. New policies (ARC next) implement
// EvictionPolicy and register a factory in make_eviction_policy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvoff {

/// A non-owning reference to a callable `bool(std::uint32_t slot)`: whether a slot may be
/// evicted now. Cheap to copy; the referenced callable must outlive every call.
class SlotPredicate {
 public:
  /// Wraps `fn` (any callable taking a slot and returning bool) by reference.
  template <typename F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, SlotPredicate>)
  SlotPredicate(F&& fn) noexcept  // NOLINT(google-explicit-constructor)
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(fn)))),
        call_([](void* object, std::uint32_t slot) -> bool {
          return (*static_cast<std::remove_reference_t<F>*>(object))(slot);
        }) {}

  /// Calls the wrapped callable.
  bool operator()(std::uint32_t slot) const { return call_(object_, slot); }

 private:
  void* object_;
  bool (*call_)(void*, std::uint32_t);
};

/// The interface of an eviction policy over slots [0, capacity).
///
/// The manager calls insert() when a key gets a slot (at prepare_store, pending blocks
/// included), touch() when a key is used, erase() when a slot's key goes away, and
/// select_victims() (which must not change any state) before committing evictions with
/// erase(..., evicted=true). Policies that keep ghost entries of evicted keys (ARC) receive the
/// key bytes in insert() and erase().
///
/// Implementations throw std::out_of_range for a slot >= capacity and std::invalid_argument
/// when a slot is inserted twice or a slot that is not tracked is touched or erased; the policy
/// is unchanged then. Not thread-safe.
class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;

  /// The name this policy is registered under in make_eviction_policy ("lru", ...).
  virtual std::string_view name() const noexcept = 0;
  /// Slots this policy can track: ids in [0, capacity).
  virtual std::uint32_t capacity() const noexcept = 0;
  /// Slots currently tracked.
  virtual std::size_t size() const noexcept = 0;
  /// Whether `slot` is tracked (false for slot >= capacity).
  virtual bool contains(std::uint32_t slot) const noexcept = 0;

  /// Starts tracking `slot`, whose block has key `key`, as the most recently used slot.
  virtual void insert(std::uint32_t slot, std::string_view key) = 0;
  /// Records a use of tracked `slot` (for LRU: makes it the most recently used).
  virtual void touch(std::uint32_t slot) = 0;
  /// Stops tracking `slot` (key `key`). `evicted` is true when the slot was chosen by
  /// select_victims and is being evicted, false when its block is dropped for another reason
  /// (a failed store).
  virtual void erase(std::uint32_t slot, std::string_view key, bool evicted) = 0;

  /// Hint that `slot` is about to be touched or erased (a policy may prefetch its state).
  /// Must accept any slot < capacity, tracked or not. Default: nothing.
  virtual void prefetch(std::uint32_t /*slot*/) const noexcept {}

  /// Appends to `out`, in eviction order, up to `count` tracked slots for which `can_evict`
  /// returns true, and returns how many it appended. Changes no state: evicting the returned
  /// slots in order with erase(slot, key, true) is what the policy would do next. Cost: the
  /// number of slots examined (victims plus the non-evictable slots skipped on the way).
  virtual std::size_t select_victims(std::size_t count, SlotPredicate can_evict,
                                     std::vector<std::uint32_t>& out) const = 0;
};

/// Least recently used: an intrusive doubly-linked list over slot ids (8 bytes per slot).
/// insert/touch/erase are O(1); select_victims walks from the least recently used end.
class LRUEvictionPolicy final : public EvictionPolicy {
 public:
  /// Creates an empty policy for slots [0, capacity).
  /// Throws std::invalid_argument when capacity is 0 or above 2^31-1.
  explicit LRUEvictionPolicy(std::uint32_t capacity);

  std::string_view name() const noexcept override { return "lru"; }
  std::uint32_t capacity() const noexcept override { return capacity_; }
  std::size_t size() const noexcept override { return size_; }
  bool contains(std::uint32_t slot) const noexcept override {
    return slot < capacity_ && nodes_[slot].prev != kUnlinked;
  }
  void insert(std::uint32_t slot, std::string_view key) override;
  void touch(std::uint32_t slot) override;
  void erase(std::uint32_t slot, std::string_view key, bool evicted) override;
  void prefetch(std::uint32_t slot) const noexcept override;
  std::size_t select_victims(std::size_t count, SlotPredicate can_evict,
                             std::vector<std::uint32_t>& out) const override;

 private:
  static constexpr std::uint32_t kUnlinked = 0xffffffffu;
  void check_tracked(std::uint32_t slot, const char* op) const;
  void link_most_recent(std::uint32_t slot) noexcept;
  void unlink(std::uint32_t slot) noexcept;

  struct Node {
    std::uint32_t prev;  // kUnlinked when not tracked
    std::uint32_t next;
  };
  std::uint32_t capacity_;
  std::uint32_t head_;  // sentinel node (== capacity_): next = least recent, prev = most recent
  std::size_t size_ = 0;
  std::vector<Node> nodes_;  // capacity_ + 1 entries
};

/// Names accepted by make_eviction_policy, in registration order (currently {"lru"}).
std::vector<std::string> eviction_policy_names();

/// Creates the policy registered under `name` for slots [0, capacity).
/// Throws std::invalid_argument for an unknown name, listing the registered names, and for a
/// capacity of 0 or above 2^31-1.
std::unique_ptr<EvictionPolicy> make_eviction_policy(std::string_view name,
                                                     std::uint32_t capacity);

}  // namespace kvoff
