// FlatHashTable (the scheduler's request index and idle set) against a std::multimap model.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <utility>

#include "kvoff/flat_hash_table.h"

namespace {

using kvoff::detail::FlatHashTable;

// Entries that share a hash are told apart by their values; erase removes exactly the matching
// entry and every other stays findable.
TEST(FlatHashTable, SharedHashesAreToldApartByValue) {
  FlatHashTable<int> t;
  t.insert(7, 1);
  t.insert(7, 2);
  t.insert(7 + 64, 3);  // same home slot in the 64-entry table
  EXPECT_EQ(t.size(), 3u);
  ASSERT_NE(t.find(7, [](int v) { return v == 2; }), nullptr);
  EXPECT_EQ(*t.find(7, [](int v) { return v == 2; }), 2);
  EXPECT_EQ(t.find(7, [](int v) { return v == 3; }), nullptr);  // another hash
  EXPECT_TRUE(t.erase(7, [](int v) { return v == 1; }));
  EXPECT_FALSE(t.erase(7, [](int v) { return v == 1; }));
  EXPECT_EQ(*t.find(7, [](int) { return true; }), 2);
  EXPECT_EQ(*t.find(7 + 64, [](int) { return true; }), 3);
  EXPECT_EQ(t.size(), 2u);
}

// Random inserts and erases, clustered on few home slots so that probe runs wrap around the
// table and backward shifts cross its end: after every operation each live entry is found and
// no erased one is, across growth.
TEST(FlatHashTable, RandomOperationsMatchAMultimap) {
  std::mt19937_64 rng(12345);
  FlatHashTable<std::uint64_t> t;
  std::multimap<std::uint64_t, std::uint64_t> model;  // hash -> value
  std::uint64_t next_value = 1;
  for (int step = 0; step < 20000; ++step) {
    // hashes near the top of a 64-entry table's range wrap to its start
    const std::uint64_t hash = 1 + (rng() % 3 == 0 ? 60 + rng() % 8 : rng() % 300);
    if (model.empty() || rng() % 5 < (model.size() < 40 ? 3u : 2u)) {  // about 40 live
      t.insert(hash, next_value);
      model.emplace(hash, next_value);
      ++next_value;
    } else {
      auto it = model.begin();
      std::advance(it, static_cast<long>(rng() % model.size()));
      const std::uint64_t h = it->first, v = it->second;
      ASSERT_TRUE(t.erase(h, [v](std::uint64_t x) { return x == v; }));
      model.erase(it);
    }
    ASSERT_EQ(t.size(), model.size());
    if (step % 97 == 0 || model.size() < 8) {
      for (const auto& [h, v] : model) {
        const std::uint64_t* found = t.find(h, [v = v](std::uint64_t x) { return x == v; });
        ASSERT_NE(found, nullptr) << "hash " << h << " value " << v << " at step " << step;
      }
    }
  }
  for (const auto& [h, v] : model) {
    ASSERT_TRUE(t.erase(h, [v = v](std::uint64_t x) { return x == v; }));
  }
  EXPECT_EQ(t.size(), 0u);
  EXPECT_EQ(t.find(61, [](std::uint64_t) { return true; }), nullptr);
}

}  // namespace
