// One job: CPUOffloadingManager (kvoff/offloading_manager.h), the CPU pool's index, slots,
// pins and eviction calls. Its reservations, removals (discard, clear) and write-through are in
// offloading_manager_{reservations,removal,write_through}.cpp, host-memory probing and the
// write-through queue in host_memory.cpp and write_through_queue.cpp.
#include "kvoff/offloading_manager.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <utility>

#include "kvoff/host_memory.h"
#include "offloading_manager_internal.h"

namespace kvoff {

using namespace manager_detail;

std::string_view to_string(BlockState state) noexcept {
  switch (state) {
    case BlockState::kMissing:
      return "missing";
    case BlockState::kPending:
      return "pending";
    case BlockState::kReady:
      return "ready";
  }
  return "unknown";
}

namespace {

constexpr const char* kMedium = "CPU";

// How many victims (new keys) ahead prepare_store's commit prefetches index buckets.
constexpr std::size_t kCommitAhead = 12;
// How many recency-log entries ahead of the victim walk prepare_store prefetches.
constexpr std::size_t kVictimAhead = 64;

inline void prefetch_byte(const void* p) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p);
#else
  (void)p;
#endif
}

/// Entries of the recency log of a pool of `num_blocks` slots: a power of two >= 2 x
/// num_blocks, at least 1024 and at most kMaxRecentLog.
std::uint64_t recent_log_entries(std::uint32_t num_blocks, std::uint64_t max_entries) noexcept {
  std::uint64_t ring = 1024;
  while (ring < 2 * static_cast<std::uint64_t>(num_blocks) && ring < max_entries) {
    ring <<= 1;
  }
  return ring;
}

// Pools needing less than this are not checked against the host's memory (no file is read):
// any host that runs the engine has it.
constexpr std::uint64_t kCheckHostMemoryFrom = std::uint64_t{256} << 20;

/// Validates the store_threshold arguments (see the constructor's errors).
void check_store_threshold(std::int64_t store_threshold, std::int64_t max_tracker_size) {
  const std::string range = "pass 0 (no admission filter) or 2.." +
                            std::to_string(CPUOffloadingManager::kMaxStoreThreshold) +
                            " (a block is stored once it was offered that many times)";
  if (store_threshold < 0) {
    throw std::invalid_argument("CPUOffloadingManager: store_threshold=" +
                                std::to_string(store_threshold) + " is negative; " + range);
  }
  if (store_threshold > CPUOffloadingManager::kMaxStoreThreshold) {
    throw std::invalid_argument(
        "CPUOffloadingManager: store_threshold=" + std::to_string(store_threshold) +
        " is above " + std::to_string(CPUOffloadingManager::kMaxStoreThreshold) +
        " (2^20): a block would be stored only after that many offers; " + range);
  }
  if (max_tracker_size < 0 || max_tracker_size > kMaxNumBlocks) {
    throw std::invalid_argument(
        "CPUOffloadingManager: max_tracker_size=" + std::to_string(max_tracker_size) +
        " is out of range; pass 1.." + std::to_string(kMaxNumBlocks) + " keys (default " +
        std::to_string(CPUOffloadingManager::kDefaultMaxTrackerSize) + ")");
  }
  if (max_tracker_size == 0 && store_threshold >= 2) {
    throw std::invalid_argument(
        "CPUOffloadingManager: max_tracker_size=0 but store_threshold=" +
        std::to_string(store_threshold) +
        " needs a tracker of at least 1 key; pass max_tracker_size >= 1 (default " +
        std::to_string(CPUOffloadingManager::kDefaultMaxTrackerSize) +
        "), or store_threshold=0 to turn the filter off");
  }
}

/// Validates the arguments before anything large is allocated, the pool's memory included;
/// returns num_blocks.
std::int64_t checked_num_blocks(std::int64_t num_blocks, std::string_view policy,
                                std::int64_t store_threshold, std::int64_t max_tracker_size) {
  if (num_blocks < 1 || num_blocks > kMaxNumBlocks) {
    throw std::invalid_argument(bad_num_blocks_message(std::to_string(num_blocks)));
  }
  const auto names = eviction_policy_names();
  if (std::find(names.begin(), names.end(), policy) == names.end()) {
    make_eviction_policy(policy, 1);  // throws the "unknown eviction_policy" error
  }
  check_store_threshold(store_threshold, max_tracker_size);
  const std::uint64_t needed = CPUOffloadingManager::memory_bytes(num_blocks, policy,
                                                                  store_threshold,
                                                                  max_tracker_size);
  if (needed >= kCheckHostMemoryFrom) {
    const std::uint64_t limit = host_memory_limit_bytes();
    if (needed > limit) {
      throw HostMemoryError(num_blocks, policy, needed, limit,
                            store_threshold >= 2 ? max_tracker_size : 0);
    }
  }
  return num_blocks;
}

std::string format_bytes(std::uint64_t bytes) {
  char buf[32];
  const double gib = static_cast<double>(bytes) / static_cast<double>(std::uint64_t{1} << 30);
  if (gib >= 1.0) {
    std::snprintf(buf, sizeof buf, "%.1f GiB", gib);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f MiB", gib * 1024.0);
  }
  return buf;
}

}  // namespace

HostMemoryError::HostMemoryError(std::int64_t num_blocks, std::string_view eviction_policy,
                                 std::uint64_t needed_bytes, std::uint64_t limit_bytes,
                                 std::int64_t tracker_entries) {
  const std::uint64_t per_block =
      num_blocks > 0 ? needed_bytes / static_cast<std::uint64_t>(num_blocks) : 0;
  std::string m = "CPUOffloadingManager: num_blocks=" + std::to_string(num_blocks) +
                  " needs about " + format_bytes(needed_bytes) + " of host memory (~" +
                  std::to_string(per_block) + " bytes per block for the key index, the '" +
                  std::string(eviction_policy) + "' eviction policy and the recency log), ";
  if (limit_bytes > 0) {
    m += "more than the " + format_bytes(limit_bytes) +
         " this process can use (physical memory or its cgroup limit)";
  } else {
    m += "and allocating it failed (std::bad_alloc)";
  }
  m += "; use fewer CPU blocks: a smaller cpu_bytes_to_use (or num_blocks), or a larger "
       "block_size_factor for fewer, larger blocks";
  if (tracker_entries > 0) {
    const std::uint64_t tracker =
        AdmissionTracker::memory_bytes(static_cast<std::uint32_t>(tracker_entries));
    m += ". Of these, " + format_bytes(tracker) + " are the store_threshold tracker of "
         "max_tracker_size=" + std::to_string(tracker_entries) +
         " keys: a smaller max_tracker_size shrinks it";
  }
  m += ". Nothing is left allocated.";
  message_ = std::make_shared<const std::string>(std::move(m));
}

std::uint64_t CPUOffloadingManager::memory_bytes(std::int64_t num_blocks,
                                                 std::string_view eviction_policy) {
  if (num_blocks < 1 || num_blocks > kMaxNumBlocks) {
    return 0;
  }
  const auto n = static_cast<std::uint32_t>(num_blocks);
  return CPUBlockPool::memory_bytes(n) + KeyIndex::memory_bytes(n) +
         eviction_policy_memory_bytes(eviction_policy, n) +
         recent_log_entries(n, kMaxRecentLog) * sizeof(std::uint32_t);
}

std::uint64_t CPUOffloadingManager::memory_bytes(std::int64_t num_blocks,
                                                 std::string_view eviction_policy,
                                                 std::int64_t store_threshold,
                                                 std::int64_t max_tracker_size) {
  std::uint64_t bytes = memory_bytes(num_blocks, eviction_policy);
  if (bytes > 0 && store_threshold >= 2 && max_tracker_size >= 1 &&
      max_tracker_size <= kMaxNumBlocks) {
    bytes += AdmissionTracker::memory_bytes(static_cast<std::uint32_t>(max_tracker_size));
  }
  return bytes;
}

namespace {

std::string describe_state(BlockState state) {
  switch (state) {
    case BlockState::kMissing:
      return "missing (never stored, evicted, or its store failed)";
    case BlockState::kPending:
      return "pending (prepare_store'd, complete_store has not run yet)";
    case BlockState::kReady:
      return "ready";
  }
  return "unknown";
}

[[noreturn]] void throw_bad_key(const char* op, std::size_t index, std::string_view key,
                                const std::string& what, const char* fix) {
  std::string shown = key_to_hex(key) + " (hex";
  if (key.size() == 8) {  // probably an int key: show its value too
    std::uint64_t v = 0;
    for (std::size_t b = 8; b > 0; --b) {
      v = (v << 8) | static_cast<unsigned char>(key[b - 1]);
    }
    shown += "; int " + std::to_string(v) + " as 8 little-endian bytes";
  }
  shown += ")";
  throw std::invalid_argument(std::string(op) + ": keys[" + std::to_string(index) + "] = " +
                              shown + " is " + what + "; " + fix + ". Nothing was changed.");
}

}  // namespace

// A function-try-block: when an allocation fails, the members built so far are destroyed
// (their memory freed) before the handler turns std::bad_alloc into a HostMemoryError.
CPUOffloadingManager::CPUOffloadingManager(std::int64_t num_blocks,
                                           std::string_view eviction_policy, bool enable_events,
                                           std::int64_t store_threshold,
                                           std::int64_t max_tracker_size)
try : pool_(checked_num_blocks(num_blocks, eviction_policy, store_threshold, max_tracker_size)),
      index_(pool_.num_blocks()),
      policy_(make_eviction_policy(eviction_policy, pool_.num_blocks())),
      enable_events_(enable_events),
      store_threshold_(store_threshold),
      max_tracker_size_(max_tracker_size),
      tracker_(store_threshold >= 2 ? std::make_unique<AdmissionTracker>(
                                          static_cast<std::uint32_t>(max_tracker_size))
                                    : nullptr) {
  recent_.assign(recent_log_entries(pool_.num_blocks(), kMaxRecentLog), 0);
} catch (const HostMemoryError&) {
  throw;
} catch (const std::bad_alloc&) {
  throw HostMemoryError(num_blocks, eviction_policy,
                        memory_bytes(num_blocks, eviction_policy, store_threshold,
                                     max_tracker_size),
                        0, store_threshold >= 2 ? max_tracker_size : 0);
}

void CPUOffloadingManager::note_recent(std::uint32_t slot) noexcept {
  recent_[recent_head_ & (recent_.size() - 1)] = slot;
  index_.extra(slot) = recent_head_;
  ++recent_head_;
}

std::uint32_t CPUOffloadingManager::predicted_victims_start() const noexcept {
  const auto ring = static_cast<std::uint32_t>(recent_.size());
  // Overwritten entries: start at the oldest entry still logged.
  return recent_head_ - recent_tail_ > ring ? recent_head_ - ring : recent_tail_;
}

void CPUOffloadingManager::prefetch_predicted(std::uint32_t position) const noexcept {
  if (position - recent_head_ < 0x80000000u) {  // at or past the head: nothing logged there
    return;
  }
  const std::uint32_t slot = recent_[position & (recent_.size() - 1)];
  policy_->prefetch(slot);
  index_.prefetch_record(slot);  // tested by can_evict, then erased and reused by a new key
}

CPUOffloadingManager::~CPUOffloadingManager() = default;

std::uint32_t CPUOffloadingManager::next_stamp() noexcept {
  if (++call_stamp_ == 0) {  // wrapped after 2^32 calls: clear the stale marks once
    for (std::uint32_t s = 0; s < index_.num_slots(); ++s) {
      index_.payload(s) &= kLow32;
    }
    call_stamp_ = 1;
  }
  return call_stamp_;
}

void CPUOffloadingManager::find_all(KeySpan keys) {
  scratch_slots_.resize(keys.size());
  scratch_hashes_.resize(keys.size());
  index_.find_many(keys.data(), keys.size(), scratch_hashes_.data(), scratch_slots_.data());
}

void CPUOffloadingManager::record(std::vector<std::string> keys, bool removed) {
  if (!enable_events_ || keys.empty()) {
    return;
  }
  events_.push_back(OffloadingEvent{std::move(keys), kMedium, removed});
}

void CPUOffloadingManager::record_stored(std::size_t from) {
  std::vector<std::string> keys;
  keys.reserve(scratch_new_.size() - from);
  for (std::size_t k = from; k < scratch_new_.size(); ++k) {
    keys.emplace_back(index_.key(scratch_new_[k]));
  }
  record(std::move(keys), /*removed=*/false);
}

void CPUOffloadingManager::drop_slot(std::uint32_t slot) {
  policy_->erase(slot, index_.key(slot), /*evicted=*/false);
  index_.erase(slot);
  pool_.free(slot);
}

// ------------------------------------------------------------------------------------ queries

BlockState CPUOffloadingManager::state(std::string_view key) const noexcept {
  const std::uint32_t slot = key.empty() ? KeyIndex::kNotFound : index_.find(key);
  return slot == KeyIndex::kNotFound ? BlockState::kMissing : state_bits(index_.payload(slot));
}

std::uint32_t CPUOffloadingManager::pin_count(std::string_view key) const noexcept {
  const std::uint32_t slot = key.empty() ? KeyIndex::kNotFound : index_.find(key);
  return slot == KeyIndex::kNotFound ? 0 : pins_bits(index_.payload(slot));
}

std::pair<BlockState, std::uint32_t> CPUOffloadingManager::state_and_pins(
    std::string_view key) const noexcept {
  const std::uint32_t slot = key.empty() ? KeyIndex::kNotFound : index_.find(key);
  if (slot == KeyIndex::kNotFound) return {BlockState::kMissing, 0};
  const std::uint64_t p = index_.payload(slot);
  return {state_bits(p), pins_bits(p)};
}

std::pair<BlockState, std::uint32_t> CPUOffloadingManager::state_and_load_pins(
    std::string_view key) const noexcept {
  const std::uint32_t slot = key.empty() ? KeyIndex::kNotFound : index_.find(key);
  if (slot == KeyIndex::kNotFound) return {BlockState::kMissing, 0};
  return load_state(slot);
}

std::pair<BlockState, std::uint32_t> CPUOffloadingManager::load_state(
    std::uint32_t slot) const noexcept {
  const std::uint64_t p = index_.payload(slot);
  std::uint32_t pins = pins_bits(p);
  if (pins > 0 && written_through(slot)) --pins;
  return {state_bits(p), pins};
}

std::size_t CPUOffloadingManager::states_until_missing(
    KeySpan keys, std::pair<BlockState, std::uint32_t>* out) const noexcept {
  std::size_t held = 0;
  index_.find_each(keys.data(), keys.size(),
                   [&](std::size_t i, std::uint32_t slot, std::uint64_t /*hash*/) {
                     if (slot == KeyIndex::kNotFound || keys[i].empty()) {
                       out[i] = {BlockState::kMissing, 0};
                       return false;
                     }
                     out[i] = load_state(slot);
                     ++held;
                     return true;
                   });
  return held;
}

std::optional<std::uint32_t> CPUOffloadingManager::block_id(std::string_view key) const noexcept {
  const std::uint32_t slot = key.empty() ? KeyIndex::kNotFound : index_.find(key);
  if (slot == KeyIndex::kNotFound) {
    return std::nullopt;
  }
  return slot;
}

std::optional<std::size_t> CPUOffloadingManager::lookup(KeySpan keys) const {
  validate_keys(keys, "lookup");
  std::size_t hits = 0;
  bool pending = false;
  index_.find_each(keys.data(), keys.size(),
                   [&](std::size_t /*i*/, std::uint32_t slot, std::uint64_t /*hash*/) {
                     if (slot == KeyIndex::kNotFound) {
                       return false;
                     }
                     if (state_bits(index_.payload(slot)) != BlockState::kReady) {
                       pending = true;  // being written: the caller retries later
                       return false;
                     }
                     ++hits;
                     return true;
                   });
  if (pending) {
    return std::nullopt;
  }
  return hits;
}

// -------------------------------------------------------------------------------------- loads

std::vector<std::uint32_t> CPUOffloadingManager::prepare_load(KeySpan keys) {
  validate_keys(keys, "prepare_load");
  maybe_drain();
  find_all(keys);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::uint32_t slot = scratch_slots_[i];
    const BlockState st =
        slot == KeyIndex::kNotFound ? BlockState::kMissing : state_bits(index_.payload(slot));
    if (st != BlockState::kReady) {
      throw_bad_key("prepare_load", i, keys[i], describe_state(st),
                    "load only keys that lookup() counted as hits");
    }
    if (pins_bits(index_.payload(slot)) > kMaxPins - std::min<std::size_t>(keys.size(), kMaxPins)) {
      throw_bad_key("prepare_load", i, keys[i],
                    "pinned by " + std::to_string(pins_bits(index_.payload(slot))) +
                        " loads in flight, the most this manager counts",
                    "complete_load finished loads first");
    }
  }
  for (const std::uint32_t slot : scratch_slots_) {
    std::uint64_t& p = index_.payload(slot);
    if (pins_bits(p) == 0) {
      --num_evictable_;
    }
    p += kOnePin;
  }
  return {scratch_slots_.begin(), scratch_slots_.end()};
}

void CPUOffloadingManager::complete_load(KeySpan keys) {
  validate_keys(keys, "complete_load");
  maybe_drain();
  find_all(keys);
  const auto refuse = [&](std::size_t i, const std::string& what) {
    throw_bad_key("complete_load", i, keys[i], what,
                  "call complete_load once per prepare_load, with the same keys");
  };
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::uint32_t slot = scratch_slots_[i];
    const BlockState st =
        slot == KeyIndex::kNotFound ? BlockState::kMissing : state_bits(index_.payload(slot));
    if (st != BlockState::kReady) refuse(i, describe_state(st));
  }
  if (const auto bad = unpin_loads(scratch_slots_)) {
    const auto first = scratch_slots_.begin();
    const auto at = first + static_cast<std::ptrdiff_t>(*bad);
    const bool repeated = std::find(first, at, *at) != at;
    refuse(*bad, repeated ? "not being loaded as many times as it occurs in this call"
                          : "not being loaded (no prepare_load is in flight for it)");
  }
}

void CPUOffloadingManager::complete_load_blocks(std::span<const std::uint32_t> block_ids) {
  maybe_drain();
  const auto refuse = [&](std::size_t i, const std::string& what) {
    throw std::invalid_argument("complete_load_blocks: block_ids[" + std::to_string(i) +
                                "] = " + std::to_string(block_ids[i]) + " is " + what +
                                "; pass the block ids of a prepare_load whose load has not "
                                "completed, once per prepare_load. Nothing was changed.");
  };
  for (std::size_t i = 0; i < block_ids.size(); ++i) {
    const std::uint32_t slot = block_ids[i];
    if (slot >= index_.num_slots()) {
      refuse(i, "outside [0, num_blocks=" + std::to_string(index_.num_slots()) + ")");
    }
    if (!policy_->contains(slot)) refuse(i, "a free block");
    const BlockState st = state_bits(index_.payload(slot));
    if (st != BlockState::kReady) refuse(i, describe_state(st) + ", not ready");
  }
  if (const auto bad = unpin_loads(block_ids)) {
    refuse(*bad, "not pinned by a load as many times as it occurs in this call");
  }
}

std::optional<std::size_t> CPUOffloadingManager::unpin_loads(
    std::span<const std::uint32_t> slots) {
  std::uint32_t unpinned = 0;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    std::uint64_t& p = index_.payload(slots[i]);
    // The write-through pin is not a load's: a load's completion cannot take it.
    const bool written = written_through(slots[i]);
    if (pins_bits(p) <= (written ? 1U : 0U)) {
      for (std::size_t j = 0; j < i; ++j) {  // roll back this call's unpins
        index_.payload(slots[j]) += kOnePin;
      }
      return i;
    }
    p -= kOnePin;
    if (pins_bits(p) == 0) {
      ++unpinned;
    }
  }
  num_evictable_ += unpinned;
  return std::nullopt;
}

void CPUOffloadingManager::touch(KeySpan keys) {
  validate_keys(keys, "touch");
  find_all(keys);
  touch_slots(scratch_slots_);
}

void CPUOffloadingManager::touch(KeySpan keys, std::span<const std::uint8_t> reused) {
  if (reused.size() != keys.size()) {
    throw std::invalid_argument("touch: " + std::to_string(reused.size()) +
                                " reuse flags for " + std::to_string(keys.size()) +
                                " keys; pass one flag per key. Nothing was changed.");
  }
  validate_keys(keys, "touch");
  find_all(keys);
  touch_slots(scratch_slots_, reused);
}

void CPUOffloadingManager::touch_blocks(std::span<const std::uint32_t> block_ids) {
  for (std::size_t i = 0; i < block_ids.size(); ++i) {
    const std::uint32_t slot = block_ids[i];
    if (slot < index_.num_slots() && policy_->contains(slot)) continue;
    throw std::invalid_argument(
        "touch_blocks: block_ids[" + std::to_string(i) + "] = " + std::to_string(slot) + " is " +
        (slot < index_.num_slots() ? std::string("a free block")
                                   : "outside [0, num_blocks=" +
                                         std::to_string(index_.num_slots()) + ")") +
        "; pass block ids of held blocks (from prepare_load or prepare_store). Nothing was "
        "changed.");
  }
  touch_slots(block_ids);
}

void CPUOffloadingManager::touch_slots(std::span<const std::uint32_t> slots,
                                       std::span<const std::uint8_t> reused) {
  for (const std::uint32_t slot : slots) {
    if (slot != KeyIndex::kNotFound) {
      policy_->prefetch(slot);
    }
  }
  // Last to first: the first ends the most recent, so a prefix's tail is evicted before its
  // head. A pending key is being stored by the request that uses it: ordered, but no reuse.
  for (std::size_t i = slots.size(); i-- > 0;) {
    const std::uint32_t slot = slots[i];
    if (slot != KeyIndex::kNotFound) {
      if (state_bits(index_.payload(slot)) == BlockState::kPending ||
          (!reused.empty() && reused[i] == 0)) {
        policy_->touch_pending(slot);
      } else {
        policy_->touch(slot);
      }
      note_recent(slot);
    }
  }
}

// ------------------------------------------------------------------------------------- stores

std::size_t CPUOffloadingManager::dedupe_insert(KeySpan keys, std::size_t index,
                                               std::uint64_t hash) {
  // Open addressing over a power-of-two table; an entry holds the high half of the key's hash
  // (compared first, no indirection) and the key's position + 1 (0 = empty).
  const std::size_t mask = scratch_set_.size() - 1;
  const auto high = static_cast<std::uint32_t>(hash >> 32);
  for (std::size_t b = hash & mask;; b = (b + 1) & mask) {
    const DedupeEntry entry = scratch_set_[b];
    if (entry.position == 0) {
      scratch_set_[b] = DedupeEntry{high, static_cast<std::uint32_t>(index) + 1};
      return index;
    }
    if (entry.hash_high == high && keys[entry.position - 1] == keys[index]) {
      return entry.position - 1;
    }
  }
}

static_assert(PrepareStoreResult::kNoBlock == KeyIndex::kNotFound);
static_assert(AdmissionTracker::kNotTracked == KeyIndex::kNotFound);

void CPUOffloadingManager::filter_new_keys(KeySpan keys) {
  scratch_tracked_.resize(keys.size());
  tracker_->find_all(keys, scratch_hashes_.data(), scratch_tracked_.data());
  const auto threshold = static_cast<std::uint64_t>(store_threshold_);
  std::size_t kept = 0;
  for (const std::uint32_t i : scratch_new_) {
    const std::uint32_t entry = scratch_tracked_[i];
    // its offers so far (0 when the tracker forgot it or never saw it) plus this call's
    const std::uint64_t offers =
        std::uint64_t{entry == AdmissionTracker::kNotTracked ? 0 : tracker_->count(entry)} +
        (keys.size() > 1 ? scratch_offers_[i] : 1);
    if (offers >= threshold) {
      scratch_new_[kept++] = i;
    } else {
      scratch_skipped_.push_back(i);
    }
  }
  scratch_new_.resize(kept);
}

bool CPUOffloadingManager::find_victims(std::size_t to_evict, std::uint32_t stamp,
                                        std::size_t num_protected) {
  scratch_victims_.clear();
  if (to_evict == 0) {
    return true;
  }
  if (static_cast<std::size_t>(num_evictable_) - num_protected < to_evict) {
    return false;  // cheap refusal: not enough candidates, nothing scanned
  }
  // A slot may be evicted when its block is ready, unpinned and not a key of this call (marked
  // with `stamp`): one read of the slot's record, which the recency log has usually prefetched
  // already. The walk itself drives a software pipeline over the recency log: each slot
  // examined prefetches the policy node and record of the entry kVictimAhead positions further
  // on, so the walk (a chain of dependent loads) mostly finds its next node in cache.
  std::uint32_t predicted = predicted_victims_start();
  for (std::size_t k = 0; k < kVictimAhead; ++k) {
    prefetch_predicted(predicted + static_cast<std::uint32_t>(k));
  }
  const auto can_evict = [this, stamp, &predicted](std::uint32_t slot) {
    prefetch_predicted(predicted + static_cast<std::uint32_t>(kVictimAhead));
    ++predicted;
    const std::uint64_t p = index_.payload(slot);
    return evictable(p) && mark_bits(p) != stamp;
  };
  const std::size_t found = policy_->select_victims(to_evict, can_evict, scratch_victims_);
  if (found != to_evict) {
    throw std::logic_error("kvoff internal error: eviction policy '" +
                           std::string(policy_->name()) + "' found " + std::to_string(found) +
                           " of " + std::to_string(to_evict) +
                           " victims that the evictable count promised; nothing was changed");
  }
  // The next victims were probably used right after the last one (a hint only).
  recent_tail_ = index_.extra(scratch_victims_.back()) + 1;
  return true;
}

void CPUOffloadingManager::evict_victims(KeyList& evicted, std::size_t key_bytes) {
  const std::size_t num_victims = scratch_victims_.size();
  evicted.clear();
  evicted.reserve(num_victims, num_victims * key_bytes);
  // Software pipeline: the bucket of the victim kCommitAhead positions ahead is fetched while
  // one is erased, so the misses overlap and the lines are still in L1 when they are used (a
  // burst of hundreds of prefetches would evict its own first lines).
  for (std::size_t k = 0; k < std::min(num_victims, kCommitAhead); ++k) {
    index_.prefetch_erase(scratch_victims_[k]);
    policy_->prefetch_evict(scratch_victims_[k]);
  }
  for (std::size_t k = 0; k < num_victims; ++k) {
    if (k + kCommitAhead < num_victims) {
      index_.prefetch_erase(scratch_victims_[k + kCommitAhead]);
      policy_->prefetch_evict(scratch_victims_[k + kCommitAhead]);
    }
    const std::uint32_t victim = scratch_victims_[k];
    const std::string_view key = index_.key(victim);
    evicted.push_back(key);
    policy_->erase(victim, key, /*evicted=*/true);
    index_.erase(victim);
  }
  num_ready_ -= static_cast<std::uint32_t>(num_victims);
  num_evictable_ -= static_cast<std::uint32_t>(num_victims);
  if (enable_events_ && num_victims > 0) {
    record(evicted.to_strings(), /*removed=*/true);
  }
}

std::optional<PrepareStoreResult> CPUOffloadingManager::prepare_store(KeySpan keys,
                                                                      bool apply_threshold) {
  PrepareStoreResult result;
  if (!prepare_store(keys, result, apply_threshold)) return std::nullopt;
  return result;
}

bool CPUOffloadingManager::prepare_store(KeySpan keys, PrepareStoreResult& result,
                                         bool apply_threshold) {
  validate_keys(keys, "prepare_store");
  maybe_drain();  // blocks the tiers finished writing become evictable again
  const std::uint32_t stamp = next_stamp();
  find_all(keys);
  scratch_new_.clear();
  scratch_skipped_.clear();
  const bool filter = tracker_ != nullptr && apply_threshold;
  if (filter && keys.size() > 1) {
    scratch_offers_.assign(keys.size(), 0);  // per new key: its occurrences in the call
  }
  if (keys.size() > 1) {
    std::size_t buckets = 4;
    while (buckets < 2 * keys.size()) {
      buckets <<= 1;
    }
    scratch_set_.assign(buckets, DedupeEntry{0, 0});
  }

  // Pass 1 (no state change but the call's marks): mark the keys already held with this
  // call's stamp (they are protected from eviction) and collect the distinct new keys.
  std::size_t num_protected = 0;  // held keys of the call that are evictable
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::uint32_t slot = scratch_slots_[i];
    if (slot != KeyIndex::kNotFound) {
      std::uint64_t& p = index_.payload(slot);
      if (mark_bits(p) != stamp) {
        set_mark(p, stamp);
        num_protected += evictable(p) ? 1 : 0;
      }
      continue;
    }
    if (keys.size() > 1) {
      const std::size_t first = dedupe_insert(keys, i, scratch_hashes_[i]);
      if (filter) ++scratch_offers_[first];
      if (first != i) continue;  // repeats an earlier new key of this call
    }
    scratch_new_.push_back(static_cast<std::uint32_t>(i));
  }
  // The store_threshold filter: new keys offered too few times need no slot (no state change).
  if (filter) {
    filter_new_keys(keys);
  }

  // Pass 2 (no state change): find victims, or give up.
  const std::size_t need = scratch_new_.size();
  const std::size_t free = pool_.num_free();
  if (!find_victims(need > free ? need - free : 0, stamp, num_protected)) {
    return false;
  }

  // Pass 3: commit. Evicted slots go straight to new keys (never through the free list): the
  // new keys take the victims' slots, last victim first, then free slots. This is the order a
  // LIFO free list would give after freeing the victims, without its traffic.
  result.store_indices.assign(scratch_new_.begin(), scratch_new_.end());
  result.keys_to_store.clear();
  result.keys_to_store.reserve(need);
  result.block_ids.clear();
  result.block_ids.reserve(need);
  const std::size_t num_victims = scratch_victims_.size();
  evict_victims(result.evicted_keys, keys.empty() ? 0 : keys[0].size());
  for (std::size_t j = 0; j < std::min(need, kCommitAhead); ++j) {
    index_.prefetch_insert(scratch_hashes_[scratch_new_[j]]);
    policy_->prefetch_key(scratch_hashes_[scratch_new_[need - 1 - j]]);  // entered last first
  }
  for (std::size_t j = 0; j < need; ++j) {
    if (j + kCommitAhead < need) {
      index_.prefetch_insert(scratch_hashes_[scratch_new_[j + kCommitAhead]]);
      policy_->prefetch_key(scratch_hashes_[scratch_new_[need - 1 - j - kCommitAhead]]);
    }
    const std::uint32_t i = scratch_new_[j];
    const std::uint32_t slot =
        j < num_victims ? scratch_victims_[num_victims - 1 - j] : pool_.allocate();
    index_.insert_absent(slot, keys[i], scratch_hashes_[i]);  // found absent in pass 1
    set_state(index_.payload(slot), BlockState::kPending);
    result.keys_to_store.push_back(keys[i]);
    result.block_ids.push_back(slot);
  }
  // Enter the policy last to first, so keys[0] is the most recent of the new blocks.
  for (std::size_t j = need; j-- > 0;) {
    policy_->insert(result.block_ids[j], keys[scratch_new_[j]]);
    note_recent(result.block_ids[j]);
  }
  num_pending_ += static_cast<std::uint32_t>(need);
  // Every key's block: held ones from pass 1, new ones from the commit, and a repeat of a new
  // key (rare: not found in pass 1, not among the new) from the index.
  result.key_block_ids.assign(scratch_slots_.begin(), scratch_slots_.end());
  for (std::size_t j = 0; j < need; ++j) {
    result.key_block_ids[scratch_new_[j]] = result.block_ids[j];
  }
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (result.key_block_ids[i] == KeyIndex::kNotFound) {
      // (kNotFound == kNoBlock: a skipped key stays so)
      result.key_block_ids[i] = index_.find(keys[i], scratch_hashes_[i]);
    }
  }
  result.skipped_indices.assign(scratch_skipped_.begin(), scratch_skipped_.end());
  if (filter) {
    stores_skipped_ += scratch_skipped_.size();
    tracker_->record(keys, scratch_hashes_.data(), scratch_tracked_);  // the call's offers
  }
  return true;
}

void CPUOffloadingManager::complete_store(KeySpan keys, bool success, bool write_through) {
  validate_keys(keys, "complete_store");
  maybe_drain();
  find_all(keys);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::uint32_t slot = scratch_slots_[i];
    const BlockState st =
        slot == KeyIndex::kNotFound ? BlockState::kMissing : state_bits(index_.payload(slot));
    if (st != BlockState::kPending) {
      throw_bad_key("complete_store", i, keys[i],
                    st == BlockState::kReady
                        ? std::string("already ready (its store completed earlier), not pending")
                        : describe_state(st) + ", not pending",
                    "pass the keys_to_store of a prepare_store whose store has not completed");
    }
  }
  finish_stores(scratch_slots_, success, write_through);
}

void CPUOffloadingManager::complete_store_blocks(std::span<const std::uint32_t> block_ids,
                                                 bool success, bool write_through,
                                                 std::span<const std::size_t> event_ends) {
  for (std::size_t i = 0; i < event_ends.size(); ++i) {
    if (event_ends[i] > block_ids.size() || (i > 0 && event_ends[i] <= event_ends[i - 1])) {
      throw std::invalid_argument(
          "complete_store_blocks: event_ends[" + std::to_string(i) + "] = " +
          std::to_string(event_ends[i]) + " is " +
          (event_ends[i] > block_ids.size()
               ? "past the end of block_ids (" + std::to_string(block_ids.size()) + " slots)"
               : std::string("not above the one before it")) +
          "; pass increasing positions in block_ids. Nothing was changed.");
    }
  }
  maybe_drain();
  for (std::size_t i = 0; i < block_ids.size(); ++i) {
    const std::uint32_t slot = block_ids[i];
    const bool in_range = slot < index_.num_slots();
    const bool held = in_range && policy_->contains(slot);
    if (held && state_bits(index_.payload(slot)) == BlockState::kPending) continue;
    const std::string what =
        !in_range ? "outside [0, num_blocks=" + std::to_string(index_.num_slots()) + ")"
        : held    ? describe_state(state_bits(index_.payload(slot))) + ", not pending"
                  : std::string("a free block");
    throw std::invalid_argument("complete_store_blocks: block_ids[" + std::to_string(i) +
                                "] = " + std::to_string(slot) + " is " + what +
                                "; pass the block_ids of a prepare_store whose store has not "
                                "completed. Nothing was changed.");
  }
  finish_stores(block_ids, success, write_through, event_ends);
}

void CPUOffloadingManager::finish_stores(std::span<const std::uint32_t> slots, bool success,
                                         bool write_through,
                                         std::span<const std::size_t> event_ends) {
  const std::uint32_t stamp = next_stamp();
  scratch_new_.clear();  // the distinct slots of the call
  // With events: one BlockStored per run of `slots` (event_ends), listing the run's slots not
  // listed before (a run of repeats only has none); each a slice of scratch_new_, recorded
  // before the states change (only the keys are read).
  const bool announce = success && enable_events_;
  std::size_t e = 0;       // next event end
  std::size_t listed = 0;  // scratch_new_ slots already in an event
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const std::uint32_t slot = slots[i];
    std::uint64_t& p = index_.payload(slot);
    if (mark_bits(p) != stamp) {  // else repeated in this call: finish it once
      set_mark(p, stamp);
      scratch_new_.push_back(slot);
    }
    if (announce && e < event_ends.size() && i + 1 == event_ends[e]) {
      ++e;
      record_stored(listed);
      listed = scratch_new_.size();
    }
  }
  const auto n = static_cast<std::uint32_t>(scratch_new_.size());
  if (success) {
    if (announce) record_stored(listed);  // the slots after the last event end
    for (const std::uint32_t slot : scratch_new_) {
      set_state(index_.payload(slot), BlockState::kReady);
    }
    num_ready_ += n;
    num_evictable_ += n;
    if (write_through && wt_capacity_ > 0) {
      queue_write_through(scratch_new_);
    }
  } else {
    for (const std::uint32_t slot : scratch_new_) {
      index_.prefetch_erase(slot);
    }
    for (const std::uint32_t slot : scratch_new_) {
      drop_slot(slot);
    }
  }
  num_pending_ -= n;
}

std::vector<OffloadingEvent> CPUOffloadingManager::take_events() {
  return std::exchange(events_, {});
}

}  // namespace kvoff
