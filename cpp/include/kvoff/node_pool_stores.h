// One engine's stores into a node pool, kept on the engine's side: the slots the pool reserved
// for this engine's connection, the stores in flight (slot <-> key), the payloads that tell
// the pool of them (the wire format of kvoff/node_pool/protocol.py), and the connection's
// outbox: the frames queued without a reply, sent with the engine's next call or flush. An engine
// stores about 200 keys a step; keeping this per-key work here, not in Python, is what keeps a node
// pool's step near a private pool's (kvoff bench scheduler --vs-vllm --node-pool).
//
// Two lifetimes meet here. The reservation and the right to complete a store belong to the
// connection: a pool that goes away releases them (lose()). A store's slot belongs to the
// engine until the engine completes the store, since its copy may still be writing the slot:
// a pool restarted on the same region must not hand that slot to this engine for another key
// (begin() refuses it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <utility>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvoff/block_manager.h"
#include "kvoff/keyed_entries.h"
#include "kvoff/key.h"
#include "kvoff/key_filter.h"
#include "kvoff/node_pool_slot_count.h"

namespace kvoff {

/// Longest key on the wire, prefix included (protocol.MAX_KEY_BYTES).
inline constexpr std::size_t kNodePoolMaxKeyBytes = 1024;

/// Appends the node pool's key list of `prefix` + each key: count u32, width u16, then the keys
/// back to back when they all have one width, else width 0 and per key length u16 and its bytes
/// (little-endian; protocol.encode_prefixed_keys). Throws std::invalid_argument, appending
/// nothing, for an empty key or one longer than kNodePoolMaxKeyBytes with the prefix.
void append_prefixed_keys(std::string& out, std::string_view prefix, KeySpan keys);

class NodePoolStores {
 public:
  /// `prefix`: the bytes every key of this engine carries in the pool (its layout
  /// fingerprint's digest, 8 bytes in kvoff); `version`: the protocol version frames carry.
  explicit NodePoolStores(std::string prefix, std::uint16_t version);

  /// Bytes of a frame's header: magic "KVNP", version u16, op u16, request id u32, payload
  /// length u32 (protocol.HEADER).
  static constexpr std::size_t kHeaderBytes = 16;

  /// Queues a frame of `op` with `payload` and the next request id, which it returns. Nothing
  /// is queued (0 is returned) while detached (set_attached(false)): the pool that would
  /// answer is gone. `changes`: the call changes the pool, so answers kept from it are stale
  /// (take_changed). Throws std::invalid_argument for a payload over 2**32 - 1 bytes.
  std::uint32_t queue(std::uint16_t op, std::string_view payload, bool changes);
  /// The next request id (for a frame the caller sends itself).
  std::uint32_t next_request_id() noexcept;
  /// The queued frames, in order, emptied.
  std::string take_outbox();
  std::size_t outbox_bytes() const noexcept { return outbox_.size(); }
  /// Whether a call that changes the pool was queued since the last take_changed().
  bool take_changed() noexcept { return std::exchange(changed_, false); }
  /// Whether a pool is there to send to (false at first); detaching drops the outbox.
  void set_attached(bool attached);
  /// Stores store_reserved() made (into reserved slots, with no round trip).
  std::uint64_t num_reserved_stores() const noexcept { return reserved_stores_; }
  bool attached() const noexcept { return attached_; }

  const std::string& prefix() const noexcept { return prefix_; }

  /// The pool's slot count (from its hello; kMaxSlots until set): a slot at or past it is
  /// refused (add_reserved, begin) before it can size this engine's table of slots.
  /// Throws std::invalid_argument over kMaxSlots.
  void set_num_slots(std::uint32_t num_slots) { num_slots_.set(num_slots); }
  /// The most slots a pool may have here: 2**28 (the table of slots in flight is then 1 GiB).
  static constexpr std::uint32_t kMaxSlots = detail::NodePoolSlotCount::kMax;

  /// Slots the pool granted this connection (a RESERVE reply), in grant order. Throws
  /// std::invalid_argument, adding none, for a slot at or past the pool's slot count.
  void add_reserved(std::span<const std::uint32_t> slots);
  /// Keys (prefixed) the pool evicted to grant them; handed to the next reserved store.
  void add_evicted(std::vector<std::string> keys);
  std::size_t num_reserved() const noexcept { return reserved_.size(); }
  /// The evicted keys not yet handed out, emptied.
  std::vector<std::string> take_evicted();

  /// Stores `keys` into the next keys.size() reserved slots, the order the pool takes them in.
  /// Only when every key is new: the keys are distinct, none is in flight here, and `filter`
  /// (the pool's key filter) rules out each prefixed key. Then `slots` gets the slots (in key
  /// order), `payload` the STORE_RESERVED payload, and the stores are in flight; true.
  /// Otherwise false and nothing changes (the caller asks the pool). Throws
  /// std::invalid_argument, changing nothing, for a key append_prefixed_keys refuses.
  bool store_reserved(KeySpan keys, const KeyFilter& filter, std::vector<std::uint32_t>& slots,
                      std::string& payload);

  /// Records stores the pool granted in a reply: keys[i] into slots[i]. False, and nothing
  /// changes, when a slot or key is in flight here already (the pool was restarted on the same
  /// region and handed out a slot an old store may still be writing): the caller refuses the
  /// store. Throws std::invalid_argument when the sizes differ, `slots` repeats a slot, or a
  /// slot is at or past the pool's slot count.
  bool begin(KeySpan keys, std::span<const std::uint32_t> slots);

  /// Ends the stores in `slots`. `payload` gets the COMPLETE_STORE payload (`success` u8 and
  /// the prefixed keys) of those this connection made; the count of those keys is returned (0:
  /// nothing to send). Slots not in flight are skipped.
  std::size_t complete_slots(std::span<const std::uint32_t> slots, bool success,
                             std::string& payload);
  /// complete_slots by key (each key once; keys not in flight are skipped).
  std::size_t complete_keys(KeySpan keys, bool success, std::string& payload);

  /// The connection is gone: its reservation, stores and queued frames went with it. The
  /// stores in flight stay so until completed (their slots are still written), but their
  /// completions send nothing.
  void lose() noexcept;

  /// Whether `key` is in flight (stored by any connection of this engine's).
  bool storing(std::string_view key) const;
  /// The slot `key` is being stored into, if it is.
  std::optional<std::uint32_t> slot_of(std::string_view key) const;
  /// Stores in flight.
  std::size_t num_storing() const noexcept { return num_storing_; }

 private:
  // A store in flight. Entries are reused (a free list), so their keys' memory serves later
  // stores: an engine stores ~200 keys a step, and a node-based map cost 35 us for that.
  struct InFlight {
    std::string key;
    std::uint64_t key_hash = 0;  // the table's hash of `key` (an end need not read the key)
    std::uint64_t connection = 0;
    std::uint32_t slot = 0;
  };
  using Entries = detail::KeyedEntries<InFlight>;
  static constexpr std::uint32_t kNone = Entries::kNone;
  // Throws std::invalid_argument for the first slot at or past the pool's slot count.
  void check_slots(std::span<const std::uint32_t> slots) const;
  std::uint32_t find_slot(std::uint32_t slot) const noexcept;
  // The entry storing `key` (kNone: none); `hash` is Entries::hash(key), which a caller that
  // also adds the key computes once for both.
  std::uint32_t find_key(std::string_view key, std::uint64_t hash) const noexcept {
    return entries_.find(key, hash);
  }
  std::uint32_t find_key(std::string_view key) const noexcept { return entries_.find(key); }
  // Puts a store in flight (tables grown first, so nothing is half done on bad_alloc); `hash`
  // is Entries::hash(key).
  void add(std::string_view key, std::uint64_t hash, std::uint32_t slot);
  // Takes entry `e` out of flight; it is added to `ended_` when this connection made it.
  void end(std::uint32_t e);
  std::size_t completion(bool success, std::string& payload);

  std::string prefix_;
  std::uint16_t version_;
  std::uint64_t connection_ = 0;  // counts lose()
  std::string outbox_;
  std::uint32_t request_id_ = 0;
  bool changed_ = false;
  bool attached_ = false;
  std::uint64_t reserved_stores_ = 0;
  std::deque<std::uint32_t> reserved_;
  std::vector<std::string> evicted_;
  Entries entries_;  // the stores in flight, by key
  // Entry by slot (kNone: none), indexed by slot: a step's completion looks up ~200 slots the
  // engine's own work has pushed out of the cache since their stores began, and a hash table
  // made each a bucket and an entry to miss. Grown to the largest slot seen (4 bytes a slot).
  std::vector<std::uint32_t> entry_of_slot_;
  std::size_t num_storing_ = 0;
  detail::NodePoolSlotCount num_slots_;
  std::vector<std::uint32_t> ended_;             // entries of the completion being made
};

}  // namespace kvoff
