#include "kvoff/block_pool.h"

#include <stdexcept>
#include <string>

namespace kvoff {

CPUBlockPool::CPUBlockPool(std::int64_t num_blocks) : num_blocks_(0) {
  if (num_blocks < 1 || num_blocks > kMaxNumBlocks) {
    throw std::invalid_argument(bad_num_blocks_message(std::to_string(num_blocks)));
  }
  num_blocks_ = static_cast<std::uint32_t>(num_blocks);
  free_.resize(num_blocks_);
  for (std::uint32_t i = 0; i < num_blocks_; ++i) {
    free_[i] = num_blocks_ - 1 - i;  // back() == 0: a fresh pool hands out 0, 1, 2, ...
  }
  allocated_.assign(num_blocks_, 0);
}

bool CPUBlockPool::is_allocated(std::uint32_t block_id) const {
  if (block_id >= num_blocks_) {
    throw std::out_of_range("CPU block id " + std::to_string(block_id) +
                            " is out of range for a pool of " + std::to_string(num_blocks_) +
                            " blocks (valid ids: 0.." + std::to_string(num_blocks_ - 1) + ")");
  }
  return allocated_[block_id] != 0;
}

std::uint32_t CPUBlockPool::allocate() {
  if (free_.empty()) {
    throw std::length_error("the CPU block pool is full (" + std::to_string(num_blocks_) +
                            " blocks allocated); free a block or check num_free() first");
  }
  const std::uint32_t id = free_.back();
  free_.pop_back();
  allocated_[id] = 1;
  return id;
}

void CPUBlockPool::free(std::uint32_t block_id) {
  if (!is_allocated(block_id)) {
    throw std::invalid_argument("CPU block id " + std::to_string(block_id) +
                                " is already free (double free); free each allocated id once");
  }
  allocated_[block_id] = 0;
  free_.push_back(block_id);
}

}  // namespace kvoff
