// Helpers shared by CPUOffloadingManager's source files (offloading_manager.cpp, its
// reservations, removals and write-through in offloading_manager_*.cpp); not part of kvoff's
// headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kvoff/offloading_manager.h"

namespace kvoff::manager_detail {

// The manager's per-slot payload in the key index: see offloading_manager.h.
inline constexpr std::uint64_t kStateBits = 0x3;
inline constexpr std::uint64_t kOnePin = 0x4;
inline constexpr std::uint64_t kLow32 = 0xffffffffULL;

inline BlockState state_bits(std::uint64_t p) noexcept {
  return static_cast<BlockState>(p & kStateBits);
}
inline std::uint32_t pins_bits(std::uint64_t p) noexcept {
  return static_cast<std::uint32_t>(p & kLow32) >> 2;
}
inline std::uint32_t mark_bits(std::uint64_t p) noexcept {
  return static_cast<std::uint32_t>(p >> 32);
}
inline void set_state(std::uint64_t& p, BlockState s) noexcept {
  p = (p & ~kStateBits) | static_cast<std::uint64_t>(s);
}
inline void set_mark(std::uint64_t& p, std::uint32_t mark) noexcept {
  p = (p & kLow32) | (static_cast<std::uint64_t>(mark) << 32);
}
/// Ready and unpinned: an eviction candidate (unless protected by the current call).
inline bool evictable(std::uint64_t p) noexcept {
  return (p & kLow32) == static_cast<std::uint64_t>(BlockState::kReady);
}

// Throws std::invalid_argument naming `op` and the index of the first empty key. Inline: it
// runs at the top of every look-up and store call.
inline void validate_keys(KeySpan keys, const char* op) {
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].empty()) {
      throw std::invalid_argument(std::string(op) + ": keys[" + std::to_string(i) +
                                  "] is empty; keys must be non-empty byte strings");
    }
  }
}

}  // namespace kvoff::manager_detail
