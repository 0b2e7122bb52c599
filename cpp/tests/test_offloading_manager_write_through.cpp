// CPUOffloadingManager: discard, clear and write-through to the secondary tiers (pins, the
// queue, hand-backs from another thread, cancel).
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

TEST(CPUOffloadingManagerDiscard, DropsOnlyReadyUnpinnedKeysOnce) {
  CPUOffloadingManager m(8, "lru", /*enable_events=*/true);
  const Keys ready{"r0", "r1", "r2"};
  ASSERT_TRUE(m.prepare_store(ready).has_value());
  m.complete_store(ready);
  m.prepare_load(K({"r1"}));
  ASSERT_TRUE(m.prepare_store(K({"p0"})).has_value());
  (void)m.take_events();
  EXPECT_EQ(m.discard(K({"r0", "r0", "r1", "p0", "missing", "r2"})), 2u);
  EXPECT_EQ(m.state("r0"), BlockState::kMissing);
  EXPECT_EQ(m.state("r2"), BlockState::kMissing);
  EXPECT_EQ(m.state("r1"), BlockState::kReady);   // pinned by a load
  EXPECT_EQ(m.state("p0"), BlockState::kPending);  // a store in flight
  EXPECT_EQ(m.num_stored_blocks(), 1u);
  EXPECT_EQ(m.num_free_blocks(), 6u);
  const auto events = m.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_TRUE(events[0].removed);
  EXPECT_EQ(events[0].keys.size(), 2u);
  EXPECT_THROW(m.discard(K({""})), std::invalid_argument);
}

TEST(CPUOffloadingManagerClear, DropsReadyUnpinnedBlocksOnly) {
  CPUOffloadingManager m(8, "lru", /*enable_events=*/true);
  const Keys ready{"r0", "r1", "r2"};
  ASSERT_TRUE(m.prepare_store(ready).has_value());
  m.complete_store(ready);
  const Keys pinned{"r1"};
  m.prepare_load(pinned);  // a load in flight
  const Keys pending{"p0"};
  ASSERT_TRUE(m.prepare_store(pending).has_value());  // a store in flight
  (void)m.take_events();
  EXPECT_EQ(m.clear(), 2u);
  EXPECT_EQ(m.state("r0"), BlockState::kMissing);
  EXPECT_EQ(m.state("r2"), BlockState::kMissing);
  EXPECT_EQ(m.state("r1"), BlockState::kReady);
  EXPECT_EQ(m.state("p0"), BlockState::kPending);
  EXPECT_EQ(m.num_stored_blocks(), 1u);
  EXPECT_EQ(m.num_evictable_blocks(), 0u);
  EXPECT_EQ(m.num_free_blocks(), 6u);
  const auto events = m.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_TRUE(events[0].removed);
  EXPECT_EQ(events[0].keys.size(), 2u);
  // the pool keeps working: freed slots are reused, the pin and the store complete
  m.complete_load(pinned);
  m.complete_store(pending);
  EXPECT_EQ(m.clear(), 2u);
  EXPECT_EQ(m.num_free_blocks(), 8u);
  EXPECT_EQ(m.clear(), 0u);
}

TEST(CPUOffloadingManagerClear, IncludingInFlightDropsPendingAndLoadPinnedBlocks) {
  // For an engine that forgets its jobs in flight at a reset (vLLM's OffloadingConnector):
  // without this, the pending key answered "being stored" for ever and the pinned block,
  // computed before the reset, stayed a hit.
  CPUOffloadingManager m(8, "lru", /*enable_events=*/true);
  const Keys ready{"r0", "r1", "r2"};
  ASSERT_TRUE(m.prepare_store(ready).has_value());
  m.complete_store(ready);
  const Keys pinned{"r1"};
  m.prepare_load(pinned);
  m.prepare_load(pinned);  // two loads in flight
  const Keys pending{"p0", "p1"};
  ASSERT_TRUE(m.prepare_store(pending).has_value());
  (void)m.take_events();
  EXPECT_EQ(m.clear(/*include_in_flight=*/true), 5u);
  for (const auto* k : {"r0", "r1", "r2", "p0", "p1"}) {
    EXPECT_EQ(m.state(k), BlockState::kMissing) << k;
  }
  EXPECT_EQ(m.num_free_blocks(), 8u);
  EXPECT_EQ(m.num_stored_blocks(), 0u);
  EXPECT_EQ(m.num_pending_blocks(), 0u);
  EXPECT_EQ(m.num_evictable_blocks(), 0u);
  const auto events = m.take_events();
  ASSERT_EQ(events.size(), 1u);  // the three stored blocks; the pending ones were never stored
  EXPECT_TRUE(events[0].removed);
  EXPECT_EQ(events[0].keys.size(), 3u);
  // the forgotten jobs' completions are errors, changing nothing
  EXPECT_THROW(m.complete_store(pending), std::invalid_argument);
  EXPECT_THROW(m.complete_load(pinned), std::invalid_argument);
  // the keys are stored anew, into any slot, and the pool's accounting holds
  const auto again = m.prepare_store(Keys{"p0", "r1"});
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->keys_to_store.size(), 2u);
  m.complete_store(Keys{"p0", "r1"});
  EXPECT_EQ(m.num_stored_blocks(), 2u);
  EXPECT_EQ(m.num_evictable_blocks(), 2u);
  EXPECT_EQ(m.num_free_blocks(), 6u);
}

TEST(CPUOffloadingManagerWriteThrough, QueuesPinsDropsAndUnpinsWhenHandedBack) {
  CPUOffloadingManager m(4);
  m.set_write_through(2);
  store(m, K({"a", "b", "c"}));  // a and b fit the queue; c is dropped, never waited for
  EXPECT_EQ(m.write_through_in_flight(), 2u);
  EXPECT_EQ(m.write_through_queued(), 2u);
  EXPECT_EQ(m.write_through_dropped(), 1u);
  EXPECT_EQ(m.pin_count("a"), 1u);
  EXPECT_EQ(m.pin_count("c"), 0u);
  EXPECT_EQ(m.num_evictable_blocks(), 1u);
  // pinned blocks are not evicted: 1 free + c evictable = 2 slots, so 3 new keys do not fit
  EXPECT_FALSE(m.prepare_store(K({"x", "y", "z"})).has_value());
  auto batches = m.take_write_through(0.0);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].keys, S({"a", "b"}));
  EXPECT_EQ(batches[0].block_ids, (std::vector<std::uint32_t>{*m.block_id("a"), *m.block_id("b")}));
  EXPECT_TRUE(m.take_write_through(0.0).empty());
  m.write_through_done(batches[0].block_ids);
  EXPECT_EQ(m.pin_count("a"), 1u);  // unpinned by the engine thread's next call, not here
  EXPECT_EQ(m.poll_write_through(), 2u);
  EXPECT_EQ(m.pin_count("a"), 0u);
  EXPECT_EQ(m.write_through_in_flight(), 0u);
  EXPECT_EQ(m.num_evictable_blocks(), 3u);
  EXPECT_TRUE(m.prepare_store(K({"x", "y", "z"})).has_value());
}

TEST(CPUOffloadingManagerWriteThrough, StatesUntilMissingEqualsOneLookupPerKey) {
  // The scheduler's pipelined prefix query answers what state_and_load_pins answers key by key,
  // in every state (ready, pending, pinned by a load, pinned for write-through), and stops at the
  // first missing key; batches longer than the pipeline (2 x KeyIndex::kFindAhead) included.
  CPUOffloadingManager m(512);
  m.set_write_through(8);
  Strings names;
  for (int i = 0; i < 300; ++i) names.push_back("k" + std::to_string(i));
  Keys all(names.begin(), names.end());
  store(m, Keys(all.begin(), all.begin() + 200));     // ready; the first 8 written through
  m.prepare_load(Keys(all.begin() + 10, all.begin() + 12));  // pinned by a load
  m.prepare_load(Keys(all.begin() + 3, all.begin() + 4));    // write-through and load pins
  ASSERT_TRUE(m.prepare_store(Keys(all.begin() + 200, all.begin() + 250)));  // pending
  // k250..k299 missing
  for (const std::size_t begin : {0u, 3u, 150u, 199u, 249u, 250u}) {
    for (const std::size_t len : {0u, 1u, 7u, 64u, 65u, 129u, 300u}) {
      const std::size_t end = std::min<std::size_t>(names.size(), begin + len);
      const Keys keys(all.begin() + begin, all.begin() + end);
      std::vector<std::pair<BlockState, std::uint32_t>> out(keys.size());
      const std::size_t held = m.states_until_missing(keys, out.data());
      std::size_t expect = 0;
      while (expect < keys.size() && m.state(keys[expect]) != BlockState::kMissing) ++expect;
      ASSERT_EQ(held, expect) << begin << "+" << len;
      for (std::size_t i = 0; i < std::min(held + 1, keys.size()); ++i) {
        EXPECT_EQ(out[i], m.state_and_load_pins(keys[i])) << keys[i];
      }
    }
  }
  EXPECT_EQ(m.state_and_load_pins("k3"), std::make_pair(BlockState::kReady, 1u));
  EXPECT_EQ(m.state_and_load_pins("k10"), std::make_pair(BlockState::kReady, 1u));
  EXPECT_EQ(m.state_and_load_pins("k5"), std::make_pair(BlockState::kReady, 0u));
  std::vector<std::pair<BlockState, std::uint32_t>> out(2);
  EXPECT_EQ(m.states_until_missing(K({"", "k0"}), out.data()), 0u);  // empty: missing
  EXPECT_EQ(out[0], std::make_pair(BlockState::kMissing, 0u));
}

TEST(CPUOffloadingManagerWriteThrough, LoadPinsLeaveOutTheWriteThroughPin) {
  CPUOffloadingManager m(4);
  m.set_write_through(4);
  store(m, K({"a"}));
  // pinned for write-through: not evictable, but not a load in flight either
  EXPECT_EQ(m.state_and_pins("a"), std::make_pair(BlockState::kReady, 1u));
  EXPECT_EQ(m.state_and_load_pins("a"), std::make_pair(BlockState::kReady, 0u));
  // complete_load cannot take the write-through pin (no load of a is in flight)
  EXPECT_THROW(m.complete_load(K({"a"})), std::invalid_argument);
  EXPECT_EQ(m.pin_count("a"), 1u);
  ASSERT_TRUE(m.prepare_load(K({"a"})).size() == 1);
  EXPECT_EQ(m.state_and_pins("a"), std::make_pair(BlockState::kReady, 2u));
  EXPECT_EQ(m.state_and_load_pins("a"), std::make_pair(BlockState::kReady, 1u));
  // one load in flight: a repeated key in one call asks for two, and changes nothing
  EXPECT_THROW(m.complete_load(K({"a", "a"})), std::invalid_argument);
  EXPECT_EQ(m.pin_count("a"), 2u);
  m.complete_load(K({"a"}));
  EXPECT_EQ(m.state_and_load_pins("a"), std::make_pair(BlockState::kReady, 0u));
  m.write_through_done(m.take_write_through(0.0).at(0).block_ids);
  EXPECT_EQ(m.poll_write_through(), 1u);
  EXPECT_EQ(m.state_and_pins("a"), std::make_pair(BlockState::kReady, 0u));
  EXPECT_EQ(m.num_evictable_blocks(), 1u);
}

TEST(CPUOffloadingManagerWriteThrough, ClearDropsBlocksBeingWrittenThroughFromTheIndex) {
  // A reset (clear) must leave no block made before it a hit: one still being written to the
  // tiers leaves the index at once, and its slot is freed only when the writer hands it back.
  for (const bool include_in_flight : {false, true}) {
    CPUOffloadingManager m(4);
    m.set_write_through(4);
    store(m, K({"a", "b"}));
    const auto batches = m.take_write_through(0.0);  // the writer reads a and b now
    ASSERT_EQ(batches.size(), 1u);
    ASSERT_TRUE(m.prepare_load(K({"b"})).size() == 1);  // and a load reads b
    EXPECT_EQ(m.clear(include_in_flight), include_in_flight ? 2u : 1u) << include_in_flight;
    EXPECT_EQ(m.state("a"), BlockState::kMissing);
    EXPECT_EQ(m.lookup(K({"a"})), 0u);
    // without include_in_flight the load in flight keeps b (and completes as usual)
    EXPECT_EQ(m.state("b"), include_in_flight ? BlockState::kMissing : BlockState::kReady);
    EXPECT_EQ(m.num_stored_blocks(), include_in_flight ? 0u : 1u);
    EXPECT_EQ(m.num_free_blocks(), 2u);  // a's slot (and b's) still read by the writer
    EXPECT_EQ(m.num_retired_blocks(), include_in_flight ? 2u : 1u);  // counted as retired
    EXPECT_EQ(m.num_free_blocks() + m.num_stored_blocks() + m.num_pending_blocks() +
                  m.num_retired_blocks(),
              4u);
    EXPECT_EQ(m.clear(include_in_flight), 0u);  // a retired slot is not dropped twice
    EXPECT_EQ(m.num_retired_blocks(), include_in_flight ? 2u : 1u);
    m.write_through_done(batches[0].block_ids);
    EXPECT_EQ(m.poll_write_through(), 2u);
    EXPECT_EQ(m.write_through_in_flight(), 0u);
    EXPECT_EQ(m.num_retired_blocks(), 0u);  // handed back: freed
    if (!include_in_flight) {
      EXPECT_EQ(m.num_free_blocks(), 3u);  // a's slot is back; b stays, pinned by its load
      m.complete_load(K({"b"}));
      EXPECT_EQ(m.num_evictable_blocks(), 1u);
    }
    EXPECT_EQ(m.num_free_blocks(), include_in_flight ? 4u : 3u);
    // the freed slots are used again, and a new "a" is a new block
    store(m, K({"a", "c", "d"}));
    EXPECT_EQ(m.state("a"), BlockState::kReady);
    EXPECT_EQ(m.num_stored_blocks(), include_in_flight ? 3u : 4u);
  }
}

TEST(CPUOffloadingManagerWriteThrough, DiscardDropsABlockPinnedOnlyForWriteThrough) {
  CPUOffloadingManager m(4);
  m.set_write_through(4);
  store(m, K({"a", "b"}));
  ASSERT_TRUE(m.prepare_load(K({"b"})).size() == 1);
  EXPECT_EQ(m.discard(K({"a", "b", "a"})), 1u);  // b is read by a load: it stays
  EXPECT_EQ(m.state("a"), BlockState::kMissing);
  EXPECT_EQ(m.state("b"), BlockState::kReady);
  EXPECT_EQ(m.num_free_blocks(), 2u);
  EXPECT_EQ(m.num_retired_blocks(), 1u);  // a: still read by the writer
  m.write_through_done(m.take_write_through(0.0).at(0).block_ids);
  EXPECT_EQ(m.poll_write_through(), 2u);
  EXPECT_EQ(m.num_free_blocks(), 3u);
  EXPECT_EQ(m.num_retired_blocks(), 0u);
}

TEST(CPUOffloadingManagerWriteThrough, CancelHandsBackOnlyBatchesNotTaken) {
  CPUOffloadingManager m(8);
  m.set_write_through(8);
  store(m, K({"a", "b"}));
  const auto taken = m.take_write_through(0.0);
  store(m, K({"c"}));
  store(m, K({"d"}));
  EXPECT_EQ(m.write_through_in_flight(), 4u);
  EXPECT_EQ(m.cancel_write_through(), 2u);  // c and d: never taken
  EXPECT_EQ(m.write_through_cancelled(), 2u);
  EXPECT_TRUE(m.take_write_through(0.0).empty());
  EXPECT_EQ(m.poll_write_through(), 2u);  // c and d unpinned, still stored
  EXPECT_EQ(m.pin_count("c"), 0u);
  EXPECT_EQ(m.state("d"), BlockState::kReady);
  EXPECT_EQ(m.pin_count("a"), 1u);  // a and b are their writer's to finish
  EXPECT_THROW(m.write_through_done(std::vector<std::uint32_t>{*m.block_id("c")}),
               std::invalid_argument);
  m.write_through_done(taken.at(0).block_ids);
  EXPECT_EQ(m.poll_write_through(), 2u);
  EXPECT_EQ(m.write_through_in_flight(), 0u);
  EXPECT_EQ(m.cancel_write_through(), 0u);
}

TEST(CPUOffloadingManagerWriteThrough, BadHandBacksChangeNothing) {
  CPUOffloadingManager m(4);
  EXPECT_THROW(m.write_through_done(std::vector<std::uint32_t>{0}), std::invalid_argument);
  m.set_write_through(4);
  store(m, K({"a", "b"}));
  const auto batches = m.take_write_through(0.0);
  ASSERT_EQ(batches.size(), 1u);
  const std::uint32_t a = batches[0].block_ids[0];
  const std::uint32_t b = batches[0].block_ids[1];
  EXPECT_THROW(m.write_through_done(std::vector<std::uint32_t>{a, a}), std::invalid_argument);
  EXPECT_THROW(m.write_through_done(std::vector<std::uint32_t>{a, 99}), std::invalid_argument);
  const std::uint32_t free_slot = *m.prepare_store(K({"c"}))->block_ids.begin();
  EXPECT_THROW(m.write_through_done(std::vector<std::uint32_t>{free_slot}), std::invalid_argument);
  EXPECT_EQ(m.poll_write_through(), 0u);  // nothing was handed back by the failed calls
  m.write_through_done(std::vector<std::uint32_t>{b, a});
  EXPECT_THROW(m.write_through_done(std::vector<std::uint32_t>{a}), std::invalid_argument);
  EXPECT_EQ(m.poll_write_through(), 2u);
  EXPECT_EQ(m.pin_count("a") + m.pin_count("b"), 0u);
}

TEST(CPUOffloadingManagerWriteThrough, FailedStoresPromotionsAndOffAreNotQueued) {
  CPUOffloadingManager m(8);
  m.set_write_through(8);
  auto r = m.prepare_store(K({"a", "b"}));
  ASSERT_TRUE(r.has_value());
  m.complete_store(K({"a"}), /*success=*/false);
  m.complete_store(K({"b"}), /*success=*/true, /*write_through=*/false);  // a promotion
  EXPECT_EQ(m.write_through_queued(), 0u);
  m.set_write_through(0);
  store(m, K({"c"}));
  EXPECT_EQ(m.write_through_queued(), 0u);
  EXPECT_EQ(m.write_through_dropped(), 0u);
  EXPECT_TRUE(m.take_write_through(0.0).empty());
}

TEST(CPUOffloadingManagerWriteThrough, AWriterThreadHandsBackWhileTheEngineStores) {
  // The engine thread stores and polls; a writer thread takes batches and hands them back.
  // Every queued block is handed back and unpinned exactly once; none is evicted while queued.
  CPUOffloadingManager m(64);
  m.set_write_through(16);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    while (!stop.load()) {
      for (const auto& batch : m.take_write_through(0.01)) m.write_through_done(batch.block_ids);
    }
  });
  std::vector<std::string> keys;
  for (int i = 0; i < 2000; ++i) keys.push_back("k" + std::to_string(i));
  for (int i = 0; i < 2000; i += 4) {
    const Keys batch(keys.begin() + i, keys.begin() + i + 4);
    auto r = m.prepare_store(batch);
    ASSERT_TRUE(r.has_value());  // 64 slots, at most 16 pinned
    Keys stored(r->keys_to_store.begin(), r->keys_to_store.end());
    m.complete_store(stored);
  }
  while (m.write_through_in_flight() > 0) m.wait_write_through(0.01);
  stop.store(true);
  m.close_write_through();
  writer.join();
  EXPECT_GT(m.write_through_queued(), 0u);
  EXPECT_EQ(m.num_evictable_blocks(), m.num_stored_blocks());  // no pin left behind
}

}  // namespace
}  // namespace kvoff
