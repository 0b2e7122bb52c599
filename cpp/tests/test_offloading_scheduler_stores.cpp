// OffloadingScheduler: stores (full blocks, hash sources, idle requests, stale blocks),
// fences (invariant 4), failed loads and cache resets.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvoff/offloading_scheduler.h"

#include "scheduler_test_util.h"

namespace kvoff {
namespace {

using namespace scheduler_test;  // the shared helpers (scheduler_test_util.h)

// ------------------------------------------------------------------------------ stores

TEST(OffloadingSchedulerStore, OnlyFullBlocksAreStoredAcrossSteps) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "r", {"a0"}, 6);
  auto meta = step(s, {sched("r", {{5, 6}}, 0, 6)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "r", {5}, {1}, {0}, {key("a0", 0)});
  EXPECT_EQ(meta.store_jobs[0].cpu_block_ids, U{0});
  EXPECT_EQ(s.next_store_block("r"), 1);
  report(s, {meta.store_jobs[0].job_id});
  // Nothing new is full: no job.
  meta = step(s, {sched("r", Table{{}}, 6, 0)});
  EXPECT_TRUE(meta.store_jobs.empty());
  add(s, "r", {"a0", "a1"}, 8);  // hashes already known are ignored
  meta = step(s, {sched("r", Table{{}}, 6, 2)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "r", {6}, {1}, {1}, {key("a1", 0)});
  EXPECT_EQ(meta.store_jobs[0].cpu_block_ids, U{1});
  EXPECT_EQ(s.next_store_block("r"), 2);
  EXPECT_EQ(s.stats().store_jobs, 2u);
  EXPECT_EQ(s.stats().blocks_stored, 2u);
}

TEST(OffloadingSchedulerStore, CappedByKnownHashes) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "r", {"a0", "a1"}, 17);
  auto meta = step(s, {sched("r", {{1, 2, 3, 4, 5}}, 0, 16)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "r", {1, 2}, {2}, {0}, {key("a0", 0), key("a1", 0)});
  EXPECT_EQ(s.next_store_block("r"), 2);
  add(s, "r", {"a2", "a3"}, 17, 2);
  meta = step(s, {sched("r", Table{{}}, 16, 1)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "r", {3, 4}, {2}, {2}, {key("a2", 0), key("a3", 0)});
  EXPECT_EQ(meta.store_jobs[0].cpu_block_ids, (U{2, 3}));
  EXPECT_EQ(s.next_store_block("r"), 4);
}

TEST(OffloadingSchedulerStore, HashSourceIsAskedOnlyWhenFullBlocksNeedMoreHashes) {
  OffloadingScheduler s(make_config({Full()}));  // 4-token blocks
  add(s, "r", {"a0"}, 5);
  const Strs all = hashes("a", 3);  // the engine's request: grows while it runs
  std::int64_t engine_tokens = 5;
  std::vector<std::pair<std::string, std::size_t>> asked;
  OffloadingScheduler::HashSource source = [&](std::size_t index, std::string_view id,
                                               std::size_t known,
                                               OffloadingScheduler::HashSink& sink) {
    EXPECT_EQ(index, 0u);  // its position in the step's scheduled list
    asked.emplace_back(std::string(id), known);
    const auto have = static_cast<std::size_t>(engine_tokens / 4);
    std::vector<std::string_view> views(all.begin() + static_cast<std::ptrdiff_t>(known),
                                        all.begin() + static_cast<std::ptrdiff_t>(have));
    sink.add(views, engine_tokens);
  };
  // 5 tokens after the step: one full block, its hash is known: no question.
  std::vector<ScheduledRequest> st{sched("r", {{5, 6}}, 0, 5)};
  auto meta = s.build_connector_meta(st, {}, {}, {}, source);
  EXPECT_TRUE(asked.empty());
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  report(s, {meta.store_jobs[0].job_id});
  // Decode to 7 tokens: still one full block: no question.
  engine_tokens = 7;
  st = {sched("r", Table{{}}, 5, 2)};
  meta = s.build_connector_meta(st, {}, {}, {}, source);
  EXPECT_TRUE(asked.empty());
  EXPECT_TRUE(meta.store_jobs.empty());
  // 8 tokens: the second block is full and its hash is pulled once, then stored.
  engine_tokens = 8;
  st = {sched("r", Table{{}}, 7, 1)};
  meta = s.build_connector_meta(st, {}, {}, {}, source);
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0], (std::pair<std::string, std::size_t>{"r", 1}));
  EXPECT_EQ(s.num_hashes("r"), 2u);
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "r", {6}, {1}, {1}, {key("a1", 0)});
}

TEST(OffloadingSchedulerStore, HashSourceWithoutNewHashesStoresNothingMore) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "r", {"a0"}, 8);
  int calls = 0;
  OffloadingScheduler::HashSource source = [&](std::size_t, std::string_view, std::size_t,
                                               OffloadingScheduler::HashSink&) { ++calls; };
  std::vector<ScheduledRequest> st{sched("r", {{5, 6}}, 0, 8)};
  auto meta = s.build_connector_meta(st, {}, {}, {}, source);
  EXPECT_EQ(calls, 1);  // asked, gave nothing (async scheduling): capped by known hashes
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "r", {5}, {1}, {0}, {key("a0", 0)});
}

// A source that gives hashes only (the Python binding's): the request keeps its token count,
// raised to what its hashes cover, so that a lookup up to those tokens stays valid.
TEST(OffloadingSchedulerStore, HashSourceWithoutTokenCountKeepsOrRaisesTheRequests) {
  OffloadingScheduler s(make_config({Full()}));  // 4-token blocks
  add(s, "r", {"a0"}, 5);
  add(s, "q", {"b0"}, 30);
  const Strs ra = hashes("a", 3);
  const Strs qb = hashes("b", 3);
  OffloadingScheduler::HashSource source = [&](std::size_t, std::string_view id,
                                               std::size_t known,
                                               OffloadingScheduler::HashSink& sink) {
    const Strs& all = id == "r" ? ra : qb;
    std::vector<std::string_view> views(all.begin() + static_cast<std::ptrdiff_t>(known),
                                        all.end());
    sink.add(views);
  };
  // both engine requests have grown to 12 tokens (3 full blocks) by this step
  std::vector<ScheduledRequest> st{sched("r", {{5, 6, 7}}, 0, 12),
                                   sched("q", {{8, 9, 10}}, 0, 12)};
  auto meta = s.build_connector_meta(st, {}, {}, {}, source);
  EXPECT_EQ(s.num_hashes("r"), 3u);
  EXPECT_EQ(s.num_hashes("q"), 3u);
  EXPECT_EQ(meta.store_jobs.size(), 2u);
  // r: 5 tokens known before, 12 covered now: a lookup at 12 is in range (the answer is
  // "retry": its own stores are in flight), 16 is not
  EXPECT_NO_THROW(s.get_num_new_matched_tokens("r", 12));
  EXPECT_THROW(s.get_num_new_matched_tokens("r", 16), std::invalid_argument);
  // q: its own 30 stays (not lowered to the 12 its hashes cover)
  EXPECT_NO_THROW(s.get_num_new_matched_tokens("q", 28));
}

// Engine code run by the hash source must not change the scheduler mid-step: the step holds
// pointers to its requests' records, and a request finished and a new one added there would
// get the finished one's record (its GPU blocks stored under the new request's keys). Every
// changing call is refused, naming itself; the step then goes on as if none had been made.
TEST(OffloadingSchedulerStore, CallsFromInsideTheHashSourceAreRefused) {
  OffloadingScheduler s(make_config({Full()}));  // 4-token blocks
  add(s, "a", {"a0"}, 12);
  add(s, "b", {"b0"}, 12);
  const Strs ah = hashes("a", 3);
  const Strs bh = hashes("b", 3);
  std::vector<std::string> refused;
  auto expect_refused = [&](const char* name, const std::function<void()>& call) {
    try {
      call();
      ADD_FAILURE() << name << " was accepted inside the hash source";
    } catch (const std::logic_error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind(std::string(name) + ": called from inside", 0), 0u) << msg;
      refused.emplace_back(name);
    }
  };
  const std::vector<std::string_view> z_hashes{"z0", "z1", "z2"};
  OffloadingScheduler::HashSource source = [&](std::size_t, std::string_view id,
                                               std::size_t known,
                                               OffloadingScheduler::HashSink& sink) {
    if (id == "b") {  // a's record is resolved by now
      expect_refused("request_finished", [&] { s.request_finished("a"); });
      expect_refused("update_request", [&] { s.update_request("z", 0, z_hashes, 12); });
      expect_refused("get_num_new_matched_tokens", [&] { s.get_num_new_matched_tokens("a", 0); });
      expect_refused("update_state_after_alloc", [&] { s.update_state_after_alloc("a", {}, 0); });
      expect_refused("build_connector_meta", [&] { s.build_connector_meta({}); });
      expect_refused("update_connector_output", [&] { s.update_connector_output({}); });
      expect_refused("take_events", [&] { s.take_events(); });
      expect_refused("reset_cache", [&] { s.reset_cache(); });
      EXPECT_EQ(s.num_requests(), 2u);  // const calls are fine
    }
    const Strs& all = id == "a" ? ah : bh;
    std::vector<std::string_view> views(all.begin() + static_cast<std::ptrdiff_t>(known),
                                        all.end());
    sink.add(views);
  };
  std::vector<ScheduledRequest> st{sched("a", {{1, 2, 3}}, 0, 12), sched("b", {{4, 5, 6}}, 0, 12)};
  auto meta = s.build_connector_meta(st, {}, {}, {}, source);
  EXPECT_EQ(refused.size(), 8u);
  ASSERT_EQ(meta.store_jobs.size(), 2u);
  expect_job(s, meta.store_jobs[0], true, "a", {1, 2, 3}, {3}, {0},
             {key("a0", 0), key("a1", 0), key("a2", 0)});
  expect_job(s, meta.store_jobs[1], true, "b", {4, 5, 6}, {3}, {0},
             {key("b0", 0), key("b1", 0), key("b2", 0)});
  // outside the hash source the same calls work again
  EXPECT_TRUE(s.request_finished("a"));
  EXPECT_NO_THROW(s.update_request("z", 0, z_hashes, 12));
}

TEST(OffloadingSchedulerStore, BadHashFromSourceIsRejectedNamingIt) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "r", {"a0"}, 8);
  OffloadingScheduler::HashSource source = [](std::size_t, std::string_view, std::size_t known,
                                              OffloadingScheduler::HashSink& sink) {
    const std::vector<std::string_view> bad{""};
    EXPECT_EQ(known, 1u);
    sink.add(bad, 8);
  };
  std::vector<ScheduledRequest> st{sched("r", {{5, 6}}, 0, 8)};
  try {
    s.build_connector_meta(st, {}, {}, {}, source);
    FAIL() << "an empty hash was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("block hash 1 is empty"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(s.num_hashes("r"), 1u);
  EXPECT_EQ(s.next_store_block("r"), 0);  // the step changed nothing
  EXPECT_EQ(s.num_jobs_in_flight(), 0u);
}

TEST(OffloadingSchedulerLoad, NoLoadNeedsNoBlockTable) {
  OffloadingScheduler s(make_config({Full(), SW(4)}));
  add(s, "r", {"a0", "a1"}, 8);
  ASSERT_EQ(s.get_num_new_matched_tokens("r", 0).num_tokens, std::optional<std::int64_t>(0));
  s.update_state_after_alloc("r", Table{}, 0);  // no group at all: fine when nothing loads
  EXPECT_EQ(s.num_jobs_in_flight(), 0u);
  EXPECT_THROW(s.update_state_after_alloc("r", Table{{1}}, 0), std::invalid_argument)
      << "a table with the wrong group count is still refused";
}

TEST(OffloadingSchedulerStore, RefusedStoreIsRetriedNextStepWithoutAdvancing) {
  OffloadingScheduler s(make_config({Full()}, 4, 1, 0, 1, /*cpu_blocks=*/2));
  add(s, "A", {"a0", "a1"}, 8);
  auto a = step(s, {sched("A", {{1, 2}}, 0, 8)});
  ASSERT_EQ(a.store_jobs.size(), 1u);  // both slots pending
  add(s, "B", {"b0", "b1"}, 9);
  auto meta = step(s, {sched("B", {{3, 4, 5}}, 0, 8)});
  EXPECT_TRUE(meta.store_jobs.empty());
  EXPECT_EQ(s.next_store_block("B"), 0);
  EXPECT_EQ(s.stats().store_refusals, 1u);
  EXPECT_EQ(s.manager().state(key("b0", 0)), BlockState::kMissing);
  EXPECT_EQ(s.manager().state(key("a0", 0)), BlockState::kPending);
  report(s, {a.store_jobs[0].job_id});  // A's blocks become ready, hence evictable
  meta = step(s, {sched("B", Table{{}}, 8, 1)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "B", {3, 4}, {2}, {0}, {key("b0", 0), key("b1", 0)});
  U cpu = meta.store_jobs[0].cpu_block_ids;
  std::sort(cpu.begin(), cpu.end());
  EXPECT_EQ(cpu, (U{0, 1}));
  EXPECT_EQ(s.manager().state(key("a0", 0)), BlockState::kMissing);
  EXPECT_EQ(s.next_store_block("B"), 2);
}

// A decoding request whose blocks are all stored is idle: steps that give it no new block and
// complete none of its offloaded blocks skip it (no lookup). What must still happen: the store
// when a block completes, the retry of a refused store in a step that completes nothing, and
// every check of a step (duplicates, unknown and finished requests).
TEST(OffloadingSchedulerIdle, IdleRequestStoresWhenItsNextBlockCompletes) {
  OffloadingScheduler s(make_config({Full()}, 4));
  add(s, "A", hashes("a", 4), 16);
  auto meta = step(s, {sched("A", {{1, 2}}, 0, 5)});  // tokens 0..4: block 0 full
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  EXPECT_EQ(s.num_idle_requests(), 1u);
  for (std::int64_t c = 5; c < 7; ++c) {  // tokens 5 and 6: block 1 is not full yet
    meta = step(s, {sched("A", Table{}, c, 1)});
    EXPECT_TRUE(meta.store_jobs.empty()) << "at " << c;
    EXPECT_EQ(s.next_store_block("A"), 1);
  }
  meta = step(s, {sched("A", Table{}, 7, 1)});  // token 7 fills block 1 (ids 1, 2 known)
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {2}, {1}, {1}, {key("a1", 0)});
  EXPECT_EQ(s.next_store_block("A"), 2);
  EXPECT_EQ(s.num_idle_requests(), 1u);
}

TEST(OffloadingSchedulerIdle, RefusedStoreIsRetriedInAStepThatCompletesNoBlock) {
  OffloadingScheduler s(make_config({Full()}, 4, 1, 0, 1, /*cpu_blocks=*/2));
  add(s, "A", {"a0", "a1"}, 8);
  auto a = step(s, {sched("A", {{1, 2}}, 0, 8)});
  ASSERT_EQ(a.store_jobs.size(), 1u);  // both slots pending
  EXPECT_EQ(s.num_idle_requests(), 1u);
  add(s, "B", {"b0", "b1"}, 9);
  auto meta = step(s, {sched("B", {{3, 4, 5}}, 0, 9)});
  EXPECT_TRUE(meta.store_jobs.empty());  // refused: no room
  EXPECT_EQ(s.num_idle_requests(), 1u);  // B is not idle: its store must be retried
  report(s, {a.store_jobs[0].job_id});   // A's blocks become ready, hence evictable
  // Token 9 completes no block and brings no new block: only B's retry stores anything.
  meta = step(s, {sched("A", Table{}, 8, 0), sched("B", Table{}, 9, 1)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "B", {3, 4}, {2}, {0}, {key("b0", 0), key("b1", 0)});
  EXPECT_EQ(s.num_idle_requests(), 2u);
}

TEST(OffloadingSchedulerIdle, RequestWaitingForHashesIsNotIdle) {
  OffloadingScheduler s(make_config({Full()}, 4));
  add(s, "A", {"a0"}, 9);  // hashes lag the tokens (async scheduling)
  auto meta = step(s, {sched("A", {{1, 2, 3}}, 0, 9)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);  // block 0 only: block 1 has no hash yet
  EXPECT_EQ(s.next_store_block("A"), 1);
  EXPECT_EQ(s.num_idle_requests(), 0u);
  add(s, "A", {"a1"}, 10, /*start=*/1);
  meta = step(s, {sched("A", Table{}, 9, 1)});  // completes no block, brings no block
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {2}, {1}, {1}, {key("a1", 0)});
  EXPECT_EQ(s.num_idle_requests(), 1u);
}

TEST(OffloadingSchedulerIdle, StepChecksStillRejectIdleRequests) {
  OffloadingScheduler s(make_config({Full()}, 4));
  add(s, "A", hashes("a", 4), 16);
  step(s, {sched("A", {{1, 2}}, 0, 5)});
  ASSERT_EQ(s.num_idle_requests(), 1u);
  const auto before = s.stats().store_jobs;
  // Listed twice: both idle, or one idle and one with new blocks.
  EXPECT_THROW(step(s, {sched("A", Table{}, 5, 1), sched("A", Table{}, 5, 1)}),
               std::invalid_argument);
  EXPECT_THROW(step(s, {sched("A", Table{}, 5, 1), sched("A", {{3}}, 5, 1)}),
               std::invalid_argument);
  EXPECT_THROW(step(s, {sched("A", {{3}}, 5, 1), sched("A", Table{}, 5, 1)}),
               std::invalid_argument);
  EXPECT_THROW(step(s, {sched("nobody", Table{}, 5, 1)}), std::invalid_argument);
  EXPECT_THROW(step(s, {sched("A", Table{}, -1, 1)}), std::invalid_argument);
  EXPECT_EQ(s.stats().store_jobs, before);
  EXPECT_EQ(s.num_idle_requests(), 1u);
  s.request_finished("A");
  EXPECT_EQ(s.num_idle_requests(), 0u);
  EXPECT_THROW(step(s, {sched("A", Table{}, 5, 1)}), std::invalid_argument);
}

TEST(OffloadingSchedulerStore, StaleBlockReallocatedToAnotherRequestIsSkipped) {
  OffloadingScheduler s(make_config({SW(5)}, 4, 1, 0, 1, /*cpu_blocks=*/2));
  add(s, "A", {"a0", "a1"}, 8);
  auto a = step(s, {sched("A", {{1, 2}}, 0, 8)});
  ASSERT_EQ(a.store_jobs.size(), 1u);
  add(s, "B", {"b0", "b1"}, 9);
  EXPECT_TRUE(step(s, {sched("B", {{5, 6, 7}}, 0, 8)}).store_jobs.empty());  // refused
  report(s, {a.store_jobs[0].job_id});
  // B's block 0 left the window, was freed, and now belongs to C.
  add(s, "C", {}, 8);
  auto meta = step(s, {sched("C", {{5, 9}}, 0, 8), sched("B", Table{{}}, 8, 1)});
  EXPECT_TRUE(meta.jobs_to_flush.empty());
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "B", {6}, {1}, {1}, {key("b1", 0)});
  EXPECT_EQ(s.manager().state(key("b0", 0)), BlockState::kMissing);
  EXPECT_EQ(s.stats().stale_blocks_skipped, 1u);
  EXPECT_EQ(s.next_store_block("B"), 2);
}

TEST(OffloadingSchedulerStore, StaleBlockReallocatedToTheSameRequestIsSkipped) {
  OffloadingScheduler s(make_config({SW(5)}, 4, 1, 0, 1, /*cpu_blocks=*/2));
  add(s, "A", {"a0", "a1"}, 8);
  auto a = step(s, {sched("A", {{1, 2}}, 0, 8)});
  ASSERT_EQ(a.store_jobs.size(), 1u);
  add(s, "B", {"b0", "b1"}, 8);
  EXPECT_TRUE(step(s, {sched("B", {{5, 6}}, 0, 8)}).store_jobs.empty());  // refused
  report(s, {a.store_jobs[0].job_id});
  add(s, "B", {"b2"}, 13, 2);
  // Block 5 (B's position 0, out of the window) comes back to B at position 2.
  auto meta = step(s, {sched("B", {{5}}, 8, 5)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "B", {6, 5}, {2}, {1}, {key("b1", 0), key("b2", 0)});
  EXPECT_EQ(s.manager().state(key("b0", 0)), BlockState::kMissing);
  EXPECT_EQ(s.stats().stale_blocks_skipped, 1u);
}

TEST(OffloadingSchedulerStore, StaleBlockIsCountedOnceWhileItsRequestsStoreIsRetried) {
  OffloadingScheduler s(make_config({SW(5)}, 4, 1, 0, 1, /*cpu_blocks=*/2));
  add(s, "A", {"a0", "a1"}, 8);
  auto a = step(s, {sched("A", {{1, 2}}, 0, 8)});
  ASSERT_EQ(a.store_jobs.size(), 1u);  // both slots pending until it is reported
  add(s, "B", {"b0", "b1"}, 12);
  EXPECT_TRUE(step(s, {sched("B", {{5, 6, 7}}, 0, 8)}).store_jobs.empty());  // refused
  // B's block 5 left the window and now belongs to C; B's store is refused again and again.
  add(s, "C", {}, 8);
  auto meta = step(s, {sched("C", {{5, 9}}, 0, 8), sched("B", Table{{}}, 8, 1)});
  EXPECT_TRUE(meta.store_jobs.empty());
  for (std::int64_t computed = 9; computed < 11; ++computed) {
    EXPECT_TRUE(step(s, {sched("B", Table{{}}, computed, 1)}).store_jobs.empty());
  }
  EXPECT_EQ(s.stats().store_refusals, 4u);
  EXPECT_EQ(s.stats().stale_blocks_skipped, 1u);  // one stale block, however many retries
  report(s, {a.store_jobs[0].job_id});
  meta = step(s, {sched("B", Table{{}}, 11, 0)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "B", {6}, {1}, {1}, {key("b1", 0)});
  EXPECT_EQ(s.stats().stale_blocks_skipped, 1u);
}

TEST(OffloadingSchedulerStore, WholeTableOfAKnownRequestReplacesItsTable) {
  // A streaming-input session that vLLM schedules again as a new request, under its old id:
  // its block ids are its whole table, the blocks it had first.
  OffloadingScheduler s(make_config({Full()}));  // 4-token blocks
  add(s, "S", hashes("s", 3), 12);
  auto first = step(s, {sched("S", {{1, 2, 3}}, 0, 12)});
  ASSERT_EQ(first.store_jobs.size(), 1u);  // still in flight: its GPU blocks are fenced
  add(s, "S", {"s3", "s4", "s5"}, 26, 3);
  ScheduledRequest again = sched("S", {{1, 2, 3, 7, 8, 9}}, 12, 12);
  again.whole_table = true;
  auto meta = step(s, {again});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "S", {7, 8, 9}, {3}, {3},
             {key("s3", 0), key("s4", 0), key("s5", 0)});
  // the blocks it kept are not new allocations: the job reading them is not flushed
  EXPECT_TRUE(meta.jobs_to_flush.empty());
  EXPECT_EQ(s.stats().stale_blocks_skipped, 0u);
  // a shorter whole table (blocks at positions 3.. given back) drops the rest
  report(s, ids_of(first.store_jobs));
  report(s, ids_of(meta.store_jobs));
  ScheduledRequest shorter = sched("S", {{1, 2, 3, 4}}, 24, 2);
  shorter.whole_table = true;
  add(s, "S", {"s6"}, 28, 6);
  meta = step(s, {shorter});
  EXPECT_EQ(meta.jobs_to_flush, Ids{});
  EXPECT_TRUE(meta.store_jobs.empty());  // 26 tokens: 6 full blocks, all stored
}

TEST(OffloadingSchedulerStore, HeldKeyInTheMiddleSplitsJobsPerGroupRun) {
  OffloadingScheduler s(make_config({Full(), Full()}));
  seed(s, "seed", {"s0", "b1"}, {{20, 21}, {0, 0}});  // holds s0/0 (slot 0) and b1/0 (slot 1)
  ASSERT_EQ(s.manager().block_id(key("b1", 0)), std::optional<std::uint32_t>(1));
  add(s, "B", hashes("b", 4), 16);
  auto meta = step(s, {sched("B", {{1, 2, 3, 4}, {5, 6, 7, 8}}, 0, 16)});
  ASSERT_EQ(meta.store_jobs.size(), 2u);
  expect_job(s, meta.store_jobs[0], true, "B", {1, 5, 6, 7, 8}, {1, 4}, {0, 0},
             {key("b0", 0), key("b0", 1), key("b1", 1), key("b2", 1), key("b3", 1)});
  EXPECT_EQ(meta.store_jobs[0].cpu_block_ids, (U{2, 3, 4, 6, 8}));
  expect_job(s, meta.store_jobs[1], true, "B", {3, 4}, {2, 0}, {2, 0},
             {key("b2", 0), key("b3", 0)});
  EXPECT_EQ(meta.store_jobs[1].cpu_block_ids, (U{5, 7}));
  EXPECT_NE(meta.store_jobs[0].job_id, meta.store_jobs[1].job_id);
}

TEST(OffloadingSchedulerStore, SlidingWindowSubBlocksSplitJobsWithFactor2) {
  // SW(5) needs 4 tokens: only the second GPU block of each offloaded block is stored.
  OffloadingScheduler s(make_config({Full(), SW(5)}, 4, 2));
  add(s, "r", hashes("a", 6), 24);
  auto meta = step(s, {sched("r", {{1, 2, 3, 4, 5, 6}, {11, 12, 13, 14, 15, 16}}, 0, 24)});
  ASSERT_EQ(meta.store_jobs.size(), 3u);
  expect_job(s, meta.store_jobs[0], true, "r", {1, 2, 3, 4, 5, 6, 12}, {6, 1}, {0, 1},
             {key("a1", 0), key("a3", 0), key("a5", 0), key("a1", 1)});
  EXPECT_EQ(meta.store_jobs[0].cpu_block_ids, (U{0, 2, 4, 1}));
  expect_job(s, meta.store_jobs[1], true, "r", {14}, {0, 1}, {0, 3}, {key("a3", 1)});
  EXPECT_EQ(meta.store_jobs[1].cpu_block_ids, U{3});
  expect_job(s, meta.store_jobs[2], true, "r", {16}, {0, 1}, {0, 5}, {key("a5", 1)});
  EXPECT_EQ(meta.store_jobs[2].cpu_block_ids, U{5});
}

TEST(OffloadingSchedulerStore, BadStepIsRejectedAndChangesNothing) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "r", {"a0"}, 4);
  expect_names(error_of([&] { step(s, {sched("r", {{1}}, 0, 4), sched("r", {{2}}, 0, 4)}); }),
               {"'r'", "scheduled twice"});
  expect_names(error_of([&] { step(s, {sched("r", {{1}}, 0, 4), sched("x", {{2}}, 0, 4)}); }),
               {"'x'", "unknown request"});
  expect_names(error_of([&] { step(s, {sched("r", {{70}}, 0, 4)}); }), {"block id 70"});
  expect_names(error_of([&] { step(s, {sched("r", {{1}}, -1, 4)}); }), {"(-1)"});
  EXPECT_EQ(s.next_store_block("r"), 0);
  EXPECT_EQ(s.num_jobs_in_flight(), 0u);
  EXPECT_EQ(s.manager().num_pending_blocks(), 0u);
  auto meta = step(s, {sched("r", {{1}}, 0, 4)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "r", {1}, {1}, {0}, {key("a0", 0)});
}

// ------------------------------------------------------------------------------ fences

TEST(OffloadingSchedulerFence, StoreSourceReallocatedToAnotherRequestIsFlushed) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "A", {"a0", "a1"}, 8);
  auto a = step(s, {sched("A", {{5, 6}}, 0, 8)});
  ASSERT_EQ(a.store_jobs.size(), 1u);
  const JobId j = a.store_jobs[0].job_id;
  EXPECT_TRUE(s.request_finished("A"));  // the engine frees 5 and 6 anyway
  add(s, "C", {}, 3);
  auto meta = step(s, {sched("C", {{7, 6}}, 0, 3)});
  EXPECT_EQ(meta.jobs_to_flush, Ids{j});
  EXPECT_EQ(s.stats().jobs_flushed, 1u);
  // Once completed, the job is no fence any more.
  report(s, {j});
  add(s, "D", {}, 3);
  meta = step(s, {sched("D", {{5}}, 0, 3)});
  EXPECT_TRUE(meta.jobs_to_flush.empty());
}

TEST(OffloadingSchedulerFence, RewrittenBlockOutsideScheduledTablesIsFlushed) {
  // A copy-on-write destination the engine writes this step belongs to no scheduled request's
  // new blocks; a store still reading it must be flushed all the same.
  OffloadingScheduler s(make_config({Full()}));
  add(s, "A", {"a0", "a1"}, 8);
  auto a = step(s, {sched("A", {{5, 6}}, 0, 8)});
  ASSERT_EQ(a.store_jobs.size(), 1u);
  const JobId j = a.store_jobs[0].job_id;
  EXPECT_TRUE(s.request_finished("A"));
  const std::vector<std::int64_t> rewritten{0, 9, 6};  // 0: the null block, ignored
  auto meta = s.build_connector_meta({}, {}, {}, rewritten);
  EXPECT_EQ(meta.jobs_to_flush, Ids{j});
  EXPECT_EQ(s.stats().jobs_flushed, 1u);
}

TEST(OffloadingSchedulerFence, RewrittenBlockOutOfRangeChangesNothing) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "A", {"a0", "a1"}, 8);
  auto a = step(s, {sched("A", {{5, 6}}, 0, 8)});
  ASSERT_EQ(a.store_jobs.size(), 1u);
  const std::vector<std::int64_t> bad{6, 64};
  const std::string msg = error_of([&] { s.build_connector_meta({}, {}, {}, bad); });
  expect_names(msg, {"rewritten_block_ids[1] = 64", "num_gpu_blocks=64"});
  // nothing changed: block 6 was not marked reallocated, no flush recorded
  EXPECT_EQ(s.stats().jobs_flushed, 0u);
  auto meta = step(s, {});
  EXPECT_TRUE(meta.jobs_to_flush.empty());
}

TEST(OffloadingSchedulerLoad, FailedLoadDropsItsBlocksSoARetryRecomputes) {
  OffloadingScheduler s(make_config({Full()}));
  seed(s, "seed", {"a0", "a1", "a2"}, {{1, 2, 3}});
  add(s, "r", {"a0", "a1", "a2"}, 13);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(12));
  s.update_state_after_alloc("r", Table{{5, 6, 7, 8}}, 12);
  auto meta = step(s, {sched("r", {{5, 6, 7, 8}}, 0, 0)});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  auto out = report(s, {meta.load_jobs[0].job_id}, /*success=*/false);
  EXPECT_EQ(out.failed_loading, Strs{"r"});
  EXPECT_EQ(s.stats().blocks_discarded, 3u);
  EXPECT_EQ(s.manager().state(key("a0", 0)), BlockState::kMissing);
  // the engine retries the request: nothing is offered, it recomputes
  expect_match(s.get_num_new_matched_tokens("r", 0), miss());
}

TEST(OffloadingSchedulerLoad, FailedLoadKeepsBlocksAnotherLoadStillPins) {
  OffloadingScheduler s(make_config({Full()}));
  seed(s, "seed", {"a0", "a1"}, {{1, 2}});
  add(s, "r", {"a0", "a1"}, 9);
  add(s, "q", {"a0"}, 5);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(8));
  s.update_state_after_alloc("r", Table{{5, 6, 7}}, 8);
  auto meta = step(s, {sched("r", {{5, 6, 7}}, 0, 0)});
  const JobId jr = meta.load_jobs[0].job_id;
  expect_match(s.get_num_new_matched_tokens("q", 0), retry());  // a0 is being loaded for r
  report(s, {jr}, /*success=*/false);
  EXPECT_EQ(s.stats().blocks_discarded, 2u);
  expect_match(s.get_num_new_matched_tokens("q", 0), miss());
}

TEST(OffloadingSchedulerReset, DropsStoredBlocksAndMakesJobsInFlightStale) {
  SchedulerConfig c = make_config({Full()});
  c.enable_events = true;
  OffloadingScheduler s(c);
  seed(s, "seed", {"a0", "a1"}, {{1, 2}});  // two stored blocks
  add(s, "B", {"b0"}, 4);
  auto b = step(s, {sched("B", {{3}}, 0, 4)});  // a store in flight
  ASSERT_EQ(b.store_jobs.size(), 1u);
  (void)s.take_events();
  EXPECT_EQ(s.reset_cache(), 2u);
  EXPECT_EQ(s.manager().num_stored_blocks(), 0u);
  EXPECT_EQ(s.manager().num_pending_blocks(), 1u);
  const auto events = s.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_TRUE(events[0].removed);
  EXPECT_EQ(events[0].keys.size(), 2u);
  add(s, "r", {"a0", "a1"}, 9);
  expect_match(s.get_num_new_matched_tokens("r", 0), miss());  // nothing left to hit
  // The store in flight completes for the engine (not failed), but its block, computed
  // before the reset (e.g. with the old weights), never becomes a hit: its slot is freed.
  const auto out = report(s, {b.store_jobs[0].job_id});
  EXPECT_EQ(out.completed_jobs, std::vector<JobId>{b.store_jobs[0].job_id});
  EXPECT_TRUE(out.failed_jobs.empty());
  EXPECT_EQ(s.manager().state(key("b0", 0)), BlockState::kMissing);
  EXPECT_EQ(s.manager().num_free_blocks(), s.manager().num_blocks());
  EXPECT_TRUE(s.take_events().empty());  // never stored, so never removed either
  // a job made after the reset is not stale: its block becomes a hit as usual
  add(s, "C", {"c0"}, 4);
  auto later = step(s, {sched("C", {{4}}, 0, 4)});
  ASSERT_EQ(later.store_jobs.size(), 1u);
  report(s, {later.store_jobs[0].job_id});
  EXPECT_EQ(s.manager().state(key("c0", 0)), BlockState::kReady);
}

TEST(OffloadingSchedulerReset, AStaleLoadsBlocksAreDiscardedWhenItCompletes) {
  OffloadingScheduler s(make_config({Full()}));
  seed(s, "seed", {"a0", "a1"}, {{1, 2}});
  prepare_load_of_a0_a1(s);
  auto meta = step(s, {sched("r", {{5, 6, 7}}, 0, 0)});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  EXPECT_EQ(s.reset_cache(), 0u);  // both blocks are pinned by the load: they stay for it
  const auto out = report(s, {meta.load_jobs[0].job_id});
  EXPECT_TRUE(out.failed_jobs.empty());
  EXPECT_EQ(s.manager().state(key("a0", 0)), BlockState::kMissing);  // pre-reset KV: gone
  EXPECT_EQ(s.manager().state(key("a1", 0)), BlockState::kMissing);
  EXPECT_EQ(s.manager().num_free_blocks(), s.manager().num_blocks());
}

TEST(OffloadingSchedulerFence, LoadTargetReallocatedIsFlushed) {
  OffloadingScheduler s(make_config({Full()}));
  seed(s, "seed", {"a0", "a1"}, {{1, 2}});
  prepare_load_of_a0_a1(s);
  auto meta = step(s, {sched("r", {{5, 6, 7}}, 0, 0)});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  EXPECT_TRUE(meta.jobs_to_flush.empty());
  const JobId j = meta.load_jobs[0].job_id;
  EXPECT_TRUE(s.request_finished("r"));  // aborted while loading; its blocks are freed
  add(s, "C", {}, 3);
  meta = step(s, {sched("C", {{6}}, 0, 3)});
  EXPECT_EQ(meta.jobs_to_flush, Ids{j});
}

TEST(OffloadingSchedulerFence, EngineCachedPrefixOfNewRequestIsNotFenced) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "A", {"a0", "a1"}, 8);
  auto a = step(s, {sched("A", {{5, 6}}, 0, 8)});
  ASSERT_EQ(a.store_jobs.size(), 1u);
  const JobId j = a.store_jobs[0].job_id;
  // C shares A's first two GPU blocks through the engine's own prefix cache.
  add(s, "C", {"a0", "a1", "c2"}, 13);
  expect_match(s.get_num_new_matched_tokens("C", 8), miss());
  s.update_state_after_alloc("C", Table{{5, 6, 8}}, 0);
  auto meta = step(s, {sched("C", {{5, 6, 8}}, 8, 5)});
  EXPECT_TRUE(meta.jobs_to_flush.empty());
  EXPECT_EQ(s.stats().jobs_flushed, 0u);
  // C stores only its new block (a0, a1 are already held, pending).
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "C", {8}, {1}, {2}, {key("c2", 0)});
  // The fence on A's blocks is still armed for a real reallocation.
  add(s, "E", {}, 3);
  meta = step(s, {sched("E", {{5}}, 0, 3)});
  EXPECT_EQ(meta.jobs_to_flush, Ids{j});
}

// A no-hit answer settles the request as update_state_after_alloc(.., 0) would, so an engine
// may skip that call (the Python scheduler does): the engine's own hit is noted at the lookup,
// and C's blocks that the engine had cached are still not fenced.
TEST(OffloadingSchedulerFence, NoHitAnswerNotesTheEngineHitWithoutAnAllocCall) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "A", {"a0", "a1"}, 8);
  auto a = step(s, {sched("A", {{5, 6}}, 0, 8)});
  ASSERT_EQ(a.store_jobs.size(), 1u);
  add(s, "C", {"a0", "a1", "c2"}, 13);
  expect_match(s.get_num_new_matched_tokens("C", 8), miss());
  auto meta = step(s, {sched("C", {{5, 6, 8}}, 8, 5)});  // no update_state_after_alloc
  EXPECT_TRUE(meta.jobs_to_flush.empty());
  EXPECT_EQ(s.stats().jobs_flushed, 0u);
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "C", {8}, {1}, {2}, {key("c2", 0)});
  // A later lookup with another engine hit replaces the noted one, as an alloc call would.
  add(s, "D", {"a0", "x1", "d2"}, 13);
  expect_match(s.get_num_new_matched_tokens("D", 8), miss());
  expect_match(s.get_num_new_matched_tokens("D", 4), miss());
  meta = step(s, {sched("D", {{5, 6, 9}}, 4, 9)});
  EXPECT_EQ(meta.jobs_to_flush, Ids{a.store_jobs[0].job_id});  // D's block 6 is new to it
}

}  // namespace
}  // namespace kvoff
