// One job: CPUOffloadingManager's write-through, the engine thread's half (kvoff/
// offloading_manager.h): pins, counts and slots of blocks handed to the tier writers. The
// hand-off itself (the threads that take batches and hand blocks back) is wt_queue_, a
// WriteThroughQueue (write_through_queue.cpp).
#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kvoff/offloading_manager.h"
#include "offloading_manager_internal.h"

namespace kvoff {

using namespace manager_detail;

void CPUOffloadingManager::set_write_through(std::uint32_t capacity_blocks) {
  if (capacity_blocks > 0 && wt_pinned_.empty()) {
    wt_pinned_.assign(index_.num_slots(), 0);
    wt_queue_.enable(index_.num_slots());
  }
  wt_capacity_ = capacity_blocks;
}

void CPUOffloadingManager::queue_write_through(std::span<const std::uint32_t> slots) {
  const std::uint32_t room = wt_capacity_ > wt_in_flight_ ? wt_capacity_ - wt_in_flight_ : 0;
  const auto n = static_cast<std::uint32_t>(std::min<std::size_t>(room, slots.size()));
  wt_dropped_total_ += slots.size() - n;
  if (n == 0) {
    return;
  }
  WriteThroughBatch batch;
  batch.block_ids.assign(slots.begin(), slots.begin() + n);
  batch.keys.reserve(n);
  for (const std::uint32_t slot : batch.block_ids) {
    index_.payload(slot) += kOnePin;  // just made ready, so unpinned until now
    wt_pinned_[slot] = kWtPinned;
    batch.keys.emplace_back(index_.key(slot));
  }
  num_evictable_ -= n;
  wt_in_flight_ += n;
  wt_queued_total_ += n;
  wt_queue_.push(std::move(batch));
}

std::vector<WriteThroughBatch> CPUOffloadingManager::take_write_through(double timeout_seconds) {
  return wt_queue_.take(timeout_seconds);
}

void CPUOffloadingManager::write_through_done(std::span<const std::uint32_t> block_ids) {
  wt_queue_.hand_back(block_ids);
}

std::size_t CPUOffloadingManager::drain_write_through() {
  wt_queue_.take_handed_back(wt_drained_);
  std::uint32_t unpinned = 0;
  for (const std::uint32_t slot : wt_drained_) {
    if (wt_pinned_[slot] == kWtRetired) {  // dropped from the index while written (clear)
      wt_pinned_[slot] = 0;
      --num_retired_;
      pool_.free(slot);
      continue;
    }
    std::uint64_t& p = index_.payload(slot);
    p -= kOnePin;
    wt_pinned_[slot] = 0;
    if (pins_bits(p) == 0) {
      ++unpinned;
    }
  }
  num_evictable_ += unpinned;
  const std::size_t n = wt_drained_.size();
  wt_in_flight_ -= static_cast<std::uint32_t>(n);
  wt_drained_.clear();
  return n;
}

std::size_t CPUOffloadingManager::poll_write_through() { return drain_write_through(); }

std::size_t CPUOffloadingManager::wait_write_through(double timeout_seconds) {
  wt_queue_.wait_handed_back(timeout_seconds);
  return drain_write_through();
}

void CPUOffloadingManager::close_write_through() { wt_queue_.close(); }

std::size_t CPUOffloadingManager::cancel_write_through() {
  const std::size_t n = wt_queue_.cancel();  // handed back unwritten: unpinned by the next drain
  wt_cancelled_total_ += n;
  return n;
}

}  // namespace kvoff
