// CPUOffloadingManager's slot reservations (reserve_blocks, store_reserved, release_reserved):
// the slots' accounting (free + stored + pending + reserved = num_blocks), eviction as
// prepare_store evicts, duplicates left reserved (docs/design.md invariant 10), and bad input
// that changes nothing (invariant 7).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvoff/offloading_manager.h"
#include "manager_test_util.h"

namespace kvoff {
namespace {

using namespace manager_test;

std::uint32_t accounted(const CPUOffloadingManager& m) {
  return m.num_free_blocks() + m.num_stored_blocks() + m.num_pending_blocks() +
         m.num_reserved_blocks();
}

TEST(Reservations, FreeSlotsFirstThenEvictionInPolicyOrderWithEvents) {
  CPUOffloadingManager m(4, "lru", /*enable_events=*/true);
  store(m, K({"a", "b", "c"}));  // keys[0] most recent: c is the LRU victim
  m.take_events();
  PrepareStoreResult r;
  ASSERT_TRUE(m.reserve_blocks(2, r));
  EXPECT_EQ(r.block_ids.size(), 2u);
  EXPECT_EQ(str(r.evicted_keys), S({"c"}));
  EXPECT_TRUE(r.keys_to_store.empty() && r.store_indices.empty());
  EXPECT_EQ(m.num_reserved_blocks(), 2u);
  EXPECT_EQ(m.num_free_blocks(), 0u);
  EXPECT_EQ(m.state("c"), BlockState::kMissing);
  for (std::uint32_t slot : r.block_ids) EXPECT_TRUE(m.is_reserved(slot));
  const auto events = m.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_TRUE(events[0].removed);
  EXPECT_EQ(events[0].keys, S({"c"}));
  EXPECT_EQ(accounted(m), 4u);
}

TEST(Reservations, AllOrNothingWhenTooFewSlotsCanBeFreed) {
  CPUOffloadingManager m(4);
  store(m, K({"a", "b"}));
  ASSERT_TRUE(m.prepare_load(K({"a"})).size() == 1);  // pinned: not evictable
  ASSERT_TRUE(m.prepare_store(K({"p"})).has_value());  // pending: not evictable
  const Keys all = K({"a", "b", "p"});
  const Snapshot before = snap(m, all);
  PrepareStoreResult r;
  EXPECT_FALSE(m.reserve_blocks(3, r));  // 1 free + 1 evictable
  EXPECT_EQ(snap(m, all), before);
  EXPECT_EQ(m.num_reserved_blocks(), 0u);
  ASSERT_TRUE(m.reserve_blocks(2, r));
  EXPECT_EQ(str(r.evicted_keys), S({"b"}));
}

TEST(Reservations, ReservedSlotsAreNeverEvictedNorHandedOut) {
  CPUOffloadingManager m(3);
  PrepareStoreResult r;
  ASSERT_TRUE(m.reserve_blocks(2, r));
  const std::set<std::uint32_t> reserved(r.block_ids.begin(), r.block_ids.end());
  store(m, K({"x"}));
  auto out = m.prepare_store(K({"y"}));  // evicts x: the reserved slots are not candidates
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(str(out->evicted_keys), S({"x"}));
  EXPECT_FALSE(reserved.count(out->block_ids[0]));
  EXPECT_FALSE(m.prepare_store(K({"z"})).has_value());  // y pending, the rest reserved
  EXPECT_EQ(m.clear(true), 1u);  // clear drops y, never a reservation
  EXPECT_EQ(m.num_reserved_blocks(), 2u);
}

TEST(Reservations, StoreReservedMakesNewKeysPendingAndLeavesHeldOnesSlotsReserved) {
  CPUOffloadingManager m(6, "lru", /*enable_events=*/true);
  store(m, K({"held"}));
  PrepareStoreResult r;
  ASSERT_TRUE(m.reserve_blocks(4, r));
  const auto& s = r.block_ids;
  const auto stored = m.store_reserved(K({"n1", "held", "n2", "n1"}), s);
  EXPECT_EQ(stored, (std::vector<std::uint32_t>{0, 2}));
  EXPECT_EQ(m.state("n1"), BlockState::kPending);
  EXPECT_EQ(m.state("n2"), BlockState::kPending);
  EXPECT_EQ(*m.block_id("n1"), s[0]);
  EXPECT_EQ(*m.block_id("n2"), s[2]);
  EXPECT_FALSE(m.is_reserved(s[0]) || m.is_reserved(s[2]));
  EXPECT_TRUE(m.is_reserved(s[1]) && m.is_reserved(s[3]));  // the held key's, the repeat's
  EXPECT_EQ(m.num_reserved_blocks(), 2u);
  EXPECT_EQ(m.lookup(K({"n1"})), std::optional<std::size_t>{});  // pending: not a hit yet
  m.complete_store_blocks(std::vector<std::uint32_t>{s[0], s[2]});
  EXPECT_EQ(m.lookup(K({"n1", "n2"})), std::optional<std::size_t>{2});
  m.release_reserved(std::vector<std::uint32_t>{s[1], s[3]});
  EXPECT_EQ(m.num_reserved_blocks(), 0u);
  EXPECT_EQ(m.num_free_blocks(), 3u);
  EXPECT_EQ(accounted(m), 6u);
}

TEST(Reservations, PinnedBlocksCountTransfersAndNeverAnIdleReservation) {
  // num_pinned_blocks is the numerator of vLLM's cpu_cache_usage_perc: slots a transfer uses
  CPUOffloadingManager m(8);
  store(m, K({"a", "b"}));
  EXPECT_EQ(m.num_pinned_blocks(), 0u);  // ready and unpinned: evictable
  ASSERT_EQ(m.prepare_load(K({"a"})).size(), 1u);
  ASSERT_TRUE(m.prepare_store(K({"p"})).has_value());
  EXPECT_EQ(m.num_pinned_blocks(), 2u);  // the load's pin and the pending store
  PrepareStoreResult r;
  ASSERT_TRUE(m.reserve_blocks(3, r));
  EXPECT_EQ(m.num_pinned_blocks(), 2u);  // reserved slots: no transfer uses them yet
  m.store_reserved(K({"q"}), std::vector<std::uint32_t>{r.block_ids[0]});
  EXPECT_EQ(m.num_pinned_blocks(), 3u);  // now a pending store
  m.complete_load(K({"a"}));
  m.complete_store(K({"p", "q"}));
  EXPECT_EQ(m.num_pinned_blocks(), 0u);
  EXPECT_EQ(accounted(m), 8u);
}

TEST(Reservations, StoredKeysEnterThePolicyAsPrepareStoreWouldKeysZeroMostRecent) {
  CPUOffloadingManager m(4);
  PrepareStoreResult r;
  ASSERT_TRUE(m.reserve_blocks(3, r));
  m.store_reserved(K({"head", "mid", "tail"}), r.block_ids);
  m.complete_store(K({"head", "mid", "tail"}));
  store(m, K({"other"}));
  EXPECT_EQ(drain(m, 3), S({"tail", "mid", "head"}));  // a prefix's tail is evicted first
}

TEST(Reservations, BadInputChangesNothing) {
  CPUOffloadingManager m(6);
  store(m, K({"a"}));
  PrepareStoreResult r;
  ASSERT_TRUE(m.reserve_blocks(3, r));
  const auto s = r.block_ids;
  std::uint32_t unreserved = 0;
  while (std::count(s.begin(), s.end(), unreserved)) ++unreserved;
  const Keys all = K({"a", "k1", "k2"});
  const Snapshot before = snap(m, all);
  const auto unchanged = [&] {
    EXPECT_EQ(snap(m, all), before);
    EXPECT_EQ(m.num_reserved_blocks(), 3u);
    for (std::uint32_t slot : s) EXPECT_TRUE(m.is_reserved(slot));
  };
  EXPECT_THROW(m.store_reserved(K({"k1"}), std::vector<std::uint32_t>{s[0], s[1]}),
               std::invalid_argument);  // sizes differ
  unchanged();
  EXPECT_THROW(m.store_reserved(K({"k1", ""}), std::vector<std::uint32_t>{s[0], s[1]}),
               std::invalid_argument);  // empty key
  unchanged();
  EXPECT_THROW(m.store_reserved(K({"k1", "k2"}), std::vector<std::uint32_t>{s[0], s[0]}),
               std::invalid_argument);  // a slot twice
  unchanged();
  EXPECT_THROW(m.store_reserved(K({"k1", "k2"}), std::vector<std::uint32_t>{s[1], unreserved}),
               std::invalid_argument);  // a held (or free) slot
  unchanged();
  EXPECT_THROW(m.store_reserved(K({"k1"}), std::vector<std::uint32_t>{99}),
               std::invalid_argument);  // out of range
  unchanged();
  EXPECT_THROW(m.release_reserved(std::vector<std::uint32_t>{s[2], s[2]}),
               std::invalid_argument);
  unchanged();
  EXPECT_THROW(m.release_reserved(std::vector<std::uint32_t>{s[0], unreserved}),
               std::invalid_argument);
  unchanged();
  try {
    m.release_reserved(std::vector<std::uint32_t>{s[1], s[1]});
    FAIL() << "a repeated slot was released";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("repeated"), std::string::npos) << e.what();
  }
  unchanged();
  // a stored-into or released slot is no longer reserved
  m.store_reserved(K({"k1"}), std::vector<std::uint32_t>{s[0]});
  EXPECT_THROW(m.release_reserved(std::vector<std::uint32_t>{s[0]}), std::invalid_argument);
  m.release_reserved(std::vector<std::uint32_t>{s[1]});
  EXPECT_THROW(m.store_reserved(K({"k2"}), std::vector<std::uint32_t>{s[1]}),
               std::invalid_argument);
}

TEST(Reservations, RandomCallsKeepEverySlotAccountedFor) {
  // A model of who holds each slot (free, a key, or a reservation), against random
  // reserve, store_reserved, release_reserved, prepare_store, complete_store and loads.
  constexpr std::uint32_t kSlots = 32;
  CPUOffloadingManager m(kSlots, "lru");
  std::mt19937 rng(11);
  std::vector<std::uint32_t> reserved;
  std::vector<std::string> pending;
  std::vector<std::string> keys;
  for (int i = 0; i < 48; ++i) keys.push_back("key" + std::to_string(i));
  const auto pick = [&](std::size_t n) { return std::uniform_int_distribution<std::size_t>(
                                             0, n - 1)(rng); };
  for (int step = 0; step < 4000; ++step) {
    switch (pick(5)) {
      case 0: {
        PrepareStoreResult r;
        const auto count = static_cast<std::uint32_t>(pick(6));
        if (m.reserve_blocks(count, r)) {
          EXPECT_EQ(r.block_ids.size(), count);
          reserved.insert(reserved.end(), r.block_ids.begin(), r.block_ids.end());
        }
        break;
      }
      case 1: {
        const std::size_t n = std::min<std::size_t>(reserved.size(), pick(4));
        std::vector<std::uint32_t> slots(reserved.end() - static_cast<std::ptrdiff_t>(n),
                                         reserved.end());
        Keys ks;
        for (std::size_t i = 0; i < n; ++i) ks.push_back(keys[pick(keys.size())]);
        const auto stored = m.store_reserved(ks, slots);
        reserved.resize(reserved.size() - n);
        std::vector<bool> taken(n, false);
        for (std::uint32_t i : stored) {
          taken[i] = true;
          pending.emplace_back(ks[i]);
          EXPECT_EQ(*m.block_id(ks[i]), slots[i]);
        }
        for (std::size_t i = 0; i < n; ++i) {
          if (!taken[i]) reserved.push_back(slots[i]);  // a held key's slot stays reserved
        }
        break;
      }
      case 2:
        if (!reserved.empty()) {
          m.release_reserved(std::vector<std::uint32_t>{reserved.back()});
          reserved.pop_back();
        }
        break;
      case 3: {
        const std::string k = keys[pick(keys.size())];
        if (auto r = m.prepare_store(Keys{k})) {
          for (auto s : r->keys_to_store) pending.emplace_back(s);
        }
        break;
      }
      default:
        if (!pending.empty()) {
          const std::size_t i = pick(pending.size());
          m.complete_store(Keys{pending[i]}, pick(4) != 0);
          pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
        }
    }
    ASSERT_EQ(accounted(m), kSlots) << "step " << step;
    ASSERT_EQ(m.num_reserved_blocks(), reserved.size());
    ASSERT_EQ(m.num_pending_blocks(), pending.size());
    for (std::uint32_t slot : reserved) ASSERT_TRUE(m.is_reserved(slot));
  }
}

}  // namespace
}  // namespace kvoff
