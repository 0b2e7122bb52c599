// The slot count of the node pool an engine is attached to (internal: NodePoolStores and
// NodePoolLoads each keep one, to refuse a slot the pool cannot have given out).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace kvoff::detail {

/// The pool's slot count, from its hello; kMax until set. A slot at or past it is refused
/// before it can size one of the engine's tables indexed by slot.
class NodePoolSlotCount {
 public:
  /// The most slots a pool may have: 2**28 (NodePoolStores' table by slot is then 1 GiB).
  static constexpr std::uint32_t kMax = 1u << 28;

  /// Sets the count. Throws std::invalid_argument, changing nothing, over kMax.
  void set(std::uint32_t num_slots) {
    if (num_slots > kMax) {
      throw std::invalid_argument("a node pool of " + std::to_string(num_slots) +
                                  " slots; at most " + std::to_string(kMax) +
                                  " (use larger blocks)");
    }
    num_slots_ = num_slots;
  }

  /// Throws std::invalid_argument for a slot at or past the count.
  void check(std::uint32_t slot) const {
    if (slot >= num_slots_) {
      throw std::invalid_argument("the node pool gave slot " + std::to_string(slot) +
                                  ", but it has " + std::to_string(num_slots_) + " slots");
    }
  }

 private:
  std::uint32_t num_slots_ = kMax;
};

}  // namespace kvoff::detail
