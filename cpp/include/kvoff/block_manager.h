// What OffloadingScheduler needs of a CPU pool's manager: the operations it calls, so that one
// scheduler runs on a pool of its own (CPUOffloadingManager) or on a node pool shared by every
// engine of a machine (a client the bindings supply; kvoff/node_pool/block_manager.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "kvoff/key.h"

namespace kvoff {

/// Keys passed to a manager: views of non-empty byte strings, valid during the call.
using KeySpan = std::span<const std::string_view>;

/// State of a key in a manager.
enum class BlockState : std::uint8_t {
  kMissing = 0,  ///< not held (never stored, evicted, its store failed, or discarded)
  kPending = 1,  ///< has a slot from prepare_store; its bytes are being written (not a hit)
  kReady = 2,    ///< complete_store(success) ran: a lookup hit, loadable
};

/// What prepare_store decided. Building it allocates nothing per key: the new keys are given as
/// positions in (and views of) the call's keys, and the evicted keys are copied into one buffer.
struct PrepareStoreResult {
  /// key_block_ids' entry of a key that has no block (skipped by the store_threshold filter).
  static constexpr std::uint32_t kNoBlock = 0xffffffffu;
  /// Positions in the call's keys of the keys that were not held and are stored now,
  /// deduplicated (the first occurrence of each), ascending: copy these blocks.
  std::vector<std::uint32_t> store_indices;
  /// keys[store_indices[i]]: views of the call's key bytes, valid as long as those are.
  std::vector<std::string_view> keys_to_store;
  /// The CPU block id (slot) allocated for each of keys_to_store, same order.
  std::vector<std::uint32_t> block_ids;
  /// The CPU block id of every key of the call, in the call's order: the block that held it
  /// already, or the one allocated for it now (a repeated key: the same block each time);
  /// kNoBlock for a key the store_threshold filter skipped. For touch_blocks after the store
  /// (without the kNoBlock entries), which then hashes and looks up no key. A node pool leaves
  /// it empty (the scheduler does not read it).
  std::vector<std::uint32_t> key_block_ids;
  /// Positions in the call's keys of the keys that were not held and that the store_threshold
  /// filter skipped (offered fewer than store_threshold times, this call's offers included),
  /// deduplicated (the first occurrence of each), ascending. They got no slot, stay missing
  /// (lookup misses), are in no event and count in stores_skipped(). Empty when the filter is
  /// off. So every key of the call is held already, stored now (store_indices) or skipped.
  std::vector<std::uint32_t> skipped_indices;
  /// Keys evicted to make room, in eviction order (their slots may be among block_ids).
  KeyList evicted_keys;
};

/// A change of the pool that routers may want to know (KV events).
struct OffloadingEvent {
  /// The keys concerned, in operation order.
  std::vector<std::string> keys;
  /// Where the blocks live: always "CPU" for kvoff's pools.
  std::string medium;
  /// false: BlockStored (keys became lookup hits); true: BlockRemoved (keys were evicted).
  bool removed = false;

  /// "BlockStored" or "BlockRemoved".
  std::string_view kind() const noexcept { return removed ? "BlockRemoved" : "BlockStored"; }
};

/// The manager operations OffloadingScheduler calls, with CPUOffloadingManager's meaning (see
/// that class for each one's guarantees: docs/design.md invariants 6-8). CPUOffloadingManager
/// is the pool in this process; the bindings implement it for a node pool (one pool for every
/// engine of a machine, in a process of its own), where:
///  * a key's load pins are this engine's own loads (other engines' are not known here);
///  * prepare_load throws when the pool cannot pin a key (gone, or the key evicted since it
///    was looked up), changing nothing;
///  * discard and clear drop nothing and return 0 (other engines use the blocks);
///  * events are every engine's stores and evictions of this engine's layout.
/// Not thread-safe: one thread (the scheduler's) calls it.
class BlockManager {
 public:
  virtual ~BlockManager() = default;

  /// The key's state and its pins by loads in flight (a load pin: loading now).
  virtual std::pair<BlockState, std::uint32_t> state_and_load_pins(std::string_view key) const = 0;
  /// state_and_load_pins of keys[0], keys[1], ... up to the first missing key: out[i] gets key
  /// i's; returns how many leading keys are held (ready or pending). `out` has room for
  /// keys.size() entries.
  virtual std::size_t states_until_missing(KeySpan keys,
                                           std::pair<BlockState, std::uint32_t>* out) const = 0;
  /// Pins the ready keys' blocks for a load; their block ids (slots), in the keys' order.
  virtual std::vector<std::uint32_t> prepare_load(KeySpan keys) = 0;
  /// Unpins the blocks of a finished load (the ids prepare_load returned).
  virtual void complete_load_blocks(std::span<const std::uint32_t> block_ids) = 0;
  /// Slots for the keys not held (all or nothing: false changes nothing).
  virtual bool prepare_store(KeySpan keys, PrepareStoreResult& result, bool apply_threshold) = 0;
  /// Ends stores by their block ids: ready (success) or freed. `event_ends`: where each
  /// BlockStored event of a successful batch ends in block_ids (empty: one event).
  virtual void complete_store_blocks(std::span<const std::uint32_t> block_ids, bool success,
                                     bool write_through,
                                     std::span<const std::size_t> event_ends) = 0;
  /// Makes the keys the most recent (keys[0] first); `reused`: per key, 1 for a reuse.
  virtual void touch(KeySpan keys, std::span<const std::uint8_t> reused) = 0;
  /// Drops ready, unpinned keys (a load that could not read them); how many were dropped.
  virtual std::size_t discard(KeySpan keys) = 0;
  /// Drops every ready, unpinned block (a cache reset); how many.
  virtual std::size_t clear(bool include_in_flight) = 0;
  /// The events since the last call, oldest first.
  virtual std::vector<OffloadingEvent> take_events() = 0;
};

}  // namespace kvoff
