// Helpers of the CPUOffloadingManager tests (test_offloading_manager*.cpp): key lists, a
// store that must succeed, eviction order by draining, and a snapshot of what a call may
// change.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvoff/offloading_manager.h"

namespace kvoff::manager_test {

using Keys = std::vector<std::string_view>;
using Strings = std::vector<std::string>;

inline Keys K(std::initializer_list<std::string_view> keys) { return Keys(keys); }

inline Strings S(std::initializer_list<const char*> keys) {
  return Strings(keys.begin(), keys.end());
}

/// Keys (views, a KeyList, strings) as strings, for comparisons.
template <typename Range>
Strings str(const Range& keys) {
  return Strings(keys.begin(), keys.end());
}

/// Stores keys and completes the store successfully; asserts it was accepted.
inline void store(CPUOffloadingManager& m, const Keys& keys) {
  auto r = m.prepare_store(keys);
  ASSERT_TRUE(r.has_value());
  Keys stored(r->keys_to_store.begin(), r->keys_to_store.end());
  m.complete_store(stored);
}

/// Evicts one block at a time by storing fresh keys, returning the eviction order of `n` blocks.
inline Strings drain(CPUOffloadingManager& m, std::size_t n) {
  Strings order;
  static int fresh = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::string key = "fresh" + std::to_string(fresh++);
    auto r = m.prepare_store(Keys{key});
    if (!r) {
      ADD_FAILURE() << "prepare_store refused while draining";
      return order;
    }
    EXPECT_EQ(r->evicted_keys.size(), 1u);
    order.insert(order.end(), r->evicted_keys.begin(), r->evicted_keys.end());
    m.complete_store(Keys{key});
  }
  return order;
}

/// Snapshot of everything observable about a set of keys, to compare before and after a call.
struct Snapshot {
  std::uint32_t free, stored, pending, evictable;
  std::vector<int> states;
  std::vector<std::uint32_t> pins;
  bool operator==(const Snapshot&) const = default;
};

inline Snapshot snap(const CPUOffloadingManager& m, const Keys& keys) {
  Snapshot s{m.num_free_blocks(), m.num_stored_blocks(), m.num_pending_blocks(),
             m.num_evictable_blocks(), {}, {}};
  for (auto k : keys) {
    s.states.push_back(static_cast<int>(m.state(k)));
    s.pins.push_back(m.pin_count(k));
    // the scheduler's one-lookup query agrees with the two separate ones in every state
    EXPECT_EQ(m.state_and_pins(k), std::make_pair(m.state(k), m.pin_count(k))) << k;
  }
  return s;
}

}  // namespace kvoff::manager_test
