// OffloadingScheduler: the engine-facing hooks, independent of Python. docs/design.md "One engine
// step" and invariants 1 (group sizes), 4 (stale blocks, fences), 6 (stores), 7 (correctness)
// and 8 (prefix order). Every job is checked field by field. This file: configuration,
// offload keys, lookups and loads; stores, fences and resets are in
// test_offloading_scheduler_stores.cpp, completion and the end of requests in
// test_offloading_scheduler_lifecycle.cpp.
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

// ----------------------------------------------------------------------------- config

TEST(OffloadingSchedulerConfig, RejectsBadValuesNamingThem) {
  OffloadingScheduler ok(make_config({Full()}));
  EXPECT_EQ(ok.config().hash_block_size, 4);  // 0 means gpu_block_size
  auto bad = [](SchedulerConfig c) {
    return error_of([&] { OffloadingScheduler s(std::move(c)); });
  };
  expect_names(bad(make_config({Full()}, 0)), {"gpu_block_size", "got 0"});
  expect_names(bad(make_config({Full()}, -3)), {"gpu_block_size", "got -3"});
  expect_names(bad(make_config({Full()}, 4, 0)), {"block_size_factor", "got 0"});
  // gpu_block_size x block_size_factor wrapped to 0 in int64 (2^61 x 8): a lookup then
  // divided by zero (SIGFPE) instead of a clear error
  expect_names(bad(make_config({Full()}, std::int64_t{1} << 61, 8)),
               {"gpu_block_size (2305843009213693952)", "block_size_factor (8)", "2^31 tokens"});
  expect_names(bad(make_config({Full()}, (std::int64_t{1} << 31) + 1)),
               {"gpu_block_size (2147483649)"});
  OffloadingScheduler largest(make_config({Full()}, std::int64_t{1} << 11, 1 << 20));
  EXPECT_EQ(largest.config().block_size_factor, 1 << 20);
  expect_names(bad(make_config({Full()}, 4, 1, 3)),
               {"gpu_block_size (4)", "hash_block_size (3)"});
  expect_names(bad(make_config({Full()}, 4, 1, -2)), {"hash_block_size (-2)"});
  expect_names(bad(make_config({Full()}, 4, 1, 0, 0)), {"world_size", "got 0"});
  expect_names(bad(make_config({Full()}, 4, 1, 0, 1, 64, 0)), {"num_gpu_blocks", "got 0"});
  expect_names(bad(make_config({Full()}, 4, 1, 0, 1, 0)), {"num_blocks", "got 0"});
  expect_names(bad(make_config({})), {"groups", "got 0"});
  expect_names(bad(make_config(std::vector<SchedulerGroup>(257, Full()))), {"got 257"});
  expect_names(bad(make_config({Full(), SW(0)})), {"group 1", "sliding_window 0"});
  auto c = make_config({Full()});
  c.eviction_policy = "nosuchpolicy";
  expect_names(bad(c), {"nosuchpolicy", "lru"});
  // 256 groups is the limit, not an error.
  OffloadingScheduler many(make_config(std::vector<SchedulerGroup>(256, Full())));
  EXPECT_EQ(many.config().groups.size(), 256u);
}

// ------------------------------------------------------------------------ offload keys

TEST(OffloadingSchedulerKeys, LastHashOfOffloadedBlockPlusGroupByte) {
  // block 4 tokens, factor 2 -> offloaded block 8 tokens; hash every 2 tokens -> 4 hashes each.
  OffloadingScheduler s(make_config({Full(), Full()}, 4, 2, 2));
  const Strs h = hashes("h", 8);
  add(s, "r", h, 16);
  auto meta = step(s, {sched("r", {{1, 2, 3, 4}, {5, 6, 7, 8}}, 0, 16)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  const auto& j = meta.store_jobs[0];
  expect_job(s, j, true, "r", {1, 2, 3, 4, 5, 6, 7, 8}, {4, 4}, {0, 0},
             {key("h3", 0), key("h7", 0), key("h3", 1), key("h7", 1)});
  // prepare_store ran on (block, group) order: h3/0, h3/1, h7/0, h7/1 -> slots 0, 1, 2, 3.
  EXPECT_EQ(j.cpu_block_ids, (U{0, 2, 1, 3}));
  EXPECT_EQ(s.manager().state(key("h3", 0)), BlockState::kPending);
  report(s, {j.job_id});
  for (const char* hh : {"h3", "h7"}) {
    for (int g : {0, 1}) EXPECT_EQ(s.manager().state(key(hh, g)), BlockState::kReady) << hh << g;
  }
  for (const char* hh : {"h0", "h1", "h2", "h4", "h5", "h6"}) {
    EXPECT_EQ(s.manager().state(key(hh, 0)), BlockState::kMissing) << hh;
  }
  EXPECT_EQ(s.manager().state("h3"), BlockState::kMissing);  // the group byte is part of it
}

// ------------------------------------------------------------------------------ lookups

TEST(OffloadingSchedulerLookup, FullAttentionLongestPrefix) {
  OffloadingScheduler s(make_config({Full()}));
  seed(s, "seed", hashes("a", 4), {{1, 2, 3, 4}});
  add(s, "r", {"a0", "a1", "x2", "a3"}, 16);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(8));  // a3 is present but after a gap
  expect_match(s.get_num_new_matched_tokens("r", 4), hit(4));
  expect_match(s.get_num_new_matched_tokens("r", 8), miss());
  add(s, "all", hashes("a", 4), 20);
  expect_match(s.get_num_new_matched_tokens("all", 0), hit(16));
  expect_match(s.get_num_new_matched_tokens("all", 12), hit(4));
  add(s, "none", {"x0", "a1"}, 8);
  expect_match(s.get_num_new_matched_tokens("none", 0), miss());
  EXPECT_EQ(s.stats().lookups, 6u);
  // Bad arguments name the value.
  expect_names(error_of([&] { s.get_num_new_matched_tokens("r", 3); }),
               {"num_computed_tokens 3", "block size 4"});
  expect_names(error_of([&] { s.get_num_new_matched_tokens("r", 20); }),
               {"num_computed_tokens 20", "num_tokens=16"});
  expect_names(error_of([&] { s.get_num_new_matched_tokens("ghost", 0); }),
               {"'ghost'", "unknown request"});
}

TEST(OffloadingSchedulerLookup, LongPrefixesAcrossLookupChunks) {
  // Full-attention lookups go a chunk per pipelined manager call, chunks of 4, 16, 64, then
  // 128 blocks (edges at 4, 20, 84, 212, 340 blocks past the first block asked): a miss or a
  // busy block past the first chunk, and a miss on either side of a chunk's edge, bound the
  // hit exactly as at block 0.
  OffloadingScheduler s(make_config({Full()}, 4, 1, 0, 1, /*cpu_blocks=*/1024,
                                    /*gpu_blocks=*/1024));
  Table seed_table(1);
  for (std::int64_t i = 1; i <= 300; ++i) seed_table[0].push_back(i);
  seed(s, "seed", hashes("a", 300), seed_table);
  const auto with_gap = [](int gap) {
    Strs hs = hashes("a", 300);
    hs[static_cast<std::size_t>(gap)] = "x";
    return hs;
  };
  add(s, "all", hashes("a", 300), 1200);
  expect_match(s.get_num_new_matched_tokens("all", 0), hit(1200));
  expect_match(s.get_num_new_matched_tokens("all", 4 * 100), hit(800));  // starts mid-prompt
  for (const int gap : {0, 1, 3, 4, 5, 19, 20, 21, 83, 84, 85, 127, 128, 129, 200, 211, 212, 213,
                        255, 256, 299}) {
    const std::string id = "gap" + std::to_string(gap);
    add(s, id, with_gap(gap), 1200);
    expect_match(s.get_num_new_matched_tokens(id, 0), gap == 0 ? miss() : hit(4 * gap));
    // the chunks count from the first block asked (here block 2, after an engine hit)
    if (gap > 2) {
      expect_match(s.get_num_new_matched_tokens(id, 4 * 2), hit(4 * (gap - 2)));
    }
  }
  // A block being stored (pending) at 200, after a present prefix: retry later.
  Strs busy = hashes("a", 200);
  busy.push_back("b200");
  add(s, "store", busy, 804);
  Table store_table(1);
  for (std::int64_t i = 301; i <= 501; ++i) store_table[0].push_back(i);
  auto meta = step(s, {sched("store", store_table, 0, 804)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  add(s, "reader", busy, 900);
  expect_match(s.get_num_new_matched_tokens("reader", 0), retry());
  report(s, {meta.store_jobs[0].job_id});
  expect_match(s.get_num_new_matched_tokens("reader", 0), hit(804));
}

TEST(OffloadingSchedulerLookup, SlidingWindowRightmostRunOfEnoughHits) {
  // window 9 tokens -> the last 8 tokens (2 blocks) before the resume point are needed.
  OffloadingScheduler s(make_config({SW(9)}));
  // present: 1 2 4 5 6 (0, 3 and 7 missing)
  seed(s, "s1", hashes("a", 8), {{0, 11, 12, 0, 14, 15, 16, 0}});
  add(s, "r", hashes("a", 8), 33);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(28));  // 5, 6 end at block 7
  // present: 0 1 2 4 (3, 5 missing): the run at 4 is too short -> 3 blocks.
  seed(s, "s2", hashes("b", 6), {{21, 22, 23, 0, 25, 0}});
  add(s, "r2", hashes("b", 6), 25);
  expect_match(s.get_num_new_matched_tokens("r2", 0), hit(12));
}

TEST(OffloadingSchedulerLookup, SlidingWindowFallsBackToLeadingRun) {
  OffloadingScheduler s(make_config({SW(9)}));
  seed(s, "s", hashes("t", 4), {{10, 0, 12, 0}});  // present: 0, 2
  add(s, "r", hashes("t", 4), 17);
  // No two consecutive hits: only the leading block 0 (shorter than the window) is usable.
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(4));
  // The engine already has block 0: nothing beyond it qualifies.
  expect_match(s.get_num_new_matched_tokens("r", 4), miss());
}

TEST(OffloadingSchedulerLookup, MambaNeedsOnlyTheLastBlock) {
  OffloadingScheduler s(make_config({Mamba()}));
  seed(s, "s", hashes("m", 4), {{0, 0, 13, 0}});  // only block 2's state is stored
  add(s, "r", hashes("m", 4), 17);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(12));
  add(s, "r3", hashes("m", 3), 13);
  expect_match(s.get_num_new_matched_tokens("r3", 0), hit(12));
  // 12 tokens: the last token is recomputed -> only 1 block could be loaded, and it is missing.
  add(s, "r12", hashes("m", 3), 12);
  expect_match(s.get_num_new_matched_tokens("r12", 0), miss());
}

TEST(OffloadingSchedulerLookup, HybridGroupsAgreeOnOnePrefix) {
  OffloadingScheduler s(make_config({Full(), SW(9)}));
  // SW group misses block 4: the window before 6 blocks is incomplete -> 4 blocks.
  seed(s, "s1", hashes("a", 6), {{1, 2, 3, 4, 5, 6}, {11, 12, 13, 14, 0, 16}});
  add(s, "r1", hashes("a", 6), 25);
  expect_match(s.get_num_new_matched_tokens("r1", 0), hit(16));
  // Full group misses block 3 -> 3 blocks, and the SW window (1, 2) before it is present.
  seed(s, "s2", hashes("b", 6), {{21, 22, 23, 0, 25, 26}, {31, 32, 33, 34, 35, 36}});
  add(s, "r2", hashes("b", 6), 25);
  expect_match(s.get_num_new_matched_tokens("r2", 0), hit(12));
  // SW group misses block 1, outside the window before 6 blocks: irrelevant.
  seed(s, "s3", hashes("c", 6), {{41, 42, 43, 44, 45, 46}, {51, 0, 53, 54, 55, 56}});
  add(s, "r3", hashes("c", 6), 25);
  expect_match(s.get_num_new_matched_tokens("r3", 0), hit(24));
}

TEST(OffloadingSchedulerLookup, LastTokenIsRecomputedWithSlidingWindowGroup) {
  OffloadingScheduler s(make_config({Full(), SW(5)}));
  seed(s, "s", hashes("a", 4), {{1, 2, 3, 4}, {5, 6, 7, 8}});
  add(s, "r16", hashes("a", 4), 16);
  expect_match(s.get_num_new_matched_tokens("r16", 0), hit(12));
  add(s, "r17", hashes("a", 4), 17);
  expect_match(s.get_num_new_matched_tokens("r17", 0), hit(16));
}

TEST(OffloadingSchedulerLookup, RetryLaterWhileNeededBlockIsBeingStored) {
  OffloadingScheduler s(make_config({Full()}));
  add(s, "A", {"a0", "a1"}, 8);
  auto meta = step(s, {sched("A", {{1, 2}}, 0, 8)});
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  add(s, "B", {"a0", "a1"}, 12);
  expect_match(s.get_num_new_matched_tokens("B", 0), retry());
  EXPECT_EQ(s.stats().lookup_retries, 1u);
  report(s, {meta.store_jobs[0].job_id});
  expect_match(s.get_num_new_matched_tokens("B", 0), hit(8));
}

TEST(OffloadingSchedulerLookup, RetryLaterWhileNeededBlockIsLoadedForAnotherRequest) {
  OffloadingScheduler s(make_config({Full()}));
  seed(s, "seed", {"a0", "a1"}, {{1, 2}});
  add(s, "A", {"a0", "a1"}, 12);
  add(s, "B", {"a0", "a1"}, 12);
  expect_match(s.get_num_new_matched_tokens("A", 0), hit(8));
  s.update_state_after_alloc("A", Table{{5, 6, 7}}, 8);
  EXPECT_EQ(s.manager().pin_count(key("a0", 0)), 1u);
  expect_match(s.get_num_new_matched_tokens("B", 0), retry());  // load built, not emitted
  auto meta = step(s, {});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  expect_match(s.get_num_new_matched_tokens("B", 0), retry());  // load in flight
  auto out = report(s, {meta.load_jobs[0].job_id});
  EXPECT_EQ(out.finished_loading, Strs{"A"});
  EXPECT_EQ(s.manager().pin_count(key("a0", 0)), 0u);
  expect_match(s.get_num_new_matched_tokens("B", 0), hit(8));
}

TEST(OffloadingSchedulerLookup, BusyBlockOutsideTheWindowIsNotWaitedFor) {
  OffloadingScheduler s(make_config({SW(5)}));  // needs 1 block before the resume point
  seed(s, "seed", hashes("s", 4), {{0, 2, 3, 4}});
  add(s, "P", {"s0"}, 4);
  auto meta = step(s, {sched("P", {{5}}, 0, 4)});  // s0 now pending
  ASSERT_EQ(meta.store_jobs.size(), 1u);
  EXPECT_EQ(s.manager().state(key("s0", 0)), BlockState::kPending);
  add(s, "r", hashes("s", 4), 17);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(16));
  add(s, "r1", {"s0"}, 5);
  expect_match(s.get_num_new_matched_tokens("r1", 0), retry());
}

// ------------------------------------------------------------------------------- loads

TEST(OffloadingSchedulerLoad, FullAttentionJobAfterEngineHit) {
  OffloadingScheduler s(make_config({Full()}));
  seed(s, "seed", hashes("a", 4), {{1, 2, 3, 4}});
  add(s, "r", hashes("a", 4), 20);
  expect_match(s.get_num_new_matched_tokens("r", 4), hit(12));
  s.update_state_after_alloc("r", Table{{7, 8, 9, 10, 11}}, 12);
  EXPECT_EQ(s.manager().pin_count(key("a0", 0)), 0u);
  for (const char* h : {"a1", "a2", "a3"}) EXPECT_EQ(s.manager().pin_count(key(h, 0)), 1u) << h;
  auto meta = step(s, {});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  EXPECT_TRUE(meta.store_jobs.empty());
  const auto& j = meta.load_jobs[0];
  expect_job(s, j, false, "r", {8, 9, 10}, {3}, {1}, {key("a1", 0), key("a2", 0), key("a3", 0)});
  EXPECT_EQ(j.cpu_block_ids, (U{1, 2, 3}));  // the seed stored a0..a3 in slots 0..3
  EXPECT_EQ(s.next_store_block("r"), 4);     // loaded blocks are not stored again
  EXPECT_EQ(s.stats().hit_tokens, 12u);
  EXPECT_EQ(s.stats().blocks_loaded, 3u);
  auto out = report(s, {j.job_id});
  EXPECT_EQ(out.finished_loading, Strs{"r"});
  EXPECT_EQ(out.completed_jobs, Ids{j.job_id});
  for (const char* h : {"a1", "a2", "a3"}) EXPECT_EQ(s.manager().pin_count(key(h, 0)), 0u) << h;
  EXPECT_EQ(s.num_jobs_in_flight(), 0u);
}

TEST(OffloadingSchedulerLoad, NumJobsInFlightCountsOnlyEmittedJobs) {
  OffloadingScheduler s(make_config({Full()}));
  seed(s, "seed", hashes("a", 2), {{1, 2}});
  add(s, "r", hashes("a", 2), 12);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(8));
  s.update_state_after_alloc("r", Table{{7, 8, 9}}, 8);
  EXPECT_EQ(s.num_jobs_in_flight(), 0u);  // header: "Jobs emitted and not yet completed"
  step(s, {});
  EXPECT_EQ(s.num_jobs_in_flight(), 1u);
}

TEST(OffloadingSchedulerLoad, HybridSkipsNullBlocksAndGroupSizesSum) {
  OffloadingScheduler s(make_config({Full(), SW(9)}));
  seed(s, "seed", hashes("a", 6), {{1, 2, 3, 4, 5, 6}, {11, 12, 13, 14, 15, 16}});
  add(s, "r", hashes("a", 6), 25);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(24));
  // Too short a table is rejected, naming the group.
  expect_names(error_of([&] {
                 s.update_state_after_alloc("r", Table{{21, 22, 23, 24, 25}, {0, 0, 0, 0, 35, 36}},
                                            24);
               }),
               {"group 0", "5 block ids"});
  expect_names(error_of([&] { s.update_state_after_alloc("r", Table{{21, 22}}, 24); }),
               {"1 KV cache groups", "the model has 2"});
  expect_names(error_of([&] {
                 s.update_state_after_alloc(
                     "r", Table{{21, 22, 23, 24, 25, 64}, {0, 0, 0, 0, 35, 36}}, 24);
               }),
               {"block id 64", "num_gpu_blocks=64"});
  EXPECT_EQ(s.manager().pin_count(key("a5", 0)), 0u);
  s.update_state_after_alloc("r", Table{{21, 22, 23, 24, 25, 26, 27}, {0, 0, 0, 0, 35, 36, 37}},
                             24);
  auto meta = step(s, {});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  expect_job(s, meta.load_jobs[0], false, "r", {21, 22, 23, 24, 25, 26, 35, 36}, {6, 2}, {0, 4},
             {key("a0", 0), key("a1", 0), key("a2", 0), key("a3", 0), key("a4", 0), key("a5", 0),
              key("a4", 1), key("a5", 1)});
  // The seed stored (block j, group g) in slot 2j + g.
  EXPECT_EQ(meta.load_jobs[0].cpu_block_ids, (U{0, 2, 4, 6, 8, 10, 9, 11}));
  EXPECT_EQ(s.manager().pin_count(key("a3", 1)), 0u);  // outside the window: not loaded
}

TEST(OffloadingSchedulerLoad, NullBlockInsideNeededRangeIsSkippedAndSplitsTheJob) {
  OffloadingScheduler s(make_config({SW(13)}));  // needs the last 3 blocks
  seed(s, "seed", hashes("a", 6), {{1, 2, 3, 4, 5, 6}});
  add(s, "r", hashes("a", 6), 25);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(24));
  s.update_state_after_alloc("r", Table{{0, 0, 0, 14, 0, 16}}, 24);
  EXPECT_EQ(s.manager().pin_count(key("a3", 0)), 1u);
  EXPECT_EQ(s.manager().pin_count(key("a4", 0)), 0u);
  EXPECT_EQ(s.manager().pin_count(key("a5", 0)), 1u);
  auto meta = step(s, {});
  ASSERT_EQ(meta.load_jobs.size(), 2u);
  expect_job(s, meta.load_jobs[0], false, "r", {14}, {1}, {3}, {key("a3", 0)});
  expect_job(s, meta.load_jobs[1], false, "r", {16}, {1}, {5}, {key("a5", 0)});
  EXPECT_EQ(meta.load_jobs[0].cpu_block_ids, U{3});
  EXPECT_EQ(meta.load_jobs[1].cpu_block_ids, U{5});
  auto out = report(s, {meta.load_jobs[0].job_id});
  EXPECT_TRUE(out.finished_loading.empty());  // one of two loads done
  out = report(s, {meta.load_jobs[1].job_id});
  EXPECT_EQ(out.finished_loading, Strs{"r"});
}

TEST(OffloadingSchedulerLoad, PartialFirstOffloadedBlockAfterEngineHitWithFactor2) {
  OffloadingScheduler s(make_config({Full()}, 4, 2));  // offloaded block = 8 tokens
  seed(s, "seed", hashes("a", 4), {{1, 2, 3, 4}});     // keys a1 (block 0), a3 (block 1)
  EXPECT_EQ(s.manager().state(key("a1", 0)), BlockState::kReady);
  EXPECT_EQ(s.manager().state(key("a0", 0)), BlockState::kMissing);
  add(s, "r", hashes("a", 4), 20);
  expect_match(s.get_num_new_matched_tokens("r", 4), hit(12));  // engine has 1 GPU block
  s.update_state_after_alloc("r", Table{{9, 10, 11, 12, 13}}, 12);
  auto meta = step(s, {});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  // GPU block 1 is the second half of offloaded block 0: block_indices 1 -> offset 1 % 2.
  expect_job(s, meta.load_jobs[0], false, "r", {10, 11, 12}, {3}, {1},
             {key("a1", 0), key("a3", 0)});
  EXPECT_EQ(meta.load_jobs[0].cpu_block_ids, (U{0, 1}));
}

TEST(OffloadingSchedulerLoad, SlidingWindowEdgeStraddlesOffloadedBlock) {
  OffloadingScheduler s(make_config({SW(5)}, 4, 2));  // needs 4 tokens = half a block
  seed(s, "seed", hashes("a", 6), {{1, 2, 3, 4, 5, 6}});
  add(s, "r", hashes("a", 6), 25);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(24));
  s.update_state_after_alloc("r", Table{{0, 0, 0, 0, 0, 16}}, 24);
  auto meta = step(s, {});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  expect_job(s, meta.load_jobs[0], false, "r", {16}, {1}, {5}, {key("a5", 0)});
}

TEST(OffloadingSchedulerLoad, MismatchedExternalTokensIsRejectedAndChangesNothing) {
  OffloadingScheduler s(make_config({Full()}));
  seed(s, "seed", hashes("a", 4), {{1, 2, 3, 4}});
  add(s, "r", hashes("a", 4), 20);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(16));
  expect_names(error_of([&] { s.update_state_after_alloc("r", Table{{5, 6, 7, 8, 9}}, 8); }),
               {"num_external_tokens 8", "16"});
  for (int i = 0; i < 4; ++i) EXPECT_EQ(s.manager().pin_count(key("a" + std::to_string(i), 0)), 0u);
  auto meta = step(s, {});
  EXPECT_TRUE(meta.load_jobs.empty());
  EXPECT_EQ(s.num_jobs_in_flight(), 0u);
  EXPECT_EQ(s.stats().hit_tokens, 0u);
  // The match survives the bad call: the right value still works.
  s.update_state_after_alloc("r", Table{{5, 6, 7, 8, 9}}, 16);
  meta = step(s, {});
  ASSERT_EQ(meta.load_jobs.size(), 1u);
  expect_job(s, meta.load_jobs[0], false, "r", {5, 6, 7, 8}, {1 * 4}, {0},
             {key("a0", 0), key("a1", 0), key("a2", 0), key("a3", 0)});
  // Without a pending hit only 0 is accepted.
  add(s, "q", hashes("a", 4), 20);
  expect_names(error_of([&] { s.update_state_after_alloc("q", Table{{10, 11, 12, 13, 14}}, 4); }),
               {"num_external_tokens 4", "no hit is pending"});
}

}  // namespace
}  // namespace kvoff
