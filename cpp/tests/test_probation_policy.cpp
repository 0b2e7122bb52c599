// ProbationEvictionPolicy: lists, second sight, the budget, ghosts, victim selection (LRU within
// the budget, probation first beyond it), prefix order, and a reference model on random
// operation sequences.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvoff/eviction_policy.h"

namespace kvoff {
namespace {

using P = ProbationEvictionPolicy;
using List = P::List;
using Slots = std::vector<std::uint32_t>;

Slots victims(const EvictionPolicy& p, std::size_t count) {
  Slots out;
  p.select_victims(count, [](std::uint32_t) { return true; }, out);
  return out;
}

/// Evicts `slot` (key `key`) as select_victims's caller would.
void evict(P& p, std::uint32_t slot, const std::string& key) { p.erase(slot, key, true); }

TEST(ProbationEvictionPolicy, NewKeysEnterProbationTouchPromotesTouchPendingOrders) {
  P p(8);
  EXPECT_EQ(p.name(), "probation");
  EXPECT_EQ(p.budget(), 8u);  // starts as LRU
  for (std::uint32_t s : {3u, 1u, 4u, 5u}) {
    p.insert(s, "k" + std::to_string(s));
  }
  EXPECT_EQ(p.slots(List::kProbation), (Slots{3, 1, 4, 5}));
  EXPECT_EQ(p.slots(List::kProtected), Slots{});
  p.touch(1);  // a reuse: protected
  EXPECT_EQ(p.list_of(1), List::kProtected);
  EXPECT_EQ(p.slots(List::kProbation), (Slots{3, 4, 5}));
  p.touch_pending(3);  // the request storing it uses it: most recent of probation, not promoted
  EXPECT_EQ(p.list_of(3), List::kProbation);
  EXPECT_EQ(p.slots(List::kProbation), (Slots{4, 5, 3}));
  p.touch_pending(1);  // a protected slot stays protected
  EXPECT_EQ(p.list_of(1), List::kProtected);
  EXPECT_EQ(p.size(), 4u);
  EXPECT_EQ(p.probation_size(), 3u);
  EXPECT_EQ(p.protected_size(), 1u);
  // Within the budget the victims are LRU's over both lists: 4 5 3 (probation), then 1.
  EXPECT_EQ(victims(p, 4), (Slots{4, 5, 3, 1}));
  EXPECT_EQ(p.size(), 4u);  // select_victims changed nothing
}

TEST(ProbationEvictionPolicy, DerivedConstants) {
  // W = ceil(c / 4), D = ceil(c / W), S = max(1, bit_ceil(c) / 2).
  const std::array<std::array<std::uint32_t, 4>, 6> cases{{
      {1, 1, 1, 1}, {4, 1, 4, 2}, {5, 2, 3, 4}, {8, 2, 4, 4}, {1000, 250, 4, 512},
      {1024, 256, 4, 512},
  }};
  for (const auto& [c, w, d, s] : cases) {
    P p(c);
    EXPECT_EQ(p.window(), w) << c;
    EXPECT_EQ(p.step(), d) << c;
    EXPECT_EQ(p.ghost_sets(), s) << c;
    EXPECT_EQ(P::ghost_sets_for(c), s) << c;
    EXPECT_EQ(p.budget(), c);
  }
}

TEST(ProbationEvictionPolicy, SecondSightAdmitsToProtected) {
  P p(4);
  p.insert(0, "x");
  evict(p, 0, "x");
  EXPECT_EQ(p.ghost_of("x"), (std::pair<List, std::uint32_t>{List::kProbation, 0}));
  p.insert(2, "x");  // stored again: second sight
  EXPECT_EQ(p.list_of(2), List::kProtected);
  EXPECT_EQ(p.ghost_of("x").first, List::kNone);  // the ghost is gone
  EXPECT_EQ(p.budget(), 4u);                        // a probation ghost raises b, clamped at c
  p.insert(1, "y");
  EXPECT_EQ(p.list_of(1), List::kProbation);
}

TEST(ProbationEvictionPolicy, MarginalGhostHitsMoveTheBudget) {
  P p(8);  // W = 2, D = 4
  // A protected ghost younger than W lowers b by D.
  p.insert(0, "a");
  p.touch(0);
  evict(p, 0, "a");
  p.insert(0, "a");
  EXPECT_EQ(p.budget(), 4u);
  EXPECT_EQ(p.list_of(0), List::kProtected);
  evict(p, 0, "a");
  p.insert(0, "a");
  EXPECT_EQ(p.budget(), 0u);
  evict(p, 0, "a");
  p.insert(0, "a");
  EXPECT_EQ(p.budget(), 0u);  // clamped at 0
  // A probation ghost younger than W raises it by D.
  p.insert(1, "b");
  evict(p, 1, "b");
  p.insert(1, "b");
  EXPECT_EQ(p.budget(), 4u);
  // A ghost of age >= W still admits (second sight) but does not move b.
  p.insert(2, "c");
  evict(p, 2, "c");
  for (int i = 0; i < 2; ++i) {  // two more probation evictions: c's ghost is 2 old
    p.insert(3, "f" + std::to_string(i));
    evict(p, 3, "f" + std::to_string(i));
  }
  EXPECT_EQ(p.ghost_of("c"), (std::pair<List, std::uint32_t>{List::kProbation, 2}));
  p.insert(2, "c");
  EXPECT_EQ(p.budget(), 4u);
  EXPECT_EQ(p.list_of(2), List::kProtected);
}

TEST(ProbationEvictionPolicy, ExpiredGhostsAndFailedStoresLeaveNothing) {
  P p(2);  // ghosts expire after 2c = 4 evictions of their list
  p.insert(0, "x");
  evict(p, 0, "x");
  for (int i = 0; i < 4; ++i) {
    p.insert(1, "f" + std::to_string(i));
    evict(p, 1, "f" + std::to_string(i));
  }
  EXPECT_EQ(p.ghost_of("x").first, List::kNone);
  p.insert(0, "x");
  EXPECT_EQ(p.list_of(0), List::kProbation);  // no second sight
  EXPECT_EQ(p.budget(), 2u);
  p.erase(0, "x", /*evicted=*/false);  // a failed store: no ghost
  EXPECT_EQ(p.ghost_of("x").first, List::kNone);
  p.insert(0, "x");
  EXPECT_EQ(p.list_of(0), List::kProbation);
}

TEST(ProbationEvictionPolicy, OverBudgetProbationLeavesFirst) {
  P p(4);  // W = 1, D = 4: one marginal protected ghost hit takes b from 4 to 0
  p.insert(0, "a");
  p.touch(0);  // protected, oldest stamp below
  p.insert(1, "b");
  p.insert(2, "c");
  EXPECT_EQ(victims(p, 3), (Slots{0, 1, 2}));  // within budget: global LRU
  p.insert(3, "d");
  p.touch(3);
  evict(p, 3, "d");
  p.insert(3, "d");  // protected ghost hit
  EXPECT_EQ(p.budget(), 0u);
  // |probation| = 2 > b = 0: b and c go first although a is older; then a, then d.
  EXPECT_EQ(victims(p, 4), (Slots{1, 2, 0, 3}));
}

TEST(ProbationEvictionPolicy, BudgetBoundsTheProbationVictims) {
  P p(8);  // W = 2, D = 4
  for (std::uint32_t s = 0; s < 4; ++s) {
    p.insert(s, "old" + std::to_string(s));
    p.touch(s);  // protected 0 1 2 3 (oldest first)
  }
  for (std::uint32_t s = 4; s < 8; ++s) {
    p.insert(s, "new" + std::to_string(s));  // probation 4 5 6 7
  }
  // b = 8: global LRU.
  EXPECT_EQ(victims(p, 8), (Slots{0, 1, 2, 3, 4, 5, 6, 7}));
  // b = 4 after one protected ghost hit: |probation| = 4 is not above it: still global LRU.
  evict(p, 3, "old3");
  p.insert(3, "old3");
  EXPECT_EQ(p.budget(), 4u);
  EXPECT_EQ(p.list_of(3), List::kProtected);
  EXPECT_EQ(victims(p, 8), (Slots{0, 1, 2, 4, 5, 6, 7, 3}));
  // b = 0: all of probation first, then protected.
  evict(p, 3, "old3");
  p.insert(3, "old3");
  EXPECT_EQ(p.budget(), 0u);
  EXPECT_EQ(victims(p, 8), (Slots{4, 5, 6, 7, 0, 1, 2, 3}));
  // b = 4 again after a probation ghost hit, with 5 probation slots: only the one beyond the
  // budget leaves first (the least recent of probation), then global LRU.
  evict(p, 7, "new7");
  p.insert(7, "new7");  // second sight: protected, b = 4
  EXPECT_EQ(p.budget(), 4u);
  p.erase(0, "old0", false);  // failed stores: no ghosts, b unchanged
  p.erase(1, "old1", false);
  p.insert(0, "n0");
  p.insert(1, "n1");
  EXPECT_EQ(p.budget(), 4u);
  EXPECT_EQ(p.slots(List::kProbation), (Slots{4, 5, 6, 0, 1}));
  EXPECT_EQ(p.slots(List::kProtected), (Slots{2, 3, 7}));
  // 4 leaves first (probation is one over b), then global LRU: 2 is older than 5.
  EXPECT_EQ(victims(p, 8), (Slots{4, 2, 5, 6, 3, 7, 0, 1}));
}

TEST(ProbationEvictionPolicy, SelectVictimsSkipsNonEvictableAndChangesNothing) {
  P p(6);
  for (std::uint32_t s = 0; s < 6; ++s) {
    p.insert(s, "k" + std::to_string(s));
  }
  p.touch(0);
  p.touch(1);
  const Slots before_p = p.slots(List::kProbation);
  const Slots before_r = p.slots(List::kProtected);
  Slots out;
  const auto odd = [](std::uint32_t s) { return s % 2 == 1; };
  EXPECT_EQ(p.select_victims(10, odd, out), 3u);
  EXPECT_EQ(out, (Slots{3, 5, 1}));  // LRU order over both lists, even slots skipped
  EXPECT_EQ(p.slots(List::kProbation), before_p);
  EXPECT_EQ(p.slots(List::kProtected), before_r);
  out.clear();
  EXPECT_EQ(p.select_victims(0, odd, out), 0u);
  EXPECT_TRUE(out.empty());
}

TEST(ProbationEvictionPolicy, PrefixTailLeavesFirst) {
  // docs/design.md invariant 8: keys inserted (or touched) last to first leave tail first, in
  // either list and across them.
  P p(6);
  for (const std::uint32_t s : {2u, 1u, 0u}) {  // a request's blocks 0 1 2, entered 2 1 0
    p.insert(s, "req-a-" + std::to_string(s));
  }
  EXPECT_EQ(victims(p, 3), (Slots{2, 1, 0}));
  for (const std::uint32_t s : {2u, 1u, 0u}) {
    p.touch(s);  // reused, touched last to first
  }
  EXPECT_EQ(p.slots(List::kProtected), (Slots{2, 1, 0}));
  EXPECT_EQ(victims(p, 3), (Slots{2, 1, 0}));
}

TEST(ProbationEvictionPolicy, MisuseThrowsAndChangesNothing) {
  P p(2);
  p.insert(0, "k");
  EXPECT_THROW(p.insert(0, "k"), std::invalid_argument);
  EXPECT_THROW(p.insert(2, "k"), std::out_of_range);
  EXPECT_THROW(p.touch(1), std::invalid_argument);
  EXPECT_THROW(p.touch_pending(1), std::invalid_argument);
  EXPECT_THROW(p.erase(1, "k", true), std::invalid_argument);
  EXPECT_THROW(p.erase(5, "k", true), std::out_of_range);
  EXPECT_THROW(p.touch(9), std::out_of_range);
  EXPECT_THROW(p.touch_pending(9), std::out_of_range);
  EXPECT_EQ(p.size(), 1u);
  EXPECT_EQ(p.slots(List::kProbation), (Slots{0}));
  EXPECT_EQ(p.ghost_of("k").first, List::kNone);
  EXPECT_EQ(p.budget(), 2u);
  p.prefetch(0);
  p.prefetch(1);   // untracked: fine
  p.prefetch(77);  // out of range: ignored
  p.prefetch_evict(77);
  p.prefetch_key(12345);
  EXPECT_THROW(P(0), std::invalid_argument);
  EXPECT_THROW(P(0x80000000u), std::invalid_argument);
}

TEST(ProbationEvictionPolicy, GhostSetsKeepTheNewestEightPerList) {
  const std::uint32_t c = 64;  // 32 sets; the horizon is 128 evictions
  P p(c);
  ASSERT_EQ(p.ghost_sets(), 32u);
  std::vector<std::string> same;  // nine keys of set 5 with distinct tags
  std::vector<std::uint16_t> tags;
  for (int i = 0; same.size() < 9; ++i) {
    const std::string k = "key" + std::to_string(i);
    const std::uint16_t tag = P::ghost_tag_of(k);
    if (P::ghost_set_of(k, c) == 5 && std::find(tags.begin(), tags.end(), tag) == tags.end()) {
      same.push_back(k);
      tags.push_back(tag);
    }
  }
  for (const auto& k : same) {
    p.insert(0, k);
    evict(p, 0, k);
  }
  EXPECT_EQ(p.ghost_of(same[0]).first, List::kNone);  // the oldest was replaced
  for (std::size_t i = 1; i < same.size(); ++i) {
    EXPECT_EQ(p.ghost_of(same[i]),
              (std::pair<List, std::uint32_t>{List::kProbation,
                                               static_cast<std::uint32_t>(same.size() - 1 - i)}))
        << i;
  }
}

// Random operation sequences with fresh keys only (no key is stored twice, so no ghost hit): the
// budget stays at c and every victim list equals LRU's over the same operations.
TEST(ProbationEvictionPolicy, IsLRUWithoutGhostHits) {
  std::mt19937 rng(7);
  for (const std::uint32_t capacity : {1u, 2u, 3u, 8u, 33u}) {
    P p(capacity);
    LRUEvictionPolicy lru(capacity);
    int next_key = 0;
    std::set<std::pair<std::size_t, std::uint16_t>> used;  // (ghost set, tag) of every key
    const auto fresh_key = [&] {  // a key that no earlier key's ghost can stand for
      for (;;) {
        std::string key = "fresh" + std::to_string(next_key++);
        if (used.insert({P::ghost_set_of(key, capacity), P::ghost_tag_of(key)}).second) {
          return key;
        }
      }
    };
    for (int step = 0; step < 2000; ++step) {
      Slots tracked, free;
      for (std::uint32_t s = 0; s < capacity; ++s) {
        (p.contains(s) ? tracked : free).push_back(s);
      }
      const unsigned op = rng() % 8;
      if (op < 3 && !free.empty()) {
        const std::uint32_t s = free[rng() % free.size()];
        const std::string key = fresh_key();
        p.insert(s, key);
        lru.insert(s, key);
      } else if (op < 5 && !tracked.empty()) {
        const std::uint32_t s = tracked[rng() % tracked.size()];
        (rng() % 2 ? p.touch(s) : p.touch_pending(s));
        lru.touch(s);
      } else if (op < 6 && !tracked.empty()) {
        const std::uint32_t s = tracked[rng() % tracked.size()];
        const bool evicted = rng() % 2 == 0;
        p.erase(s, "", evicted);  // the policy keeps each slot's key hash itself
        lru.erase(s, "", evicted);
      } else {
        const std::uint32_t mask = rng();
        const auto can_evict = [mask](std::uint32_t s) { return ((mask >> (s % 32)) & 1) != 0; };
        const std::size_t count = rng() % (capacity + 2);
        Slots got, want;
        p.select_victims(count, can_evict, got);
        lru.select_victims(count, can_evict, want);
        ASSERT_EQ(got, want) << "capacity " << capacity << " step " << step;
      }
      ASSERT_EQ(p.budget(), capacity);
      ASSERT_EQ(p.size(), lru.size());
    }
  }
}

/// A deliberately simple probation policy following the header's rules (std::deque, linear
/// searches, a map of stamps): victims are found by erasing them one by one from a copy, the
/// definition select_victims must match. Ghosts: per set and list eight (tag, eviction number)
/// ways, replaced as the header says (the key's own, else empty, else the oldest; first way on
/// ties), for pools small enough that an eviction epoch is one eviction.
struct ReferenceProbation {
  struct Way {
    std::uint16_t tag = 0;
    std::uint16_t number = 0;
  };
  explicit ReferenceProbation(std::uint32_t c)
      : c(c),
        w((c + 3) / 4),
        d((c + w - 1) / w),
        budget(c),
        sets(P::ghost_sets_for(c)),
        ghosts(sets) {}

  std::uint32_t c, w, d, budget;
  std::size_t sets;
  std::uint64_t clock = 0;
  std::deque<std::uint32_t> probation, protected_;  // least recent first
  std::map<std::uint32_t, std::uint64_t> stamp;
  std::map<std::uint32_t, std::string> key_of;
  std::vector<std::array<std::array<Way, 8>, 2>> ghosts;
  std::uint16_t evictions[2] = {0, 0};

  static bool remove(std::deque<std::uint32_t>& d, std::uint32_t s) {
    auto it = std::find(d.begin(), d.end(), s);
    if (it == d.end()) {
      return false;
    }
    d.erase(it);
    return true;
  }
  void link(std::uint32_t s, bool to_protected) {
    (to_protected ? protected_ : probation).push_back(s);
    stamp[s] = ++clock;
  }
  void insert(std::uint32_t s, const std::string& key) {
    auto& set = ghosts[P::ghost_set_of(key, c)];
    const std::uint16_t tag = P::ghost_tag_of(key);
    bool admit = false;
    for (int l = 0; l < 2; ++l) {
      for (auto& way : set[l]) {
        if (way.tag != tag) {
          continue;
        }
        way.tag = 0;
        const std::uint16_t age = static_cast<std::uint16_t>(evictions[l] - way.number);
        if (age >= 2 * c) {
          continue;
        }
        if (age < w) {
          budget = l == 0 ? std::min(c, budget + d) : (budget > d ? budget - d : 0);
        }
        admit = true;
      }
    }
    key_of[s] = key;
    link(s, admit);
  }
  void touch(std::uint32_t s) {
    if (!remove(probation, s)) {
      remove(protected_, s);
    }
    link(s, true);
  }
  void touch_pending(std::uint32_t s) {
    const bool was_protected = !remove(probation, s);
    if (was_protected) {
      remove(protected_, s);
    }
    link(s, was_protected);
  }
  void erase(std::uint32_t s, bool evicted) {
    const int l = remove(probation, s) ? 0 : 1;
    if (l == 1) {
      remove(protected_, s);
    }
    if (evicted) {
      const std::string& key = key_of[s];
      auto& ways = ghosts[P::ghost_set_of(key, c)][l];
      const std::uint16_t tag = P::ghost_tag_of(key);
      const std::uint16_t now = ++evictions[l];
      std::size_t pick = 0;
      std::uint32_t oldest = 0;
      for (std::size_t i = 0; i < ways.size(); ++i) {
        if (ways[i].tag == tag) {
          pick = i;
          break;
        }
        const std::uint32_t age =
            ways[i].tag == 0 ? 0x10000u : static_cast<std::uint16_t>(now - ways[i].number);
        if (i == 0 || age > oldest) {
          pick = i;
          oldest = age;
        }
      }
      ways[pick] = Way{tag, now};
    }
    stamp.erase(s);
    key_of.erase(s);
  }
  template <typename Pred>
  Slots victims(std::size_t count, Pred can_evict) const {
    ReferenceProbation sim = *this;
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
      const std::int64_t vp = first(sim.probation);
      const std::int64_t vr = first(sim.protected_);
      std::int64_t v = -1;
      if (vp >= 0 && sim.probation.size() > sim.budget) {
        v = vp;
      } else if (vp >= 0 && (vr < 0 || sim.stamp.at(static_cast<std::uint32_t>(vp)) <
                                           sim.stamp.at(static_cast<std::uint32_t>(vr)))) {
        v = vp;
      } else {
        v = vr;
      }
      if (v < 0) {
        break;
      }
      sim.erase(static_cast<std::uint32_t>(v), true);
      out.push_back(static_cast<std::uint32_t>(v));
    }
    return out;
  }
};

void expect_same(const P& p, const ReferenceProbation& ref, int step) {
  ASSERT_EQ(p.budget(), ref.budget) << "step " << step;
  ASSERT_EQ(p.slots(List::kProbation), Slots(ref.probation.begin(), ref.probation.end()))
      << "step " << step;
  ASSERT_EQ(p.slots(List::kProtected), Slots(ref.protected_.begin(), ref.protected_.end()))
      << "step " << step;
  ASSERT_EQ(p.size(), ref.probation.size() + ref.protected_.size());
}

// Random operation sequences over a key universe larger than the pool (evicted keys come back:
// second sight and budget moves both ways): insert/touch/touch_pending/erase bookkeeping and the
// ghosts agree with the reference, and select_victims returns exactly what sequential erase
// calls evict.
TEST(ProbationEvictionPolicy, MatchesReferenceOnRandomSequences) {
  std::mt19937 rng(2024);
  for (const std::uint32_t capacity : {1u, 2u, 3u, 5u, 8u, 16u, 64u}) {
    for (int run = 0; run < 20; ++run) {
      P p(capacity);
      ReferenceProbation ref(capacity);
      std::vector<std::string> key_of_slot(capacity);
      const int universe = static_cast<int>(capacity) * 3 + 2;
      int budget_moves = 0;
      for (int step = 0; step < 400; ++step) {
        Slots tracked, free;
        for (std::uint32_t s = 0; s < capacity; ++s) {
          (p.contains(s) ? tracked : free).push_back(s);
        }
        const std::uint32_t budget_before = p.budget();
        const unsigned op = rng() % 10;
        if (op < 4 && !free.empty()) {  // insert a key that is not resident
          const std::uint32_t s = free[rng() % free.size()];
          std::string key;
          do {
            key = "key" + std::to_string(rng() % universe);
          } while (std::find(key_of_slot.begin(), key_of_slot.end(), key) != key_of_slot.end());
          key_of_slot[s] = key;
          p.insert(s, key);
          ref.insert(s, key);
        } else if (op < 6 && !tracked.empty()) {
          const std::uint32_t s = tracked[rng() % tracked.size()];
          if (rng() % 2 == 0) {
            p.touch(s);
            ref.touch(s);
          } else {
            p.touch_pending(s);
            ref.touch_pending(s);
          }
        } else if (op < 7 && !tracked.empty()) {  // a failed store or an eviction by hand
          const std::uint32_t s = tracked[rng() % tracked.size()];
          const bool evicted = rng() % 2 == 0;
          p.erase(s, key_of_slot[s], evicted);
          ref.erase(s, evicted);
          key_of_slot[s].clear();
        } else {  // select victims under a random mask, then evict them
          const std::uint32_t mask = rng();
          const auto can_evict = [mask](std::uint32_t s) { return ((mask >> (s % 32)) & 1) != 0; };
          const std::size_t count = rng() % (capacity + 2);
          Slots got;
          const std::size_t n = p.select_victims(count, can_evict, got);
          const Slots want = ref.victims(count, can_evict);
          ASSERT_EQ(got, want) << "capacity " << capacity << " run " << run << " step " << step;
          ASSERT_EQ(n, got.size());
          expect_same(p, ref, step);  // select_victims changed nothing
          for (const std::uint32_t v : got) {
            p.erase(v, key_of_slot[v], true);
            ref.erase(v, true);
            key_of_slot[v].clear();
          }
        }
        budget_moves += p.budget() != budget_before ? 1 : 0;
        expect_same(p, ref, step);
        if (HasFatalFailure()) {
          return;
        }
      }
      if (capacity >= 2) {
        EXPECT_GT(budget_moves, 0) << "capacity " << capacity << " run " << run;
      }
    }
  }
}

}  // namespace
}  // namespace kvoff
