// OffloadingScheduler: the engine-facing hooks, independent of Python. docs/design.md "One engine
// step" and invariants 1 (group sizes), 4 (stale blocks, fences), 6 (stores), 7 (correctness)
// and 8 (prefix order). Every job is checked field by field.
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

namespace kvoff {
namespace {

using I = std::vector<std::int64_t>;
using U = std::vector<std::uint32_t>;
using Strs = std::vector<std::string>;
using Table = std::vector<std::vector<std::int64_t>>;
using Ids = std::vector<JobId>;

SchedulerGroup Full() { return SchedulerGroup{GroupKind::kFullAttention, 0}; }
SchedulerGroup SW(std::int64_t window) { return SchedulerGroup{GroupKind::kSlidingWindow, window}; }
SchedulerGroup Mamba() { return SchedulerGroup{GroupKind::kMamba, 0}; }

SchedulerConfig make_config(std::vector<SchedulerGroup> groups, std::int64_t block_size = 4,
                            std::int64_t factor = 1, std::int64_t hash_block_size = 0,
                            std::int64_t world_size = 1, std::int64_t cpu_blocks = 64,
                            std::int64_t gpu_blocks = 64) {
  SchedulerConfig c;
  c.num_cpu_blocks = cpu_blocks;
  c.gpu_block_size = block_size;
  c.block_size_factor = factor;
  c.hash_block_size = hash_block_size;
  c.world_size = world_size;
  c.num_gpu_blocks = gpu_blocks;
  c.groups = std::move(groups);
  return c;
}

/// "p0", "p1", ... "p{n-1}".
Strs hashes(const std::string& prefix, int n) {
  Strs out;
  for (int i = 0; i < n; ++i) out.push_back(prefix + std::to_string(i));
  return out;
}

/// Offload key: hash bytes + one group byte.
std::string key(std::string_view hash, int group) {
  std::string k(hash);
  k.push_back(static_cast<char>(static_cast<unsigned char>(group)));
  return k;
}

void add(OffloadingScheduler& s, std::string_view id, const Strs& hs, std::int64_t num_tokens,
         std::size_t start = 0) {
  std::vector<std::string_view> views(hs.begin(), hs.end());
  s.update_request(id, start, views, num_tokens);
}

/// `id` must outlive the step it is scheduled in (string literals, or a caller's string).
ScheduledRequest sched(std::string_view id, Table new_ids, std::int64_t computed,
                       std::int64_t scheduled, bool resumed = false) {
  ScheduledRequest r;
  r.request_id = id;
  r.new_block_ids = std::move(new_ids);
  r.num_computed_tokens = computed;
  r.num_scheduled_tokens = scheduled;
  r.resumed_from_preemption = resumed;
  return r;
}

ConnectorMeta step(OffloadingScheduler& s, std::vector<ScheduledRequest> scheduled,
                   Strs finished = {}, Strs preempted = {}) {
  return s.build_connector_meta(scheduled, finished, preempted);
}

/// One report per id (one rank).
ConnectorOutput report(OffloadingScheduler& s, Ids ids, bool success = true) {
  std::vector<JobReport> reps;
  for (JobId id : ids) reps.push_back(JobReport{id, success});
  return s.update_connector_output(reps);
}

Ids ids_of(const std::vector<TransferJob>& jobs) {
  Ids out;
  for (const auto& j : jobs) out.push_back(j.job_id);
  return out;
}

/// Invariant 1 on every GPU side, and the CPU side matches the manager's slots.
void check_job(const OffloadingScheduler& s, const TransferJob& j) {
  const std::size_t groups = s.config().groups.size();
  ASSERT_EQ(j.group_sizes.size(), groups);
  ASSERT_EQ(j.block_indices.size(), groups);
  EXPECT_EQ(std::accumulate(j.group_sizes.begin(), j.group_sizes.end(), std::int64_t{0}),
            static_cast<std::int64_t>(j.gpu_block_ids.size()));
  for (auto id : j.gpu_block_ids) EXPECT_NE(id, 0) << "null block in job " << j.job_id;
  ASSERT_EQ(j.keys.size(), j.cpu_block_ids.size());
  for (std::size_t i = 0; i < j.keys.size(); ++i) {
    auto slot = s.manager().block_id(j.keys[i]);
    ASSERT_TRUE(slot.has_value()) << "job key " << i << " has no slot";
    EXPECT_EQ(j.cpu_block_ids[i], *slot) << "job key " << i;
  }
}

void expect_job(const OffloadingScheduler& s, const TransferJob& j, bool is_store,
                std::string_view request_id, const I& gpu, const I& group_sizes,
                const I& block_indices, const Strs& keys) {
  check_job(s, j);
  EXPECT_NE(j.job_id, 0u);
  EXPECT_EQ(j.is_store, is_store);
  EXPECT_EQ(j.request_id, request_id);
  EXPECT_EQ(j.gpu_block_ids, gpu);
  EXPECT_EQ(j.group_sizes, group_sizes);
  EXPECT_EQ(j.block_indices, block_indices);
  EXPECT_EQ(j.keys.to_strings(), keys);
}

/// Stores `hs` for the table through a throwaway request and completes every store.
void seed(OffloadingScheduler& s, const std::string& id, const Strs& hs, Table table) {
  const auto tokens = static_cast<std::int64_t>(hs.size()) * s.config().hash_block_size;
  add(s, id, hs, tokens);
  auto meta = step(s, {sched(id, std::move(table), 0, tokens)});
  ASSERT_TRUE(meta.load_jobs.empty());
  ASSERT_FALSE(meta.store_jobs.empty());
  for (const auto& j : meta.store_jobs) check_job(s, j);
  auto out = report(s, ids_of(meta.store_jobs));
  ASSERT_EQ(out.completed_jobs.size(), meta.store_jobs.size());
  ASSERT_TRUE(out.failed_jobs.empty());
  EXPECT_FALSE(s.request_finished(id));
}

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

MatchResult hit(std::int64_t n) { return MatchResult{n, true}; }
MatchResult miss() { return MatchResult{0, false}; }
MatchResult retry() { return MatchResult{std::nullopt, false}; }

void expect_match(const MatchResult& got, const MatchResult& want) {
  EXPECT_EQ(got.num_tokens, want.num_tokens);
  EXPECT_EQ(got.load_async, want.load_async);
}

// Request "r" (blocks a0, a1 and one token more) hits both stored blocks and gets GPU blocks
// 5, 6, 7: its 2-block load is prepared (and emitted by the next step).
void prepare_load_of_a0_a1(OffloadingScheduler& s) {
  add(s, "r", {"a0", "a1"}, 9);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(8));
  s.update_state_after_alloc("r", Table{{5, 6, 7}}, 8);
}

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
                 s.update_state_after_alloc("r", Table{{21, 22, 23, 24, 25, 64}, {0, 0, 0, 0, 35, 36}},
                                            24);
               }),
               {"block id 64", "num_gpu_blocks=64"});
  EXPECT_EQ(s.manager().pin_count(key("a5", 0)), 0u);
  s.update_state_after_alloc("r", Table{{21, 22, 23, 24, 25, 26, 27}, {0, 0, 0, 0, 35, 36, 37}}, 24);
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
  expect_job(s, meta.load_jobs[0], false, "r", {10, 11, 12}, {3}, {1}, {key("a1", 0), key("a3", 0)});
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
    if (finish_first) EXPECT_FALSE(s.request_finished("r"));
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

}  // namespace
}  // namespace kvoff
