// Store admission: the store_threshold filter of CPUOffloadingManager (its AdmissionTracker)
// and of the OffloadingScheduler that owns one. vLLM 0.32's CPUOffloadingManager semantics,
// except where docs/design.md invariants 6 (a refused prepare_store changes nothing, the tracker
// included) and 8 (a prefix's tail leaves before its head) say otherwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvoff/admission_tracker.h"
#include "kvoff/key.h"
#include "kvoff/offloading_manager.h"
#include "kvoff/offloading_scheduler.h"

namespace kvoff {
namespace {

using Keys = std::vector<std::string_view>;
using Strings = std::vector<std::string>;
using U = std::vector<std::uint32_t>;
constexpr std::uint32_t kNoBlock = PrepareStoreResult::kNoBlock;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected std::invalid_argument";
  return "";
}

void expect_names(const std::string& msg, std::initializer_list<std::string_view> parts) {
  for (auto p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
}

Strings str(const std::vector<std::string_view>& keys) {
  return Strings(keys.begin(), keys.end());
}

/// prepare_store + complete_store(success) of what it stored; returns the result.
PrepareStoreResult store(CPUOffloadingManager& m, const Keys& keys) {
  auto r = m.prepare_store(keys);
  EXPECT_TRUE(r.has_value());
  if (!r) return {};
  if (!r->keys_to_store.empty()) m.complete_store(r->keys_to_store);
  return *r;
}

// --------------------------------------------------------------------- AdmissionTracker

/// find_all + record of one call, as the manager makes them.
void offer(AdmissionTracker& t, const Keys& keys) {
  std::vector<std::uint64_t> hashes;
  for (auto k : keys) hashes.push_back(hash_key(k));
  U entries(keys.size());
  t.find_all(keys, hashes.data(), entries.data());
  t.record(keys, hashes.data(), entries);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (entries[i] != AdmissionTracker::kNotTracked) {
      EXPECT_GT(t.count(entries[i]), 0u) << keys[i];
    }
  }
}

TEST(AdmissionTracker, CountsOffersAndForgetsTheLeastRecentlyOfferedTailFirst) {
  AdmissionTracker t(3);
  EXPECT_EQ(t.capacity(), 3u);
  offer(t, {"a", "b", "c"});
  EXPECT_EQ(t.size(), 3u);
  offer(t, {"a"});
  EXPECT_EQ(t.count_of("a"), 2u);
  EXPECT_EQ(t.count_of("b"), 1u);
  // keys[0] of a call ends the most recent: c (the first call's tail) is the least recent
  offer(t, {"d"});
  EXPECT_EQ(t.count_of("c"), 0u);
  EXPECT_EQ(t.count_of("b"), 1u);
  offer(t, {"e"});  // then b
  EXPECT_EQ(t.count_of("b"), 0u);
  EXPECT_EQ(t.count_of("a"), 2u);
  EXPECT_EQ(t.count_of("d"), 1u);
  EXPECT_EQ(t.count_of("e"), 1u);
  EXPECT_EQ(t.size(), 3u);
}

TEST(AdmissionTracker, KeysOfOneCallAreNeverForgottenForEachOther) {
  AdmissionTracker t(2);
  offer(t, {"a", "b"});
  // a and b are keys of the call: the full tracker has no room for c, which stays untracked
  offer(t, {"a", "b", "c"});
  EXPECT_EQ(t.count_of("a"), 2u);
  EXPECT_EQ(t.count_of("b"), 2u);
  EXPECT_EQ(t.count_of("c"), 0u);
  // new keys: the head gets the room
  AdmissionTracker u(2);
  offer(u, {"x", "y", "z"});
  EXPECT_EQ(u.count_of("x"), 1u);
  EXPECT_EQ(u.count_of("y"), 1u);
  EXPECT_EQ(u.count_of("z"), 0u);
  // a full tracker evicts an unprotected entry even when protected ones are older
  offer(u, {"y"});           // order: y, x
  offer(u, {"x", "q"});      // x protected; y (unprotected, least recent) goes for q
  EXPECT_EQ(u.count_of("y"), 0u);
  EXPECT_EQ(u.count_of("x"), 2u);
  EXPECT_EQ(u.count_of("q"), 1u);
}

TEST(AdmissionTracker, EachOccurrenceIsAnOffer) {
  AdmissionTracker t(4);
  offer(t, {"a", "a", "b"});
  EXPECT_EQ(t.count_of("a"), 2u);
  EXPECT_EQ(t.count_of("b"), 1u);
  offer(t, {"b", "a", "b"});
  EXPECT_EQ(t.count_of("a"), 3u);
  EXPECT_EQ(t.count_of("b"), 3u);
  EXPECT_EQ(t.size(), 2u);
}

TEST(AdmissionTracker, RejectsZeroOrHugeCapacityAndCountsItsMemory) {
  expect_names(error_of([] { AdmissionTracker t(0); }), {"capacity=0", "1 .. 2^31-1"});
  expect_names(error_of([] { AdmissionTracker t(0x80000000u); }), {"capacity=2147483648"});
  EXPECT_EQ(AdmissionTracker::memory_bytes(64000),
            KeyIndex::memory_bytes(64000) + 64001 * std::uint64_t{8});
  EXPECT_GT(AdmissionTracker::memory_bytes(64000), 6'000'000u);
  EXPECT_LT(AdmissionTracker::memory_bytes(64000), 7'000'000u);
}

/// The tracker's rules written the slow, obvious way (a list, most recent first).
struct ReferenceTracker {
  std::size_t capacity;
  std::list<std::pair<std::string, std::uint64_t>> order;  // front: most recent

  std::uint64_t count(const std::string& k) const {
    for (const auto& [key, c] : order) {
      if (key == k) return c;
    }
    return 0;
  }
  bool tracked(const std::string& k) const {
    return std::any_of(order.begin(), order.end(), [&](const auto& e) { return e.first == k; });
  }
  void to_front(const std::string& k) {
    auto it = std::find_if(order.begin(), order.end(), [&](const auto& e) { return e.first == k; });
    order.splice(order.begin(), order, it);
  }
  void record(const Strings& keys) {
    std::set<std::string> in_call;  // tracked keys of the call: protected
    for (const auto& k : keys) {
      if (tracked(k)) in_call.insert(k);
    }
    const std::set<std::string> tracked_before = in_call;
    for (const auto& k : keys) {
      if (tracked_before.count(k)) {
        for (auto& e : order) {
          if (e.first == k) ++e.second;
        }
      }
    }
    for (const auto& k : keys) {
      if (tracked_before.count(k)) continue;
      if (tracked(k)) {  // an earlier occurrence added it
        for (auto& e : order) {
          if (e.first == k) ++e.second;
        }
        continue;
      }
      if (order.size() == capacity) {
        auto victim = order.end();
        for (auto it = order.begin(); it != order.end(); ++it) {
          if (!in_call.count(it->first)) victim = it;  // the least recent unprotected
        }
        if (victim == order.end()) continue;  // all protected: not tracked
        order.erase(victim);
      }
      order.emplace_front(k, 1);
      in_call.insert(k);
    }
    for (std::size_t i = keys.size(); i-- > 0;) {
      if (tracked(keys[i])) to_front(keys[i]);
    }
  }
};

TEST(AdmissionTracker, RandomCallsMatchTheReference) {
  std::mt19937 rng(7);
  for (const std::uint32_t capacity : {1u, 2u, 5u, 16u}) {
    AdmissionTracker t(capacity);
    ReferenceTracker ref{capacity, {}};
    std::set<std::string> universe;
    for (int call = 0; call < 400; ++call) {
      Strings keys(1 + rng() % 6);
      for (auto& k : keys) k = "k" + std::to_string(rng() % 24);
      universe.insert(keys.begin(), keys.end());
      offer(t, Keys(keys.begin(), keys.end()));
      ref.record(keys);
      ASSERT_EQ(t.size(), ref.order.size()) << "call " << call;
      for (const auto& k : universe) {
        ASSERT_EQ(t.count_of(k), ref.count(k)) << k << " after call " << call;
      }
    }
  }
}

// ------------------------------------------------------------------- CPUOffloadingManager

TEST(StoreThreshold, OffByDefaultAndBelowTwo) {
  CPUOffloadingManager m(4);
  EXPECT_EQ(m.store_threshold(), 0);
  EXPECT_EQ(m.max_tracker_size(), 64000);
  CPUOffloadingManager one(4, "lru", false, 1);
  for (CPUOffloadingManager* x : {&m, &one}) {
    auto r = store(*x, {"a", "b"});
    EXPECT_EQ(r.store_indices, (U{0, 1}));
    EXPECT_TRUE(r.skipped_indices.empty());
    EXPECT_EQ(x->stores_skipped(), 0u);
    EXPECT_EQ(x->tracker_size(), 0u);
    EXPECT_EQ(x->offer_count("a"), 0u);
  }
  // no tracker, no memory: the filter's bytes only when it is on
  EXPECT_EQ(CPUOffloadingManager::memory_bytes(1000, "lru", 1, 64000),
            CPUOffloadingManager::memory_bytes(1000, "lru"));
  EXPECT_EQ(CPUOffloadingManager::memory_bytes(1000, "lru", 2, 64000),
            CPUOffloadingManager::memory_bytes(1000, "lru") +
                AdmissionTracker::memory_bytes(64000));
  // off: max_tracker_size 0 is accepted (unused)
  CPUOffloadingManager zero(4, "lru", false, 0, 0);
  EXPECT_EQ(zero.max_tracker_size(), 0);
}

TEST(StoreThreshold, BadArgumentsAreRejectedNamingThem) {
  auto bad = [](std::int64_t threshold, std::int64_t tracker) {
    return error_of([&] { CPUOffloadingManager m(4, "lru", false, threshold, tracker); });
  };
  expect_names(bad(-1, 64000), {"store_threshold=-1", "negative", "2..1048576"});
  expect_names(bad((1 << 20) + 1, 64000), {"store_threshold=1048577", "2^20"});
  expect_names(bad(2, 0), {"max_tracker_size=0", "store_threshold=2", ">= 1"});
  expect_names(bad(2, -5), {"max_tracker_size=-5", "1..2147483647"});
  expect_names(bad(0, -5), {"max_tracker_size=-5"});
  expect_names(bad(2, std::int64_t{1} << 31), {"max_tracker_size=2147483648"});
  CPUOffloadingManager largest(4, "lru", false, 1 << 20, 1);
  EXPECT_EQ(largest.store_threshold(), 1 << 20);
}

TEST(StoreThreshold, ATrackerLargerThanTheHostIsRefusedNamingMaxTrackerSize) {
  const std::int64_t huge = (std::int64_t{1} << 31) - 1;
  if (CPUOffloadingManager::memory_bytes(4, "lru", 2, huge) <= host_memory_limit_bytes()) {
    GTEST_SKIP() << "this host could hold a tracker of 2^31-1 keys";
  }
  try {
    CPUOffloadingManager m(4, "lru", false, 2, (std::int64_t{1} << 31) - 1);
    ADD_FAILURE() << "a 200 GiB tracker was allocated";  // only on a host that has it
  } catch (const HostMemoryError& e) {
    expect_names(e.what(), {"max_tracker_size=2147483647", "smaller max_tracker_size"});
  }
}

// vLLM's test_filter_reused_manager, with kvoff's tracker order (keys[0] most recent).
TEST(StoreThreshold, AKeyIsStoredOnItsSecondOffer) {
  CPUOffloadingManager m(4, "lru", /*enable_events=*/true, /*store_threshold=*/2,
                         /*max_tracker_size=*/3);
  EXPECT_EQ(m.lookup(Keys{"1", "2"}), std::optional<std::size_t>(0));  // lookups count nothing
  EXPECT_EQ(m.tracker_size(), 0u);
  auto r = m.prepare_store(Keys{"1", "2"});  // first offer: skipped, not refused
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->store_indices.empty());
  EXPECT_TRUE(r->keys_to_store.empty());
  EXPECT_EQ(r->skipped_indices, (U{0, 1}));
  EXPECT_EQ(r->key_block_ids, (U{kNoBlock, kNoBlock}));
  EXPECT_EQ(m.stores_skipped(), 2u);
  EXPECT_EQ(m.state("1"), BlockState::kMissing);
  EXPECT_EQ(m.num_free_blocks(), 4u);
  EXPECT_TRUE(m.take_events().empty());
  EXPECT_EQ(m.offer_count("1"), 1u);
  EXPECT_EQ(m.offer_count("2"), 1u);
  r = m.prepare_store(Keys{"1", "2"});  // second offer: the whole prefix at once
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(str(r->keys_to_store), (Strings{"1", "2"}));
  EXPECT_TRUE(r->skipped_indices.empty());
  EXPECT_EQ(m.stores_skipped(), 2u);
  m.complete_store(r->keys_to_store);
  EXPECT_EQ(m.lookup(Keys{"1", "2"}), std::optional<std::size_t>(2));
  ASSERT_EQ(m.take_events().size(), 1u);  // BlockStored of 1, 2
  // [3, 4]: first offer; the full tracker forgets 2, the tail of [1, 2] (vLLM: 1)
  r = m.prepare_store(Keys{"3", "4"});
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->skipped_indices, (U{0, 1}));
  EXPECT_EQ(m.offer_count("2"), 0u);
  EXPECT_EQ(m.offer_count("1"), 2u);
  EXPECT_EQ(m.offer_count("3"), 1u);
  EXPECT_EQ(m.offer_count("4"), 1u);
  EXPECT_EQ(m.tracker_size(), 3u);
  // recency now 3, 4, 1: [5] forgets 1, [6] forgets 4
  ASSERT_TRUE(m.prepare_store(Keys{"5"}).has_value());
  EXPECT_EQ(m.offer_count("1"), 0u);
  ASSERT_TRUE(m.prepare_store(Keys{"6"}).has_value());
  EXPECT_EQ(m.offer_count("4"), 0u);
  EXPECT_EQ(m.offer_count("3"), 1u);
  // 4 re-enters the tracker at 1, so it is filtered again
  r = m.prepare_store(Keys{"4"});
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->skipped_indices, U{0});
  EXPECT_EQ(m.offer_count("4"), 1u);
  EXPECT_EQ(m.stores_skipped(), 7u);
  EXPECT_TRUE(m.take_events().empty());
  // 1 is held: never skipped, though the tracker forgot it
  r = m.prepare_store(Keys{"1"});
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->skipped_indices.empty());
  EXPECT_TRUE(r->keys_to_store.empty());
  EXPECT_EQ(m.stores_skipped(), 7u);
}

// vLLM's test_filter_reused_manager_oversized_offer_makes_progress.
TEST(StoreThreshold, AnOfferLargerThanTheTrackerMakesProgress) {
  CPUOffloadingManager m(4, "lru", false, 2, 3);
  const Strings all = {"1", "2", "3", "4"};
  std::set<std::string> stored;
  for (int round = 0; round < 4; ++round) {
    Keys remaining;
    for (const auto& k : all) {
      if (!stored.count(k)) remaining.push_back(k);
    }
    auto r = store(m, remaining);
    stored.insert(r.keys_to_store.begin(), r.keys_to_store.end());
  }
  EXPECT_EQ(stored, std::set<std::string>(all.begin(), all.end()));
  EXPECT_EQ(m.lookup(Keys{"1", "2", "3", "4"}), std::optional<std::size_t>(4));
}

// vLLM's test_store_threshold_does_not_hide_ready_reuse: a held key is never filtered, even
// when the tracker forgot it; kvoff's prepare_store leaves held keys' recency to the caller's
// touch, as always.
TEST(StoreThreshold, HeldKeysAreNeverSkippedEvenWhenTheTrackerForgotThem) {
  CPUOffloadingManager m(2, "lru", false, 2, 2);
  store(m, {"head", "tail"});
  auto r = store(m, {"head", "tail"});
  ASSERT_EQ(str(r.keys_to_store), (Strings{"head", "tail"}));
  r = store(m, {"noise1", "noise2"});  // forgets head and tail; stores nothing
  EXPECT_EQ(r.skipped_indices, (U{0, 1}));
  EXPECT_EQ(m.offer_count("head"), 0u);
  EXPECT_EQ(m.offer_count("tail"), 0u);
  const auto skipped = m.stores_skipped();
  auto held = m.prepare_store(Keys{"tail"});
  ASSERT_TRUE(held.has_value());
  EXPECT_TRUE(held->keys_to_store.empty());
  EXPECT_TRUE(held->skipped_indices.empty());
  EXPECT_EQ(held->key_block_ids, U{*m.block_id("tail")});
  EXPECT_EQ(m.stores_skipped(), skipped);
  m.touch(Keys{"tail"});  // the reuse (the schedulers touch after prepare_store)
  store(m, {"replacement"});
  auto last = m.prepare_store(Keys{"replacement"});
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->evicted_keys.to_strings(), Strings{"head"});
  EXPECT_EQ(m.state("tail"), BlockState::kReady);
}

// On purpose unlike vLLM: a refused prepare_store (nullopt) counts no offer (invariant 6), so
// the scheduler's retry of the same keys next step is one offer, not two.
TEST(StoreThreshold, ARefusedPrepareStoreChangesNeitherTheTrackerNorTheCounter) {
  CPUOffloadingManager m(2, "lru", false, 2, 8);
  store(m, {"a", "b"});  // first offer: a, b at 1
  // fill the pool with pending blocks (apply_threshold false: no offer counted)
  auto pending = m.prepare_store(Keys{"x", "y"}, /*apply_threshold=*/false);
  ASSERT_TRUE(pending.has_value());
  ASSERT_EQ(str(pending->keys_to_store), (Strings{"x", "y"}));
  EXPECT_EQ(m.tracker_size(), 2u);
  const Keys call = {"a", "c", "b"};  // a, b would be stored now, c skipped: no room for a, b
  EXPECT_FALSE(m.prepare_store(call).has_value());
  EXPECT_EQ(m.offer_count("a"), 1u);
  EXPECT_EQ(m.offer_count("b"), 1u);
  EXPECT_EQ(m.offer_count("c"), 0u);
  EXPECT_EQ(m.tracker_size(), 2u);
  EXPECT_EQ(m.stores_skipped(), 2u);  // the first call's two, not c
  PrepareStoreResult reused;
  EXPECT_FALSE(m.prepare_store(call, reused));  // the retry: still no room, still nothing
  EXPECT_EQ(m.offer_count("a"), 1u);
  m.complete_store(pending->keys_to_store);  // x, y ready: evictable
  auto r = m.prepare_store(call);  // the retry succeeds: one more offer each
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(str(r->keys_to_store), (Strings{"a", "b"}));
  EXPECT_EQ(r->store_indices, (U{0, 2}));
  EXPECT_EQ(r->skipped_indices, U{1});
  EXPECT_EQ(r->key_block_ids[1], kNoBlock);
  EXPECT_EQ(r->evicted_keys.size(), 2u);
  EXPECT_EQ(m.offer_count("a"), 2u);
  EXPECT_EQ(m.offer_count("c"), 1u);
  EXPECT_EQ(m.stores_skipped(), 3u);
}

TEST(StoreThreshold, EachOccurrenceInACallIsAnOfferAndASkippedKeyIsListedOnce) {
  // the scheduler offers the keys of every storing request in one call: two requests with the
  // same new block are two offers, as two calls would be
  CPUOffloadingManager m(8, "lru", false, 2, 8);
  auto r = m.prepare_store(Keys{"s", "t", "s"});
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(str(r->keys_to_store), Strings{"s"});
  EXPECT_EQ(r->store_indices, U{0});
  EXPECT_EQ(r->skipped_indices, U{1});
  EXPECT_EQ(r->key_block_ids, (U{r->block_ids[0], kNoBlock, r->block_ids[0]}));
  EXPECT_EQ(m.stores_skipped(), 1u);
  auto u = m.prepare_store(Keys{"u", "u", "u"});  // a threshold of 3 would need all three
  ASSERT_TRUE(u.has_value());
  EXPECT_EQ(m.offer_count("u"), 3u);
  CPUOffloadingManager three(8, "lru", false, 3, 8);
  auto v = three.prepare_store(Keys{"v", "w", "v"});
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->skipped_indices, (U{0, 1}));  // v: 2 offers, w: 1
  EXPECT_EQ(three.stores_skipped(), 2u);
  v = three.prepare_store(Keys{"v"});
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(str(v->keys_to_store), Strings{"v"});
}

TEST(StoreThreshold, APromotionNeitherCountsNorIsFiltered) {
  CPUOffloadingManager m(4, "lru", false, 2, 8);
  auto r = m.prepare_store(Keys{"a", "b"}, /*apply_threshold=*/false);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(str(r->keys_to_store), (Strings{"a", "b"}));
  EXPECT_TRUE(r->skipped_indices.empty());
  EXPECT_EQ(m.tracker_size(), 0u);
  EXPECT_EQ(m.stores_skipped(), 0u);
}

TEST(StoreThreshold, AReusedResultListsOnlyTheLastCallsSkips) {
  CPUOffloadingManager m(4, "lru", false, 2, 8);
  PrepareStoreResult result;
  ASSERT_TRUE(m.prepare_store(Keys{"a", "b"}, result));
  EXPECT_EQ(result.skipped_indices, (U{0, 1}));
  ASSERT_TRUE(m.prepare_store(Keys{"b", "c"}, result));
  EXPECT_EQ(result.skipped_indices, U{1});
  EXPECT_EQ(str(result.keys_to_store), Strings{"b"});
  EXPECT_EQ(result.key_block_ids, (U{result.block_ids[0], kNoBlock}));
}

// Random calls against the rules written out: every key of a successful call is held, stored
// or skipped; skipped are exactly the new keys whose offers (tracked count + occurrences in
// the call) stay below the threshold; refused calls change no count.
TEST(StoreThreshold, RandomCallsMatchTheReference) {
  std::mt19937 rng(11);
  for (const std::int64_t threshold : {2, 3}) {
    for (const std::uint32_t tracker : {1u, 4u, 32u}) {
      CPUOffloadingManager m(6, "lru", false, threshold, tracker);
      ReferenceTracker ref{tracker, {}};
      std::uint64_t skipped_total = 0;
      std::vector<Strings> in_flight;
      for (int call = 0; call < 600; ++call) {
        if (!in_flight.empty() && rng() % 3 == 0) {  // finish a store, sometimes failed
          const Strings done = std::move(in_flight.front());
          in_flight.erase(in_flight.begin());
          m.complete_store(Keys(done.begin(), done.end()), rng() % 4 != 0);
          continue;
        }
        Strings keys(1 + rng() % 5);
        for (auto& k : keys) k = "k" + std::to_string(rng() % 16);
        const Keys views(keys.begin(), keys.end());
        std::map<std::string, std::uint64_t> occurrences;
        for (const auto& k : keys) ++occurrences[k];
        std::set<std::string> want_skipped;
        for (const auto& k : keys) {
          if (m.state(k) == BlockState::kMissing &&
              ref.count(k) + occurrences[k] < static_cast<std::uint64_t>(threshold)) {
            want_skipped.insert(k);
          }
        }
        auto r = m.prepare_store(views);
        if (!r) {
          continue;  // refused: the reference records nothing either (checked below)
        }
        ref.record(keys);
        std::set<std::string> got_skipped;
        for (const auto i : r->skipped_indices) got_skipped.insert(keys[i]);
        ASSERT_EQ(got_skipped, want_skipped) << "call " << call;
        skipped_total += want_skipped.size();
        for (const auto& k : want_skipped) EXPECT_EQ(m.state(k), BlockState::kMissing);
        if (!r->keys_to_store.empty()) in_flight.push_back(str(r->keys_to_store));
        ASSERT_EQ(m.stores_skipped(), skipped_total);
        ASSERT_EQ(m.tracker_size(), ref.order.size());
        for (int k = 0; k < 16; ++k) {
          const std::string key = "k" + std::to_string(k);
          ASSERT_EQ(m.offer_count(key), ref.count(key)) << key << " after call " << call;
        }
      }
    }
  }
}

// ------------------------------------------------------------------- OffloadingScheduler

SchedulerConfig threshold_config(std::int64_t threshold, std::int64_t cpu_blocks = 64) {
  SchedulerConfig c;
  c.num_cpu_blocks = cpu_blocks;
  c.gpu_block_size = 4;
  c.num_gpu_blocks = 64;
  c.groups = {SchedulerGroup{GroupKind::kFullAttention, 0}};
  c.store_threshold = threshold;
  c.max_tracker_size = 100;
  return c;
}

/// Offload key of the test hashes: hash bytes + group byte 0.
std::string key0(std::string_view hash) {
  std::string k(hash);
  k.push_back('\0');
  return k;
}

void add(OffloadingScheduler& s, std::string_view id, const Strings& hs) {
  const Keys views(hs.begin(), hs.end());
  s.update_request(id, 0, views, static_cast<std::int64_t>(hs.size()) * 4);
}

/// A step of `id` that computes its new blocks (4 tokens each) after `computed` tokens.
ScheduledRequest sched(std::string_view id, std::vector<std::int64_t> blocks,
                       std::int64_t computed = 0) {
  ScheduledRequest r;
  r.request_id = id;
  r.num_computed_tokens = computed;
  r.num_scheduled_tokens = static_cast<std::int64_t>(blocks.size()) * 4;
  r.new_block_ids = {std::move(blocks)};
  return r;
}

ConnectorMeta step(OffloadingScheduler& s, std::vector<ScheduledRequest> scheduled) {
  return s.build_connector_meta(scheduled);
}

TEST(SchedulerStoreThreshold, ConfigIsCheckedNamingTheField) {
  auto bad = [](std::int64_t threshold, std::int64_t tracker) {
    auto c = threshold_config(threshold);
    c.max_tracker_size = tracker;
    return error_of([&] { OffloadingScheduler s(c); });
  };
  expect_names(bad(-1, 100), {"OffloadingScheduler", "store_threshold", "got -1"});
  expect_names(bad((1 << 20) + 1, 100), {"store_threshold", "got 1048577"});
  expect_names(bad(2, 0), {"max_tracker_size", "got 0"});
  expect_names(bad(0, -1), {"max_tracker_size", "got -1"});
  expect_names(bad(2, std::int64_t{1} << 31), {"max_tracker_size", "got 2147483648"});
  OffloadingScheduler off(threshold_config(0));
  EXPECT_EQ(off.manager().store_threshold(), 0);
  OffloadingScheduler on(threshold_config(2));
  EXPECT_EQ(on.manager().store_threshold(), 2);
  EXPECT_EQ(on.manager().max_tracker_size(), 100);
}

TEST(SchedulerStoreThreshold, TheFirstRequestsBlocksAreSkippedASecondWithTheSamePrefixStores) {
  OffloadingScheduler s(threshold_config(2));
  add(s, "A", {"p0", "p1"});
  auto meta = step(s, {sched("A", {1, 2})});
  EXPECT_TRUE(meta.store_jobs.empty());  // offered once: nothing copied
  EXPECT_EQ(s.stats().stores_skipped, 2u);
  EXPECT_EQ(s.stats().store_refusals, 0u);
  EXPECT_EQ(s.stats().store_jobs, 0u);
  EXPECT_EQ(s.next_store_block("A"), 2);  // moved past them, as past held blocks
  EXPECT_EQ(s.manager().state(key0("p0")), BlockState::kMissing);
  meta = step(s, {sched("A", {}, 8)});  // not offered again by the same request
  EXPECT_TRUE(meta.store_jobs.empty());
  EXPECT_EQ(s.stats().stores_skipped, 2u);
  // B shares the prefix: no hit yet (nothing stored), so it computes and offers p0, p1 again
  add(s, "B", {"p0", "p1", "b2"});
  EXPECT_EQ(s.get_num_new_matched_tokens("B", 0).num_tokens, std::optional<std::int64_t>(0));
  meta = step(s, {sched("B", {5, 6, 7})});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  const TransferJob& j = meta.store_jobs[0];
  EXPECT_EQ(j.request_id, "B");
  EXPECT_EQ(j.gpu_block_ids, (std::vector<std::int64_t>{5, 6}));  // b2 (first offer) is not copied
  EXPECT_EQ(j.keys.to_strings(), (Strings{key0("p0"), key0("p1")}));
  EXPECT_EQ(j.group_sizes, std::vector<std::int64_t>{2});
  EXPECT_EQ(j.block_indices, std::vector<std::int64_t>{0});
  EXPECT_EQ(s.stats().stores_skipped, 3u);
  EXPECT_EQ(s.stats().blocks_stored, 2u);
  EXPECT_EQ(s.next_store_block("B"), 3);
  EXPECT_EQ(s.manager().state(key0("b2")), BlockState::kMissing);
  s.update_connector_output(std::vector<JobReport>{JobReport{j.job_id, true}});
  add(s, "C", {"p0", "p1", "c2"});
  EXPECT_EQ(s.get_num_new_matched_tokens("C", 0).num_tokens, std::optional<std::int64_t>(8));
}

TEST(SchedulerStoreThreshold, ASkippedBlockInTheMiddleSplitsTheJob) {
  OffloadingScheduler s(threshold_config(2));
  add(s, "A", {"x0", "x2"});
  step(s, {sched("A", {1, 2})});  // x0, x2: one offer each
  add(s, "B", {"x0", "y1", "x2"});
  auto meta = step(s, {sched("B", {5, 6, 7})});
  ASSERT_EQ(meta.store_jobs.size(), 2u);  // y1 (first offer) is skipped between them
  EXPECT_EQ(meta.store_jobs[0].gpu_block_ids, std::vector<std::int64_t>{5});
  EXPECT_EQ(meta.store_jobs[0].block_indices, std::vector<std::int64_t>{0});
  EXPECT_EQ(meta.store_jobs[1].gpu_block_ids, std::vector<std::int64_t>{7});
  EXPECT_EQ(meta.store_jobs[1].block_indices, std::vector<std::int64_t>{2});
  EXPECT_EQ(meta.store_jobs[1].keys.to_strings(), Strings{key0("x2")});
  EXPECT_EQ(s.next_store_block("B"), 3);
  EXPECT_EQ(s.stats().stores_skipped, 3u);
}

TEST(SchedulerStoreThreshold, TwoRequestsOfferingOneBlockInOneStepAreTwoOffers) {
  OffloadingScheduler s(threshold_config(2));
  add(s, "A", {"s0", "a1"});
  add(s, "B", {"s0", "b1"});
  auto meta = step(s, {sched("A", {1, 2}), sched("B", {5, 6})});
  ASSERT_EQ(meta.store_jobs.size(), 1u);  // s0 once (the later request's keys come first)
  EXPECT_EQ(meta.store_jobs[0].request_id, "B");
  EXPECT_EQ(meta.store_jobs[0].keys.to_strings(), Strings{key0("s0")});
  EXPECT_EQ(s.stats().stores_skipped, 2u);  // a1, b1
  EXPECT_EQ(s.manager().offer_count(key0("s0")), 2u);
}

TEST(SchedulerStoreThreshold, OffStoresEveryBlockAtOnce) {
  OffloadingScheduler s(threshold_config(1));
  add(s, "A", {"p0", "p1"});
  auto meta = step(s, {sched("A", {1, 2})});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  EXPECT_EQ(meta.store_jobs[0].gpu_block_ids, (std::vector<std::int64_t>{1, 2}));
  EXPECT_EQ(s.stats().stores_skipped, 0u);
  EXPECT_EQ(s.manager().tracker_size(), 0u);
}

}  // namespace
}  // namespace kvoff
