// One job: CPUOffloadingManager's removals (discard, clear; kvoff/offloading_manager.h): blocks
// dropped from the index on request rather than evicted for room. A block a tier writer still
// reads is retired (out of the index, its slot freed when the writer hands it back).
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvoff/offloading_manager.h"
#include "offloading_manager_internal.h"

namespace kvoff {

using namespace manager_detail;

std::size_t CPUOffloadingManager::discard(KeySpan keys) {
  validate_keys(keys, "discard");
  find_all(keys);
  std::vector<std::string> removed;
  std::size_t count = 0;    // dropped, unpinned
  std::size_t retired = 0;  // dropped while written through (pinned for the tier writer only)
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::uint32_t slot = scratch_slots_[i];
    if (slot == KeyIndex::kNotFound) {
      continue;  // missing, or dropped earlier in this call
    }
    const std::uint64_t p = index_.payload(slot);
    const bool written_only =
        state_bits(p) == BlockState::kReady && pins_bits(p) == 1 && written_through(slot);
    if (!evictable(p) && !written_only) {
      continue;  // pending, or pinned by a load
    }
    if (enable_events_) {
      removed.emplace_back(index_.key(slot));
    }
    if (written_only) {
      retire_written_through(slot);
      ++retired;
    } else {
      policy_->erase(slot, index_.key(slot), /*evicted=*/false);
      index_.erase(slot);
      pool_.free(slot);
      ++count;
    }
    // a later occurrence of the key in this call must not see the slot
    for (std::size_t k = i + 1; k < keys.size(); ++k) {
      if (scratch_slots_[k] == slot) scratch_slots_[k] = KeyIndex::kNotFound;
    }
  }
  num_ready_ -= static_cast<std::uint32_t>(count + retired);
  num_evictable_ -= static_cast<std::uint32_t>(count);
  count += retired;
  record(std::move(removed), /*removed=*/true);
  return count;
}

std::size_t CPUOffloadingManager::clear(bool include_in_flight) {
  std::vector<std::string> removed;
  std::size_t ready = 0;  // ready blocks dropped (evictable, or pinned by loads only)
  std::size_t unpinned_dropped = 0;  // of them, the unpinned ones
  std::size_t pending = 0;  // pending blocks dropped (include_in_flight)
  for (std::uint32_t slot = 0; slot < index_.num_slots(); ++slot) {
    if (!policy_->contains(slot)) {
      continue;  // free, or retired and still read by a tier writer
    }
    const std::uint64_t p = index_.payload(slot);
    const bool unpinned = evictable(p);
    if (!unpinned) {
      if (state_bits(p) == BlockState::kPending) {
        if (!include_in_flight) {
          continue;  // a store in flight: it completes as usual
        }
        drop_slot(slot);  // never stored: no event
        ++pending;
        continue;
      }
      const bool written = written_through(slot);
      if (pins_bits(p) > (written ? 1U : 0U) && !include_in_flight) {
        continue;  // a load in flight reads it
      }
      if (written) {
        // the tier writer still reads it (write_through_done needs the slot): no longer a
        // hit, its slot freed once the writer hands it back; the loads' pins go with it, since
        // (include_in_flight) their completions will not come
        if (enable_events_) {
          removed.emplace_back(index_.key(slot));
        }
        retire_written_through(slot);
        ++ready;
        continue;
      }
    }
    if (enable_events_) {
      removed.emplace_back(index_.key(slot));
    }
    policy_->erase(slot, index_.key(slot), /*evicted=*/true);
    index_.erase(slot);
    pool_.free(slot);
    ++ready;
    unpinned_dropped += unpinned ? 1 : 0;
  }
  num_ready_ -= static_cast<std::uint32_t>(ready);
  num_evictable_ -= static_cast<std::uint32_t>(unpinned_dropped);
  num_pending_ -= static_cast<std::uint32_t>(pending);
  record(std::move(removed), /*removed=*/true);
  return ready + pending;
}

void CPUOffloadingManager::retire_written_through(std::uint32_t slot) {
  policy_->erase(slot, index_.key(slot), /*evicted=*/false);
  index_.erase(slot);
  wt_pinned_[slot] = kWtRetired;  // drain_write_through frees the slot
  ++num_retired_;
}

}  // namespace kvoff
