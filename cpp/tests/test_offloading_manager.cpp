// CPUOffloadingManager: construction, lookups, docs/design.md invariants 6 (stores), 7 (bad
// input changes nothing) and 8 (prefix order), and events. Eviction under churn and by
// policy: test_offloading_manager_eviction.cpp; discard, clear and write-through:
// test_offloading_manager_write_through.cpp.
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

// ------------------------------------------------------------------------ construction

TEST(Manager, ConstructionValidatesArguments) {
  CPUOffloadingManager m(8);
  EXPECT_EQ(m.num_blocks(), 8u);
  EXPECT_EQ(m.num_free_blocks(), 8u);
  EXPECT_EQ(m.num_stored_blocks(), 0u);
  EXPECT_EQ(m.eviction_policy_name(), "lru");
  EXPECT_FALSE(m.events_enabled());
  for (const std::int64_t bad : {std::int64_t{0}, std::int64_t{-1}, std::int64_t{1} << 31}) {
    try {
      CPUOffloadingManager bad_m(bad);
      FAIL() << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(bad)), std::string::npos) << e.what();
    }
  }
}

TEST(Manager, UnknownPolicyListsChoices) {
  try {
    CPUOffloadingManager m(4, "arc-typo");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("arc-typo"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("'lru'"), std::string::npos);
  }
}

TEST(Manager, MemoryBytesCountsEveryPerSlotArray) {
  const std::uint64_t n = std::uint64_t{1} << 20;
  // Pool 5 bytes per slot, index buckets 4n x 8 and 64-byte records, LRU links (n + 1) x 8,
  // recency log 2n x 4.
  EXPECT_EQ(CPUOffloadingManager::memory_bytes(n, "lru"), 5 * n + 32 * n + 64 * n + 8 * (n + 1) +
                                                              8 * n);
  EXPECT_GT(CPUOffloadingManager::memory_bytes(n, "arc"),
            CPUOffloadingManager::memory_bytes(n, "lru"));
  EXPECT_GT(CPUOffloadingManager::memory_bytes(n, "probation"),
            CPUOffloadingManager::memory_bytes(n, "lru"));
  EXPECT_EQ(CPUOffloadingManager::memory_bytes(0, "lru"), 0u);
  EXPECT_EQ(CPUOffloadingManager::memory_bytes(kMaxNumBlocks + 1, "lru"), 0u);
  // The largest pool: 2^33 buckets, a recency log capped at 2^28 entries.
  const std::uint64_t max_n = kMaxNumBlocks;
  EXPECT_EQ(CPUOffloadingManager::memory_bytes(kMaxNumBlocks, "lru"),
            5 * max_n + (std::uint64_t{8} << 33) + 64 * max_n + 8 * (max_n + 1) +
                (std::uint64_t{4} << 28));
}

TEST(Manager, HostMemoryErrorNamesTheBlocksTheBytesAndTheFix) {
  const HostMemoryError over(1000000, "arc", std::uint64_t{150} << 30, std::uint64_t{64} << 30);
  const std::string what = over.what();
  for (const char* part : {"num_blocks=1000000", "150.0 GiB", "'arc' eviction policy",
                           "more than the 64.0 GiB", "cpu_bytes_to_use"}) {
    EXPECT_NE(what.find(part), std::string::npos) << part << " in " << what;
  }
  const HostMemoryError failed(4096, "lru", std::uint64_t{3} << 20, 0);
  EXPECT_NE(std::string(failed.what()).find("3.0 MiB"), std::string::npos) << failed.what();
  EXPECT_NE(std::string(failed.what()).find("allocating it failed"), std::string::npos);
  const std::bad_alloc& as_bad_alloc = failed;  // callers that catch std::bad_alloc still do
  EXPECT_EQ(std::string(as_bad_alloc.what()), failed.what());
}

TEST(Manager, APoolLargerThanTheHostIsRefusedBeforeAnyAllocation) {
  const std::uint64_t needed = CPUOffloadingManager::memory_bytes(kMaxNumBlocks, "lru");
  if (needed <= host_memory_limit_bytes()) {
    GTEST_SKIP() << "this host has " << host_memory_limit_bytes() << " bytes, enough for "
                 << needed;
  }
  try {
    CPUOffloadingManager m(kMaxNumBlocks);
    FAIL();
  } catch (const HostMemoryError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("num_blocks=2147483647"), std::string::npos) << what;
    EXPECT_NE(what.find("more than the"), std::string::npos) << what;  // checked, not tried
  }
}

#if defined(__linux__)
std::uint64_t virtual_memory_bytes() {
  std::ifstream status("/proc/self/status");
  std::string field;
  while (status >> field) {
    if (field == "VmSize:") {
      std::uint64_t kib = 0;
      status >> kib;
      return kib << 10;
    }
  }
  return 0;
}

// In a child process whose address space is capped 512 MiB above its current size, a pool
// needing ~3.7 GiB fails to allocate (its 1 GiB of index buckets, after the 160 MiB block pool);
// the error names it, and the arrays built before the failure are freed.
[[noreturn]] void build_a_pool_too_large_for_the_address_space() {
  const std::uint64_t used = virtual_memory_bytes();
  const rlimit cap{used + (std::uint64_t{512} << 20), used + (std::uint64_t{512} << 20)};
  if (used == 0 || setrlimit(RLIMIT_AS, &cap) != 0) {
    std::_Exit(2);
  }
  try {
    CPUOffloadingManager m(std::int64_t{1} << 25);
    std::_Exit(3);
  } catch (const HostMemoryError& e) {
    const std::string what = e.what();
    if (what.find("num_blocks=33554432") == std::string::npos ||
        what.find("allocating it failed") == std::string::npos) {
      std::fputs(e.what(), stderr);
      std::_Exit(4);
    }
  }
  // ~470 MiB: fits only if the ~160 MiB block pool built before the failure was freed.
  CPUOffloadingManager fits(std::int64_t{1} << 22);
  std::_Exit(fits.num_blocks() == (1u << 22) ? 0 : 5);
}

TEST(ManagerDeathTest, AFailedAllocationBecomesAHostMemoryErrorAndFreesEverything) {
  EXPECT_EXIT(build_a_pool_too_large_for_the_address_space(), ::testing::ExitedWithCode(0), "");
}
#endif

// ------------------------------------------------------------------------ lookup / pool

TEST(Manager, LookupCountsLeadingReadyKeys) {
  CPUOffloadingManager m(8);
  store(m, K({"a", "b", "c"}));
  EXPECT_EQ(m.lookup(K({"a", "b", "c"})), 3u);
  EXPECT_EQ(m.lookup(K({"a", "x", "c"})), 1u);  // stops at the first missing key
  EXPECT_EQ(m.lookup(K({"x", "a"})), 0u);
  EXPECT_EQ(m.lookup(K({})), 0u);
  EXPECT_EQ(m.num_stored_blocks(), 3u);
  EXPECT_EQ(m.num_free_blocks(), 5u);
}

TEST(Manager, LookupOfPendingKeyIsRetryLater) {
  CPUOffloadingManager m(8);
  store(m, K({"a"}));
  ASSERT_TRUE(m.prepare_store(K({"b"})));
  EXPECT_EQ(m.lookup(K({"a", "b"})), std::nullopt);
  EXPECT_EQ(m.lookup(K({"b"})), std::nullopt);
  EXPECT_EQ(m.lookup(K({"a", "x", "b"})), 1u);  // the pending key is after the first miss
}

TEST(Manager, BlockIdsAreDistinctSlots) {
  CPUOffloadingManager m(4);
  auto r = m.prepare_store(K({"a", "b", "c", "d"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->block_ids, (std::vector<std::uint32_t>{0, 1, 2, 3}));
  EXPECT_EQ(str(r->keys_to_store), S({"a", "b", "c", "d"}));
  EXPECT_TRUE(r->evicted_keys.empty());
  EXPECT_EQ(m.num_free_blocks(), 0u);
  EXPECT_EQ(m.num_pending_blocks(), 4u);
  m.complete_store(K({"a", "b", "c", "d"}));
  EXPECT_EQ(m.prepare_load(K({"c", "a"})), (std::vector<std::uint32_t>{2, 0}));
}

// ------------------------------------------------------------------------ invariant 6: stores

// A block is a lookup hit only after complete_store(success=true).
TEST(Invariant6, HitOnlyAfterSuccessfulCompleteStore) {
  CPUOffloadingManager m(4);
  auto r = m.prepare_store(K({"a", "b"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(m.state("a"), BlockState::kPending);
  EXPECT_EQ(m.lookup(K({"a"})), std::nullopt);
  EXPECT_THROW(m.prepare_load(K({"a"})), std::invalid_argument);
  EXPECT_EQ(m.num_stored_blocks(), 0u);
  m.complete_store(K({"a"}));
  EXPECT_EQ(m.lookup(K({"a"})), 1u);
  EXPECT_EQ(m.lookup(K({"a", "b"})), std::nullopt);
  m.complete_store(K({"b"}));
  EXPECT_EQ(m.lookup(K({"a", "b"})), 2u);
}

// A failed store frees its slots and is never a hit.
TEST(Invariant6, FailedStoreFreesSlots) {
  CPUOffloadingManager m(2, "lru", true);
  auto r = m.prepare_store(K({"a", "b"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(m.num_free_blocks(), 0u);
  m.complete_store(K({"a", "b"}), /*success=*/false);
  EXPECT_EQ(m.num_free_blocks(), 2u);
  EXPECT_EQ(m.num_pending_blocks(), 0u);
  EXPECT_EQ(m.num_stored_blocks(), 0u);
  EXPECT_EQ(m.state("a"), BlockState::kMissing);
  EXPECT_EQ(m.lookup(K({"a"})), 0u);
  EXPECT_TRUE(m.take_events().empty());  // a failed store is never announced
  // The freed slots are usable (a leak would make this prepare_store return nullopt).
  auto again = m.prepare_store(K({"c", "d"}));
  ASSERT_TRUE(again);
  EXPECT_TRUE(again->evicted_keys.empty());
}

// prepare_store is all-or-nothing: nullopt changes no state.
TEST(Invariant6, PrepareStoreAllOrNothing) {
  CPUOffloadingManager m(4, "lru", true);
  store(m, K({"d"}));
  store(m, K({"c"}));
  store(m, K({"b"}));
  store(m, K({"a"}));  // LRU order (least recent first): d c b a
  m.prepare_load(K({"a"}));
  (void)m.take_events();
  const Keys all = K({"a", "b", "c", "d", "e", "f", "g", "h"});
  const Snapshot before = snap(m, all);
  // Needs 4 slots: 0 free, 3 evictable (a is pinned) -> refused, even though 3 could go.
  EXPECT_FALSE(m.prepare_store(K({"e", "f", "g", "h"})).has_value());
  EXPECT_EQ(snap(m, all), before);
  EXPECT_TRUE(m.take_events().empty());
  EXPECT_EQ(m.lookup(K({"a", "b", "c", "d"})), 4u);
  // The recency order is unchanged too: evictions still go d, c, b.
  EXPECT_EQ(drain(m, 3), S({"d", "c", "b"}));
}

// The refusal also holds when the blocking blocks are pending or keys of the call itself.
TEST(Invariant6, PrepareStoreRefusesWhenOnlyProtectedOrPendingBlocksRemain) {
  CPUOffloadingManager m(3, "lru", true);
  store(m, K({"a", "b"}));
  ASSERT_TRUE(m.prepare_store(K({"p"})));  // pending, fills the pool
  const Keys all = K({"a", "b", "p", "x"});
  const Snapshot before = snap(m, all);
  EXPECT_FALSE(m.prepare_store(K({"a", "b", "x"})).has_value());  // a, b protected; p pending
  EXPECT_EQ(snap(m, all), before);
  EXPECT_FALSE(m.prepare_store(K({"x", "y", "z"})).has_value());  // needs 3, only 2 evictable
  EXPECT_EQ(snap(m, all), before);
  EXPECT_EQ(m.take_events().size(), 1u);  // only the BlockStored of a, b
}

// Keys of one call are never evicted to make room for each other.
TEST(Invariant6, KeysOfOneCallAreNotEvictedForEachOther) {
  CPUOffloadingManager m(3);
  store(m, K({"a"}));
  store(m, K({"b"}));
  store(m, K({"c"}));  // LRU order: a b c
  auto r = m.prepare_store(K({"a", "d"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(str(r->keys_to_store), S({"d"}));
  EXPECT_EQ(str(r->evicted_keys), S({"b"}));  // a is the LRU block but belongs to the call
  EXPECT_EQ(m.state("a"), BlockState::kReady);
  EXPECT_EQ(m.state("b"), BlockState::kMissing);
}

// Blocks being loaded cannot be evicted until complete_load.
TEST(Invariant6, PinnedBlocksAreNotEvictedUntilCompleteLoad) {
  CPUOffloadingManager m(2);
  store(m, K({"a"}));
  store(m, K({"b"}));  // LRU order: a b
  EXPECT_EQ(m.prepare_load(K({"a"})).size(), 1u);
  EXPECT_EQ(m.pin_count("a"), 1u);
  auto r = m.prepare_store(K({"c"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(str(r->evicted_keys), S({"b"}));  // a is least recent but pinned
  EXPECT_FALSE(m.prepare_store(K({"d"})).has_value());  // a pinned, c pending
  m.complete_store(K({"c"}));
  m.complete_load(K({"a"}));
  EXPECT_EQ(m.pin_count("a"), 0u);
  r = m.prepare_store(K({"d"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(str(r->evicted_keys), S({"a"}));
}

TEST(Invariant6, DoublePinNeedsTwoCompleteLoads) {
  CPUOffloadingManager m(1);
  store(m, K({"a"}));
  m.prepare_load(K({"a"}));
  m.prepare_load(K({"a"}));
  m.complete_load(K({"a"}));
  EXPECT_FALSE(m.prepare_store(K({"b"})).has_value());  // still pinned once
  m.complete_load(K({"a"}));
  EXPECT_TRUE(m.prepare_store(K({"b"})).has_value());
}

TEST(Invariant6, PendingBlocksAreNotEvicted) {
  CPUOffloadingManager m(1);
  ASSERT_TRUE(m.prepare_store(K({"a"})));
  EXPECT_FALSE(m.prepare_store(K({"b"})).has_value());
  EXPECT_EQ(m.state("a"), BlockState::kPending);
}

TEST(Invariant6, DuplicateNewKeysNeedOneSlot) {
  CPUOffloadingManager m(2);
  auto r = m.prepare_store(K({"a", "b", "a", "b"}));
  ASSERT_TRUE(r);  // 2 distinct keys fit exactly
  EXPECT_EQ(str(r->keys_to_store), S({"a", "b"}));
  m.complete_store(K({"a", "b", "a"}));  // a repeated key is finished once
  EXPECT_EQ(m.num_stored_blocks(), 2u);
}

TEST(Invariant6, HeldKeysAreNotStoredAgain) {
  CPUOffloadingManager m(4);
  store(m, K({"a"}));
  ASSERT_TRUE(m.prepare_store(K({"b"})));
  auto r = m.prepare_store(K({"a", "b", "c"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(str(r->keys_to_store), S({"c"}));
  EXPECT_EQ(m.num_free_blocks(), 1u);
}

TEST(Invariant6, EvictionFillsFreedSlots) {
  CPUOffloadingManager m(3);
  store(m, K({"a", "b", "c"}));  // eviction order c b a
  auto r = m.prepare_store(K({"x", "y"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(str(r->evicted_keys), S({"c", "b"}));
  std::vector<std::uint32_t> ids = r->block_ids;
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(ids, (std::vector<std::uint32_t>{1, 2}));  // the slots of b and c
  EXPECT_EQ(m.num_free_blocks(), 0u);
}

TEST(Invariant6, StoreIndicesNameFirstOccurrencesOfNewKeys) {
  CPUOffloadingManager m(8);
  store(m, K({"held"}));
  const Keys call = K({"x", "held", "y", "x", "z", "y"});
  auto r = m.prepare_store(call);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->store_indices, (std::vector<std::uint32_t>{0, 2, 4}));
  ASSERT_EQ(r->keys_to_store.size(), 3u);
  for (std::size_t j = 0; j < 3; ++j) {  // views of the call's own key bytes
    EXPECT_EQ(r->keys_to_store[j].data(), call[r->store_indices[j]].data());
  }
  EXPECT_EQ(r->block_ids.size(), 3u);
}

TEST(Invariant6, EvictedSlotsGoToNewKeysLastVictimFirstThenFreeSlots) {
  CPUOffloadingManager m(4);
  store(m, K({"a", "b", "c"}));  // slots 0 1 2; eviction order c b a; slot 3 free
  auto r = m.prepare_store(K({"x", "y", "w"}));  // needs 3: the free slot and 2 victims
  ASSERT_TRUE(r);
  EXPECT_EQ(str(r->evicted_keys), S({"c", "b"}));
  // The order a LIFO free list gives after freeing the victims c (2) then b (1).
  EXPECT_EQ(r->block_ids, (std::vector<std::uint32_t>{1, 2, 3}));
  EXPECT_EQ(m.block_id("x"), 1u);
  EXPECT_EQ(m.block_id("w"), 3u);
  EXPECT_EQ(m.num_free_blocks(), 0u);
  m.complete_store(K({"x", "y", "w"}));
  EXPECT_EQ(m.lookup(K({"a", "x", "y", "w"})), 4u);
  EXPECT_EQ(m.lookup(K({"b"})), 0u);
  EXPECT_EQ(m.lookup(K({"c"})), 0u);
}

// ------------------------------------------------------------------------ invariant 8: order

// touch processes keys last to first: with equal prior recency, touch([a, b, c]) leaves a the
// most recent, so eviction goes c, b, a (tail of the prefix first).
TEST(Invariant8, TouchLastToFirstEvictsTailFirst) {
  CPUOffloadingManager m(3);
  store(m, K({"c", "b", "a"}));  // eviction order before touch: a b c
  m.touch(K({"a", "b", "c"}));
  EXPECT_EQ(drain(m, 3), S({"c", "b", "a"}));
}

TEST(Invariant8, PrepareStoreMakesFirstKeyMostRecent) {
  CPUOffloadingManager m(3);
  store(m, K({"a", "b", "c"}));
  EXPECT_EQ(drain(m, 3), S({"c", "b", "a"}));
}

TEST(Invariant8, TouchIgnoresUnknownKeysAndMovesOnlyHeldOnes) {
  CPUOffloadingManager m(3);
  store(m, K({"a"}));
  store(m, K({"b"}));
  store(m, K({"c"}));  // order: a b c
  m.touch(K({"zz", "a", "yy"}));
  EXPECT_EQ(drain(m, 3), S({"b", "c", "a"}));
}

TEST(Invariant8, PrepareStoreDoesNotTouchHeldKeys) {
  CPUOffloadingManager m(3);
  store(m, K({"a"}));
  store(m, K({"b"}));  // order: a b
  ASSERT_TRUE(m.prepare_store(K({"a", "c"})));
  m.complete_store(K({"c"}));
  EXPECT_EQ(drain(m, 1), S({"a"}));
}

// touch_blocks (by CPU block id, as the scheduler's loads use it) orders exactly as touch (by
// key) under every policy, pending blocks included; a bad id changes nothing.
TEST(Invariant6, PrepareStoreGivesEveryKeysBlock) {
  CPUOffloadingManager m(3);
  store(m, K({"a", "b"}));
  // held, new, repeated held, repeated new, new (evicts: 1 free slot for 2 new keys)
  auto r = m.prepare_store(K({"a", "x", "a", "x", "y"}));
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(str(r->keys_to_store), S({"x", "y"}));
  ASSERT_EQ(str(r->evicted_keys), S({"b"}));
  std::vector<std::uint32_t> want;
  for (const char* k : {"a", "x", "a", "x", "y"}) want.push_back(m.block_id(k).value());
  EXPECT_EQ(r->key_block_ids, want);
  EXPECT_EQ(r->key_block_ids[1], r->block_ids[0]);
  EXPECT_EQ(r->key_block_ids[4], r->block_ids[1]);
}

TEST(Invariant8, TouchBlocksOrdersAsTouchByKeyUnderEveryPolicy) {
  for (const char* policy : {"lru", "arc", "probation"}) {
    SCOPED_TRACE(policy);
    CPUOffloadingManager by_key(13, policy);  // full: every fresh key of drain() evicts
    CPUOffloadingManager by_id(13, policy);
    std::mt19937 rng(7);
    Strings names;
    for (int i = 0; i < 12; ++i) names.push_back("k" + std::to_string(i));
    for (auto* m : {&by_key, &by_id}) {
      for (int i = 0; i < 12; i += 3) store(*m, Keys{names[i], names[i + 1], names[i + 2]});
      ASSERT_TRUE(m->prepare_store(K({"pending"})));  // touched while pending: touch_pending
    }
    for (int round = 0; round < 20; ++round) {
      Keys keys;
      std::vector<std::uint32_t> ids;
      const int n = 1 + static_cast<int>(rng() % 5);
      for (int i = 0; i < n; ++i) {
        const std::string_view k =
            rng() % 6 == 0 ? std::string_view("pending") : std::string_view(names[rng() % 12]);
        keys.push_back(k);
        ids.push_back(by_id.block_id(k).value());
      }
      by_key.touch(keys);
      by_id.touch_blocks(ids);
    }
    // One call that evicts every block shows the whole victim order (the same new keys).
    std::vector<Strings> victims;
    for (auto* m : {&by_key, &by_id}) {
      m->complete_store(K({"pending"}));
      Strings fresh;
      for (int i = 0; i < 13; ++i) fresh.push_back("new" + std::to_string(i));
      auto r = m->prepare_store(Keys(fresh.begin(), fresh.end()));
      ASSERT_TRUE(r.has_value());
      victims.push_back(str(r->evicted_keys));
    }
    EXPECT_EQ(victims[0].size(), 13u);
    EXPECT_EQ(victims[0], victims[1]);
  }
}

TEST(Invariant7, TouchBlocksWithABadIdChangesNothing) {
  CPUOffloadingManager m(4);
  store(m, K({"c", "b", "a"}));  // eviction order: a b c; block 3 is free
  const std::uint32_t a = m.block_id("a").value();
  const std::uint32_t free_block = 3;
  ASSERT_NE(a, free_block);
  for (const std::uint32_t bad : {free_block, 4u, 0xffffffffu}) {
    try {
      m.touch_blocks(std::vector<std::uint32_t>{a, bad});
      ADD_FAILURE() << "touch_blocks accepted block id " << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("block_ids[1] = " + std::to_string(bad)),
                std::string::npos)
          << e.what();
    }
  }
  store(m, K({"d"}));                                // fills the free block
  EXPECT_EQ(drain(m, 4), S({"a", "b", "c", "d"}));  // "a" was not touched by the refused calls
}

// ------------------------------------------------------------------------ events

TEST(Events, StoredAndRemovedInOrder) {
  CPUOffloadingManager m(2, "lru", true);
  store(m, K({"a", "b"}));
  ASSERT_TRUE(m.prepare_store(K({"c"})));  // evicts b
  m.complete_store(K({"c"}));
  ASSERT_TRUE(m.prepare_store(K({"d"})));  // evicts a
  m.complete_store(K({"d"}), false);       // a failed store records nothing
  auto events = m.take_events();
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].keys, S({"a", "b"}));
  EXPECT_FALSE(events[0].removed);
  EXPECT_EQ(events[0].kind(), "BlockStored");
  EXPECT_EQ(events[0].medium, "CPU");
  EXPECT_EQ(events[1].keys, S({"b"}));
  EXPECT_TRUE(events[1].removed);
  EXPECT_EQ(events[1].kind(), "BlockRemoved");
  EXPECT_EQ(events[2].keys, S({"c"}));
  EXPECT_FALSE(events[2].removed);
  EXPECT_EQ(events[3].keys, S({"a"}));
  EXPECT_TRUE(events[3].removed);
  EXPECT_TRUE(m.take_events().empty());  // taken events are cleared
}

TEST(Events, DisabledRecordsNothing) {
  CPUOffloadingManager m(1);
  store(m, K({"a"}));
  store(m, K({"b"}));
  EXPECT_TRUE(m.take_events().empty());
}

// Stores of several requests completed in one call (the scheduler's update_connector_output)
// are announced one BlockStored event per run (event_ends): a router reads an event's keys as
// one request's run, so an event never lists two requests' blocks. A slot repeated in a later
// run is listed in the first only; a run left empty so has no event; bad ends change nothing.
TEST(Events, CompleteStoreBlocksSplitsEventsByRun) {
  CPUOffloadingManager m(8, "lru", true);
  auto p = m.prepare_store(K({"a0", "a1", "b0", "c0", "c1"}));
  ASSERT_TRUE(p);
  const auto& s = p->block_ids;
  // runs: [a0 a1] [b0 a1] [a0] [c0 c1]  (the third run repeats a slot only)
  const std::vector<std::uint32_t> slots{s[0], s[1], s[2], s[1], s[0], s[3], s[4]};
  const Keys all = K({"a0", "a1", "b0", "c0", "c1"});
  const Snapshot before = snap(m, all);
  for (const std::vector<std::size_t>& bad :
       {std::vector<std::size_t>{2, 2, 7}, std::vector<std::size_t>{4, 2},
        std::vector<std::size_t>{2, 8}}) {
    EXPECT_THROW(m.complete_store_blocks(slots, true, true, bad), std::invalid_argument);
    EXPECT_EQ(snap(m, all), before);
  }
  const std::vector<std::size_t> ends{2, 4, 5, 7};
  m.complete_store_blocks(slots, true, true, ends);
  const auto events = m.take_events();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].keys, S({"a0", "a1"}));
  EXPECT_EQ(events[1].keys, S({"b0"}));
  EXPECT_EQ(events[2].keys, S({"c0", "c1"}));
  for (const auto& e : events) EXPECT_FALSE(e.removed);
  EXPECT_EQ(m.lookup(all), 5u);
}

// ------------------------------------------------------------------------ invariant 7: bad input

TEST(BadInput, PrepareLoadOfMissingOrPendingKeyChangesNothing) {
  CPUOffloadingManager m(4);
  store(m, K({"a", "b"}));
  ASSERT_TRUE(m.prepare_store(K({"p"})));
  const Keys all = K({"a", "b", "p", "x"});
  const Snapshot before = snap(m, all);
  try {
    m.prepare_load(K({"a", "b", "x"}));
    FAIL();
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("keys[2]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("78"), std::string::npos) << msg;  // hex of "x"
    EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
  }
  try {
    m.prepare_load(K({"a", "p"}));
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("pending"), std::string::npos) << e.what();
  }
  EXPECT_EQ(snap(m, all), before);  // a and b were not pinned
}

TEST(BadInput, CompleteLoadOfKeyNotBeingLoadedChangesNothing) {
  CPUOffloadingManager m(4);
  store(m, K({"a", "b"}));
  m.prepare_load(K({"a", "b"}));
  const Keys all = K({"a", "b"});
  const Snapshot before = snap(m, all);
  EXPECT_THROW(m.complete_load(K({"a", "x"})), std::invalid_argument);
  EXPECT_THROW(m.complete_load(K({"a", "b", "a"})), std::invalid_argument);  // a pinned once
  EXPECT_EQ(snap(m, all), before);
  m.complete_load(K({"b", "a"}));
  EXPECT_THROW(m.complete_load(K({"a"})), std::invalid_argument);
  EXPECT_EQ(m.num_evictable_blocks(), 2u);
}

// complete_load_blocks (by the block ids prepare_load returned, as the scheduler's load jobs
// complete) unpins exactly as complete_load by key, and refuses what complete_load refuses.
TEST(Invariant6, CompleteLoadBlocksUnpinsAsCompleteLoad) {
  CPUOffloadingManager m(2);
  store(m, K({"a"}));
  store(m, K({"b"}));  // LRU order: a b
  const std::vector<std::uint32_t> ids = m.prepare_load(K({"a"}));
  m.prepare_load(K({"a"}));  // pinned twice
  ASSERT_TRUE(m.prepare_store(K({"c"})));  // evicts b, not the pinned a
  m.complete_store(K({"c"}));
  m.complete_load_blocks(ids);
  EXPECT_EQ(m.pin_count("a"), 1u);
  EXPECT_EQ(m.num_evictable_blocks(), 1u);  // c; a is still pinned once
  m.complete_load_blocks(ids);
  EXPECT_EQ(m.pin_count("a"), 0u);
  EXPECT_EQ(m.num_evictable_blocks(), 2u);
}

TEST(BadInput, CompleteLoadBlocksOfBlockNotBeingLoadedChangesNothing) {
  CPUOffloadingManager m(5);
  m.set_write_through(4);
  store(m, K({"w"}));  // ready, pinned for write-through only
  m.set_write_through(0);
  store(m, K({"a", "b"}));
  ASSERT_TRUE(m.prepare_store(K({"p"})));  // pending
  const std::vector<std::uint32_t> ab = m.prepare_load(K({"a", "b"}));
  const std::uint32_t a = ab[0];
  const std::uint32_t w = m.block_id("w").value();
  const std::uint32_t p = m.block_id("p").value();
  std::uint32_t free_block = 0;
  while (free_block == a || free_block == ab[1] || free_block == w || free_block == p) {
    ++free_block;
  }
  const Keys all = K({"a", "b", "w", "p"});
  const Snapshot before = snap(m, all);
  const auto refused = [&](std::vector<std::uint32_t> ids, std::size_t bad) {
    try {
      m.complete_load_blocks(ids);
      ADD_FAILURE() << "complete_load_blocks accepted block_ids[" << bad << "]";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("block_ids[" + std::to_string(bad) + "] = " +
                                           std::to_string(ids[bad])),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(snap(m, all), before);
  };
  refused({a, 5}, 1);           // out of range
  refused({a, free_block}, 1);  // free
  refused({a, p}, 1);           // pending
  refused({a, w}, 1);           // only the write-through pin: no load in flight
  refused({a, ab[1], a}, 2);    // a is pinned by one load, asked twice
  m.complete_load_blocks(std::vector<std::uint32_t>{ab[1], a});
  EXPECT_EQ(m.pin_count("a"), 0u);
  EXPECT_EQ(m.pin_count("b"), 0u);
  EXPECT_EQ(m.pin_count("w"), 1u);
}

TEST(BadInput, CompleteStoreOfKeyNotPendingChangesNothing) {
  CPUOffloadingManager m(4, "lru", true);
  store(m, K({"r"}));
  (void)m.take_events();
  ASSERT_TRUE(m.prepare_store(K({"a", "b"})));
  const Keys all = K({"a", "b", "r", "x"});
  const Snapshot before = snap(m, all);
  for (const bool success : {true, false}) {
    EXPECT_THROW(m.complete_store(K({"a", "x"}), success), std::invalid_argument);  // missing
    EXPECT_THROW(m.complete_store(K({"b", "r"}), success), std::invalid_argument);  // ready
    EXPECT_EQ(snap(m, all), before);
  }
  EXPECT_TRUE(m.take_events().empty());
  m.complete_store(K({"a", "b"}));
  EXPECT_THROW(m.complete_store(K({"a"})), std::invalid_argument);  // already completed
}

// complete_store_blocks (by slot, as the scheduler completes its store jobs) behaves as
// complete_store by key: ready and announced on success, freed and never a hit on failure,
// repeats finished once; a slot that is out of range, free or not pending changes nothing.
TEST(Invariant6, CompleteStoreBlocksEqualsCompleteStoreByKey) {
  CPUOffloadingManager m(4, "lru", true);
  store(m, K({"r"}));
  (void)m.take_events();
  auto p = m.prepare_store(K({"a", "b", "c"}));
  ASSERT_TRUE(p);
  ASSERT_EQ(p->block_ids.size(), 3u);
  const std::uint32_t a = p->block_ids[0], b = p->block_ids[1], c = p->block_ids[2];
  const std::uint32_t r = *m.block_id("r");
  const Keys all = K({"a", "b", "c", "r"});
  const Snapshot before = snap(m, all);
  for (const bool success : {true, false}) {
    const std::vector<std::uint32_t> ready{a, r}, outside{a, 4}, huge{b, 1u << 31};
    EXPECT_THROW(m.complete_store_blocks(ready, success), std::invalid_argument);
    EXPECT_THROW(m.complete_store_blocks(outside, success), std::invalid_argument);
    EXPECT_THROW(m.complete_store_blocks(huge, success), std::invalid_argument);
    EXPECT_EQ(snap(m, all), before);
  }
  EXPECT_TRUE(m.take_events().empty());
  const std::vector<std::uint32_t> ok{a, b, a};  // a repeated: finished once
  m.complete_store_blocks(ok, true);
  EXPECT_EQ(m.lookup(K({"a", "b"})), 2u);
  EXPECT_EQ(m.num_pending_blocks(), 1u);
  EXPECT_EQ(m.num_stored_blocks(), 3u);
  const auto events = m.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].keys, S({"a", "b"}));
  EXPECT_FALSE(events[0].removed);
  const std::vector<std::uint32_t> again{a};
  EXPECT_THROW(m.complete_store_blocks(again, true), std::invalid_argument);  // ready now
  const std::vector<std::uint32_t> failed{c};
  m.complete_store_blocks(failed, false);
  EXPECT_EQ(m.state("c"), BlockState::kMissing);
  EXPECT_EQ(m.num_free_blocks(), 1u);
  EXPECT_EQ(m.num_pending_blocks(), 0u);
  EXPECT_TRUE(m.take_events().empty());  // a failed store is never announced
  const std::vector<std::uint32_t> freed{c};
  EXPECT_THROW(m.complete_store_blocks(freed, true), std::invalid_argument);  // a free slot
}

// prepare_store into a reused result gives what the optional form gives on a fresh manager,
// whatever the result held before (evictions included), and refuses alike.
TEST(Invariant6, PrepareStoreIntoAReusedResultEqualsTheFreshOne) {
  CPUOffloadingManager a(3), b(3);
  PrepareStoreResult reused;
  for (const Keys& keys : {K({"a", "b"}), K({"b", "c", "d"}), K({"e"}), K({"d", "f", "g"})}) {
    auto fresh = a.prepare_store(keys);
    ASSERT_TRUE(fresh);
    ASSERT_TRUE(b.prepare_store(keys, reused));
    EXPECT_EQ(reused.store_indices, fresh->store_indices);
    EXPECT_EQ(reused.keys_to_store, fresh->keys_to_store);
    EXPECT_EQ(reused.block_ids, fresh->block_ids);
    EXPECT_EQ(reused.evicted_keys, fresh->evicted_keys);
    EXPECT_EQ(reused.key_block_ids, fresh->key_block_ids);
    a.complete_store(fresh->keys_to_store);
    b.complete_store(reused.keys_to_store);
  }
  const auto all = K({"a", "b", "c", "d", "e", "f", "g"});
  EXPECT_EQ(snap(a, all), snap(b, all));
  a.prepare_load(K({"d", "f", "g"}));
  b.prepare_load(K({"d", "f", "g"}));
  EXPECT_FALSE(a.prepare_store(K({"x"})));  // every block pinned
  EXPECT_FALSE(b.prepare_store(K({"x"}), reused));
  EXPECT_EQ(snap(a, all), snap(b, all));
}

TEST(BadInput, EmptyKeyIsRejectedEverywhere) {
  CPUOffloadingManager m(2);
  store(m, K({"a"}));
  const Keys bad = K({"a", ""});
  const Snapshot before = snap(m, K({"a"}));
  EXPECT_THROW((void)m.lookup(bad), std::invalid_argument);
  EXPECT_THROW(m.prepare_load(bad), std::invalid_argument);
  EXPECT_THROW(m.complete_load(bad), std::invalid_argument);
  EXPECT_THROW(m.touch(bad), std::invalid_argument);
  EXPECT_THROW((void)m.prepare_store(bad), std::invalid_argument);
  EXPECT_THROW(m.complete_store(bad), std::invalid_argument);
  EXPECT_EQ(snap(m, K({"a"})), before);
}

}  // namespace
}  // namespace kvoff
