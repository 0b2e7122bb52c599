// The hand-off between CPUOffloadingManager (engine thread) and the tier writers (any thread)
// for write-through to secondary tiers: batches of blocks queued to be written, and blocks
// handed back once written. The one thread-safe part of the manager.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace kvoff {

/// Blocks whose stores completed, pinned in the pool until every secondary tier wrote them:
/// `keys[i]` lives in CPU block `block_ids[i]`. See CPUOffloadingManager::set_write_through.
struct WriteThroughBatch {
  std::vector<std::string> keys;
  std::vector<std::uint32_t> block_ids;
};

/// The queue of write-through batches and the list of blocks handed back. Thread-safe: every
/// method may be called from any thread, at the same time as the others (each takes the
/// queue's mutex; take and wait_handed_back wait on condition variables). In practice the
/// manager's engine thread calls enable, push, take_handed_back, wait_handed_back and cancel,
/// and tier writers call take and hand_back. The pins of queued blocks are the manager's (its
/// engine-thread state): the queue only tracks which blocks are queued and not handed back.
/// Error messages name the CPUOffloadingManager methods that reach these calls.
class WriteThroughQueue {
 public:
  /// Makes room for blocks 0 .. num_slots-1 (2 bytes per slot with the manager's pins); once:
  /// later calls change nothing.
  void enable(std::size_t num_slots);

  /// Queues `batch` (its blocks enabled, none queued already) and wakes one take.
  void push(WriteThroughBatch batch);

  /// The batches queued since the last call, oldest first, waiting up to `timeout_seconds` for
  /// one (0: do not wait; 1e6 or more, inf included: until one is queued or close runs). Empty
  /// on timeout or once close ran. Throws std::invalid_argument for a NaN timeout.
  std::vector<WriteThroughBatch> take(double timeout_seconds);

  /// Blocks of taken batches are done (written or failed): they join the handed-back list and
  /// wake wait_handed_back. Throws std::invalid_argument, changing nothing, for a block that is
  /// not queued (never queued, already handed back, outside the pool) or repeated in the call.
  void hand_back(std::span<const std::uint32_t> block_ids);

  /// Whether blocks were handed back since the last take_handed_back (a cheap check that takes
  /// no lock, for the manager's calls to see whether to drain).
  bool has_handed_back() const noexcept {
    return handed_back_ready_.load(std::memory_order_acquire);
  }

  /// Moves the blocks handed back so far into `out` (which must be empty; its memory is
  /// reused), oldest first.
  void take_handed_back(std::vector<std::uint32_t>& out);

  /// Waits up to `timeout_seconds` (1e6 or more, inf included: until woken) until some block is
  /// handed back; returns at once when one is already. Throws std::invalid_argument for a NaN
  /// timeout.
  void wait_handed_back(double timeout_seconds);

  /// Wakes every take; later ones return at once. Idempotent.
  void close();

  /// Hands back, unwritten, every batch that no take took yet; returns how many blocks.
  std::size_t cancel();

 private:
  std::mutex mutex_;
  std::condition_variable queued_cv_;       // a batch was queued, or closed
  std::condition_variable handed_back_cv_;  // blocks were handed back
  std::vector<WriteThroughBatch> batches_;  // queued, not taken
  std::vector<std::uint32_t> handed_back_;  // handed back, not taken by the manager
  std::vector<std::uint8_t> outstanding_;   // per slot: 1 queued and not handed back
  std::atomic<bool> handed_back_ready_{false};  // handed_back_ is not empty
  bool closed_ = false;
};

}  // namespace kvoff
