// OffloadingScheduler: connector output, finishing requests, preemption, invariants 7 (load
// xor store) and 8 (events, prefix order), stores of one step, reused records, store
// batching and offload_prompt_only.
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

// ------------------------------------------------------------------- connector output

TEST(OffloadingSchedulerOutput, JobCompletesOnlyAfterEveryRankReported) {
  OffloadingScheduler s(make_config({Full()}, 4, 1, 0, /*world_size=*/2));
  add(s, "A", {"a0"}, 4);
  auto a = step(s, {sched("A", {{5}}, 0, 4)});
  ASSERT_EQ(a.store_jobs.size(), 1u);
  const JobId j = a.store_jobs[0].job_id;
  auto out = report(s, {j});
  EXPECT_TRUE(out.completed_jobs.empty());
  EXPECT_EQ(s.manager().state(key("a0", 0)), BlockState::kPending);
  EXPECT_EQ(s.num_jobs_in_flight(), 1u);
  out = report(s, {j});
  EXPECT_EQ(out.completed_jobs, Ids{j});
  EXPECT_TRUE(out.failed_jobs.empty());
  EXPECT_EQ(s.manager().state(key("a0", 0)), BlockState::kReady);
  EXPECT_EQ(s.num_jobs_in_flight(), 0u);
}

TEST(OffloadingSchedulerOutput, FailureOnOneRankIsNoHitAndFreesSlots) {
  OffloadingScheduler s(make_config({Full()}, 4, 1, 0, /*world_size=*/2, /*cpu_blocks=*/8));
  add(s, "A", {"a0", "a1"}, 8);
  auto a = step(s, {sched("A", {{5, 6}}, 0, 8)});
  ASSERT_EQ(a.store_jobs.size(), 1u);
  const JobId j = a.store_jobs[0].job_id;
  EXPECT_EQ(s.manager().num_free_blocks(), 6u);
  std::vector<JobReport> reps{{j, true}, {j, false}};
  auto out = s.update_connector_output(reps);
  EXPECT_EQ(out.completed_jobs, Ids{j});
  EXPECT_EQ(out.failed_jobs, Ids{j});
  EXPECT_EQ(s.manager().state(key("a0", 0)), BlockState::kMissing);
  EXPECT_EQ(s.manager().state(key("a1", 0)), BlockState::kMissing);
  EXPECT_EQ(s.manager().num_free_blocks(), 8u);
  EXPECT_EQ(s.stats().failed_jobs, 1u);
  add(s, "B", {"a0", "a1"}, 9);
  expect_match(s.get_num_new_matched_tokens("B", 0), miss());
}

TEST(OffloadingSchedulerOutput, FailedLoadIsReportedAndUnpins) {
  OffloadingScheduler s(make_config({Full()}));
  seed(s, "seed", {"a0", "a1"}, {{1, 2}});
  prepare_load_of_a0_a1(s);
  auto meta = step(s, {});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  auto out = report(s, {meta.load_jobs[0].job_id}, /*success=*/false);
  EXPECT_EQ(out.failed_loading, Strs{"r"});
  EXPECT_TRUE(out.finished_loading.empty());
  EXPECT_EQ(out.failed_jobs, Ids{meta.load_jobs[0].job_id});
  EXPECT_EQ(s.manager().pin_count(key("a0", 0)), 0u);
  // A failed load may have read a damaged copy: the blocks are dropped, so the
  // retry recomputes instead of loading them again (and failing forever).
  EXPECT_EQ(s.manager().state(key("a0", 0)), BlockState::kMissing);
  EXPECT_EQ(s.manager().state(key("a1", 0)), BlockState::kMissing);
}

TEST(OffloadingSchedulerOutput, TooManyReportsAreRejectedBeforeAnyChange) {
  OffloadingScheduler s(make_config({Full()}, 4, 1, 0, /*world_size=*/2));
  add(s, "A", {"a0"}, 4);
  auto a = step(s, {sched("A", {{5}}, 0, 4)});
  ASSERT_EQ(a.store_jobs.size(), 1u);
  const JobId j = a.store_jobs[0].job_id;
  expect_names(error_of([&] { report(s, {j, j, j}); }),
               {"job " + std::to_string(j), "3 times", "world_size is 2"});
  EXPECT_EQ(s.manager().state(key("a0", 0)), BlockState::kPending);
  EXPECT_TRUE(report(s, {j}).completed_jobs.empty());  // 1 of 2: the bad call counted nothing
  expect_names(error_of([&] { report(s, {j, j}); }), {"3 times"});
  EXPECT_EQ(report(s, {j}).completed_jobs, Ids{j});
  EXPECT_EQ(s.manager().state(key("a0", 0)), BlockState::kReady);
}

TEST(OffloadingSchedulerOutput, UnknownJobIsRejectedBeforeAnyChange) {
  OffloadingScheduler s(make_config({Full()}, 4, 1, 0, /*world_size=*/2));
  add(s, "A", {"a0"}, 4);
  auto a = step(s, {sched("A", {{5}}, 0, 4)});
  ASSERT_EQ(a.store_jobs.size(), 1u);
  const JobId j = a.store_jobs[0].job_id;
  EXPECT_EQ(j, 1u);
  expect_names(error_of([&] { report(s, {j, 999}); }), {"job 999", "not in flight"});
  // j's report in the rejected call was not counted: two more are needed.
  EXPECT_TRUE(report(s, {j}).completed_jobs.empty());
  EXPECT_EQ(report(s, {j}).completed_jobs, Ids{j});
  expect_names(error_of([&] { report(s, {j}); }), {"job 1", "not in flight"});  // completed
  // A load built but not yet emitted is not in flight either (job ids count up from 1).
  report(s, {});
  add(s, "r", {"a0"}, 5);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(4));
  s.update_state_after_alloc("r", Table{{7, 8}}, 4);
  expect_names(error_of([&] { report(s, {2}); }), {"job 2", "not in flight"});
  auto meta = step(s, {});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  EXPECT_EQ(meta.load_jobs[0].job_id, 2u);
}

// ------------------------------------------------------------------------------ finish

TEST(OffloadingSchedulerFinish, UnemittedLoadIsCancelledAndUnpinned) {
  OffloadingScheduler s(make_config({Full()}));
  seed(s, "seed", {"a0", "a1"}, {{1, 2}});
  prepare_load_of_a0_a1(s);
  EXPECT_EQ(s.manager().pin_count(key("a1", 0)), 1u);
  EXPECT_FALSE(s.request_finished("r"));
  EXPECT_EQ(s.manager().pin_count(key("a0", 0)), 0u);
  EXPECT_EQ(s.manager().pin_count(key("a1", 0)), 0u);
  EXPECT_EQ(s.num_requests(), 0u);
  EXPECT_EQ(s.next_store_block("r"), -1);
  auto meta = step(s, {});
  EXPECT_TRUE(meta.load_jobs.empty());
  EXPECT_EQ(s.num_jobs_in_flight(), 0u);
  // The keys are no longer "being loaded": another request gets a hit, not "retry later".
  add(s, "B", {"a0", "a1"}, 9);
  expect_match(s.get_num_new_matched_tokens("B", 0), hit(8));
  EXPECT_FALSE(s.request_finished("nobody"));
}

TEST(OffloadingSchedulerFinish, TrueWhileStoreInFlightThenForgottenAndListed) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "A", {"a0"}, 4);
  auto a = step(s, {sched("A", {{5}}, 0, 4)});
  ASSERT_EQ(a.store_jobs.size(), 1u);
  EXPECT_TRUE(s.request_finished("A"));
  EXPECT_EQ(s.num_requests(), 1u);
  EXPECT_EQ(s.next_store_block("A"), 1);
  expect_names(error_of([&] { s.get_num_new_matched_tokens("A", 0); }), {"'A'", "finished"});
  auto out = report(s, {a.store_jobs[0].job_id});
  EXPECT_EQ(out.finished_storing, Strs{"A"});
  EXPECT_EQ(s.num_requests(), 0u);
  EXPECT_EQ(s.next_store_block("A"), -1);
  EXPECT_FALSE(s.request_finished("A"));
  EXPECT_EQ(s.manager().state(key("a0", 0)), BlockState::kReady);
}

TEST(OffloadingSchedulerFinish, FinishedListOfStepReleasesAfterStores) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "B", {"b0", "b1"}, 8);
  auto b = step(s, {sched("B", {{5, 6}}, 0, 4)});  // stores b0
  ASSERT_EQ(b.store_jobs.size(), 1u);
  auto meta = step(s, {}, {"B"});
  EXPECT_TRUE(meta.store_jobs.empty());
  EXPECT_EQ(s.num_requests(), 1u);  // b0's store is still in flight
  auto out = report(s, {b.store_jobs[0].job_id});
  EXPECT_EQ(out.finished_storing, Strs{"B"});
  EXPECT_EQ(s.num_requests(), 0u);
  // A finished request without jobs is forgotten at once.
  add(s, "C", {}, 3);
  step(s, {sched("C", {{7}}, 0, 3)});
  EXPECT_EQ(s.num_requests(), 1u);
  step(s, {}, {"C"});
  EXPECT_EQ(s.num_requests(), 0u);
}

// request_finished returned true (a load in flight), so the engine keeps the blocks until the
// request is listed in finished_storing: it must be listed even though it never stored.
TEST(OffloadingSchedulerFinish, FinishedWhileLoadingIsListedOnceItsLoadCompletes) {
  OffloadingScheduler s(make_config({Full()}));
  seed(s, "seed", {"a0"}, {{1}});
  add(s, "r", {"a0"}, 5);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(4));
  s.update_state_after_alloc("r", Table{{5, 6}}, 4);
  auto meta = step(s, {});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  EXPECT_TRUE(s.request_finished("r"));
  auto out = report(s, {meta.load_jobs[0].job_id});
  EXPECT_EQ(out.finished_storing, Strs{"r"});
  EXPECT_TRUE(out.finished_loading.empty());
  EXPECT_EQ(s.num_requests(), 0u);
  EXPECT_EQ(s.manager().pin_count(key("a0", 0)), 0u);
}

// -------------------------------------------------------------------------- preemption

TEST(OffloadingSchedulerPreemption, ResumedRequestUsesItsNewTable) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "A", {"a0", "a1"}, 8);
  auto meta = step(s, {sched("A", {{5, 6}}, 0, 4)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {5}, {1}, {0}, {key("a0", 0)});
  report(s, {meta.store_jobs[0].job_id});
  meta = step(s, {}, {}, {"A"});
  EXPECT_TRUE(meta.store_jobs.empty());
  meta = step(s, {sched("A", {{7, 8}}, 4, 4, /*resumed=*/true)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {8}, {1}, {1}, {key("a1", 0)});
}

TEST(OffloadingSchedulerPreemption, PreemptionClearsTheTable) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "A", {"a0", "a1"}, 8);
  auto meta = step(s, {sched("A", {{5, 6}}, 0, 4)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  report(s, {meta.store_jobs[0].job_id});
  meta = step(s, {}, {}, {"A"});
  // Scheduled again without the resumed flag: after a preemption its blocks are a whole table.
  meta = step(s, {sched("A", {{9, 10}}, 4, 4)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {10}, {1}, {1}, {key("a1", 0)});
}

TEST(OffloadingSchedulerPreemption, PreemptedInTheSameStepAsResumedTableIsReplaced) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "A", {"a0", "a1", "a2"}, 12);
  auto meta = step(s, {sched("A", {{5, 6, 7}}, 0, 4)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  report(s, {meta.store_jobs[0].job_id});
  // Preempted and resumed with a fresh table in one step.
  meta = step(s, {sched("A", {{11, 12, 13}}, 4, 8, true)}, {}, {"A"});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {12, 13}, {1 * 2}, {1},
             {key("a1", 0), key("a2", 0)});
}

// ------------------------------------------------------------- invariant 7: load xor store

TEST(OffloadingSchedulerInvariant7, StoresWaitUntilTheLoadCompletes) {
  OffloadingScheduler s(make_config({Full()}));
  seed(s, "seed", {"a0", "a1"}, {{1, 2}});
  add(s, "r", {"a0", "a1", "r2", "r3"}, 17);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(8));
  s.update_state_after_alloc("r", Table{{5, 6, 7, 8, 9}}, 8);
  auto meta = step(s, {sched("r", {{5, 6, 7, 8, 9}}, 8, 9)});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  expect_job(s, meta.load_jobs[0], false, "r", {5, 6}, {1 * 2}, {0},
             {key("a0", 0), key("a1", 0)});
  EXPECT_TRUE(meta.store_jobs.empty());
  EXPECT_EQ(s.next_store_block("r"), 2);
  const JobId load = meta.load_jobs[0].job_id;
  add(s, "r", {}, 19, 4);
  meta = step(s, {sched("r", Table{{}}, 17, 1)});
  EXPECT_TRUE(meta.load_jobs.empty());
  EXPECT_TRUE(meta.store_jobs.empty());  // still loading
  EXPECT_EQ(s.next_store_block("r"), 2);
  auto out = report(s, {load});
  EXPECT_EQ(out.finished_loading, Strs{"r"});
  meta = step(s, {sched("r", Table{{}}, 18, 1)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "r", {7, 8}, {2}, {2}, {key("r2", 0), key("r3", 0)});
  EXPECT_EQ(meta.store_jobs[0].cpu_block_ids, (U{2, 3}));
}

// A preempted request whose store is still in flight must not get a load before the store
// completes (docs/design.md invariant 7: never a load and a store in flight at once). With a
// sliding-window group the last token is recomputed, so the block being stored (block 1) lies
// outside the lookup and nothing makes it "retry later".
TEST(OffloadingSchedulerInvariant7, NoLoadWhileOwnStoreIsInFlight) {
  OffloadingScheduler s(make_config({SW(5)}));
  add(s, "A", {"a0"}, 4);
  auto meta = step(s, {sched("A", {{5}}, 0, 4)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  report(s, {meta.store_jobs[0].job_id});
  add(s, "A", {"a1"}, 8, 1);
  meta = step(s, {sched("A", {{6}}, 4, 4)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {6}, {1}, {1}, {key("a1", 0)});
  const JobId store = meta.store_jobs[0].job_id;
  step(s, {}, {}, {"A"});  // preempted: the engine will look it up again
  const MatchResult m = s.get_num_new_matched_tokens("A", 0);
  EXPECT_FALSE(m.num_tokens.has_value() && *m.num_tokens > 0)
      << "a load of " << *m.num_tokens << " tokens was offered while store job " << store
      << " of the same request is in flight";
  if (m.num_tokens.has_value() && *m.num_tokens > 0) {
    s.update_state_after_alloc("A", Table{{7, 8}}, *m.num_tokens);
    meta = step(s, {});
    EXPECT_TRUE(meta.load_jobs.empty()) << "load job emitted with store " << store << " in flight";
    return;
  }
  report(s, {store});
  expect_match(s.get_num_new_matched_tokens("A", 0), hit(4));
  s.update_state_after_alloc("A", Table{{7, 8}}, 4);
  meta = step(s, {sched("A", {{7, 8}}, 0, 4, /*resumed=*/true)});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  expect_job(s, meta.load_jobs[0], false, "A", {7}, {1}, {0}, {key("a0", 0)});
  EXPECT_TRUE(meta.store_jobs.empty());
}

// ------------------------------------------------------------------ events, invariant 8

TEST(OffloadingSchedulerEvents, StoredAndRemovedEventsAndLoadTouchesHeadLast) {
  auto c = make_config({Full()}, 4, 1, 0, 1, /*cpu_blocks=*/4);
  c.enable_events = true;
  OffloadingScheduler s(std::move(c));
  seed(s, "sa", {"a0", "a1"}, {{1, 2}});
  seed(s, "sb", {"b0", "b1"}, {{3, 4}});  // b more recent than a
  auto ev = s.take_events();
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_FALSE(ev[0].removed);
  EXPECT_EQ(ev[0].medium, "CPU");
  EXPECT_EQ(ev[0].keys, (Strs{key("a0", 0), key("a1", 0)}));
  EXPECT_EQ(ev[1].keys, (Strs{key("b0", 0), key("b1", 0)}));
  // Loading a0, a1 touches them: now a is more recent than b, with a0 (the head) most recent.
  prepare_load_of_a0_a1(s);
  auto meta = step(s, {});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  report(s, {meta.load_jobs[0].job_id});
  EXPECT_TRUE(s.request_finished("r") == false);
  // Three new blocks need three evictions: b's tail, b's head, then a's tail.
  add(s, "w", {"c0", "c1", "c2"}, 12);
  meta = step(s, {sched("w", {{8, 9, 10}}, 0, 12)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  ev = s.take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_TRUE(ev[0].removed);
  EXPECT_EQ(ev[0].keys, (Strs{key("b1", 0), key("b0", 0), key("a1", 0)}));
  EXPECT_EQ(s.manager().state(key("a0", 0)), BlockState::kReady);
}

// Recency comes when a request finishes (as vLLM 0.32's managers apply it), not when its load
// is prepared: a request that loaded a's blocks and still runs leaves them where they were,
// and its finish makes them the most recent, head first. (Recency at load time evicted the
// blocks the next requests of a repeated sequence needed: issue 53.)
TEST(OffloadingSchedulerEvents, ALoadMakesItsBlocksRecentWhenItsRequestFinishes) {
  for (const bool finish_first : {false, true}) {
    auto c = make_config({Full()}, 4, 1, 0, 1, /*cpu_blocks=*/4);
    c.enable_events = true;
    OffloadingScheduler s(std::move(c));
    seed(s, "sa", {"a0", "a1"}, {{1, 2}});
    seed(s, "sb", {"b0", "b1"}, {{3, 4}});  // b more recent than a
    s.take_events();
    prepare_load_of_a0_a1(s);
    auto meta = step(s, {});
    report(s, {meta.load_jobs[0].job_id});  // loaded: a is no longer pinned
    if (finish_first) {
      EXPECT_FALSE(s.request_finished("r"));
    }
    add(s, "w", {"c0", "c1"}, 8);
    meta = step(s, {sched("w", {{8, 9}}, 0, 8)});
    ASSERT_EQ(meta.store_jobs.size(), 1u);
    auto ev = s.take_events();
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_TRUE(ev[0].removed);
    EXPECT_EQ(ev[0].keys, finish_first ? (Strs{key("b1", 0), key("b0", 0)})
                                       : (Strs{key("a1", 0), key("a0", 0)}))
        << "finish first: " << finish_first;
  }
}

// Invariant 8 over a hybrid request: its blocks age by token position across KV cache groups,
// so every group's tail goes before any group's head (vLLM's manager orders them so too). Fails
// if keys were ordered group by group (group 1's head would go before group 0's tail).
TEST(OffloadingSchedulerEvents, TailsOfEveryGroupAreEvictedBeforeAnyHead) {
  auto c = make_config({Full(), Full()}, 4, 1, 0, 1, /*cpu_blocks=*/4);
  c.enable_events = true;
  OffloadingScheduler s(std::move(c));
  add(s, "A", {"h", "t"}, 8);  // head block at tokens 0-3, tail at 4-7, in both groups
  auto meta = step(s, {sched("A", {{1, 2}, {3, 4}}, 0, 8)});
  report(s, ids_of(meta.store_jobs));
  s.take_events();
  add(s, "w", {"n0"}, 4);  // one new block in both groups: two evictions
  meta = step(s, {sched("w", {{5}, {6}}, 0, 4)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  auto ev = s.take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_TRUE(ev[0].removed);
  EXPECT_EQ(ev[0].keys, (Strs{key("t", 1), key("t", 0)}));
  EXPECT_EQ(s.manager().state(key("h", 0)), BlockState::kReady);
  EXPECT_EQ(s.manager().state(key("h", 1)), BlockState::kReady);
}

// A step's stores are prepared in one manager call (build_stores). What one call per request in
// scheduling order gives must still hold: recency by scheduling order (invariant 8 across
// requests), and a refusal of one request only when the step's stores do not fit together.
TEST(OffloadingSchedulerStepStores, RequestsStoredInOneStepAgeInSchedulingOrder) {
  auto c = make_config({Full()}, 4, 1, 0, 1, /*cpu_blocks=*/4);
  c.enable_events = true;
  OffloadingScheduler s(std::move(c));
  add(s, "A", {"a0", "a1"}, 8);
  add(s, "B", {"b0", "b1"}, 8);
  auto meta = step(s, {sched("A", {{1, 2}}, 0, 8), sched("B", {{3, 4}}, 0, 8)});
  ASSERT_EQ(meta.store_jobs.size(), 2u);
  expect_job(s, meta.store_jobs[0], true, "A", {1, 2}, {2}, {0}, {key("a0", 0), key("a1", 0)});
  expect_job(s, meta.store_jobs[1], true, "B", {3, 4}, {2}, {0}, {key("b0", 0), key("b1", 0)});
  EXPECT_LT(meta.store_jobs[0].job_id, meta.store_jobs[1].job_id);
  report(s, ids_of(meta.store_jobs));
  // Both jobs complete in one call: one BlockStored event per job, never both requests' keys
  // in one (a router reads an event's block hashes as one request's run).
  auto stored = s.take_events();
  ASSERT_EQ(stored.size(), 2u);
  EXPECT_FALSE(stored[0].removed);
  EXPECT_FALSE(stored[1].removed);
  EXPECT_EQ(stored[0].keys, (Strs{key("a0", 0), key("a1", 0)}));
  EXPECT_EQ(stored[1].keys, (Strs{key("b0", 0), key("b1", 0)}));
  // B was stored after A: A's blocks go first, each request's tail before its head.
  add(s, "w", {"c0", "c1", "c2"}, 12);
  meta = step(s, {sched("w", {{8, 9, 10}}, 0, 12)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  auto ev = s.take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_TRUE(ev[0].removed);
  EXPECT_EQ(ev[0].keys, (Strs{key("a1", 0), key("a0", 0), key("b1", 0)}));
  EXPECT_EQ(s.stats().store_refusals, 0u);
}

TEST(OffloadingSchedulerStepStores, StoresThatDoNotFitTogetherAreTriedOneRequestAtATime) {
  OffloadingScheduler s(make_config({Full()}, 4, 1, 0, 1, /*cpu_blocks=*/3));
  add(s, "A", {"a0", "a1"}, 8);
  add(s, "B", {"b0", "b1"}, 8);
  // 4 new blocks, 3 free slots, nothing to evict: A's fit alone, B's are refused.
  auto meta = step(s, {sched("A", {{1, 2}}, 0, 8), sched("B", {{3, 4}}, 0, 8)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {1, 2}, {2}, {0}, {key("a0", 0), key("a1", 0)});
  EXPECT_EQ(s.stats().store_refusals, 1u);
  EXPECT_EQ(s.next_store_block("A"), 2);
  EXPECT_EQ(s.next_store_block("B"), 0);
  EXPECT_EQ(s.manager().state(key("b0", 0)), BlockState::kMissing);
  EXPECT_EQ(s.manager().num_free_blocks(), 1u);
  report(s, ids_of(meta.store_jobs));  // A's blocks become evictable: B's retry fits
  meta = step(s, {sched("A", Table{}, 8, 0), sched("B", Table{}, 8, 0)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "B", {3, 4}, {2}, {0}, {key("b0", 0), key("b1", 0)});
  EXPECT_EQ(s.next_store_block("B"), 2);
  EXPECT_EQ(s.stats().store_refusals, 1u);
}

TEST(OffloadingSchedulerStepStores, ABlockAnotherRequestOfTheStepHoldsIsNotEvictedForIt) {
  OffloadingScheduler s(make_config({Full()}, 4, 1, 0, 1, /*cpu_blocks=*/3));
  seed(s, "sk", {"k"}, {{1}});  // the least recent block
  seed(s, "sz", {"z"}, {{2}});
  seed(s, "sy", {"y"}, {{3}});
  ASSERT_EQ(s.manager().num_free_blocks(), 0u);
  add(s, "A", {"a0"}, 4);
  add(s, "B", {"k", "b1"}, 8);  // B's first block is held already (k)
  auto meta = step(s, {sched("A", {{4}}, 0, 4), sched("B", {{5, 6}}, 0, 8)});
  // A's new block would evict k, the least recent, if it were prepared alone; B then needs k
  // again and evicts two more. Prepared together, k is protected: z and y make the room.
  ASSERT_EQ(meta.store_jobs.size(), 2u);
  expect_job(s, meta.store_jobs[0], true, "A", {4}, {1}, {0}, {key("a0", 0)});
  expect_job(s, meta.store_jobs[1], true, "B", {6}, {1}, {1}, {key("b1", 0)});
  EXPECT_EQ(s.stats().blocks_evicted, 2u);
  EXPECT_EQ(s.manager().state(key("k", 0)), BlockState::kReady);
  EXPECT_EQ(s.manager().state(key("z", 0)), BlockState::kMissing);
  EXPECT_EQ(s.manager().state(key("y", 0)), BlockState::kMissing);
}

// Completed jobs' records are reused by later jobs of either direction (no allocation once
// warm): a reused record carries nothing of the job before it.
TEST(OffloadingSchedulerJobs, ReusedRecordsCarryNothingOver) {
  OffloadingScheduler s(make_config({Full()}, 4));
  seed(s, "sa", {"a0", "a1", "a2"}, {{1, 2, 3}});  // a 3-block store, completed
  prepare_load_of_a0_a1(s);
  auto meta = step(s, {});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  expect_job(s, meta.load_jobs[0], false, "r", {5, 6}, {2}, {0}, {key("a0", 0), key("a1", 0)});
  report(s, {meta.load_jobs[0].job_id});
  add(s, "w", {"c0"}, 4);
  meta = step(s, {sched("w", {{8}}, 0, 4)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "w", {8}, {1}, {0}, {key("c0", 0)});
  report(s, {meta.store_jobs[0].job_id});
  add(s, "q", {"a0", "a1", "a2"}, 13);
  expect_match(s.get_num_new_matched_tokens("q", 4), hit(8));
  s.update_state_after_alloc("q", Table{{1, 9, 10, 11}}, 8);
  meta = step(s, {});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  expect_job(s, meta.load_jobs[0], false, "q", {9, 10}, {2}, {1}, {key("a1", 0), key("a2", 0)});
}

// A finished request's record is reused for the next new request (its buffers kept): the new
// request must start as a fresh one (no hashes, table, stores, match or flags carried over).
TEST(OffloadingSchedulerRequests, ReusedRecordsCarryNothingOver) {
  OffloadingScheduler s(make_config({Full(), SW(4)}, 4));
  seed(s, "sa", {"x0", "x1"}, {{1, 2}, {3, 4}});  // stored, completed: a hit for "b" below
  // "a": two blocks stored, a third in flight when it finishes, a pending hit left unused
  add(s, "a", {"a0", "a1", "a2"}, 13);
  auto meta = step(s, {sched("a", {{5, 6}, {7, 8}}, 0, 8)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  report(s, {meta.store_jobs[0].job_id});
  meta = step(s, {sched("a", {{9}, {10}}, 8, 5)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  const JobId in_flight = meta.store_jobs[0].job_id;
  EXPECT_TRUE(s.request_finished("a"));  // kept until its store completes
  report(s, {in_flight});                 // then erased: its record becomes a spare
  EXPECT_EQ(s.num_requests(), 0u);
  // "b" takes the spare record: a fresh request, whatever "a" left in it
  add(s, "b", {"x0", "x1", "b2"}, 13);
  EXPECT_EQ(s.num_hashes("b"), 3u);
  EXPECT_EQ(s.next_store_block("b"), 0);
  expect_match(s.get_num_new_matched_tokens("b", 0), hit(8));
  s.update_state_after_alloc("b", Table{{11, 12, 13}, {14, 15, 16}}, 8);
  meta = step(s, {});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  EXPECT_EQ(meta.load_jobs[0].request_id, "b");
  // the window group loads only the block its 4-token window needs
  EXPECT_EQ(meta.load_jobs[0].gpu_block_ids, (std::vector<std::int64_t>{11, 12, 15}));
  report(s, {meta.load_jobs[0].job_id});
  meta = step(s, {sched("b", {{11, 12, 13}, {14, 15, 16}}, 8, 5)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);  // only its own third block, from its own table
  expect_job(s, meta.store_jobs[0], true, "b", {13, 16}, {1, 1}, {2, 2},
             {key("b2", 0), key("b2", 1)});
  EXPECT_EQ(s.next_store_block("b"), 3);
  // "a" is gone (a finished id cannot come back under the reused record)
  EXPECT_EQ(s.num_hashes("a"), 0u);
}

// Records are owned in a vector and an erase moves the last one into the hole: finishing the
// first, a middle and the last request must leave every other request whole and findable, and
// new requests (on spare records) must not disturb them either.
TEST(OffloadingSchedulerRequests, FinishingAnyRequestLeavesTheOthersIntact) {
  OffloadingScheduler s(make_config({Full()}, 4));
  auto hashes = [](const std::string& id, std::size_t n) {
    std::vector<std::string> h;
    for (std::size_t j = 0; j < n; ++j) h.push_back(id + "." + std::to_string(j));
    return h;
  };
  for (std::size_t i = 0; i < 10; ++i) {
    const std::string id = "r" + std::to_string(i);
    add(s, id, hashes(id, i + 1), static_cast<std::int64_t>(4 * (i + 1) + 1));
  }
  ASSERT_EQ(s.num_requests(), 10u);
  for (const char* id : {"r0", "r5", "r9"}) EXPECT_FALSE(s.request_finished(id));
  EXPECT_EQ(s.num_requests(), 7u);
  add(s, "n", hashes("n", 2), 9);  // takes a spare record
  EXPECT_EQ(s.num_requests(), 8u);
  for (std::size_t i = 0; i < 10; ++i) {
    const std::string id = "r" + std::to_string(i);
    const bool gone = i == 0 || i == 5 || i == 9;
    EXPECT_EQ(s.num_hashes(id), gone ? 0u : i + 1) << id;
  }
  EXPECT_EQ(s.num_hashes("n"), 2u);
  for (std::size_t i = 0; i < 10; ++i) s.request_finished("r" + std::to_string(i));
  EXPECT_EQ(s.num_requests(), 1u);
  EXPECT_EQ(s.num_hashes("n"), 2u);
  EXPECT_FALSE(s.request_finished("n"));
  EXPECT_EQ(s.num_requests(), 0u);
}

// ------------------------------------------------------------------------ store batching

SchedulerConfig batched(std::int64_t batch, std::vector<SchedulerGroup> groups = {Full()}) {
  auto c = make_config(std::move(groups));
  c.store_batch_blocks = batch;
  return c;
}

TEST(OffloadingSchedulerStoreBatch, ConfigRangeAndPartialGroupsStoreEveryBlock) {
  expect_names(error_of([] { OffloadingScheduler s(batched(0)); }),
               {"store_batch_blocks", "got 0"});
  expect_names(error_of([] { OffloadingScheduler s(batched((1 << 20) + 1)); }),
               {"store_batch_blocks", "got 1048577"});
  EXPECT_EQ(OffloadingScheduler(batched(1 << 20)).store_batch_blocks(), 1 << 20);
  EXPECT_EQ(OffloadingScheduler(batched(3)).store_batch_blocks(), 3);
  // Blocks of a sliding-window or Mamba group can leave the window and be freed while waiting
  EXPECT_EQ(OffloadingScheduler(batched(3, {Full(), SW(8)})).store_batch_blocks(), 1);
  EXPECT_EQ(OffloadingScheduler(batched(3, {Full(), Mamba()})).store_batch_blocks(), 1);
}

TEST(OffloadingSchedulerStoreBatch, DecodeStoresWaitForAFullBatch) {
  OffloadingScheduler s(batched(3));
  add(s, "A", hashes("a", 8), 32);
  // prefill of 8 tokens: 2 full blocks wait (fewer than 3)
  auto meta = step(s, {sched("A", {{5, 6, 7}}, 0, 9)});
  EXPECT_TRUE(meta.store_jobs.empty());
  EXPECT_EQ(s.next_store_block("A"), 0);
  EXPECT_EQ(s.num_idle_requests(), 1u);  // steps that complete no block skip it
  for (std::int64_t c = 9; c < 11; ++c) {
    EXPECT_TRUE(step(s, {sched("A", Table{}, c, 1)}).store_jobs.empty()) << "at " << c;
  }
  // token 11 fills block 2: the batch of 3 is stored in one job
  meta = step(s, {sched("A", Table{}, 11, 1)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {5, 6, 7}, {3}, {0},
             {key("a0", 0), key("a1", 0), key("a2", 0)});
  EXPECT_EQ(s.next_store_block("A"), 3);
  report(s, {meta.store_jobs[0].job_id});
  // a prefill chunk that completes a batch or more at once stores all of it
  meta = step(s, {sched("A", {{8, 9, 10, 11}}, 12, 16)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {8, 9, 10, 11}, {4}, {3},
             {key("a3", 0), key("a4", 0), key("a5", 0), key("a6", 0)});
  EXPECT_EQ(s.stats().store_jobs, 2u);
  EXPECT_EQ(s.stats().blocks_stored, 7u);
}

TEST(OffloadingSchedulerStoreBatch, FinishStoresTheWaitingBlocksInTheNextStep) {
  OffloadingScheduler s(batched(4));
  add(s, "A", hashes("a", 3), 12);
  EXPECT_TRUE(step(s, {sched("A", {{5, 6, 7}}, 0, 12)}).store_jobs.empty());
  EXPECT_TRUE(s.request_finished("A"));  // a store is due: keep the blocks
  EXPECT_EQ(s.num_flushes_pending(), 1u);
  EXPECT_FALSE(s.request_finished("A"));  // finishing again changes nothing
  expect_names(error_of([&] { step(s, {sched("A", Table{}, 12, 1)}); }), {"'A'", "finished"});
  EXPECT_EQ(s.num_flushes_pending(), 1u);
  EXPECT_EQ(s.manager().state(key("a0", 0)), BlockState::kMissing);
  auto meta = step(s, {}, {"A"});  // the engine lists it as finished in its next step
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {5, 6, 7}, {3}, {0},
             {key("a0", 0), key("a1", 0), key("a2", 0)});
  EXPECT_EQ(s.num_flushes_pending(), 0u);
  EXPECT_EQ(s.num_requests(), 1u);
  auto out = report(s, {meta.store_jobs[0].job_id});
  EXPECT_EQ(out.finished_storing, Strs{"A"});
  EXPECT_EQ(s.num_requests(), 0u);
  for (const char* h : {"a0", "a1", "a2"}) {
    EXPECT_EQ(s.manager().state(key(h, 0)), BlockState::kReady) << h;
  }
}

TEST(OffloadingSchedulerStoreBatch, BlocksFilledWhileSkippedAsIdleAreStoredAtFinish) {
  OffloadingScheduler s(batched(4));
  add(s, "A", hashes("a", 4), 16);
  EXPECT_TRUE(step(s, {sched("A", {{5, 6, 7}}, 0, 8)}).store_jobs.empty());  // 2 blocks wait
  EXPECT_EQ(s.num_idle_requests(), 1u);
  for (std::int64_t c = 8; c < 12; ++c) {  // token 11 fills block 2: skipped (batch of 4)
    EXPECT_TRUE(step(s, {sched("A", Table{}, c, 1)}).store_jobs.empty()) << "at " << c;
    EXPECT_EQ(s.num_idle_requests(), 1u) << "at " << c;
  }
  EXPECT_TRUE(s.request_finished("A"));
  auto meta = step(s, {});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {5, 6, 7}, {3}, {0},
             {key("a0", 0), key("a1", 0), key("a2", 0)});
}

TEST(OffloadingSchedulerStoreBatch, FinishStoresOnlyBlocksWhoseHashesAreKnown) {
  OffloadingScheduler s(batched(4));
  add(s, "A", hashes("a", 1), 12);  // 3 blocks computed, 1 hash known
  EXPECT_TRUE(step(s, {sched("A", {{5, 6, 7}}, 0, 12)}).store_jobs.empty());
  // the engine's last hashes, handed over before finishing (the binding reads them)
  const Strs more = hashes("a", 2);
  std::vector<std::string_view> views(more.begin(), more.end());
  s.add_hashes("A", 0, views);
  EXPECT_TRUE(s.request_finished("A"));
  auto meta = step(s, {});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {5, 6}, {2}, {0}, {key("a0", 0), key("a1", 0)});
  expect_names(error_of([&] { s.add_hashes("A", 2, views); }), {"'A'", "finished"});
  expect_names(error_of([&] { s.add_hashes("nobody", 0, views); }), {"'nobody'", "unknown"});
}

TEST(OffloadingSchedulerStoreBatch, WaitingBlockReallocatedBeforeTheFlushIsStale) {
  OffloadingScheduler s(batched(4));
  add(s, "A", hashes("a", 3), 12);
  EXPECT_TRUE(step(s, {sched("A", {{5, 6, 7}}, 0, 12)}).store_jobs.empty());
  EXPECT_TRUE(s.request_finished("A"));
  // the engine freed A's blocks and gives block 7 to B in the very step the flush is built
  add(s, "B", {}, 8);
  auto meta = step(s, {sched("B", {{7, 9}}, 0, 3)}, {"A"});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {5, 6}, {2}, {0}, {key("a0", 0), key("a1", 0)});
  EXPECT_EQ(s.stats().stale_blocks_skipped, 1u);
  EXPECT_EQ(s.manager().state(key("a2", 0)), BlockState::kMissing);
  // every waiting block reallocated: nothing is stored, and the request is listed as done by
  // the next update_connector_output (request_finished returned true for it)
  add(s, "C", hashes("c", 2), 8);
  EXPECT_TRUE(step(s, {sched("C", {{11, 12}}, 0, 8)}).store_jobs.empty());
  EXPECT_TRUE(s.request_finished("C"));
  add(s, "D", {}, 8);
  meta = step(s, {sched("D", {{12, 11}}, 0, 3)}, {"C"});
  EXPECT_TRUE(meta.store_jobs.empty());
  EXPECT_EQ(s.stats().stale_blocks_skipped, 3u);
  EXPECT_EQ(s.next_store_block("C"), -1);  // forgotten
  auto out = report(s, {});
  EXPECT_EQ(out.finished_storing, Strs{"C"});
  EXPECT_TRUE(report(s, {}).finished_storing.empty());  // listed once
}

TEST(OffloadingSchedulerStoreBatch, PreemptionDropsTheWaitAndTheNewTableIsStored) {
  OffloadingScheduler s(batched(2));
  add(s, "A", hashes("a", 4), 16);
  EXPECT_TRUE(step(s, {sched("A", {{5}}, 0, 4)}).store_jobs.empty());  // block 0 waits
  EXPECT_TRUE(step(s, {}, {}, {"A"}).store_jobs.empty());  // preempted: blocks freed
  add(s, "B", {}, 8);
  EXPECT_TRUE(step(s, {sched("B", {{5}}, 0, 3)}).store_jobs.empty());  // 5 reused by B
  auto meta = step(s, {sched("A", {{7, 8}}, 0, 8, /*resumed=*/true)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {7, 8}, {2}, {0}, {key("a0", 0), key("a1", 0)});
  EXPECT_EQ(s.stats().stale_blocks_skipped, 0u);
}

TEST(OffloadingSchedulerStoreBatch, BlocksWaitingAtAResetAreNeverStored) {
  OffloadingScheduler s(batched(3));
  add(s, "A", hashes("a", 8), 32);
  EXPECT_TRUE(step(s, {sched("A", {{5, 6, 7, 8, 9}}, 0, 8)}).store_jobs.empty());  // 2 wait
  add(s, "B", hashes("b", 2), 8);
  EXPECT_TRUE(step(s, {sched("B", {{10, 11}}, 0, 8)}).store_jobs.empty());
  EXPECT_TRUE(s.request_finished("B"));  // B's 2 blocks are due at the next step
  s.reset_cache();  // a weight update: KV computed before it is never stored
  EXPECT_EQ(s.num_flushes_pending(), 0u);
  EXPECT_EQ(s.next_store_block("A"), 2);
  EXPECT_EQ(s.next_store_block("B"), -1);
  // A's blocks 2..4 fill after the reset: they are its next batch; 0 and 1 are never stored
  EXPECT_TRUE(step(s, {sched("A", Table{}, 8, 4)}).store_jobs.empty());
  auto meta = step(s, {sched("A", Table{}, 12, 8)}, {"B"});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {7, 8, 9}, {3}, {2},
             {key("a2", 0), key("a3", 0), key("a4", 0)});
  auto out = report(s, {meta.store_jobs[0].job_id});
  EXPECT_EQ(out.finished_storing, Strs{"B"});
  for (const char* h : {"a0", "a1", "b0", "b1"}) {
    EXPECT_EQ(s.manager().state(key(h, 0)), BlockState::kMissing) << h;
  }
}

TEST(OffloadingSchedulerStoreBatch, UnscheduledRequestIsForgottenAtOnce) {
  OffloadingScheduler s(batched(4));
  add(s, "Q", hashes("q", 2), 8);  // queued, never scheduled: nothing to store
  EXPECT_FALSE(s.request_finished("Q"));
  EXPECT_EQ(s.num_requests(), 0u);
  EXPECT_EQ(s.num_flushes_pending(), 0u);
}

// ------------------------------------------------------------------- offload_prompt_only

SchedulerConfig prompt_only(std::int64_t batch = 1) {
  auto c = batched(batch);
  c.offload_prompt_only = true;
  return c;
}

TEST(OffloadingSchedulerPromptOnly, DecodeBlocksAreNeverStored) {
  OffloadingScheduler s(prompt_only());
  add(s, "A", hashes("a", 2), 10);  // a prompt of 10 tokens: 2 full blocks and 2 tokens
  s.set_prompt_tokens("A", 10);
  auto meta = step(s, {sched("A", {{5, 6, 7}}, 0, 10)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {5, 6}, {2}, {0}, {key("a0", 0), key("a1", 0)});
  report(s, {meta.store_jobs[0].job_id});
  EXPECT_EQ(s.num_idle_requests(), 1u);  // nothing more to store: decode steps skip it
  // decode fills block 2 (tokens 8..11) and block 3: neither is stored
  add(s, "A", hashes("a", 4), 16);
  for (std::int64_t c = 10; c < 16; ++c) {
    EXPECT_TRUE(step(s, {sched("A", c == 11 ? Table{{8}} : Table{}, c, 1)}).store_jobs.empty())
        << "at " << c;
  }
  EXPECT_FALSE(s.request_finished("A"));  // no store due at the finish either
  EXPECT_EQ(s.stats().blocks_stored, 2u);
  EXPECT_EQ(s.manager().state(key("a2", 0)), BlockState::kMissing);
}

TEST(OffloadingSchedulerPromptOnly, TheLastPromptBlocksAreStoredWithoutWaitingForABatch) {
  OffloadingScheduler s(prompt_only(4));
  add(s, "A", hashes("a", 6), 24);
  s.set_prompt_tokens("A", 24);  // 6 prompt blocks: one batch of 4, then 2 that end it
  auto meta = step(s, {sched("A", {{5, 6, 7, 8}}, 0, 16)});  // prefill chunk 1: 4 blocks
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  EXPECT_EQ(meta.store_jobs[0].keys.size(), 4u);
  report(s, {meta.store_jobs[0].job_id});
  meta = step(s, {sched("A", {{9, 10}}, 16, 8)});  // chunk 2: the prompt's last 2 blocks
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {9, 10}, {2}, {4}, {key("a4", 0), key("a5", 0)});
  report(s, {meta.store_jobs[0].job_id});
  EXPECT_FALSE(s.request_finished("A"));  // nothing waits for the finish
}

TEST(OffloadingSchedulerPromptOnly, OffByDefaultAndAPromptLengthWithoutTheOptionChangesNothing) {
  OffloadingScheduler s(batched(1));
  EXPECT_FALSE(s.config().offload_prompt_only);
  add(s, "A", hashes("a", 3), 12);
  s.set_prompt_tokens("A", 4);  // checked, not applied
  auto meta = step(s, {sched("A", {{5, 6, 7}}, 0, 12)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  EXPECT_EQ(meta.store_jobs[0].keys.size(), 3u);
}

TEST(OffloadingSchedulerPromptOnly, ARequestWithoutAPromptLengthIsNotLimited) {
  OffloadingScheduler s(prompt_only());
  add(s, "A", hashes("a", 3), 12);
  auto meta = step(s, {sched("A", {{5, 6, 7}}, 0, 12)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  EXPECT_EQ(meta.store_jobs[0].keys.size(), 3u);
}

TEST(OffloadingSchedulerPromptOnly, BadPromptLengthsAreRefusedAndChangeNothing) {
  OffloadingScheduler s(prompt_only());
  add(s, "A", hashes("a", 3), 12);
  expect_names(error_of([&] { s.set_prompt_tokens("A", -1); }),
               {"set_prompt_tokens", "'A'", "-1", "prompt"});
  expect_names(error_of([&] { s.set_prompt_tokens("nobody", 4); }), {"'nobody'"});
  auto meta = step(s, {sched("A", {{5, 6, 7}}, 0, 12)});  // not limited: nothing was set
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  EXPECT_EQ(meta.store_jobs[0].keys.size(), 3u);
  report(s, {meta.store_jobs[0].job_id});
  s.request_finished("A");
  expect_names(error_of([&] { s.set_prompt_tokens("A", 4); }), {"'A'"});
}

TEST(OffloadingSchedulerPromptOnly, AStreamingSessionWhosePromptGrewStoresTheNewPromptBlocks) {
  OffloadingScheduler s(prompt_only());
  add(s, "A", hashes("a", 2), 8);
  s.set_prompt_tokens("A", 8);
  auto meta = step(s, {sched("A", {{5, 6}}, 0, 8)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  report(s, {meta.store_jobs[0].job_id});
  // the session's next input: its prompt now has 16 tokens; scheduled again as new (its
  // whole table), it stores the prompt blocks it did not have
  add(s, "A", hashes("a", 4), 16);
  s.set_prompt_tokens("A", 16);
  ScheduledRequest again = sched("A", {{5, 6, 7, 8}}, 8, 8);
  again.whole_table = true;
  meta = step(s, {again});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  expect_job(s, meta.store_jobs[0], true, "A", {7, 8}, {2}, {2}, {key("a2", 0), key("a3", 0)});
}

// ---------------------------------------------------------------- a pool of several engines

// Two schedulers on one manager (what a node pool is: a BlockManager that is not the
// scheduler's own; here the in-process manager stands for it). What one stores is a hit for
// the other, loaded from the same slots; the other's load pins are its own to release; and a
// scheduler without a pool of its own has no manager() to hand out.
TEST(OffloadingSchedulerNodePool, SchedulersSharingOneManagerHitEachOthersBlocks) {
  auto pool = std::make_shared<CPUOffloadingManager>(8);
  OffloadingScheduler a(make_config({Full()}, 4, 1, 0, 1, /*cpu_blocks=*/8), pool);
  OffloadingScheduler b(make_config({Full()}, 4, 1, 0, 1, /*cpu_blocks=*/8), pool);
  EXPECT_TRUE(a.has_node_pool());
  EXPECT_THROW(static_cast<void>(a.manager()), std::logic_error);
  add(a, "A", {"h0", "h1"}, 8);
  auto meta = step(a, {sched("A", {{5, 6}}, 0, 8)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  const U stored = meta.store_jobs[0].cpu_block_ids;
  EXPECT_EQ(pool->state(key("h0", 0)), BlockState::kPending);
  add(b, "B", {"h0", "h1"}, 12);
  expect_match(b.get_num_new_matched_tokens("B", 0), retry());  // a's store is in flight
  report(a, {meta.store_jobs[0].job_id});
  expect_match(b.get_num_new_matched_tokens("B", 0), hit(8));
  b.update_state_after_alloc("B", Table{{3, 4, 7}}, 8);
  EXPECT_EQ(pool->pin_count(key("h0", 0)), 1u);
  auto loads = step(b, {});
  ASSERT_EQ(loads.load_jobs.size(), 1u);
  EXPECT_EQ(loads.load_jobs[0].cpu_block_ids, stored);
  auto out = report(b, {loads.load_jobs[0].job_id});
  EXPECT_EQ(out.finished_loading, Strs{"B"});
  EXPECT_EQ(pool->pin_count(key("h0", 0)), 0u);
  EXPECT_EQ(pool->num_stored_blocks(), 2u);
}

}  // namespace
}  // namespace kvoff
