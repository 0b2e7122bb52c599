// EvictionPolicy interface: LRU, ARC and probation order, victim selection, and the factory by
// name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvoff/eviction_policy.h"
#include "kvoff/key.h"

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
  EXPECT_EQ(eviction_policy_names(), (std::vector<std::string>{"lru", "arc", "probation"}));
  for (const char* name : {"lru", "arc", "probation"}) {
    auto p = make_eviction_policy(name, 16);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p->name(), name);
    EXPECT_EQ(p->capacity(), 16u);
    EXPECT_EQ(p->size(), 0u);
  }
}

TEST(EvictionPolicyFactory, UnknownNameListsChoices) {
  try {
    make_eviction_policy("mru", 4);
    FAIL() << "no exception for an unknown policy";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'mru'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'lru'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'arc'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'probation'"), std::string::npos) << msg;
  }
  EXPECT_THROW(make_eviction_policy("LRU ", 4), std::invalid_argument);
  EXPECT_THROW(make_eviction_policy("lru", 0), std::invalid_argument);
  EXPECT_THROW(make_eviction_policy("arc", 0), std::invalid_argument);
  EXPECT_THROW(make_eviction_policy("arc", 0x80000000u), std::invalid_argument);
  EXPECT_THROW(make_eviction_policy("probation", 0), std::invalid_argument);
  EXPECT_THROW(make_eviction_policy("probation", 0x80000000u), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------- ARC

using List = ARCEvictionPolicy::List;
using Slots = std::vector<std::uint32_t>;

std::string key_of(int i) { return "key" + std::to_string(i); }

/// Ghost hashes of keys, in the given order.
std::vector<std::uint64_t> H(std::initializer_list<const char*> keys) {
  std::vector<std::uint64_t> out;
  for (const char* k : keys) {
    out.push_back(hash_key(k));
  }
  return out;
}

/// Selects `count` victims (all evictable) and erases them as evicted; returns them.
Slots evict(ARCEvictionPolicy& arc, std::size_t count,
            const std::vector<std::string>& key_of_slot) {
  Slots victims;
  arc.select_victims(count, [](std::uint32_t) { return true; }, victims);
  for (const std::uint32_t v : victims) {
    arc.erase(v, key_of_slot[v], true);
  }
  return victims;
}

TEST(ARCEvictionPolicy, NewKeysEnterT1AndTouchPromotesToT2) {
  ARCEvictionPolicy arc(8);
  EXPECT_EQ(arc.name(), "arc");
  EXPECT_EQ(arc.capacity(), 8u);
  for (std::uint32_t s : {3u, 1u, 4u}) {
    arc.insert(s, key_of(static_cast<int>(s)));
  }
  EXPECT_EQ(arc.slots(List::kT1), (Slots{3, 1, 4}));  // least recent first
  EXPECT_TRUE(arc.slots(List::kT2).empty());
  EXPECT_EQ(arc.list_of(1), List::kT1);
  EXPECT_EQ(arc.list_of(0), List::kNone);
  EXPECT_EQ(arc.list_of(99), List::kNone);
  EXPECT_EQ(arc.size(), 3u);
  EXPECT_EQ(arc.target(), 0u);
  arc.touch(1);  // T1 -> T2
  EXPECT_EQ(arc.slots(List::kT1), (Slots{3, 4}));
  EXPECT_EQ(arc.slots(List::kT2), (Slots{1}));
  EXPECT_EQ(arc.list_of(1), List::kT2);
  arc.touch(3);
  arc.touch(1);  // T2 -> most recent of T2
  EXPECT_EQ(arc.slots(List::kT2), (Slots{3, 1}));
  arc.touch(1);  // already the most recent
  EXPECT_EQ(arc.slots(List::kT2), (Slots{3, 1}));
  EXPECT_EQ(arc.t1_size(), 1u);
  EXPECT_EQ(arc.t2_size(), 2u);
  // p = 0 and |T1| = 1 > 0: T1 goes first, then T2 from its least recent end.
  EXPECT_EQ(order(arc), (Slots{4, 3, 1}));
  // A failed store leaves no ghost; an eviction does, in the list matching T1 / T2.
  arc.erase(4, key_of(4), false);
  EXPECT_EQ(arc.ghost_of(key_of(4)), List::kNone);
  arc.erase(3, key_of(3), true);
  EXPECT_EQ(arc.ghost_of(key_of(3)), List::kB2);
  EXPECT_EQ(arc.b2_size(), 1u);
  EXPECT_EQ(arc.b1_size(), 0u);
  EXPECT_FALSE(arc.contains(3));
  EXPECT_EQ(arc.size(), 1u);
}

TEST(ARCEvictionPolicy, GhostHitAdaptsTargetAndInsertsIntoT2) {
  ARCEvictionPolicy arc(4);
  std::vector<std::string> keys = {"a", "b", "c", "d"};
  for (std::uint32_t s = 0; s < 4; ++s) {
    arc.insert(s, keys[s]);
  }
  EXPECT_EQ(evict(arc, 1, keys), (Slots{0}));  // |T1| = 4 > p = 0: T1's least recent
  EXPECT_EQ(arc.ghost_of("a"), List::kB1);
  arc.insert(0, "a");  // B1 hit: p = min(4, 0 + max(1, 0 / 1)) = 1
  EXPECT_EQ(arc.target(), 1u);
  EXPECT_EQ(arc.list_of(0), List::kT2);
  EXPECT_EQ(arc.ghost_of("a"), List::kNone);
  EXPECT_EQ(arc.b1_size(), 0u);
  arc.touch(1);                                    // T1 = [c d], T2 = [a b]
  EXPECT_EQ(evict(arc, 2, keys), (Slots{2, 0}));   // |T1| 2 > 1: c; then |T1| 1 <= 1: a
  EXPECT_EQ(arc.ghosts(List::kB1), H({"c"}));
  EXPECT_EQ(arc.ghosts(List::kB2), H({"a"}));
  arc.insert(0, "a");  // B2 hit: p = max(0, 1 - max(1, 1 / 1)) = 0
  EXPECT_EQ(arc.target(), 0u);
  EXPECT_EQ(arc.slots(List::kT2), (Slots{1, 0}));
  EXPECT_EQ(arc.ghosts(List::kB2), H({}));
}

TEST(ARCEvictionPolicy, TargetMovesByGhostListRatio) {
  ARCEvictionPolicy arc(4);
  std::vector<std::string> keys = {"k0", "k1", "k2", "k3"};
  for (std::uint32_t s = 0; s < 4; ++s) {
    arc.insert(s, keys[s]);
    arc.touch(s);
  }
  EXPECT_EQ(evict(arc, 3, keys), (Slots{0, 1, 2}));  // T1 empty: T2's least recent
  EXPECT_EQ(arc.ghosts(List::kB2), H({"k0", "k1", "k2"}));
  keys[0] = "x";
  arc.insert(0, "x");
  EXPECT_EQ(evict(arc, 1, keys), (Slots{0}));  // |T1| 1 > 0
  EXPECT_EQ(arc.ghost_of("x"), List::kB1);
  arc.insert(0, "x");  // B1 hit with |B2| / |B1| = 3 / 1: p = 3
  EXPECT_EQ(arc.target(), 3u);
  arc.insert(1, "k0");  // B2 hit with |B1| / |B2| = 0 / 3: p = 3 - 1
  EXPECT_EQ(arc.target(), 2u);
  EXPECT_EQ(arc.slots(List::kT2), (Slots{3, 0, 1}));
}

TEST(ARCEvictionPolicy, TargetIsClampedToZeroAndCapacity) {
  ARCEvictionPolicy arc(2);
  std::vector<std::string> keys = {"a", "b"};
  arc.insert(0, "a");
  arc.insert(1, "b");
  arc.touch(0);
  arc.touch(1);
  EXPECT_EQ(evict(arc, 2, keys), (Slots{0, 1}));  // B2 = [a b]
  arc.insert(0, "a");                              // B2 hit at p = 0: stays 0
  EXPECT_EQ(arc.target(), 0u);
  keys[1] = "c";
  arc.insert(1, "c");
  EXPECT_EQ(evict(arc, 1, keys), (Slots{1}));  // |T1| 1 > 0: c -> B1
  arc.insert(1, "c");                          // B1 hit: p = 0 + max(1, 1 / 1) = 1
  EXPECT_EQ(arc.target(), 1u);
  EXPECT_EQ(evict(arc, 2, keys), (Slots{0, 1}));  // T1 empty: T2 = [a c]
  EXPECT_EQ(arc.ghosts(List::kB2), H({"b", "a", "c"}));
  keys[0] = "x";
  arc.insert(0, "x");
  EXPECT_EQ(evict(arc, 1, keys), (Slots{0}));  // |T1| 1 <= p, T2 empty: T1 after all
  arc.insert(0, "x");                          // B1 hit: p = min(2, 1 + max(1, 3 / 1)) = 2
  EXPECT_EQ(arc.target(), 2u);
}

TEST(ARCEvictionPolicy, SelectVictimsSkipsNonEvictableAndChangesNothing) {
  ARCEvictionPolicy arc(8);
  for (std::uint32_t s = 0; s < 5; ++s) {
    arc.insert(s, key_of(static_cast<int>(s)));
  }
  arc.touch(3);
  arc.touch(4);  // T1 = [0 1 2], T2 = [3 4], p = 0
  Slots out;
  const auto not_0_or_3 = [](std::uint32_t s) { return s != 0 && s != 3; };
  // T1 while |T1| (counting the skipped slot 0) > 0; T1 has nothing evictable left after 1, 2
  // although |T1| = 1 > p, so T2, skipping 3.
  EXPECT_EQ(arc.select_victims(3, not_0_or_3, out), 3u);
  EXPECT_EQ(out, (Slots{1, 2, 4}));
  out.clear();
  EXPECT_EQ(arc.select_victims(8, not_0_or_3, out), 3u);  // only three evictable slots
  EXPECT_EQ(out, (Slots{1, 2, 4}));
  out.clear();
  EXPECT_EQ(arc.select_victims(0, not_0_or_3, out), 0u);
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(arc.slots(List::kT1), (Slots{0, 1, 2}));
  EXPECT_EQ(arc.slots(List::kT2), (Slots{3, 4}));
  EXPECT_EQ(arc.size(), 5u);
  EXPECT_EQ(arc.b1_size() + arc.b2_size(), 0u);
  // Examines each slot at most once.
  std::vector<int> calls(8, 0);
  const auto counting = [&](std::uint32_t s) {
    ++calls[s];
    return s != 0 && s != 3;
  };
  EXPECT_EQ(arc.select_victims(5, counting, out), 3u);
  for (const int c : calls) {
    EXPECT_LE(c, 1);
  }
}

TEST(ARCEvictionPolicy, SelectVictimsFallsBackToT1WhenT2HasNothingEvictable) {
  ARCEvictionPolicy arc(4);
  std::vector<std::string> keys = {"a", "b", "c", "d"};
  for (std::uint32_t s = 0; s < 4; ++s) {
    arc.insert(s, keys[s]);
  }
  EXPECT_EQ(evict(arc, 1, keys), (Slots{0}));
  arc.insert(0, "a");  // B1 hit: p = 1; T1 = [b c d], T2 = [a]
  Slots out;
  const auto not_0 = [](std::uint32_t s) { return s != 0; };
  // |T1| 3 > 1: b; 2 > 1: c; 1 <= 1: T2, but a is not evictable: T1 again, d.
  EXPECT_EQ(arc.select_victims(3, not_0, out), 3u);
  EXPECT_EQ(out, (Slots{1, 2, 3}));
  out.clear();
  EXPECT_EQ(arc.select_victims(4, [](std::uint32_t) { return true; }, out), 4u);
  EXPECT_EQ(out, (Slots{1, 2, 0, 3}));
}

TEST(ARCEvictionPolicy, GhostListsAreBounded) {
  // |T1| + |B1| <= c: a scan of new keys keeps at most c - |T1| ghosts in B1.
  {
    ARCEvictionPolicy arc(3);
    std::vector<std::string> keys(3);
    for (int i = 0; i < 50; ++i) {
      std::uint32_t slot = static_cast<std::uint32_t>(i % 3);
      if (i >= 3) {
        EXPECT_EQ(evict(arc, 1, keys), (Slots{slot}));
      }
      keys[slot] = key_of(i);
      arc.insert(slot, keys[slot]);
      EXPECT_LE(arc.t1_size() + arc.b1_size(), 3u);
    }
    EXPECT_EQ(arc.b1_size(), 0u);  // |T1| = 3 = c leaves no room for B1
    EXPECT_EQ(arc.ghost_of(key_of(45)), List::kNone);
  }
  // |T1| + |T2| + |B1| + |B2| <= 2c: a full ghost store drops B2's least recent for a new key.
  {
    ARCEvictionPolicy arc(2);
    std::vector<std::string> keys = {"a", "b"};
    arc.insert(0, "a");
    arc.insert(1, "b");
    arc.touch(0);
    arc.touch(1);
    EXPECT_EQ(evict(arc, 2, keys), (Slots{0, 1}));
    EXPECT_EQ(arc.ghosts(List::kB2), H({"a", "b"}));
    keys = {"c", "d"};
    arc.insert(0, "c");
    arc.insert(1, "d");
    EXPECT_EQ(evict(arc, 2, keys), (Slots{0, 1}));  // |T1| > 0
    EXPECT_EQ(arc.ghosts(List::kB1), H({"c", "d"}));
    EXPECT_EQ(arc.b1_size() + arc.b2_size(), 4u);  // 2c ghosts, nothing resident
    arc.insert(0, "e");                            // |T1| + |B1| = 2 >= c: drop c from B1
    EXPECT_EQ(arc.ghosts(List::kB1), H({"d"}));
    EXPECT_EQ(arc.ghosts(List::kB2), H({"a", "b"}));
    arc.touch(0);        // T2 = [e]: |T2| + |B1| + |B2| = 4 = 2c
    arc.insert(1, "x");  // |T1| + |B1| = 1 < c, but the total is full: drop B2's least recent
    EXPECT_EQ(arc.ghost_of("a"), List::kNone);
    EXPECT_EQ(arc.ghosts(List::kB2), H({"b"}));
    EXPECT_EQ(arc.ghosts(List::kB1), H({"d"}));
    EXPECT_EQ(arc.slots(List::kT1), (Slots{1}));
    EXPECT_EQ(arc.slots(List::kT2), (Slots{0}));
    EXPECT_EQ(arc.size() + arc.b1_size() + arc.b2_size(), 4u);
  }
}

TEST(ARCEvictionPolicy, MisuseThrowsAndChangesNothing) {
  ARCEvictionPolicy arc(2);
  arc.insert(0, "k");
  EXPECT_THROW(arc.insert(0, "k"), std::invalid_argument);
  EXPECT_THROW(arc.insert(2, "k"), std::out_of_range);
  EXPECT_THROW(arc.touch(1), std::invalid_argument);
  EXPECT_THROW(arc.erase(1, "k", true), std::invalid_argument);
  EXPECT_THROW(arc.erase(5, "k", true), std::out_of_range);
  EXPECT_THROW(arc.touch(9), std::out_of_range);
  EXPECT_EQ(arc.size(), 1u);
  EXPECT_EQ(arc.slots(List::kT1), (Slots{0}));
  EXPECT_EQ(arc.b1_size() + arc.b2_size(), 0u);
  arc.prefetch(0);
  arc.prefetch(1);   // untracked: fine
  arc.prefetch(77);  // out of range: ignored
  EXPECT_THROW(ARCEvictionPolicy(0), std::invalid_argument);
  EXPECT_THROW(ARCEvictionPolicy(0x80000000u), std::invalid_argument);
  EXPECT_THROW(ARCEvictionPolicy(0xffffffffu), std::invalid_argument);
}

/// A deliberately simple ARC (std::deque, linear searches) following the header's rules:
/// victims are found by erasing them one by one from a copy, the definition select_victims must
/// match.
struct ReferenceARC {
  explicit ReferenceARC(std::size_t capacity) : c(capacity) {}

  std::size_t c;
  std::size_t p = 0;
  std::deque<std::uint32_t> t1, t2;  // least recent first
  std::deque<std::uint64_t> b1, b2;

  static bool remove(std::deque<std::uint32_t>& d, std::uint32_t s) {
    auto it = std::find(d.begin(), d.end(), s);
    if (it == d.end()) {
      return false;
    }
    d.erase(it);
    return true;
  }
  static bool remove_hash(std::deque<std::uint64_t>& d, std::uint64_t h) {
    auto it = std::find(d.begin(), d.end(), h);
    if (it == d.end()) {
      return false;
    }
    d.erase(it);
    return true;
  }

  void insert(std::uint32_t s, const std::string& key) {
    const std::uint64_t h = hash_key(key);
    if (std::find(b1.begin(), b1.end(), h) != b1.end()) {
      p = std::min(c, p + std::max<std::size_t>(1, b2.size() / b1.size()));
      remove_hash(b1, h);
      t2.push_back(s);
    } else if (std::find(b2.begin(), b2.end(), h) != b2.end()) {
      const std::size_t d = std::max<std::size_t>(1, b1.size() / b2.size());
      p = d >= p ? 0 : p - d;
      remove_hash(b2, h);
      t2.push_back(s);
    } else {
      while (t1.size() + b1.size() >= c && !b1.empty()) {
        b1.pop_front();
      }
      while (t1.size() + t2.size() + b1.size() + b2.size() >= 2 * c &&
             !(b1.empty() && b2.empty())) {
        (b2.empty() ? b1 : b2).pop_front();
      }
      t1.push_back(s);
    }
  }
  void touch(std::uint32_t s) {
    if (!remove(t1, s)) {
      remove(t2, s);
    }
    t2.push_back(s);
  }
  void erase(std::uint32_t s, const std::string& key, bool evicted) {
    const bool from_t1 = remove(t1, s);
    if (!from_t1) {
      remove(t2, s);
    }
    if (evicted) {
      const std::uint64_t h = hash_key(key);
      if (!remove_hash(b1, h)) {
        remove_hash(b2, h);
      }
      (from_t1 ? b1 : b2).push_back(h);
    }
  }
  template <typename Pred>
  Slots victims(std::size_t count, Pred can_evict, const std::vector<std::string>& keys) const {
    ReferenceARC sim = *this;
    Slots out;
    const auto first = [&](const std::deque<std::uint32_t>& d) -> std::int64_t {
      for (const std::uint32_t s : d) {
        if (can_evict(s)) {
          return s;
        }
      }
      return -1;
    };
    while (out.size() < count) {
      const bool t1_first = sim.t1.size() > sim.p;
      std::int64_t v = first(t1_first ? sim.t1 : sim.t2);
      if (v < 0) {
        v = first(t1_first ? sim.t2 : sim.t1);
      }
      if (v < 0) {
        break;
      }
      const auto s = static_cast<std::uint32_t>(v);
      sim.erase(s, keys[s], true);
      out.push_back(s);
    }
    return out;
  }
};

void expect_same(const ARCEvictionPolicy& arc, const ReferenceARC& ref, int step) {
  ASSERT_EQ(arc.target(), ref.p) << "step " << step;
  ASSERT_EQ(arc.slots(List::kT1), Slots(ref.t1.begin(), ref.t1.end())) << "step " << step;
  ASSERT_EQ(arc.slots(List::kT2), Slots(ref.t2.begin(), ref.t2.end())) << "step " << step;
  ASSERT_EQ(arc.ghosts(List::kB1), std::vector<std::uint64_t>(ref.b1.begin(), ref.b1.end()))
      << "step " << step;
  ASSERT_EQ(arc.ghosts(List::kB2), std::vector<std::uint64_t>(ref.b2.begin(), ref.b2.end()))
      << "step " << step;
  ASSERT_EQ(arc.t1_size(), ref.t1.size());
  ASSERT_EQ(arc.t2_size(), ref.t2.size());
  ASSERT_EQ(arc.b1_size(), ref.b1.size());
  ASSERT_EQ(arc.b2_size(), ref.b2.size());
  ASSERT_EQ(arc.size(), ref.t1.size() + ref.t2.size());
  ASSERT_LE(arc.t1_size() + arc.b1_size(), ref.c) << "step " << step;
  ASSERT_LE(arc.size() + arc.b1_size() + arc.b2_size(), 2 * ref.c) << "step " << step;
}

// Random operation sequences: select_victims returns exactly what sequential erase calls
// evict (the reference's definition), and insert/touch/erase/ghost bookkeeping agree.
TEST(ARCEvictionPolicy, MatchesReferenceOnRandomSequences) {
  std::mt19937 rng(12345);
  for (const std::uint32_t capacity : {1u, 2u, 3u, 5u, 8u, 16u, 64u}) {
    for (int run = 0; run < 20; ++run) {
      ARCEvictionPolicy arc(capacity);
      ReferenceARC ref(capacity);
      std::vector<std::string> key_of_slot(capacity);
      const int universe = static_cast<int>(capacity) * 3 + 2;  // keys come back as ghost hits
      for (int step = 0; step < 400; ++step) {
        Slots tracked, free;
        for (std::uint32_t s = 0; s < capacity; ++s) {
          (arc.contains(s) ? tracked : free).push_back(s);
        }
        const unsigned op = rng() % 10;
        if (op < 4 && !free.empty()) {  // insert a key that is not resident
          const std::uint32_t s = free[rng() % free.size()];
          std::string key;
          do {
            key = key_of(static_cast<int>(rng() % universe));
          } while (std::find(key_of_slot.begin(), key_of_slot.end(), key) != key_of_slot.end());
          key_of_slot[s] = key;
          arc.insert(s, key);
          ref.insert(s, key);
        } else if (op < 6 && !tracked.empty()) {
          const std::uint32_t s = tracked[rng() % tracked.size()];
          arc.touch(s);
          ref.touch(s);
        } else if (op < 7 && !tracked.empty()) {  // a failed store or an eviction by hand
          const std::uint32_t s = tracked[rng() % tracked.size()];
          const bool evicted = rng() % 2 == 0;
          arc.erase(s, key_of_slot[s], evicted);
          ref.erase(s, key_of_slot[s], evicted);
          key_of_slot[s].clear();
        } else {  // select victims under a random mask, then evict them
          const std::uint32_t mask = rng();
          const auto can_evict = [mask](std::uint32_t s) { return ((mask >> (s % 32)) & 1) != 0; };
          const std::size_t count = rng() % (capacity + 2);
          Slots got;
          const std::size_t n = arc.select_victims(count, can_evict, got);
          const Slots want = ref.victims(count, can_evict, key_of_slot);
          ASSERT_EQ(got, want) << "capacity " << capacity << " run " << run << " step " << step;
          ASSERT_EQ(n, got.size());
          expect_same(arc, ref, step);  // select_victims changed nothing
          for (const std::uint32_t v : got) {
            arc.erase(v, key_of_slot[v], true);
            ref.erase(v, key_of_slot[v], true);
            key_of_slot[v].clear();
          }
        }
        expect_same(arc, ref, step);
        if (HasFatalFailure()) {
          return;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvoff
