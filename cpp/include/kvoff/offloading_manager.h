// The CPU offloading manager: which offloaded blocks the CPU pool holds, in which slots, and
// which to evict (docs/design.md "manager operations" and invariants 6, 7, 8).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvoff/admission_tracker.h"
#include "kvoff/block_manager.h"
#include "kvoff/block_pool.h"
#include "kvoff/eviction_policy.h"
#include "kvoff/host_memory.h"  // host_memory_limit_bytes, which the constructor checks
#include "kvoff/key_index.h"
#include "kvoff/large_page_allocator.h"
#include "kvoff/write_through_queue.h"

namespace kvoff {

/// "missing", "pending" or "ready".
std::string_view to_string(BlockState state) noexcept;

/// Thrown by CPUOffloadingManager's constructor when this host cannot hold the manager's
/// per-slot arrays. A std::bad_alloc (code that catches that still does; Python sees a
/// MemoryError with this message) whose what() names num_blocks, about how much host memory
/// they need and the fix (fewer blocks: a smaller cpu_bytes_to_use).
class HostMemoryError : public std::bad_alloc {
 public:
  /// `needed_bytes`: CPUOffloadingManager::memory_bytes(num_blocks, eviction_policy, ...).
  /// `limit_bytes`: the host limit (host_memory_limit_bytes) that needed_bytes exceeds, or 0
  /// when an allocation failed below it. `tracker_entries`: max_tracker_size when the
  /// store_threshold filter is on (its tracker is part of needed_bytes; the message then names
  /// it), else 0.
  HostMemoryError(std::int64_t num_blocks, std::string_view eviction_policy,
                  std::uint64_t needed_bytes, std::uint64_t limit_bytes,
                  std::int64_t tracker_entries = 0);
  const char* what() const noexcept override { return message_->c_str(); }

 private:
  std::shared_ptr<const std::string> message_;  // shared: copying an exception cannot throw
};

/// The offloading manager of one CPU pool of `num_blocks` slots.
///
/// Every key is in one of three states (BlockState). prepare_store gives missing keys a slot
/// (pending); complete_store makes them ready (success) or drops them (failure). Ready blocks
/// are lookup hits and can be loaded: prepare_load pins them (a reference count) and
/// complete_load unpins them. When prepare_store needs more slots than are free, it evicts
/// ready, unpinned blocks that are not keys of the same call, in eviction-policy order.
///
/// Guarantees (docs/design.md invariants 6-8):
///  * prepare_store is all-or-nothing: when it cannot get a slot for every new key it returns
///    std::nullopt and changes nothing (no eviction, no event, no recency change).
///  * keys of one prepare_store call are never evicted to make room for each other.
///  * a key is a lookup hit only after complete_store(success=true); a failed store frees its
///    slots; pinned (being loaded) and pending blocks are never evicted.
///  * every operation validates its whole batch before changing anything: on an exception the
///    manager is unchanged (except after std::bad_alloc).
///  * touch and prepare_store order keys so that keys[0] ends most recent: among blocks of
///    equal recency, a prefix's tail is evicted before its head.
///
/// Store admission (store_threshold >= 2; vLLM's store_threshold and max_tracker_size): a key
/// that is not held is stored only once it has been offered to prepare_store at least
/// store_threshold times. An AdmissionTracker of at most max_tracker_size keys counts the
/// offers: every successful prepare_store adds one offer per occurrence of each of its keys
/// (held ones included), and a full tracker forgets its least recently offered key that is not
/// a key of the call (when all are, a new key is not tracked). A new key whose offers, this
/// call's included, stay below the threshold is skipped: no slot, no event, still missing,
/// counted in stores_skipped() and listed in PrepareStoreResult::skipped_indices. Held keys
/// are never skipped, even when the tracker forgot them. lookup() counts nothing. On
/// purpose unlike vLLM (whose CPU manager counts offers even when prepare_store then refuses
/// for lack of room): a refused prepare_store changes the tracker neither (invariant 6; the
/// schedulers retry a refused store with the same keys, which would count one offer twice).
/// And among the keys of one call the tracker orders keys[0] most recent, so that a prefix's
/// tail leaves it before its head, as in the pool (invariant 8; vLLM keeps call order), and
/// its head gets room first when the tracker is full. Off (store_threshold 0 or 1): no
/// tracker, no memory, no cost per call.
///
/// All operations are O(1) per key, plus, for prepare_store, the slots the policy skips while
/// looking for victims (pinned, pending or protected blocks at the evictable end).
/// Memory: about 115 bytes per slot (a 64-byte record holding the key inline up to 40 bytes, the
/// slot's state and its recency-log position; 32 bytes of hash buckets; 8 bytes of LRU links;
/// 5 bytes of free list and flags; 4..8 bytes of recency log), plus the bytes of keys longer
/// than 40; memory_bytes() gives the exact figure for a pool size and policy. The store_threshold
/// tracker adds about 104 bytes per max_tracker_size entry (64,000: about 6.6 MB).
/// Not thread-safe: call it from one thread (the scheduler's), except the write-through calls
/// documented as "any thread" (take_write_through, write_through_done, close_write_through),
/// which go to its WriteThroughQueue, the one part that is thread-safe.
///
/// Speed on large pools (the per-slot arrays are far larger than the CPU caches, so a key costs
/// cache misses, not instructions): each batch operation hashes its keys and probes the index
/// as a software pipeline (KeyIndex::find_each), so the misses of many keys overlap; the big
/// arrays sit on huge pages (LargePageAllocator), so they rarely miss the TLB; prepare_store
/// prefetches the policy nodes and records of the blocks a recency log predicts to be the next
/// victims (turning the policy's pointer-chasing walk into cache hits), keeps everything it
/// needs of a slot in that one record, prefetches the victims' buckets before erasing them, and
/// hands evicted slots straight to the new keys. No allocation per key: the result holds
/// indices and views of the call's keys, and the evicted keys in one buffer. `kvoff bench
/// scheduler` measures it (cpp/bench/manager_bench.h).
class CPUOffloadingManager final : public BlockManager {
 public:
  /// Largest store_threshold (offers): a larger one would store almost nothing.
  static constexpr std::int64_t kMaxStoreThreshold = std::int64_t{1} << 20;
  /// Default max_tracker_size (keys), vLLM's.
  static constexpr std::int64_t kDefaultMaxTrackerSize = 64000;

  /// Creates a manager for a pool of `num_blocks` slots using the eviction policy registered as
  /// `eviction_policy` ("lru", "arc", "probation"); with `enable_events` it records
  /// OffloadingEvents. `store_threshold` (offers; 0 or 1: off) and `max_tracker_size` (keys,
  /// used only when store_threshold >= 2) configure store admission (see the class notes).
  /// Throws std::invalid_argument when num_blocks < 1 or num_blocks > 2^31-1 (naming the
  /// value), when the policy name is unknown (listing the choices), when store_threshold is
  /// negative or above kMaxStoreThreshold, when max_tracker_size is negative or above 2^31-1,
  /// or when it is 0 while store_threshold >= 2 (each naming the value and the valid range);
  /// HostMemoryError (a std::bad_alloc) when memory_bytes() exceeds host_memory_limit_bytes()
  /// (checked before anything is allocated) or when an allocation fails; nothing stays
  /// allocated then.
  explicit CPUOffloadingManager(std::int64_t num_blocks, std::string_view eviction_policy = "lru",
                                bool enable_events = false, std::int64_t store_threshold = 0,
                                std::int64_t max_tracker_size = kDefaultMaxTrackerSize);
  /// Bytes of host memory the constructor allocates for `num_blocks` slots with
  /// `eviction_policy` (pool, key index, policy and recency log; keys longer than 40 bytes add
  /// theirs later; write-through adds 2 bytes per slot once enabled). Allocates nothing.
  /// Counts no policy for an unknown name; 0 for num_blocks outside [1, 2^31-1].
  static std::uint64_t memory_bytes(std::int64_t num_blocks, std::string_view eviction_policy);
  /// memory_bytes(num_blocks, eviction_policy) plus the store_threshold tracker's
  /// (AdmissionTracker::memory_bytes(max_tracker_size)) when store_threshold >= 2 and
  /// max_tracker_size is in [1, 2^31-1]. Allocates nothing.
  static std::uint64_t memory_bytes(std::int64_t num_blocks, std::string_view eviction_policy,
                                    std::int64_t store_threshold, std::int64_t max_tracker_size);
  ~CPUOffloadingManager();
  CPUOffloadingManager(const CPUOffloadingManager&) = delete;
  CPUOffloadingManager& operator=(const CPUOffloadingManager&) = delete;

  /// How many leading keys are ready: counts keys from keys[0] until the first missing one.
  /// Returns std::nullopt ("retry later") when a key before the first missing one is pending.
  /// Changes nothing. Throws std::invalid_argument for an empty key.
  std::optional<std::size_t> lookup(KeySpan keys) const;

  /// Pins every key (reference count +1 per occurrence) so it cannot be evicted until
  /// complete_load, and returns their CPU block ids in call order.
  /// Throws std::invalid_argument, changing nothing, when a key is not ready (naming it in hex
  /// and its state).
  std::vector<std::uint32_t> prepare_load(KeySpan keys) override;

  /// Unpins every key once per occurrence.
  /// Throws std::invalid_argument, changing nothing, when a key is not ready or not pinned as
  /// many times as it occurs (naming it in hex).
  void complete_load(KeySpan keys);
  /// complete_load by CPU block id (the ids prepare_load returned), for callers that kept them:
  /// a block pinned by a load cannot be evicted, so its id names it as well as its key does,
  /// and no key is hashed or looked up.
  /// Throws std::invalid_argument, changing nothing, when an id is outside [0, num_blocks),
  /// free, not ready, or not pinned by loads as many times as it occurs (naming it).
  void complete_load_blocks(std::span<const std::uint32_t> block_ids) override;

  /// Marks held keys (ready or pending) as used, processing them last to first so that keys[0]
  /// ends the most recently used. Keys not held are ignored. A ready key's use goes to the
  /// policy's touch() (a reuse), a pending key's to touch_pending() (the request storing it
  /// uses it: ordered, but no reuse).
  /// Throws std::invalid_argument, changing nothing, for an empty key.
  void touch(KeySpan keys);
  /// touch() with each key's kind of use given, for a request's accesses applied when it
  /// finishes (vLLM's managers do so at on_request_finished): reused[i] != 0 is a reuse (the
  /// policy's touch(): ARC promotes, probation protects), 0 orders the key without counting a
  /// reuse (touch_pending(): a block the request stored itself). A pending key is never a
  /// reuse. keys[0] ends the most recent; keys not held are ignored.
  /// Throws std::invalid_argument, changing nothing, for an empty key or when reused.size()
  /// differs from keys.size().
  void touch(KeySpan keys, std::span<const std::uint8_t> reused) override;
  /// touch() by CPU block id (as prepare_load and prepare_store return them), for callers that
  /// know the blocks already: block_ids[0] ends the most recently used; no key is hashed.
  /// Throws std::invalid_argument, changing nothing, for an id that is not a held block (out of
  /// [0, num_blocks), or free).
  void touch_blocks(std::span<const std::uint32_t> block_ids);

  /// Gives every key that is not held a slot (pending), evicting if needed; see
  /// PrepareStoreResult. New keys enter the policy as most recent, keys[0] the most recent of
  /// them. Keys already held are left as they are (not touched).
  /// Returns std::nullopt and changes nothing when free slots plus evictable blocks (ready,
  /// unpinned, not keys of this call) are fewer than the new keys.
  /// Throws std::invalid_argument, changing nothing, for an empty key.
  ///
  /// With store_threshold >= 2 (class notes) the keys not held are first filtered: those
  /// offered fewer than store_threshold times, this call's offers included, are skipped
  /// (PrepareStoreResult::skipped_indices) and need no slot; the call's offers are recorded
  /// only when it succeeds. `apply_threshold` false: the filter neither counts nor skips these
  /// keys (promotions from a secondary tier: the blocks passed it when first stored).
  std::optional<PrepareStoreResult> prepare_store(KeySpan keys, bool apply_threshold = true);
  /// prepare_store into `result` (its vectors emptied first, their memory reused: a caller
  /// that stores every step allocates nothing here). Returns false where the other returns
  /// std::nullopt; `result` is then unspecified. Throws as the other.
  bool prepare_store(KeySpan keys, PrepareStoreResult& result,
                     bool apply_threshold = true) override;

  /// Finishes the stores of pending keys: with `success` they become ready (lookup hits) and a
  /// BlockStored event lists them; without, they are dropped and their slots freed. A key
  /// occurring several times is finished once.
  /// Throws std::invalid_argument, changing nothing, when a key is not pending (naming it in hex
  /// and its state).
  /// With `write_through` (and write-through enabled), blocks made ready are queued for the
  /// secondary tiers; promotions from a tier pass false (the tier has them already).
  void complete_store(KeySpan keys, bool success = true, bool write_through = true);

  /// complete_store by CPU block id (slot) instead of by key: the `block_ids` of a
  /// PrepareStoreResult, e.g. the slots a store job kept. A pending block cannot move or be
  /// evicted, so its slot names it as well as its key does, and no key is hashed or looked up.
  /// A slot occurring several times is finished once.
  /// Throws std::invalid_argument, changing nothing, when a slot is outside [0, num_blocks),
  /// free, or not pending (naming it and its state).
  ///
  /// `event_ends`: with events enabled, where the BlockStored events split: increasing
  /// positions in `block_ids` (exclusive ends; the last one should be block_ids.size()), e.g.
  /// the end of each store job's slots when the jobs of several requests complete in one call,
  /// so that one event never lists blocks of two requests (a router reads an event's
  /// block_hashes as one request's run). Empty: one event lists them all. Throws
  /// std::invalid_argument, changing nothing, when they are not increasing or pass the end.
  void complete_store_blocks(std::span<const std::uint32_t> block_ids, bool success = true,
                             bool write_through = true,
                             std::span<const std::size_t> event_ends = {}) override;

  /// Slot reservations (a node pool's engines store without waiting for the pool: they write
  /// into slots granted ahead, kvoff/node_pool/server.py). A reserved slot is allocated but
  /// held by no key: not in the index, not evictable, not free (num_reserved_blocks).
  ///
  /// reserve_blocks takes `count` slots, free ones first, then evicting ready, unpinned blocks
  /// in policy order, as prepare_store does (BlockRemoved events with events on): the slots in
  /// result.block_ids, the evicted keys in result.evicted_keys, the other fields empty. All or
  /// nothing: false, and nothing changed, when free plus evictable blocks are fewer than
  /// `count`. The first call allocates one byte per slot (the reserved flags).
  bool reserve_blocks(std::uint32_t count, PrepareStoreResult& result);
  /// Gives keys[i] the reserved slot block_ids[i], pending, as prepare_store gives a new key
  /// its slot (keys[0] the most recent of them; no admission filter, no eviction). A key held
  /// already, or repeating an earlier key of the call, is not stored: its slot stays reserved.
  /// Returns the positions of the keys stored, ascending.
  /// Throws std::invalid_argument, changing nothing, when the sizes differ, a key is empty, or
  /// a slot is not reserved or occurs twice (naming it).
  std::vector<std::uint32_t> store_reserved(KeySpan keys,
                                            std::span<const std::uint32_t> block_ids);
  /// Frees reserved slots (an engine's reservation it will not use).
  /// Throws std::invalid_argument, changing nothing, when a slot is not reserved or occurs
  /// twice (naming it).
  void release_reserved(std::span<const std::uint32_t> block_ids);
  /// Slots reserved (reserve_blocks) and not yet stored into or released.
  std::uint32_t num_reserved_blocks() const noexcept { return num_reserved_; }
  /// Whether slot `block_id` is reserved (false outside [0, num_blocks)).
  bool is_reserved(std::uint32_t block_id) const noexcept {
    return block_id < reserved_.size() && reserved_[block_id] != 0;
  }

  /// Write-through to secondary tiers, with no work on the engine thread beyond a pin per
  /// block. With `capacity_blocks` > 0, each block a store makes ready (complete_store with
  /// write_through) is pinned, so it is not evicted while tiers read it, and queued for
  /// take_write_through, as long as at most `capacity_blocks` blocks are queued or being
  /// written; the rest are dropped and counted (write_through_dropped), never waited for.
  /// 0 turns it off for later stores (blocks in flight finish as usual).
  /// Engine thread (the thread of every other call).
  void set_write_through(std::uint32_t capacity_blocks);
  std::uint32_t write_through_capacity() const noexcept { return wt_capacity_; }

  /// Any thread (a tier writer): the batches queued since the last call, oldest first,
  /// waiting up to `timeout_seconds` for one (0: do not wait; 1e6 or more, inf included: until
  /// one is queued or close_write_through runs). Returns an empty vector on timeout or once
  /// close_write_through ran. Throws std::invalid_argument for a NaN timeout.
  std::vector<WriteThroughBatch> take_write_through(double timeout_seconds);

  /// Any thread: every tier is done with these blocks (of batches from take_write_through);
  /// the engine thread unpins them at its next prepare_store, complete_store*, prepare_load,
  /// complete_load or poll_write_through.
  /// Throws std::invalid_argument, changing nothing, for a block that is not being written
  /// through (never queued, already handed back, or repeated in the call).
  void write_through_done(std::span<const std::uint32_t> block_ids);

  /// Engine thread: unpins the blocks handed back by write_through_done; returns how many.
  std::size_t poll_write_through();

  /// Engine thread: waits up to `timeout_seconds` for blocks to be handed back (1e6 or more,
  /// inf included: until some are), then polls; returns how many were unpinned (for callers
  /// that must not drop, e.g. trace replays). Throws std::invalid_argument for a NaN timeout.
  std::size_t wait_write_through(double timeout_seconds);

  /// Any thread: wakes every take_write_through; later ones return at once. Idempotent.
  void close_write_through();

  /// Blocks queued or being written through (pinned for it) now.
  std::uint32_t write_through_in_flight() const noexcept { return wt_in_flight_; }
  /// Blocks queued for write-through since construction.
  std::uint64_t write_through_queued() const noexcept { return wt_queued_total_; }
  /// Blocks not queued because the queue was full, since construction.
  std::uint64_t write_through_dropped() const noexcept { return wt_dropped_total_; }

  /// Engine thread, for a cache reset with secondary tiers: hands back, unwritten, every batch
  /// queued for write-through that no take_write_through took yet (the next drain unpins
  /// them); returns how many blocks. Batches already taken are the takers' to finish. Call it
  /// while no take_write_through can run (the tiers' dispatcher is held), so that every
  /// block queued before the call is either cancelled or already with its writers.
  std::size_t cancel_write_through();
  /// Blocks handed back unwritten by cancel_write_through, since construction.
  std::uint64_t write_through_cancelled() const noexcept { return wt_cancelled_total_; }

  /// Returns the events recorded since the last call, oldest first, and forgets them. Always
  /// empty when events are disabled.
  std::vector<OffloadingEvent> take_events() override;

  /// Drops the ready, unpinned blocks among `keys` (one BlockRemoved event lists them) and
  /// returns how many: blocks whose data cannot be trusted (a load of them failed, or it was
  /// made before a cache reset). Keys that are missing, pending or still pinned by another
  /// load are left as they are. A block pinned only by its write-through to the tiers is
  /// dropped from the index (no longer a hit) and its slot freed when the tier writer hands it
  /// back. A key occurring several times is dropped once.
  /// Throws std::invalid_argument, changing nothing, for an empty key.
  std::size_t discard(KeySpan keys) override;

  /// Drops every ready block that is not pinned by a load (one BlockRemoved event lists them)
  /// and returns how many. Pending blocks (stores in flight) and pinned blocks (loads in flight)
  /// stay; a pending block that completes later becomes ready as usual. O(num_blocks).
  ///
  /// With `include_in_flight`, for an engine that forgets its jobs in flight at a reset and
  /// never completes them (vLLM's OffloadingConnector does): pending blocks and blocks pinned
  /// by loads are dropped too, their slots freed at once (a later complete_store or
  /// complete_load of them is an error, like for any unknown key). A store still copying into
  /// such a slot is queued before any later store into it, so the later one's bytes win; this
  /// is what vLLM's own CPU manager does. A block being written through to the tiers (and not
  /// pinned by a load, unless `include_in_flight`) is dropped from the index too, so it is no
  /// longer a hit; its slot is freed only when the tier writer hands it back (the writer still
  /// reads it). Returns the blocks dropped, pending ones included.
  std::size_t clear(bool include_in_flight = false) override;

  /// State of `key` (kMissing for a key never seen, or an empty key).
  BlockState state(std::string_view key) const noexcept;
  /// Pin count of `key` (loads in flight); 0 when not ready.
  std::uint32_t pin_count(std::string_view key) const noexcept;
  /// state(key) and pin_count(key) from one index lookup.
  std::pair<BlockState, std::uint32_t> state_and_pins(std::string_view key) const noexcept;
  /// state(key) and its pins by loads only: pin_count(key) less the write-through pin (a block
  /// being written to the secondary tiers can still be loaded). Engine thread.
  std::pair<BlockState, std::uint32_t> state_and_load_pins(
      std::string_view key) const noexcept override;
  /// state_and_load_pins of keys[0], keys[1], ... up to the first key that is missing:
  /// out[i] gets key i's, and the number of leading keys that are held (ready or pending) is
  /// returned (keys.size() when all are; otherwise keys[returned] is missing and out[returned]
  /// is {kMissing, 0}). `out` must have room for keys.size() entries. The index lookups are
  /// pipelined (KeyIndex::find_each), so a batch costs about one memory latency per 64 keys
  /// instead of one per key; stopping at a miss wastes at most 64 hashes. Changes nothing.
  /// Engine thread. An empty key counts as missing.
  std::size_t states_until_missing(
      KeySpan keys, std::pair<BlockState, std::uint32_t>* out) const noexcept override;
  /// CPU block id of a held key, or std::nullopt.
  std::optional<std::uint32_t> block_id(std::string_view key) const noexcept;

  /// Pool size (blocks).
  std::uint32_t num_blocks() const noexcept { return pool_.num_blocks(); }
  /// Free slots (blocks).
  std::uint32_t num_free_blocks() const noexcept { return pool_.num_free(); }
  /// Ready blocks (lookup hits).
  std::uint32_t num_stored_blocks() const noexcept { return num_ready_; }
  /// Pending blocks (prepare_store'd, not yet complete_store'd).
  std::uint32_t num_pending_blocks() const noexcept { return num_pending_; }
  /// Ready blocks that are not pinned (could be evicted now).
  std::uint32_t num_evictable_blocks() const noexcept { return num_evictable_; }
  /// Slots of blocks that clear() or discard() dropped while a tier writer still reads them
  /// (write-through): in no key's name any more, freed when the writer hands them back. So
  /// free + stored + pending + retired + reserved = num_blocks at every moment.
  std::uint32_t num_retired_blocks() const noexcept { return num_retired_; }
  /// Slots some transfer uses now: pending stores, ready blocks pinned by loads or by the
  /// tiers' write-through, and retired slots a writer still reads. That is num_blocks less
  /// the free, evictable and reserved slots (a reserved slot is in use by no transfer until
  /// store_reserved). The numerator of vLLM's vllm:kv_offload_cpu_cache_usage_perc.
  std::uint32_t num_pinned_blocks() const noexcept {
    return num_blocks() - num_free_blocks() - num_evictable_ - num_reserved_;
  }
  /// The eviction policy's registered name.
  std::string_view eviction_policy_name() const noexcept { return policy_->name(); }
  /// Whether events are recorded.
  bool events_enabled() const noexcept { return enable_events_; }
  /// The store_threshold given to the constructor (offers; < 2: no admission filter).
  std::int64_t store_threshold() const noexcept { return store_threshold_; }
  /// The max_tracker_size given to the constructor (keys; used when store_threshold >= 2).
  std::int64_t max_tracker_size() const noexcept { return max_tracker_size_; }
  /// Keys that prepare_store skipped because of store_threshold, since construction (each
  /// skipped key once per call; refused calls count nothing).
  std::uint64_t stores_skipped() const noexcept { return stores_skipped_; }
  /// Keys the store_threshold tracker holds now (0 when the filter is off).
  std::uint32_t tracker_size() const noexcept { return tracker_ ? tracker_->size() : 0; }
  /// Offers the store_threshold tracker counted for `key` (0 when it is not tracked, or the
  /// filter is off).
  std::uint32_t offer_count(std::string_view key) const noexcept {
    return tracker_ ? tracker_->count_of(key) : 0;
  }

 private:
  // Per-slot state lives in the key index's 8-byte payload (same cache line as the key):
  // bits 0-1 BlockState, bits 2-31 pin count, bits 32-63 the stamp of the last call that
  // marked the slot (deduplication and protection within one call).
  static constexpr std::uint32_t kMaxPins = (1u << 30) - 1;

  std::uint32_t next_stamp() noexcept;
  /// State and pins by loads of a held slot (its pin count less the write-through pin).
  std::pair<BlockState, std::uint32_t> load_state(std::uint32_t slot) const noexcept;
  /// Finds all keys (hashes into scratch_hashes_, slots into scratch_slots_).
  void find_all(KeySpan keys);
  /// touch() of slots (kNotFound entries skipped), last to first; no checks. With `reused`
  /// (one flag per slot), a ready slot whose flag is 0 is ordered only (touch_pending).
  void touch_slots(std::span<const std::uint32_t> slots,
                   std::span<const std::uint8_t> reused = {});
  /// Takes one load pin off each of `slots` (ready blocks; a slot may repeat). When a slot has
  /// no load pin left to take (the write-through pin is not a load's), undoes the call's
  /// unpins and returns that slot's index: nothing changed. Else std::nullopt.
  std::optional<std::size_t> unpin_loads(std::span<const std::uint32_t> slots);
  /// Position of the first occurrence of keys[index] among the keys dedupe_insert saw in this
  /// call, or `index` itself (then inserted) when it is the first.
  std::size_t dedupe_insert(KeySpan keys, std::size_t index, std::uint64_t hash);
  /// The store_threshold filter of prepare_store (tracker on): keeps in scratch_new_ the new
  /// keys whose offers reach the threshold, the others in scratch_skipped_. Changes nothing.
  void filter_new_keys(KeySpan keys);
  /// Drops a pending slot whose store failed (policy, index and pool).
  void drop_slot(std::uint32_t slot);
  // complete_store's second half: finishes the (validated, pending) slots, each once.
  void finish_stores(std::span<const std::uint32_t> slots, bool success, bool write_through,
                     std::span<const std::size_t> event_ends = {});
  // finish_stores' BlockStored event of scratch_new_[from:] (none when empty).
  void record_stored(std::size_t from);
  void queue_write_through(std::span<const std::uint32_t> slots);
  std::size_t drain_write_through();
  // Drops a ready block pinned for write-through only from the index and the policy; its slot
  // stays allocated (wt_pinned_ = kWtRetired) until drain_write_through sees it handed back.
  void retire_written_through(std::uint32_t slot);
  void maybe_drain() {
    if (wt_queue_.has_handed_back()) drain_write_through();
  }
  void record(std::vector<std::string> keys, bool removed);
  /// Appends `slot` to the recency log (it was just inserted into or touched in the policy).
  void note_recent(std::uint32_t slot) noexcept;
  // Finds `to_evict` victims into scratch_victims_ (ready, unpinned, not marked with `stamp`;
  // `num_protected` of the evictable blocks are so marked): false, nothing changed, when there
  // are too few.
  bool find_victims(std::size_t to_evict, std::uint32_t stamp, std::size_t num_protected);
  // Evicts scratch_victims_ (their slots stay allocated, for the caller), listing their keys
  // in `evicted` (`key_bytes`: a guess of each key's size, to reserve room).
  void evict_victims(KeyList& evicted, std::size_t key_bytes);
  // Checks that `block_ids` are distinct reserved slots (throws naming `op` otherwise).
  void check_reserved(std::span<const std::uint32_t> block_ids, const char* op);
  /// Position in the recency log of the predicted next victim.
  std::uint32_t predicted_victims_start() const noexcept;
  /// Prefetches the policy node and record of the slot logged at `position` (a hint: the
  /// eviction order is the policy's alone); nothing when nothing is logged there yet.
  void prefetch_predicted(std::uint32_t position) const noexcept;

  CPUBlockPool pool_;
  KeyIndex index_;
  std::unique_ptr<EvictionPolicy> policy_;
  bool enable_events_;
  std::int64_t store_threshold_;
  std::int64_t max_tracker_size_;
  std::unique_ptr<AdmissionTracker> tracker_;  // null when store_threshold < 2
  std::uint64_t stores_skipped_ = 0;
  std::uint32_t num_ready_ = 0;
  std::uint32_t num_pending_ = 0;
  std::uint32_t num_evictable_ = 0;  // ready and unpinned
  std::uint32_t num_retired_ = 0;    // kWtRetired slots (see num_retired_blocks)
  std::uint32_t call_stamp_ = 0;
  std::uint32_t num_reserved_ = 0;  // reserved slots (reserve_blocks)
  std::vector<std::uint8_t> reserved_;  // per slot, 1 when reserved; empty until first used
  std::vector<OffloadingEvent> events_;
  // Recency log, for prefetching only: the slots in the order the manager inserted or touched
  // them in the policy (a ring of >= 2 x num_blocks entries, capped at kMaxRecentLog); each
  // slot's index extra word holds the position of its latest entry. A policy's victims walk
  // (LRU: a chain of dependent loads through its list) mostly follows this order, so
  // prepare_store prefetches the policy nodes and records of the entries after the last
  // victim's before asking the policy for victims. Positions are 32-bit and wrap (differences
  // are taken modulo 2^32).
  static constexpr std::uint64_t kMaxRecentLog = std::uint64_t{1} << 28;
  std::vector<std::uint32_t, LargePageAllocator<std::uint32_t>> recent_;
  std::uint32_t recent_head_ = 0;  // position of the next entry
  std::uint32_t recent_tail_ = 0;  // predicted position of the next victim
  // Scratch buffers reused across calls (no allocation in steady state).
  std::vector<std::uint32_t> scratch_slots_;    // per key of the call: its slot or kNotFound
  std::vector<std::uint64_t> scratch_hashes_;   // per key of the call: hash_key
  std::vector<std::uint32_t> scratch_victims_;
  std::vector<std::uint32_t> scratch_new_;      // indices into the call's keys
  struct DedupeEntry {
    std::uint32_t hash_high;  // hash_key >> 32
    std::uint32_t position;   // index into the call's keys + 1; 0 = empty
  };
  std::vector<DedupeEntry> scratch_set_;        // open-addressing set for deduplication
  // store_threshold filter (tracker on): per key of the call, its tracker entry; per key, the
  // occurrences of a new key (at its first occurrence); the skipped new keys
  std::vector<std::uint32_t> scratch_tracked_;
  std::vector<std::uint32_t> scratch_offers_;
  std::vector<std::uint32_t> scratch_skipped_;

  // Write-through (set_write_through): engine-thread fields, then the thread-safe hand-off.
  std::uint32_t wt_capacity_ = 0;
  std::uint32_t wt_in_flight_ = 0;
  std::uint64_t wt_queued_total_ = 0;
  std::uint64_t wt_dropped_total_ = 0;
  std::vector<std::uint32_t> wt_drained_;           // engine thread: slots to unpin
  // engine thread, per slot: kWtPinned = pinned for write-through (one pin of the payload's),
  // kWtRetired = dropped from the index while being written (the slot is freed at its drain)
  static constexpr std::uint8_t kWtPinned = 1;
  static constexpr std::uint8_t kWtRetired = 2;
  std::uint64_t wt_cancelled_total_ = 0;
  std::vector<std::uint8_t> wt_pinned_;
  // Whether one of `slot`'s pins is the write-through's (not a load's).
  [[nodiscard]] bool written_through(std::uint32_t slot) const noexcept {
    return slot < wt_pinned_.size() && wt_pinned_[slot] == kWtPinned;
  }
  WriteThroughQueue wt_queue_;  // thread-safe: batches to write, blocks handed back
};

}  // namespace kvoff
