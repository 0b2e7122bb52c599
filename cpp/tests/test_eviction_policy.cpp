// EvictionPolicy interface: LRU order, victim selection, and the factory by name.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "kvoff/eviction_policy.h"

namespace kvoff {
namespace {

std::vector<std::uint32_t> order(const EvictionPolicy& p) {
  std::vector<std::uint32_t> out;
  p.select_victims(p.size(), [](std::uint32_t) { return true; }, out);
  return out;
}

TEST(LRUEvictionPolicy, InsertTouchEraseOrder) {
  LRUEvictionPolicy lru(8);
  EXPECT_EQ(lru.name(), "lru");
  for (std::uint32_t s : {3u, 1u, 4u, 5u}) {
    lru.insert(s, "k");
  }
  EXPECT_EQ(order(lru), (std::vector<std::uint32_t>{3, 1, 4, 5}));  // least recent first
  lru.touch(1);
  EXPECT_EQ(order(lru), (std::vector<std::uint32_t>{3, 4, 5, 1}));
  lru.touch(1);  // already most recent
  EXPECT_EQ(order(lru), (std::vector<std::uint32_t>{3, 4, 5, 1}));
  lru.erase(4, "k", true);
  EXPECT_FALSE(lru.contains(4));
  EXPECT_EQ(lru.size(), 3u);
  EXPECT_EQ(order(lru), (std::vector<std::uint32_t>{3, 5, 1}));
  lru.insert(4, "k");
  EXPECT_EQ(order(lru), (std::vector<std::uint32_t>{3, 5, 1, 4}));
}

TEST(LRUEvictionPolicy, SelectVictimsSkipsAndChangesNothing) {
  LRUEvictionPolicy lru(8);
  for (std::uint32_t s = 0; s < 6; ++s) {
    lru.insert(s, "k");
  }
  std::vector<std::uint32_t> out;
  const auto odd = [](std::uint32_t s) { return s % 2 == 1; };
  EXPECT_EQ(lru.select_victims(2, odd, out), 2u);
  EXPECT_EQ(out, (std::vector<std::uint32_t>{1, 3}));
  out.clear();
  EXPECT_EQ(lru.select_victims(5, odd, out), 3u);  // only three odd slots exist
  EXPECT_EQ(out, (std::vector<std::uint32_t>{1, 3, 5}));
  EXPECT_EQ(order(lru), (std::vector<std::uint32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(lru.size(), 6u);
}

TEST(LRUEvictionPolicy, MisuseThrowsAndChangesNothing) {
  LRUEvictionPolicy lru(2);
  lru.insert(0, "k");
  EXPECT_THROW(lru.insert(0, "k"), std::invalid_argument);
  EXPECT_THROW(lru.insert(2, "k"), std::out_of_range);
  EXPECT_THROW(lru.touch(1), std::invalid_argument);
  EXPECT_THROW(lru.erase(1, "k", false), std::invalid_argument);
  EXPECT_THROW(lru.touch(9), std::out_of_range);
  EXPECT_EQ(lru.size(), 1u);
  EXPECT_EQ(order(lru), (std::vector<std::uint32_t>{0}));
  EXPECT_THROW(LRUEvictionPolicy(0), std::invalid_argument);
}

TEST(EvictionPolicyFactory, MakesRegisteredPolicies) {
  EXPECT_EQ(eviction_policy_names(), (std::vector<std::string>{"lru"}));
  auto p = make_eviction_policy("lru", 16);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->name(), "lru");
  EXPECT_EQ(p->capacity(), 16u);
  EXPECT_EQ(p->size(), 0u);
}

TEST(EvictionPolicyFactory, UnknownNameListsChoices) {
  try {
    make_eviction_policy("mru", 4);
    FAIL() << "no exception for an unknown policy";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'mru'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'lru'"), std::string::npos) << msg;
  }
  EXPECT_THROW(make_eviction_policy("LRU ", 4), std::invalid_argument);
  EXPECT_THROW(make_eviction_policy("lru", 0), std::invalid_argument);
}

}  // namespace
}  // namespace kvoff
