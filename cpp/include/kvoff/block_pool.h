// The CPU block pool: which of the pool's slots (CPU block ids) are free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvoff/large_page_allocator.h"

namespace kvoff {

/// Largest pool size, in blocks: CPU block ids must fit in a signed 32-bit integer (they are
/// passed to copy kernels as int32/int64 tensors), so ids are 0 .. 2^31-2.
inline constexpr std::int64_t kMaxNumBlocks = 2147483647;  // 2^31 - 1

/// The message for a CPU block count out of [1, kMaxNumBlocks]; `got` is the value as written.
inline std::string bad_num_blocks_message(const std::string& got) {
  return "num_blocks must be in [1, 2^31-1] (CPU block ids are 32-bit), got " + got +
         "; size the CPU pool (cpu_bytes_to_use) for at least one block, and for at most 2^31-1 "
         "(a larger block_size_factor makes fewer, larger blocks)";
}

/// A fixed pool of `num_blocks` CPU block slots with a free-list stack.
///
/// Slots are identified by their CPU block id in [0, num_blocks). `allocate` pops the free
/// stack in O(1); a fresh pool hands out 0, 1, 2, ... in order, and a freed slot is the next one
/// handed out (LIFO, so recently used memory is reused first). The pool only tracks ownership;
/// the bytes of each slot live in the worker's CPU tensors.
///
/// Not thread-safe.
class CPUBlockPool {
 public:
  /// Creates a pool of `num_blocks` free slots.
  /// Throws std::invalid_argument when num_blocks < 1 or num_blocks > kMaxNumBlocks
  /// (2^31-1), naming the value.
  explicit CPUBlockPool(std::int64_t num_blocks);
  /// Bytes the constructor allocates for `num_blocks` slots (5 per slot: the free stack and
  /// the allocated flags). Allocates nothing, checks nothing.
  static std::uint64_t memory_bytes(std::uint32_t num_blocks) noexcept {
    return std::uint64_t{num_blocks} * (sizeof(std::uint32_t) + sizeof(std::uint8_t));
  }

  /// Total slots (blocks).
  std::uint32_t num_blocks() const noexcept { return num_blocks_; }
  /// Slots currently free (blocks).
  std::uint32_t num_free() const noexcept { return static_cast<std::uint32_t>(free_.size()); }
  /// Slots currently allocated (blocks).
  std::uint32_t num_allocated() const noexcept { return num_blocks_ - num_free(); }
  /// Whether slot `block_id` is allocated. Throws std::out_of_range for an id >= num_blocks.
  bool is_allocated(std::uint32_t block_id) const;

  /// Hint that slot `block_id` is about to be freed or allocated (prefetches its flag).
  /// Unchecked: block_id < num_blocks.
  void prefetch(std::uint32_t block_id) const noexcept {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(&allocated_[block_id]);
#else
    (void)block_id;
#endif
  }

  /// Takes one free slot and returns its CPU block id. O(1).
  /// Throws std::length_error when no slot is free (check num_free() first).
  std::uint32_t allocate();

  /// Returns slot `block_id` to the free list. O(1).
  /// Throws std::out_of_range for an id >= num_blocks and std::invalid_argument when the slot
  /// is already free (double free); the pool is unchanged in both cases.
  void free(std::uint32_t block_id);

 private:
  std::uint32_t num_blocks_;
  // Huge-page backed (LargePageAllocator): indexed at random on large pools.
  std::vector<std::uint32_t, LargePageAllocator<std::uint32_t>> free_;  // stack; back() is next
  std::vector<std::uint8_t, LargePageAllocator<std::uint8_t>> allocated_;  // 1 when allocated
};

}  // namespace kvoff
