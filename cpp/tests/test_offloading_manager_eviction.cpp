// CPUOffloadingManager under churn and by eviction policy: bookkeeping at scale, the
// invariant-6/8 cases with "arc", prefetch hints that must not change decisions, and touch
// with reuse flags.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <new>
#include <thread>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kvoff/offloading_manager.h"

#if defined(__linux__)
#include <sys/resource.h>
#endif

#include "manager_test_util.h"

namespace kvoff {
namespace {

using namespace manager_test;  // the shared helpers (manager_test_util.h)

// ------------------------------------------------------------------------ scale

// Heavy churn on a small pool: counters, states and block ids stay consistent with a simple
// reference of which keys are held, and every held key has a distinct slot.
TEST(Manager, ChurnKeepsBookkeepingConsistent) {
  constexpr std::uint32_t kBlocks = 64;
  CPUOffloadingManager m(kBlocks);
  std::unordered_map<std::string, BlockState> ref;
  std::vector<Strings> in_flight;
  std::mt19937 rng(7);
  for (int step = 0; step < 20000; ++step) {
    Strings batch;
    const int n = 1 + static_cast<int>(rng() % 6);
    for (int i = 0; i < n; ++i) {
      batch.push_back("k" + std::to_string(rng() % 300));
    }
    const Keys keys(batch.begin(), batch.end());
    switch (rng() % 4) {
      case 0: {
        auto r = m.prepare_store(keys);
        if (r) {
          for (const std::string& k : str(r->evicted_keys)) {
            ASSERT_EQ(ref.at(k), BlockState::kReady);
            ref.erase(k);
          }
          for (const std::string& k : str(r->keys_to_store)) {
            ASSERT_EQ(ref.count(k), 0u);
            ref[k] = BlockState::kPending;
          }
          in_flight.push_back(str(r->keys_to_store));
        }
        break;
      }
      case 1:
        if (!in_flight.empty()) {
          const bool ok = rng() % 5 != 0;
          const Keys done(in_flight.back().begin(), in_flight.back().end());
          m.complete_store(done, ok);
          for (auto k : done) {
            if (ok) {
              ref[std::string(k)] = BlockState::kReady;
            } else {
              ref.erase(std::string(k));
            }
          }
          in_flight.pop_back();
        }
        break;
      case 2:
        m.touch(keys);
        break;
      default: {
        std::size_t expect = 0;
        bool retry = false;
        for (auto k : keys) {
          auto it = ref.find(std::string(k));
          if (it == ref.end()) {
            break;
          }
          if (it->second == BlockState::kPending) {
            retry = true;
            break;
          }
          ++expect;
        }
        const auto got = m.lookup(keys);
        if (retry) {
          ASSERT_FALSE(got.has_value());
        } else {
          ASSERT_EQ(got, expect);
        }
      }
    }
    ASSERT_EQ(m.num_free_blocks() + m.num_stored_blocks() + m.num_pending_blocks(), kBlocks);
    ASSERT_EQ(m.num_stored_blocks() + m.num_pending_blocks(), ref.size());
  }
  std::unordered_set<std::uint32_t> slots;
  for (const auto& [k, st] : ref) {
    ASSERT_EQ(m.state(k), st);
    auto id = m.block_id(k);
    ASSERT_TRUE(id.has_value());
    ASSERT_TRUE(slots.insert(*id).second) << "slot " << *id << " held twice";
  }
}

// ------------------------------------------------------------------------ ARC policy

// The invariant-6 and invariant-8 cases above, with eviction_policy "arc". Eviction order is
// checked with one prepare_store of several fresh keys (drain() would insert fresh keys into
// ARC's T1 between evictions and so change what goes next).

TEST(ARCManager, PolicyNameAndUnknownPolicyListsBoth) {
  CPUOffloadingManager m(4, "arc");
  EXPECT_EQ(m.eviction_policy_name(), "arc");
  try {
    CPUOffloadingManager bad(4, "arc-typo");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'lru', 'arc'"), std::string::npos) << e.what();
  }
}

TEST(ARCManager, PrepareStoreAllOrNothing) {
  CPUOffloadingManager m(4, "arc", true);
  store(m, K({"d"}));
  store(m, K({"c"}));
  store(m, K({"b"}));
  store(m, K({"a"}));  // T1 (least recent first): d c b a
  m.prepare_load(K({"a"}));
  (void)m.take_events();
  const Keys all = K({"a", "b", "c", "d", "e", "f", "g", "h"});
  const Snapshot before = snap(m, all);
  EXPECT_FALSE(m.prepare_store(K({"e", "f", "g", "h"})).has_value());  // 3 evictable < 4
  EXPECT_EQ(snap(m, all), before);
  EXPECT_TRUE(m.take_events().empty());
  auto r = m.prepare_store(K({"e", "f", "g"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(str(r->evicted_keys), S({"d", "c", "b"}));  // order unchanged by the refusal
}

TEST(ARCManager, ProtectedPendingAndPinnedBlocksAreNotEvicted) {
  CPUOffloadingManager m(3, "arc", true);
  store(m, K({"a", "b"}));
  ASSERT_TRUE(m.prepare_store(K({"p"})));
  const Keys all = K({"a", "b", "p", "x"});
  const Snapshot before = snap(m, all);
  EXPECT_FALSE(m.prepare_store(K({"a", "b", "x"})).has_value());  // a, b protected; p pending
  EXPECT_FALSE(m.prepare_store(K({"x", "y", "z"})).has_value());  // needs 3, 2 evictable
  EXPECT_EQ(snap(m, all), before);
  m.complete_store(K({"p"}));
  m.touch(K({"b"}));  // T1 (least recent first) = [a p], T2 = [b]
  m.prepare_load(K({"a"}));
  auto r = m.prepare_store(K({"p", "x"}));  // a pinned, p protected: T1 has none, so T2's b
  ASSERT_TRUE(r);
  EXPECT_EQ(str(r->evicted_keys), S({"b"}));
  EXPECT_EQ(m.state("a"), BlockState::kReady);
  EXPECT_EQ(m.state("p"), BlockState::kReady);
}

TEST(ARCManager, KeysOfOneCallAreNotEvictedForEachOther) {
  CPUOffloadingManager m(3, "arc");
  store(m, K({"a"}));
  store(m, K({"b"}));
  store(m, K({"c"}));  // T1: a b c
  auto r = m.prepare_store(K({"a", "d"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(str(r->keys_to_store), S({"d"}));
  EXPECT_EQ(str(r->evicted_keys), S({"b"}));
  EXPECT_EQ(m.state("a"), BlockState::kReady);
}

TEST(ARCManager, TouchLastToFirstEvictsTailFirst) {
  CPUOffloadingManager m(3, "arc");
  store(m, K({"c", "b", "a"}));  // T1: a b c
  m.touch(K({"a", "b", "c"}));   // T2: c b a (a most recent)
  auto r = m.prepare_store(K({"x", "y", "z"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(str(r->evicted_keys), S({"c", "b", "a"}));
}

TEST(ARCManager, PrepareStoreMakesFirstKeyMostRecent) {
  CPUOffloadingManager m(3, "arc");
  store(m, K({"a", "b", "c"}));  // T1: c b a
  auto r = m.prepare_store(K({"x", "y", "z"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(str(r->evicted_keys), S({"c", "b", "a"}));
}

// What makes ARC differ from LRU through the manager: a scan of one-time keys does not flush
// blocks used twice, and a key evicted from T1 that comes back enters T2.
TEST(ARCManager, ScanDoesNotFlushFrequentBlocks) {
  for (const char* policy : {"lru", "arc"}) {
    CPUOffloadingManager m(4, policy);
    store(m, K({"a", "b"}));
    m.touch(K({"a", "b"}));
    for (int i = 0; i < 10; ++i) {
      store(m, Keys{"scan" + std::to_string(i)});
    }
    const bool kept = m.lookup(K({"a", "b"})) == 2u;
    EXPECT_EQ(kept, std::string(policy) == "arc") << policy;
  }
}

// Heavy churn with loads: evicted keys were ready, unpinned and not keys of the call, and the
// bookkeeping stays consistent, as in Manager.ChurnKeepsBookkeepingConsistent.
TEST(ARCManager, ChurnKeepsBookkeepingConsistent) {
  constexpr std::uint32_t kBlocks = 32;
  CPUOffloadingManager m(kBlocks, "arc");
  std::unordered_map<std::string, BlockState> ref;
  std::unordered_map<std::string, int> pins;
  std::vector<Strings> stores, loads;
  std::mt19937 rng(11);
  for (int step = 0; step < 20000; ++step) {
    Strings batch;
    const int n = 1 + static_cast<int>(rng() % 6);
    for (int i = 0; i < n; ++i) {
      std::string key = "k";  // not "k" + ...: GCC 12 -Wrestrict false positive
      key += std::to_string(rng() % 100);
      batch.push_back(std::move(key));
    }
    const Keys keys(batch.begin(), batch.end());
    switch (rng() % 6) {
      case 0:
      case 1: {
        auto r = m.prepare_store(keys);
        if (r) {
          for (const std::string& k : str(r->evicted_keys)) {
            ASSERT_EQ(ref.at(k), BlockState::kReady);
            ASSERT_EQ(pins[k], 0) << k;
            ASSERT_EQ(std::find(batch.begin(), batch.end(), k), batch.end()) << k;
            ref.erase(k);
          }
          for (const std::string& k : str(r->keys_to_store)) {
            ref[k] = BlockState::kPending;
          }
          stores.push_back(str(r->keys_to_store));
        }
        break;
      }
      case 2:
        if (!stores.empty()) {
          const bool ok = rng() % 5 != 0;
          const Keys done(stores.back().begin(), stores.back().end());
          m.complete_store(done, ok);
          for (auto k : done) {
            if (ok) {
              ref[std::string(k)] = BlockState::kReady;
            } else {
              ref.erase(std::string(k));
            }
          }
          stores.pop_back();
        }
        break;
      case 3:
        m.touch(keys);
        break;
      case 4: {
        const auto hits = m.lookup(keys);
        if (hits && *hits > 0 && loads.size() < 4) {
          Strings load(batch.begin(), batch.begin() + static_cast<std::ptrdiff_t>(*hits));
          m.prepare_load(Keys(load.begin(), load.end()));
          for (const auto& k : load) {
            ++pins[k];
          }
          loads.push_back(load);
        }
        break;
      }
      default:
        if (!loads.empty()) {
          const Strings load = loads.front();
          m.complete_load(Keys(load.begin(), load.end()));
          for (const auto& k : load) {
            --pins[k];
          }
          loads.erase(loads.begin());
        }
    }
    ASSERT_EQ(m.num_free_blocks() + m.num_stored_blocks() + m.num_pending_blocks(), kBlocks);
    ASSERT_EQ(m.num_stored_blocks() + m.num_pending_blocks(), ref.size());
  }
  for (const auto& [k, st] : ref) {
    ASSERT_EQ(m.state(k), st);
    ASSERT_EQ(m.pin_count(k), static_cast<std::uint32_t>(pins[k]));
  }
}

// ------------------------------------------------------- prefetch hints do not change decisions

TEST(ManagerPrefetch, LongRunMatchesAReferenceLRUWhileTheRecencyLogWraps) {
  // The manager's recency log (a prefetch hint, >= 1024 entries) wraps many times here; victims,
  // their order and the keys stored must still be exactly LRU's (a vector model, front = least
  // recently used).
  constexpr std::size_t kSlots = 6;
  CPUOffloadingManager m(kSlots);
  Strings lru;
  const auto index_of = [](const Strings& v, const std::string& k) {
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (v[i] == k) {
        return i;
      }
    }
    return v.size();
  };
  std::mt19937 rng(11);
  for (int step = 0; step < 20000; ++step) {
    Strings keys;
    const int n = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < n; ++i) {
      keys.push_back("k" + std::to_string(rng() % 15));
    }
    const Keys views(keys.begin(), keys.end());
    if (rng() % 3 == 0) {
      m.touch(views);
      for (auto it = keys.rbegin(); it != keys.rend(); ++it) {
        const std::size_t at = index_of(lru, *it);
        if (at != lru.size()) {
          lru.erase(lru.begin() + static_cast<std::ptrdiff_t>(at));
          lru.push_back(*it);
        }
      }
      continue;
    }
    Strings fresh;
    for (const auto& k : keys) {
      if (index_of(lru, k) == lru.size() && index_of(fresh, k) == fresh.size()) {
        fresh.push_back(k);
      }
    }
    Strings victims;
    std::size_t to_evict = lru.size() + fresh.size() > kSlots ? lru.size() + fresh.size() - kSlots
                                                               : 0;
    for (const auto& k : lru) {
      if (to_evict > 0 && index_of(keys, k) == keys.size()) {
        victims.push_back(k);
        --to_evict;
      }
    }
    auto r = m.prepare_store(views);
    if (to_evict > 0) {
      ASSERT_FALSE(r.has_value()) << step;
      continue;
    }
    ASSERT_TRUE(r.has_value()) << step;
    ASSERT_EQ(str(r->evicted_keys), victims) << step;
    ASSERT_EQ(str(r->keys_to_store), fresh) << step;
    for (const auto& k : victims) {
      lru.erase(lru.begin() + static_cast<std::ptrdiff_t>(index_of(lru, k)));
    }
    for (auto it = fresh.rbegin(); it != fresh.rend(); ++it) {
      lru.push_back(*it);
    }
    m.complete_store(Keys(fresh.begin(), fresh.end()), true);
  }
  EXPECT_EQ(m.num_stored_blocks(), lru.size());
}

// ----------------------------------------------- touch with reuse flags (a request's accesses)

/// ARC evicts T1 (blocks seen once) before T2 (reused blocks): A survives three more stores
/// into a pool of 3 only if its touch counted as a reuse.
bool survives_arc_after_touch(std::uint8_t reused) {
  CPUOffloadingManager m(3, "arc");
  for (const char* k : {"A", "B", "C"}) store(m, Keys{k});
  const std::uint8_t flags[] = {reused};
  m.touch(Keys{"A"}, flags);
  for (const char* k : {"D", "E", "F"}) store(m, Keys{k});
  return m.state("A") == BlockState::kReady;
}

TEST(ManagerTouchReused, OnlyAFlaggedUseIsAReuse) {
  EXPECT_TRUE(survives_arc_after_touch(1));   // promoted to T2 by the reuse
  EXPECT_FALSE(survives_arc_after_touch(0));  // ordered in T1, evicted with the others
}

TEST(ManagerTouchReused, KeysEndInPrefixOrderWhateverTheirFlags) {
  CPUOffloadingManager m(4, "lru");
  for (const char* k : {"h", "m", "t", "x"}) store(m, Keys{k});
  const std::uint8_t flags[] = {0, 1, 0};
  m.touch(K({"h", "m", "t"}), flags);  // h ends the most recent, t the least of the three
  EXPECT_EQ(drain(m, 4), S({"x", "t", "m", "h"}));
}

TEST(ManagerTouchReused, PendingKeysAreOrderedNeverReused) {
  CPUOffloadingManager m(2, "arc");
  auto r = m.prepare_store(Keys{"A"});
  ASSERT_TRUE(r.has_value());
  const std::uint8_t flags[] = {1};
  m.touch(Keys{"A"}, flags);  // pending: its own request stores it, no reuse
  m.complete_store(Keys{"A"});
  store(m, Keys{"B"});
  EXPECT_EQ(drain(m, 1), S({"A"}));  // both in T1: the least recent goes first
}

TEST(ManagerTouchReused, AFlagCountOtherThanTheKeysIsRefusedAndChangesNothing) {
  CPUOffloadingManager m(2, "lru");
  for (const char* k : {"a", "b"}) store(m, Keys{k});
  const std::uint8_t flags[] = {1};
  try {
    m.touch(K({"a", "b"}), flags);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("1 reuse flags for 2 keys"), std::string::npos);
  }
  EXPECT_EQ(drain(m, 2), S({"a", "b"}));  // b was stored last: a is still the least recent
}

}  // namespace
}  // namespace kvoff
