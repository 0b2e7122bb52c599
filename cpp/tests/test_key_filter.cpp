// KeyFilter (a node pool's key filter in shared memory) against a multiset model: a key the
// model holds is never "no", removing what was added empties it, and bad memory is refused.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvoff/key.h"
#include "kvoff/key_filter.h"

namespace {

using kvoff::KeyFilter;

std::string key_of(std::uint64_t i) {
  std::string k(40, '\0');
  for (int b = 0; b < 8; ++b) k[b] = static_cast<char>(i >> (8 * b));  // small integer keys
  return k;
}

struct Memory {
  explicit Memory(std::size_t capacity) : words((KeyFilter::bytes_for(capacity) + 7) / 8) {}
  std::span<std::byte> span() {
    return {reinterpret_cast<std::byte*>(words.data()), words.size() * 8};
  }
  std::vector<std::uint64_t> words;  // 8-byte aligned
};

// Random adds and removes: every key the model holds stays "maybe" at every step (the one
// guarantee readers rely on), and after removing everything no cell is left set.
TEST(KeyFilter, AKeyAddedAndNotRemovedIsNeverMissed) {
  Memory mem(1000);
  KeyFilter f = KeyFilter::create(mem.span(), 7);
  std::map<std::uint64_t, int> model;
  std::mt19937_64 rng(1);
  for (int step = 0; step < 20000; ++step) {
    const std::uint64_t k = rng() % 3000;
    if (rng() % 3 != 0 || model[k] == 0) {
      f.add(key_of(k));
      ++model[k];
    } else {
      ASSERT_TRUE(f.remove(key_of(k)));
      --model[k];
    }
    if (step % 97 == 0) {
      for (const auto& [key, n] : model) {
        if (n > 0) ASSERT_TRUE(f.may_contain(key_of(key))) << "key " << key << " step " << step;
      }
    }
  }
  for (auto& [key, n] : model) {
    for (; n > 0; --n) ASSERT_TRUE(f.remove(key_of(key)));
  }
  EXPECT_EQ(f.nonzero_cells(), 0u);
  EXPECT_FALSE(f.may_contain(key_of(1)));
}

// At capacity the false positive rate is near Bloom's (1 - e^(-1/4))^4 = 0.24 %.
TEST(KeyFilter, FalsePositivesAtCapacityAreRare) {
  const std::size_t capacity = 20000;
  Memory mem(capacity);
  KeyFilter f = KeyFilter::create(mem.span(), 1);
  for (std::uint64_t i = 0; i < capacity; ++i) f.add(key_of(i));
  std::size_t maybe = 0;
  const std::size_t probes = 200000;
  for (std::uint64_t i = capacity; i < capacity + probes; ++i) maybe += f.may_contain(key_of(i));
  EXPECT_LT(static_cast<double>(maybe) / probes, 0.005);
  EXPECT_GT(maybe, 0u);  // the filter is a filter, not an index: some answers are "maybe"
}

// Removing a key never added changes nothing: no other key may turn "no".
// first_maybe answers as may_contain key by key would, at every batch size and position (its
// prefetch ring wraps past 8 keys).
TEST(KeyFilter, FirstMaybeIsTheFirstKeyMayContainWouldSayMaybeFor) {
  Memory mem(2000);
  KeyFilter f = KeyFilter::create(mem.span(), 3);
  for (std::uint64_t i = 0; i < 2000; i += 7) f.add(key_of(i));
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<std::string> keys;
    const std::size_t n = rng() % 40;
    for (std::size_t i = 0; i < n; ++i) keys.push_back(key_of(rng() % 4000));
    std::vector<std::string_view> views(keys.begin(), keys.end());
    std::size_t expected = n;
    for (std::size_t i = 0; i < n; ++i) {
      if (f.may_contain(keys[i])) {
        expected = i;
        break;
      }
    }
    ASSERT_EQ(f.first_maybe(views), expected) << "trial " << trial;
  }
  EXPECT_EQ(f.first_maybe({}), 0u);
}

TEST(KeyFilter, RemovingAKeyNeverAddedChangesNothing) {
  Memory mem(4);
  KeyFilter f = KeyFilter::create(mem.span(), 1);
  f.add(key_of(1));
  const std::size_t set = f.nonzero_cells();
  std::size_t refused = 0;
  for (std::uint64_t i = 2; i < 200; ++i) refused += !f.remove(key_of(i));
  EXPECT_GT(refused, 0u);
  EXPECT_TRUE(f.may_contain(key_of(1)));
  EXPECT_EQ(f.nonzero_cells(), set);
}

// A saturated cell is never decremented, so a key sharing it cannot be missed after overflow.
TEST(KeyFilter, SaturatedCellsStaySet) {
  Memory mem(1);
  KeyFilter f = KeyFilter::create(mem.span(), 1);
  for (int i = 0; i < 300; ++i) f.add(key_of(9));
  for (int i = 0; i < 300; ++i) f.remove(key_of(9));
  EXPECT_TRUE(f.may_contain(key_of(9)));
}

// A reader sees the writer's keys through the same memory, and its epoch.
TEST(KeyFilter, AReaderSeesTheWritersKeys) {
  Memory mem(100);
  KeyFilter w = KeyFilter::create(mem.span(), 0xfeedULL);
  const KeyFilter r = KeyFilter::attach(mem.span());
  EXPECT_EQ(r.epoch(), 0xfeedULL);
  EXPECT_EQ(r.num_cells(), w.num_cells());
  EXPECT_FALSE(r.may_contain(key_of(5)));
  w.add(key_of(5));
  EXPECT_TRUE(r.may_contain(key_of(5)));
  w.remove(key_of(5));
  EXPECT_FALSE(r.may_contain(key_of(5)));
}

TEST(KeyFilter, BadMemoryIsRefused) {
  Memory mem(10);
  EXPECT_THROW(KeyFilter::attach(mem.span()), std::invalid_argument);  // not formatted
  EXPECT_THROW(KeyFilter::create(mem.span().first(KeyFilter::bytes_for(1) - 1), 1),
               std::invalid_argument);
  KeyFilter::create(mem.span(), 1);
  EXPECT_THROW(KeyFilter::attach(mem.span().first(KeyFilter::kHeaderBytes + 8)),
               std::invalid_argument);  // fewer cells than the header says
  mem.words[1] ^= 1;                    // another format
  EXPECT_THROW(KeyFilter::attach(mem.span()), std::invalid_argument);
  EXPECT_THROW(KeyFilter::create(mem.span().subspan(1), 1), std::invalid_argument);  // unaligned
}

// Readers and the writer may run different builds: the format must change with hash_key. These
// values pin hash_key; when they change, bump KeyFilter::kFormat with them.
TEST(KeyFilter, HashKeyIsPinnedToTheFormat) {
  static_assert(KeyFilter::kFormat == 1);
  EXPECT_EQ(kvoff::hash_key("k"), 0x61e33027d8864083ULL);
  EXPECT_EQ(kvoff::hash_key(key_of(12345)), 0x61ce99db8e7d50dcULL);
}

}  // namespace
