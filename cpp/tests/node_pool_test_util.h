// Helpers of the node pool engine-side tests (test_node_pool_stores.cpp,
// test_node_pool_loads.cpp): the wire's key lists read back, and key views.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace kvoff::testing {

/// The keys of a key list payload, as protocol.decode_keys reads it (count u32, width u16, then
/// the keys; width 0: a length u16 before each key). Fails the test when bytes are left over.
inline std::vector<std::string> decode_keys(std::string_view p) {
  auto u = [&](std::size_t at, int bytes) {
    std::size_t v = 0;
    for (int b = 0; b < bytes; ++b) {
      v |= std::size_t(static_cast<unsigned char>(p[at + b])) << (8 * b);
    }
    return v;
  };
  const std::size_t count = u(0, 4), width = u(4, 2);
  std::vector<std::string> out;
  std::size_t at = 6;
  for (std::size_t i = 0; i < count; ++i) {
    std::size_t len = width;
    if (width == 0) {
      len = u(at, 2);
      at += 2;
    }
    out.emplace_back(p.substr(at, len));
    at += len;
  }
  EXPECT_EQ(at, p.size());
  return out;
}

inline std::vector<std::string_view> views(const std::vector<std::string>& keys) {
  return {keys.begin(), keys.end()};
}

}  // namespace kvoff::testing
