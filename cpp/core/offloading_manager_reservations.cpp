// One job: CPUOffloadingManager's slot reservations (reserve_blocks, store_reserved,
// release_reserved; kvoff/offloading_manager.h). A node pool grants an engine free slots
// ahead of its stores, so that the engine can store without waiting for the pool's reply.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kvoff/offloading_manager.h"
#include "offloading_manager_internal.h"

namespace kvoff {

using namespace manager_detail;

bool CPUOffloadingManager::reserve_blocks(std::uint32_t count, PrepareStoreResult& result) {
  maybe_drain();  // blocks the tiers finished writing become evictable again
  result.store_indices.clear();
  result.keys_to_store.clear();
  result.key_block_ids.clear();
  result.skipped_indices.clear();
  result.block_ids.clear();
  result.evicted_keys.clear();
  const std::size_t free = pool_.num_free();
  // No key of a call to protect: a stamp no slot carries.
  if (!find_victims(count > free ? count - free : 0, next_stamp(), 0)) {
    return false;
  }
  if (reserved_.empty()) {
    reserved_.assign(index_.num_slots(), 0);
  }
  evict_victims(result.evicted_keys, 40);
  result.block_ids.reserve(count);
  // The victims' slots stay allocated (never through the free list), then free slots.
  result.block_ids.assign(scratch_victims_.begin(), scratch_victims_.end());
  while (result.block_ids.size() < count) {
    result.block_ids.push_back(pool_.allocate());
  }
  for (const std::uint32_t slot : result.block_ids) {
    reserved_[slot] = 1;
  }
  num_reserved_ += count;
  return true;
}

void CPUOffloadingManager::check_reserved(std::span<const std::uint32_t> block_ids,
                                          const char* op) {
  // Marks each slot 2 while checking, so a repeat is found; every mark is undone.
  std::size_t i = 0;
  std::string bad;
  for (; i < block_ids.size(); ++i) {
    const std::uint32_t slot = block_ids[i];
    if (slot >= reserved_.size() || reserved_[slot] != 1) {
      bad = slot < index_.num_slots() && slot < reserved_.size() && reserved_[slot] == 2
                ? "repeated in this call"
                : "not a reserved slot (never reserved, or stored into or released since)";
      break;
    }
    reserved_[slot] = 2;
  }
  for (std::size_t j = 0; j < i; ++j) {
    reserved_[block_ids[j]] = 1;
  }
  if (!bad.empty()) {
    throw std::invalid_argument(std::string(op) + ": block_ids[" + std::to_string(i) +
                                "] = " + std::to_string(block_ids[i]) + " is " + bad +
                                "; pass slots reserve_blocks gave, each once. Nothing was "
                                "changed.");
  }
}

std::vector<std::uint32_t> CPUOffloadingManager::store_reserved(
    KeySpan keys, std::span<const std::uint32_t> block_ids) {
  if (keys.size() != block_ids.size()) {
    throw std::invalid_argument("store_reserved: " + std::to_string(keys.size()) +
                                " keys for " + std::to_string(block_ids.size()) +
                                " block_ids; pass one reserved slot per key. Nothing was "
                                "changed.");
  }
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].empty()) {
      throw std::invalid_argument("store_reserved: keys[" + std::to_string(i) +
                                  "] is empty; keys must be non-empty byte strings. Nothing "
                                  "was changed.");
    }
  }
  check_reserved(block_ids, "store_reserved");
  maybe_drain();
  find_all(keys);
  if (keys.size() > 1) {
    std::size_t buckets = 4;
    while (buckets < 2 * keys.size()) {
      buckets <<= 1;
    }
    scratch_set_.assign(buckets, DedupeEntry{0, 0});
  }
  scratch_new_.clear();
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (scratch_slots_[i] != KeyIndex::kNotFound) continue;  // held: its slot stays reserved
    if (keys.size() > 1 && dedupe_insert(keys, i, scratch_hashes_[i]) != i) continue;
    scratch_new_.push_back(static_cast<std::uint32_t>(i));
  }
  for (const std::uint32_t i : scratch_new_) {
    const std::uint32_t slot = block_ids[i];
    index_.insert_absent(slot, keys[i], scratch_hashes_[i]);  // found absent above
    std::uint64_t& p = index_.payload(slot);
    set_state(p, BlockState::kPending);
    reserved_[slot] = 0;
  }
  // Enter the policy last to first, so keys[0] is the most recent of the new blocks.
  for (std::size_t j = scratch_new_.size(); j-- > 0;) {
    const std::uint32_t i = scratch_new_[j];
    policy_->insert(block_ids[i], keys[i]);
    note_recent(block_ids[i]);
  }
  const auto n = static_cast<std::uint32_t>(scratch_new_.size());
  num_pending_ += n;
  num_reserved_ -= n;
  return {scratch_new_.begin(), scratch_new_.end()};
}

void CPUOffloadingManager::release_reserved(std::span<const std::uint32_t> block_ids) {
  check_reserved(block_ids, "release_reserved");
  for (const std::uint32_t slot : block_ids) {
    reserved_[slot] = 0;
    pool_.free(slot);
  }
  num_reserved_ -= static_cast<std::uint32_t>(block_ids.size());
}

}  // namespace kvoff
