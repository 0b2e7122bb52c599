// One engine's loads from a node pool, kept on the engine's side: which key each slot it loads
// from holds, how many of this engine's loads of each key run, and how many of those the current
// connection pinned. The pool releases a connection's pins when the connection goes, so only
// those are completed on the wire; a load made from leases after the pool went away counts
// here (the key is being read) and sends nothing. The C++ scheduler completes a step's loads
// by slot through this object with no Python call (a step at 256 running completes a few
// hundred keys: 31 us a step as Python dicts).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvoff/block_manager.h"
#include "kvoff/keyed_entries.h"
#include "kvoff/key.h"
#include "kvoff/node_pool_slot_count.h"

namespace kvoff {

class NodePoolLoads {
 public:
  /// `prefix`: the bytes every key of this engine carries in the pool (the completions'
  /// payloads carry it). Throws std::invalid_argument for a prefix that leaves no room for a
  /// key (protocol.MAX_KEY_BYTES).
  explicit NodePoolLoads(std::string prefix);

  /// The most slots a pool may have here (as NodePoolStores: 2**28).
  static constexpr std::uint32_t kMaxSlots = detail::NodePoolSlotCount::kMax;
  /// The pool's slot count (its hello; kMaxSlots until set): pin() refuses a slot at or past
  /// it. Throws std::invalid_argument over kMaxSlots.
  void set_num_slots(std::uint32_t num_slots) { num_slots_.set(num_slots); }

  /// Loads of keys[i] from slots[i] begin; `connection`: the current connection's pool pinned
  /// them (false: loads from leases after the pool went away, which nothing on the wire ends).
  /// A slot loading another key starts over with this one (a pool restarted on the region
  /// gave it out again). Throws std::invalid_argument, changing nothing, when the sizes
  /// differ, a slot is at or past the slot count, or a key is empty or too long for the wire.
  void pin(KeySpan keys, std::span<const std::uint32_t> slots, bool connection);

  /// Ends one load from each of `slots` (slots not loading are skipped). `payload` gets the
  /// COMPLETE_LOAD payload (the prefixed keys) of those the current connection pinned, in slot
  /// order; their count is returned (0: nothing to send).
  std::size_t complete_slots(std::span<const std::uint32_t> slots, std::string& payload);
  /// complete_slots by key: one load of each key (keys not loading are skipped).
  std::size_t complete_keys(KeySpan keys, std::string& payload);

  /// The connection is gone, and the pool released its pins: the loads in flight go on, but
  /// their completions send nothing.
  void lose() noexcept { ++connection_; }

  /// This engine's loads of `key` in flight (any connection).
  std::uint32_t pins(std::string_view key) const;
  /// Loads of `key` in flight that the current connection pinned.
  std::uint32_t connection_pins(std::string_view key) const;
  /// A slot `key` is being loaded from, if it is.
  std::optional<std::uint32_t> slot_of(std::string_view key) const;
  /// Per key, 1 when it is being loaded, else 0.
  std::string loading_mask(KeySpan keys) const;
  /// Loads in flight (a key loaded twice counts twice).
  std::size_t num_loads() const noexcept { return num_loads_; }
  /// Keys being loaded.
  std::size_t num_keys() const noexcept { return entries_.size(); }

 private:
  // A key being loaded. Entries are reused (a free list): their keys' memory serves later
  // loads.
  struct Loading {
    std::string key;
    std::uint64_t key_hash = 0;
    std::uint64_t connection = 0;  // the connection connection_pins counts for
    std::uint32_t pins = 0;
    std::uint32_t connection_pins = 0;
    std::uint32_t slot = 0;        // the last slot it was pinned from
    std::uint32_t generation = 0;  // counts the entry's reuses (SlotLoads::generation)
  };
  using Entries = detail::KeyedEntries<Loading>;
  static constexpr std::uint32_t kNone = Entries::kNone;
  // A slot being loaded from: its key's entry (while the entry's generation is this one: a
  // key loaded from two slots, after a pool restart, may end through the other) and the loads.
  struct SlotLoads {
    std::uint32_t entry = kNone;
    std::uint32_t generation = 0;
    std::uint32_t count = 0;
  };
  // The live entry slot `slot` is loaded from, else kNone.
  std::uint32_t entry_of_slot(std::uint32_t slot) const noexcept;
  // Takes entry `e` out (no load of its key left).
  void free_entry(std::uint32_t e);
  // One load of entry `e` from slot `slot` ends (the slot's count too when it holds `e`); its
  // key is added to ended_ when the current connection pinned it.
  void end(std::uint32_t e, std::uint32_t slot);
  std::size_t completion(std::string& payload);

  std::string prefix_;
  std::uint64_t connection_ = 0;
  detail::NodePoolSlotCount num_slots_;
  std::size_t num_loads_ = 0;
  Entries entries_;  // the keys being loaded
  // by slot, grown to the largest slot seen (12 bytes a slot): a step's completions look up a
  // few hundred slots the engine's own work has pushed out of the cache since the loads began
  std::vector<SlotLoads> of_slot_;
  std::vector<std::string_view> ended_;  // keys of the completion being made
};

}  // namespace kvoff
