// Eviction policies: which stored block to drop when the CPU pool is full.
//
// A policy tracks a set of slots (CPU block ids) in its own order and proposes victims; the
// offloading manager decides which slots may be evicted (ready, not pinned by a load, not part
// of the current store) and commits the evictions. Policies: LRU, ARC and probation. New
// policies implement EvictionPolicy and register a factory in make_eviction_policy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvoff/large_page_allocator.h"

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
/// included), touch() when a ready key is used, touch_pending() when a key whose store has not
/// completed is used (by the request that is storing it), erase() when a slot's key goes away,
/// and select_victims() (which must not change any state) before committing evictions with
/// erase(..., evicted=true). Policies that keep ghost entries of evicted keys (ARC, probation)
/// receive the key bytes in insert() and erase().
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
  /// Records a use of tracked `slot` whose block is ready (a lookup hit or a block the request
  /// holds): for LRU it becomes the most recently used; for ARC it moves to the most recent end
  /// of T2; for probation it is a reuse.
  virtual void touch(std::uint32_t slot) = 0;
  /// Records a use of tracked `slot` whose store has not completed (prepare_store'd, pending):
  /// the request writing the block uses it, which orders it but is no reuse. Default: touch().
  virtual void touch_pending(std::uint32_t slot) { touch(slot); }
  /// Stops tracking `slot` (key `key`). `evicted` is true when the slot was chosen by
  /// select_victims and is being evicted, false when its block is dropped for another reason
  /// (a failed store).
  virtual void erase(std::uint32_t slot, std::string_view key, bool evicted) = 0;

  /// Hint that `slot` is about to be touched or erased (a policy may prefetch its state).
  /// Must accept any slot < capacity, tracked or not. Default: nothing.
  virtual void prefetch(std::uint32_t /*slot*/) const noexcept {}
  /// Hint that a key with hash_key(key) == `key_hash` is about to be inserted (a policy with
  /// ghost entries may prefetch where it looks them up). Default: nothing.
  virtual void prefetch_key(std::uint64_t /*key_hash*/) const noexcept {}
  /// Hint that `slot`, just returned by select_victims, is about to be erased as evicted (a
  /// policy with ghost entries may prefetch where it will write one). Must accept any slot <
  /// capacity. Default: nothing.
  virtual void prefetch_evict(std::uint32_t /*slot*/) const noexcept {}

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
  /// Bytes the constructor allocates for `capacity` slots (no allocation, no check).
  static std::uint64_t memory_bytes(std::uint32_t capacity) noexcept;

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
  template <typename T>
  using Array = std::vector<T, LargePageAllocator<T>>;
  Array<Node> nodes_;  // capacity_ + 1 entries (huge pages: read at random)
};

/// Adaptive Replacement Cache (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement
/// Cache", FAST 2003) over slots [0, capacity), c = capacity.
///
/// Resident slots are in one of two lists, each ordered from least to most recently used:
///  * T1: keys seen once recently (inserted without a ghost hit, never touched since);
///  * T2: keys seen at least twice (touched, or re-inserted after a ghost hit).
/// Ghost lists remember the 64-bit hash_key() of evicted keys (never the key bytes):
///  * B1: keys evicted from T1; B2: keys evicted from T2.
/// The adaptive target p in [0, c] is the size T1 should have; it starts at 0.
///
/// Operations (all O(1); no allocation after construction):
///  * insert(slot, key): when hash(key) is in B1, p = min(c, p + max(1, |B2| / |B1|)); when
///    it is in B2, p = max(0, p - max(1, |B1| / |B2|)) (sizes before the ghost is removed,
///    integer division); either way the ghost is removed and the slot enters T2 as most recent.
///    Otherwise (the paper's case IV) the slot enters T1 as most recent, after trimming ghosts:
///    the least recent ghost of B1 is dropped while |T1| + |B1| >= c, then the least recent ghost
///    of B2 (of B1 when B2 is empty) while |T1| + |T2| + |B1| + |B2| >= 2c. So always
///    |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c.
///  * touch(slot): a T1 or T2 slot becomes the most recent of T2.
///  * touch_pending(slot): the slot becomes the most recent of its own list (no promotion: a
///    block used by the request that stores it, or whose own store it was, is seen once).
///  * erase(slot, key, evicted=true): the slot leaves its list and hash(key) becomes the most
///    recent ghost of B1 (from T1) or B2 (from T2); a ghost with the same hash is replaced.
///    erase(slot, key, evicted=false) (a failed store) drops the slot without a ghost.
///    Neither changes p; both keep the bounds above.
///  * select_victims(count, can_evict, out) (the REPLACE step, one victim at a time): with t1 =
///    |T1| minus the T1 victims already chosen in this call, the next victim is the least
///    recent slot of T1 for which can_evict is true when t1 > p, else that of T2; when the
///    chosen list has no such slot, the least recent evictable slot of the other list; when
///    neither has one, selection stops. Non-evictable slots are skipped (the walk goes on
///    towards the most recent end). This is exactly what erase(victim, key, true) calls in that
///    order would evict, since eviction changes |T1| but not p. (Unlike the paper, the incoming
///    key is not known here, so its "x in B2 and |T1| == p" tie rule is not applied.)
///
/// Prefix order (docs/design.md invariant 8): within T1 and within T2 the order is recency, so keys
/// inserted or touched last to first are evicted tail first among blocks of the same list.
///
/// Memory: 9 bytes per slot for the resident lists (two 4-byte links, 1-byte list tag), plus a
/// ghost store sized for the 2c-ghost bound: 2c ghost nodes of 17 bytes (hash, two links, tag)
/// and 3c+1 4-byte hash buckets, about 55 bytes per slot in all, allocated at construction.
class ARCEvictionPolicy final : public EvictionPolicy {
 public:
  /// Which list a slot or ghost is in.
  enum class List : std::uint8_t { kNone = 0, kT1 = 1, kT2 = 2, kB1 = 3, kB2 = 4 };

  /// Creates an empty policy for slots [0, capacity) with p = 0.
  /// Throws std::invalid_argument when capacity is 0 or above 2^31-1.
  explicit ARCEvictionPolicy(std::uint32_t capacity);
  /// Bytes the constructor allocates for `capacity` slots (no allocation, no check).
  static std::uint64_t memory_bytes(std::uint32_t capacity) noexcept;

  std::string_view name() const noexcept override { return "arc"; }
  std::uint32_t capacity() const noexcept override { return capacity_; }
  std::size_t size() const noexcept override { return t1_size_ + t2_size_; }
  bool contains(std::uint32_t slot) const noexcept override {
    return slot < capacity_ && where_[slot] != List::kNone;
  }
  void insert(std::uint32_t slot, std::string_view key) override;
  void touch(std::uint32_t slot) override;
  void touch_pending(std::uint32_t slot) override;
  void erase(std::uint32_t slot, std::string_view key, bool evicted) override;
  void prefetch(std::uint32_t slot) const noexcept override;
  std::size_t select_victims(std::size_t count, SlotPredicate can_evict,
                             std::vector<std::uint32_t>& out) const override;

  // Introspection (tests, debugging).
  /// The adaptive target size p of T1, in [0, capacity].
  std::uint32_t target() const noexcept { return p_; }
  std::size_t t1_size() const noexcept { return t1_size_; }
  std::size_t t2_size() const noexcept { return t2_size_; }
  std::size_t b1_size() const noexcept { return b1_size_; }
  std::size_t b2_size() const noexcept { return b2_size_; }
  /// kT1, kT2 or kNone (also for slot >= capacity).
  List list_of(std::uint32_t slot) const noexcept {
    return slot < capacity_ ? where_[slot] : List::kNone;
  }
  /// kB1, kB2 or kNone: the ghost list holding hash_key(key).
  List ghost_of(std::string_view key) const noexcept;
  /// The slots of kT1 or kT2, least recent first. O(size of the list).
  std::vector<std::uint32_t> slots(List list) const;
  /// The ghost hashes of kB1 or kB2, least recent first. O(size of the list).
  std::vector<std::uint64_t> ghosts(List list) const;

 private:
  struct Link {
    std::uint32_t prev;
    std::uint32_t next;
  };
  struct Ghost {
    std::uint64_t hash;
    std::uint32_t prev;
    std::uint32_t next;  // also the free-list link of unused nodes
  };

  void check_slot(std::uint32_t slot, const char* op) const;
  void check_tracked(std::uint32_t slot, const char* op) const;
  // Resident lists: sentinels t1_head_ / t2_head_ (next = least recent, prev = most recent).
  void link_most_recent(std::uint32_t slot, List list) noexcept;
  void unlink(std::uint32_t slot) noexcept;
  // Ghost store.
  std::size_t home_bucket(std::uint64_t hash) const noexcept;
  std::uint32_t find_ghost(std::uint64_t hash) const noexcept;  // node index or b1_head_
  void add_ghost(std::uint64_t hash, List list) noexcept;        // as most recent of list
  void remove_ghost(std::uint32_t node) noexcept;
  void drop_least_recent_ghost(List list) noexcept;

  std::uint32_t capacity_;
  std::uint32_t p_ = 0;
  std::uint32_t t1_head_;  // == capacity_
  std::uint32_t t2_head_;  // == capacity_ + 1
  std::size_t t1_size_ = 0;
  std::size_t t2_size_ = 0;
  // Per-slot and per-ghost arrays are read at random: huge pages (LargePageAllocator).
  template <typename T>
  using Array = std::vector<T, LargePageAllocator<T>>;
  Array<Link> links_;   // capacity_ + 2 entries (two sentinels)
  Array<List> where_;   // capacity_ entries: kNone, kT1 or kT2

  // Ghost node indices: [0, 2c) entries, 2c and 2c+1 the B1 and B2 sentinels. The B1
  // sentinel's index also marks an empty bucket and the end of the free list (it never appears
  // in either), so no index needs a reserved value even at capacity 2^31-1.
  std::uint32_t b1_head_;     // == 2 * capacity_
  std::uint32_t b2_head_;     // == 2 * capacity_ + 1
  std::uint32_t ghost_free_;  // first unused ghost node, b1_head_ when none
  std::size_t b1_size_ = 0;
  std::size_t b2_size_ = 0;
  Array<Ghost> ghost_nodes_;  // 2 * capacity_ + 2 entries (two sentinels)
  Array<List> ghost_list_;    // per ghost node: kB1, kB2 or kNone (unused)
  Array<std::uint32_t> buckets_;  // 3c+1, linear probing: node index or b1_head_ (empty)
};

/// Probation (kvoff's policy for prefix caches): LRU, except that blocks that have not been
/// reused since they were stored are on probation and leave first while they hold more than an
/// adaptive budget of the pool. Over slots [0, capacity), c = capacity.
///
/// Why (measured with `kvoff replay`, docs/eviction-policies.md): in
/// multi-turn traffic most stored blocks are never read again, and a conversation's next turn
/// comes hundreds of requests later. When the pool holds fewer blocks than arrive between two
/// turns, LRU keeps exactly the newest blocks, whose next turn is still far away, and loses
/// nearly every reuse. Keeping reused ("proven") blocks ahead of unproven ones lets a pool hold
/// live conversations across their turn gaps; when the pool is large enough for LRU to keep
/// them anyway, the budget grows to the whole pool and the policy is LRU.
///
/// State. Every tracked slot is in one of two lists, each ordered by a recency stamp (a 64-bit
/// clock that every insert, touch and touch_pending advances):
///  * probation: blocks not reused since they were stored (inserted without a ghost hit);
///  * protected: blocks reused at least once (touched while ready), or stored again soon after
///    they were evicted ("second sight", a ghost hit; cf. ARC's B1/B2 -> T2, Megiddo & Modha,
///    FAST 2003, and S3-FIFO's ghost queue, Yang et al., SOSP 2023).
/// The budget b in [0, c] is the number of slots probation may hold before its blocks are
/// evicted ahead of older protected ones. It starts at c (pure LRU).
///
/// Ghosts. An evicted key leaves a ghost: a 16-bit tag of its hash and a 16-bit epoch of its
/// eviction number in its list (probation and protected evictions are counted separately). Ghosts
/// live in a set-associative table of S = max(1, bit_ceil(c) / 2) sets; set = hash_key(key) mod S;
/// each set keeps kGhostWays = 8 ghosts per list (one 64-byte line), replacing the oldest of its
/// list when full. So each list remembers at least its last 2c evicted keys (8S >= 2c); a ghost
/// whose age (later evictions from its list) is 2c or more is expired.
///
/// Operations (all O(1); no allocation after construction):
///  * insert(slot, key): the ghosts of the key are removed. A ghost younger than W = ceil(c / 4)
///    evictions of its list is a marginal hit (Qureshi & Patt, "Utility-Based Cache
///    Partitioning", MICRO 2006: a hit that W more slots for that list would have given): a
///    probation ghost raises b by D = ceil(c / W), a protected ghost lowers it by D (clamped to
///    [0, c]), so W marginal hits of one kind sweep b across the whole pool. A ghost younger than
///    2c admits the slot to protected; otherwise it enters probation. Either way it is the most
///    recent slot of its list.
///  * touch(slot): the slot becomes the most recent of protected (from probation: promoted).
///  * touch_pending(slot): the slot becomes the most recent of its own list (no promotion).
///  * erase(slot, key, evicted): the slot leaves its list; when evicted, the key becomes the
///    newest ghost of that list. erase(..., false) (a failed store) leaves no ghost. b is
///    unchanged.
///  * select_victims(count, can_evict, out), one victim at a time, with n_p = |probation| minus
///    the probation victims already chosen in this call: when n_p > b, the least recent
///    evictable slot of probation; otherwise the least recently stamped of the two lists' least
///    recent evictable slots (global LRU). When the chosen list has no evictable slot, the
///    other's; when neither has one, selection stops. This is what erase(victim, key, true)
///    calls in that order evict (erase changes n_p, not b or stamps).
///
/// With b = c the victims are those of LRU over the same operations (every slot is stamped when
/// LRU would make it most recent). Prefix order (docs/design.md invariant 8): within a list the
/// order is the stamp order, so keys touched or inserted last to first are evicted tail first.
///
/// Constants: W = c/4 and D = c/W (the budget's learning window and step) and the 2c ghost
/// horizon (ARC's directory of 2c keys) are fractions of the pool size fixed in advance, not
/// fitted to a trace; the budget itself is learned online.
///
/// Memory: 25 bytes per slot (two 4-byte links, an 8-byte stamp, the 8-byte key hash, a 1-byte
/// list tag) plus the ghost table, 64 x S bytes (32 to 64 bytes per slot), allocated at
/// construction.
class ProbationEvictionPolicy final : public EvictionPolicy {
 public:
  /// Which list a slot is in, or which list a ghost came from.
  enum class List : std::uint8_t { kNone = 0, kProbation = 1, kProtected = 2 };

  /// Creates an empty policy for slots [0, capacity) with budget b = capacity.
  /// Throws std::invalid_argument when capacity is 0 or above 2^31-1.
  explicit ProbationEvictionPolicy(std::uint32_t capacity);
  /// Bytes the constructor allocates for `capacity` slots (no allocation, no check).
  static std::uint64_t memory_bytes(std::uint32_t capacity) noexcept;

  std::string_view name() const noexcept override { return "probation"; }
  std::uint32_t capacity() const noexcept override { return capacity_; }
  std::size_t size() const noexcept override { return probation_size_ + protected_size_; }
  bool contains(std::uint32_t slot) const noexcept override {
    return slot < capacity_ && nodes_[slot].list != List::kNone;
  }
  void insert(std::uint32_t slot, std::string_view key) override;
  void touch(std::uint32_t slot) override;
  void touch_pending(std::uint32_t slot) override;
  void erase(std::uint32_t slot, std::string_view key, bool evicted) override;
  void prefetch(std::uint32_t slot) const noexcept override;
  void prefetch_key(std::uint64_t key_hash) const noexcept override;
  void prefetch_evict(std::uint32_t slot) const noexcept override;
  std::size_t select_victims(std::size_t count, SlotPredicate can_evict,
                             std::vector<std::uint32_t>& out) const override;

  // Introspection (tests, debugging).
  /// The budget b, in slots: probation blocks beyond it are evicted first. In [0, capacity].
  std::uint32_t budget() const noexcept { return budget_; }
  /// W: a ghost younger than this many evictions of its list moves the budget.
  std::uint32_t window() const noexcept { return window_; }
  /// D: how far one marginal ghost hit moves the budget, in slots.
  std::uint32_t step() const noexcept { return step_; }
  /// Ghost sets S (each holds kGhostWays = 8 ghosts per list).
  std::size_t ghost_sets() const noexcept { return ghost_sets_.size(); }
  /// S for a policy of `capacity` slots: max(1, bit_ceil(capacity) / 2).
  static std::size_t ghost_sets_for(std::uint32_t capacity) noexcept;
  /// The set where `key`'s ghosts live in a policy of `capacity` slots: hash_key(key) mod S.
  static std::size_t ghost_set_of(std::string_view key, std::uint32_t capacity) noexcept;
  /// The 16-bit tag that stands for `key` in its ghost set (never 0). Two keys with the same
  /// set and tag share their ghosts.
  static std::uint16_t ghost_tag_of(std::string_view key) noexcept;
  std::size_t probation_size() const noexcept { return probation_size_; }
  std::size_t protected_size() const noexcept { return protected_size_; }
  /// kProbation, kProtected or kNone (also for slot >= capacity).
  List list_of(std::uint32_t slot) const noexcept {
    return slot < capacity_ ? nodes_[slot].list : List::kNone;
  }
  /// The slots of kProbation or kProtected, least recent first. O(size of the list).
  std::vector<std::uint32_t> slots(List list) const;
  /// The list of `key`'s youngest unexpired ghost (kNone if it has none), and that ghost's age
  /// in evictions of its list (0: the latest eviction).
  std::pair<List, std::uint32_t> ghost_of(std::string_view key) const noexcept;

 private:
  struct alignas(32) Node {  // 32 bytes: one slot's state never straddles a cache line
    std::uint32_t prev;
    std::uint32_t next;
    std::uint64_t stamp;  // clock value of the slot's latest insert or touch
    std::uint64_t hash;   // hash_key of the slot's key (where its ghost will go)
    List list;            // kNone when not tracked
  };
  static constexpr std::size_t kGhostWays = 8;  // ghosts per list per set
  struct alignas(64) GhostSet {
    // Per list (index 0: probation, 1: protected): 16-bit hash tags (0: empty) and the
    // eviction epoch of each ghost. 64 bytes: one cache line.
    std::uint16_t tag[2][kGhostWays];
    std::uint16_t epoch[2][kGhostWays];
  };

  void check_slot(std::uint32_t slot, const char* op) const;
  void check_tracked(std::uint32_t slot, const char* op) const;
  void link_most_recent(std::uint32_t slot, List list) noexcept;
  void unlink(std::uint32_t slot) noexcept;
  std::size_t set_index(std::uint64_t hash) const noexcept;
  static std::uint16_t tag_of(std::uint64_t hash) noexcept;
  std::uint16_t epoch(std::size_t list) const noexcept;  // current epoch of a list, mod 2^16
  void add_ghost(std::uint64_t hash, List list) noexcept;

  std::uint32_t capacity_;
  std::uint32_t probation_head_;  // sentinel == capacity_ (next = least recent, prev = most)
  std::uint32_t protected_head_;  // sentinel == capacity_ + 1
  std::size_t probation_size_ = 0;
  std::size_t protected_size_ = 0;
  std::uint64_t clock_ = 0;
  std::uint32_t budget_;
  std::uint32_t window_;
  std::uint32_t step_;
  std::uint32_t epoch_shift_;     // an epoch is 2^epoch_shift_ evictions of a list
  std::uint32_t horizon_epochs_;  // ghosts this many epochs old or older are expired (2c)
  std::uint32_t window_epochs_;   // ghosts younger than this move the budget (W)
  std::uint64_t evictions_[2] = {0, 0};  // per list
  template <typename T>
  using Array = std::vector<T, LargePageAllocator<T>>;
  Array<Node> nodes_;   // capacity_ + 2 entries (two sentinels)
  Array<GhostSet> ghost_sets_;
};

/// Names accepted by make_eviction_policy, in registration order ({"lru", "arc", "probation"}).
std::vector<std::string> eviction_policy_names();

/// Bytes the policy registered under `name` allocates when created for `capacity` slots
/// (its memory_bytes); 0 for an unknown name. Allocates nothing.
std::uint64_t eviction_policy_memory_bytes(std::string_view name,
                                           std::uint32_t capacity) noexcept;

/// Creates the policy registered under `name` for slots [0, capacity).
/// Throws std::invalid_argument for an unknown name, listing the registered names, and for a
/// capacity of 0 or above 2^31-1.
std::unique_ptr<EvictionPolicy> make_eviction_policy(std::string_view name,
                                                     std::uint32_t capacity);

}  // namespace kvoff
