// KeyIndex (open addressing, backward-shift deletion) and key hashing / hex.
#include <gtest/gtest.h>

#include <random>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvoff/key.h"
#include "kvoff/key_index.h"

namespace kvoff {
namespace {

std::string int_key(std::uint64_t v) {
  std::string s(8, '\0');
  for (int b = 0; b < 8; ++b) {
    s[b] = static_cast<char>((v >> (8 * b)) & 0xff);
  }
  return s;
}

TEST(KeyHash, DistinguishesSmallIntsAndLengths) {
  std::unordered_set<std::uint64_t> seen;
  for (std::uint64_t i = 0; i < 100000; ++i) {
    EXPECT_TRUE(seen.insert(hash_key(int_key(i))).second) << i;
  }
  // Same bytes, different length (trailing zero bytes) must not collide.
  EXPECT_NE(hash_key(std::string("a")), hash_key(std::string("a\0", 2)));
  EXPECT_NE(hash_key(std::string(8, '\0')), hash_key(std::string(16, '\0')));
}

TEST(KeyHash, HexFormatting) {
  EXPECT_EQ(key_to_hex(std::string("\x01\xab\xff", 3)), "01abff");
  EXPECT_EQ(key_to_hex(std::string(4, 'a'), 2), "6161...(4 bytes)");
}

TEST(KeyList, AppendsCopiesBackToBack) {
  KeyList list;
  EXPECT_TRUE(list.empty());
  std::string a = "alpha";
  list.reserve(3, 16);
  list.push_back(a);
  list.push_back(std::string(1, '\0'));  // keys are bytes: a zero byte is a key
  list.push_back(int_key(7));
  a[0] = 'X';  // the list holds copies
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0], "alpha");
  EXPECT_EQ(list[1], std::string(1, '\0'));
  EXPECT_EQ(list[2], int_key(7));
  EXPECT_EQ(list.to_strings(),
            (std::vector<std::string>{"alpha", std::string(1, '\0'), int_key(7)}));
  std::size_t n = 0;
  for (const std::string_view key : list) {
    EXPECT_EQ(key, list[n++]);
  }
  EXPECT_EQ(n, 3u);
  list.clear();
  EXPECT_TRUE(list.empty());
  EXPECT_EQ(list.begin(), list.end());
}

TEST(KeyIndex, InsertFindErase) {
  KeyIndex index(4);
  const std::string a = "alpha";
  const std::string b = int_key(7);
  EXPECT_EQ(index.find(a), KeyIndex::kNotFound);
  index.insert(2, a, hash_key(a));
  index.insert(0, b, hash_key(b));
  EXPECT_EQ(index.size(), 2u);
  EXPECT_EQ(index.find(a), 2u);
  EXPECT_EQ(index.find(b), 0u);
  EXPECT_EQ(index.key(2), a);
  EXPECT_TRUE(index.holds(2));
  EXPECT_EQ(index.extra(2), 0u);  // zero after insert, kept until erase
  index.extra(2) = 0xdeadbeef;
  EXPECT_EQ(index.extra(2), 0xdeadbeefu);
  EXPECT_EQ(index.find(a), 2u);
  index.erase(2);
  index.insert(2, a, hash_key(a));
  EXPECT_EQ(index.extra(2), 0u);
  index.erase(2);
  EXPECT_FALSE(index.holds(2));
  EXPECT_EQ(index.find(a), KeyIndex::kNotFound);
  EXPECT_EQ(index.find(b), 0u);
  EXPECT_EQ(index.size(), 1u);
}

TEST(KeyIndex, LongKeysAndPayload) {
  KeyIndex index(3);
  const std::string long_key(KeyIndex::kInlineKeyBytes + 1, 'x');
  const std::string inline_key(KeyIndex::kInlineKeyBytes, 'x');
  index.insert(0, long_key, hash_key(long_key));
  index.insert(1, inline_key, hash_key(inline_key));
  EXPECT_EQ(index.key(0), long_key);
  EXPECT_EQ(index.key(1), inline_key);
  EXPECT_EQ(index.find(long_key), 0u);
  EXPECT_EQ(index.find(inline_key), 1u);
  EXPECT_EQ(index.payload(0), 0u);
  index.payload(0) = 42;
  EXPECT_EQ(index.payload(0), 42u);
  index.erase(0);
  index.insert(0, "z", hash_key("z"));
  EXPECT_EQ(index.payload(0), 0u);  // reset on insert
  EXPECT_EQ(index.find(long_key), KeyIndex::kNotFound);
  EXPECT_THROW(index.insert(2, "", hash_key("")), std::invalid_argument);
}

TEST(KeyIndex, MisuseThrowsAndLeavesIndexUnchanged) {
  KeyIndex index(2);
  const std::string a = "a";
  index.insert(0, a, hash_key(a));
  EXPECT_THROW(index.insert(0, "b", hash_key("b")), std::invalid_argument);  // slot in use
  EXPECT_THROW(index.insert(1, a, hash_key(a)), std::invalid_argument);      // key present
  EXPECT_THROW(index.insert(2, "c", hash_key("c")), std::out_of_range);
  EXPECT_THROW(index.erase(1), std::invalid_argument);
  EXPECT_THROW(index.erase(5), std::out_of_range);
  EXPECT_EQ(index.size(), 1u);
  EXPECT_EQ(index.find(a), 0u);
  EXPECT_EQ(index.find("b"), KeyIndex::kNotFound);
  EXPECT_THROW(KeyIndex(0), std::invalid_argument);
}

// Random inserts and erases at full load, against std::unordered_map: exercises probe runs that
// wrap around the table and backward-shift deletion.
TEST(KeyIndex, MatchesReferenceMapUnderChurn) {
  constexpr std::uint32_t kSlots = 257;
  KeyIndex index(kSlots);
  std::unordered_map<std::string, std::uint32_t> ref;
  std::vector<std::uint32_t> free_slots;
  for (std::uint32_t s = 0; s < kSlots; ++s) {
    free_slots.push_back(s);
  }
  std::mt19937_64 rng(1234);
  for (int step = 0; step < 200000; ++step) {
    const std::uint64_t pick = rng() % 600;
    // the third kind is long enough to live on the heap
    const std::string key = (pick % 3 == 0)   ? int_key(pick)
                            : (pick % 3 == 1) ? "k" + std::to_string(pick)
                                              : std::string(60, 'L') + std::to_string(pick);
    const auto it = ref.find(key);
    ASSERT_EQ(index.find(key), it == ref.end() ? KeyIndex::kNotFound : it->second);
    if (it != ref.end()) {
      index.erase(it->second);
      free_slots.push_back(it->second);
      ref.erase(it);
    } else if (!free_slots.empty()) {
      const std::uint32_t slot = free_slots.back();
      free_slots.pop_back();
      index.insert(slot, key, hash_key(key));
      ref.emplace(key, slot);
    }
    ASSERT_EQ(index.size(), ref.size());
    if (step % 1000 == 0) {  // find_many agrees with find on a batch of hits and misses
      std::vector<std::string> batch;
      for (int i = 0; i < 37; ++i) {
        batch.push_back(i % 2 ? int_key(rng() % 600)
                              : std::string(60, 'L') + std::to_string(rng() % 600));
      }
      std::vector<std::string_view> views(batch.begin(), batch.end());
      std::vector<std::uint64_t> hashes(views.size());
      std::vector<std::uint32_t> slots(views.size());
      index.find_many(views.data(), views.size(), hashes.data(), slots.data());
      for (std::size_t i = 0; i < views.size(); ++i) {
        ASSERT_EQ(hashes[i], hash_key(views[i]));
        ASSERT_EQ(slots[i], index.find(views[i]));
      }
    }
  }
  for (const auto& [key, slot] : ref) {
    EXPECT_EQ(index.find(key), slot);
  }
}

TEST(KeyIndex, KeysOfEveryLengthAreComparedExactly) {
  // Keys that differ in a single byte at any position, for lengths around the 8-byte word
  // compare (< 8, 8, 9, 16, 33), the inline limit (48) and beyond (heap, 49+).
  for (const std::size_t len : {1u, 2u, 7u, 8u, 9u, 15u, 16u, 17u, 33u, 47u, 48u, 49u, 64u}) {
    KeyIndex index(static_cast<std::uint32_t>(len + 1));
    const std::string base(len, 'k');
    index.insert(0, base, hash_key(base));
    for (std::size_t i = 0; i < len; ++i) {
      std::string other = base;
      other[i] = 'x';
      index.insert(static_cast<std::uint32_t>(i + 1), other, hash_key(other));
    }
    EXPECT_EQ(index.find(base), 0u) << len;
    for (std::size_t i = 0; i < len; ++i) {
      std::string other = base;
      other[i] = 'x';
      EXPECT_EQ(index.find(other), i + 1) << len << " " << i;
      other[i] = 'y';
      EXPECT_EQ(index.find(other), KeyIndex::kNotFound) << len << " " << i;
    }
    EXPECT_EQ(index.find(base + "k"), KeyIndex::kNotFound);
    EXPECT_EQ(index.find(base.substr(1)), KeyIndex::kNotFound);
  }
}

TEST(KeyIndex, FindEachVisitsInOrderAndStopsEarly) {
  // More keys than the pipeline depth (2 * kFindAhead), so every stage runs.
  const std::uint32_t n = 500;
  KeyIndex index(n);
  std::vector<std::string> keys;
  for (std::uint32_t i = 0; i < n; ++i) {
    keys.push_back(int_key(i * 7919));
    if (i % 3 != 0) {
      index.insert(i, keys.back(), hash_key(keys.back()));
    }
  }
  std::vector<std::string_view> views(keys.begin(), keys.end());
  std::vector<std::size_t> seen;
  const std::size_t all = index.find_each(
      views.data(), views.size(), [&](std::size_t i, std::uint32_t slot, std::uint64_t hash) {
        EXPECT_EQ(hash, hash_key(views[i]));
        EXPECT_EQ(slot, i % 3 != 0 ? i : KeyIndex::kNotFound);
        seen.push_back(i);
        return true;
      });
  EXPECT_EQ(all, n);
  ASSERT_EQ(seen.size(), n);
  for (std::size_t i = 0; i < n; ++i) {
    EXPECT_EQ(seen[i], i);
  }
  // Stop at the 100th key: visit returns false there, and nothing after it is visited.
  std::size_t last = 0;
  const std::size_t visited = index.find_each(
      views.data(), views.size(), [&](std::size_t i, std::uint32_t, std::uint64_t) {
        last = i;
        return i < 99;
      });
  EXPECT_EQ(visited, 100u);
  EXPECT_EQ(last, 99u);
  EXPECT_EQ(index.find_each(views.data(), 0, [](std::size_t, std::uint32_t, std::uint64_t) {
    return true;
  }),
            0u);
}

TEST(KeyIndex, LargeIndexOnHugePagesWorks) {
  // 1M slots: the bucket and record arrays take the huge-page path of LargePageAllocator.
  const std::uint32_t n = 1u << 20;
  KeyIndex index(n);
  for (std::uint32_t i = 0; i < n; i += 4099) {
    const std::string k = int_key(i);
    index.insert(i, k, hash_key(k));
  }
  for (std::uint32_t i = 0; i < n; i += 4099) {
    EXPECT_EQ(index.find(int_key(i)), i);
  }
  EXPECT_EQ(index.find(int_key(1)), KeyIndex::kNotFound);
}

TEST(KeyIndex, InsertAbsentMatchesInsert) {
  KeyIndex index(8);
  const std::string inline_key = int_key(42);
  const std::string heap_key(70, 'h');
  index.insert_absent(3, inline_key, hash_key(inline_key));
  index.insert_absent(5, heap_key, hash_key(heap_key));
  EXPECT_EQ(index.size(), 2u);
  EXPECT_EQ(index.find(inline_key), 3u);
  EXPECT_EQ(index.find(heap_key), 5u);
  EXPECT_EQ(index.key(5), heap_key);
  EXPECT_EQ(index.payload(3), 0u);
  index.erase(3);
  index.erase(5);
  EXPECT_EQ(index.find(inline_key), KeyIndex::kNotFound);
  EXPECT_EQ(index.find(heap_key), KeyIndex::kNotFound);
  EXPECT_EQ(index.size(), 0u);
}

}  // namespace
}  // namespace kvoff
