#include "kvoff/write_through_queue.h"

#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvoff {

namespace {

// Waits longer than this (about 11.6 days, inf included) wait until woken: converting a huge
// double to the condition variable's clock ticks would overflow (undefined behaviour).
constexpr double kWaitForeverSeconds = 1e6;

void check_timeout(const char* op, double timeout_seconds) {
  if (std::isnan(timeout_seconds)) {
    throw std::invalid_argument(std::string(op) +
                                ": timeout_seconds is NaN; pass seconds >= 0 (0: do not wait, "
                                "inf: until woken)");
  }
}

template <class Predicate>
void wait_up_to(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                double timeout_seconds, Predicate done) {
  if (timeout_seconds >= kWaitForeverSeconds) {
    cv.wait(lock, done);
  } else {
    cv.wait_for(lock, std::chrono::duration<double>(timeout_seconds), done);
  }
}

}  // namespace

void WriteThroughQueue::enable(std::size_t num_slots) {
  const std::lock_guard lock(mutex_);
  if (outstanding_.empty()) {
    outstanding_.assign(num_slots, 0);
  }
}

void WriteThroughQueue::push(WriteThroughBatch batch) {
  {
    const std::lock_guard lock(mutex_);
    for (const std::uint32_t slot : batch.block_ids) {
      outstanding_[slot] = 1;
    }
    batches_.push_back(std::move(batch));
  }
  queued_cv_.notify_one();
}

std::vector<WriteThroughBatch> WriteThroughQueue::take(double timeout_seconds) {
  check_timeout("take_write_through", timeout_seconds);
  std::unique_lock lock(mutex_);
  if (batches_.empty() && !closed_ && timeout_seconds > 0) {
    wait_up_to(queued_cv_, lock, timeout_seconds, [&] { return !batches_.empty() || closed_; });
  }
  return std::exchange(batches_, {});
}

void WriteThroughQueue::hand_back(std::span<const std::uint32_t> block_ids) {
  {
    const std::lock_guard lock(mutex_);
    for (std::size_t i = 0; i < block_ids.size(); ++i) {
      const std::uint32_t slot = block_ids[i];
      if (slot < outstanding_.size() && outstanding_[slot] == 1) {
        outstanding_[slot] = 2;  // seen in this call
        continue;
      }
      for (std::size_t j = 0; j < i; ++j) {
        outstanding_[block_ids[j]] = 1;
      }
      const std::string what =
          slot >= outstanding_.size() ? "not a block of write-through (outside the pool, or "
                                        "write-through was never enabled)"
          : outstanding_[slot] == 2   ? "repeated in this call"
                                      : "not being written through (never queued, or "
                                        "handed back already)";
      throw std::invalid_argument("write_through_done: block_ids[" + std::to_string(i) +
                                  "] = " + std::to_string(slot) + " is " + what +
                                  "; pass each block of a take_write_through batch once. "
                                  "Nothing was changed.");
    }
    for (const std::uint32_t slot : block_ids) {
      outstanding_[slot] = 0;
      handed_back_.push_back(slot);
    }
    handed_back_ready_.store(!handed_back_.empty(), std::memory_order_release);
  }
  handed_back_cv_.notify_all();
}

void WriteThroughQueue::take_handed_back(std::vector<std::uint32_t>& out) {
  const std::lock_guard lock(mutex_);
  out.swap(handed_back_);
  handed_back_ready_.store(false, std::memory_order_release);
}

void WriteThroughQueue::wait_handed_back(double timeout_seconds) {
  check_timeout("wait_write_through", timeout_seconds);
  std::unique_lock lock(mutex_);
  if (handed_back_.empty() && timeout_seconds > 0) {
    wait_up_to(handed_back_cv_, lock, timeout_seconds, [&] { return !handed_back_.empty(); });
  }
}

void WriteThroughQueue::close() {
  {
    const std::lock_guard lock(mutex_);
    closed_ = true;
  }
  queued_cv_.notify_all();
}

std::size_t WriteThroughQueue::cancel() {
  std::size_t n = 0;
  {
    const std::lock_guard lock(mutex_);
    for (const WriteThroughBatch& batch : batches_) {
      for (const std::uint32_t slot : batch.block_ids) {
        outstanding_[slot] = 0;
        handed_back_.push_back(slot);  // handed back unwritten: unpinned by the next drain
      }
      n += batch.block_ids.size();
    }
    batches_.clear();
    handed_back_ready_.store(!handed_back_.empty(), std::memory_order_release);
  }
  handed_back_cv_.notify_all();
  return n;
}

}  // namespace kvoff
