// Helpers of the OffloadingScheduler tests (test_offloading_scheduler*.cpp): configs, steps,
// reports, and checks of every job field by field.
#pragma once

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

namespace kvoff::scheduler_test {

using I = std::vector<std::int64_t>;
using U = std::vector<std::uint32_t>;
using Strs = std::vector<std::string>;
using Table = std::vector<std::vector<std::int64_t>>;
using Ids = std::vector<JobId>;

inline SchedulerGroup Full() { return SchedulerGroup{GroupKind::kFullAttention, 0}; }
inline SchedulerGroup SW(std::int64_t window) {
  return SchedulerGroup{GroupKind::kSlidingWindow, window};
}
inline SchedulerGroup Mamba() { return SchedulerGroup{GroupKind::kMamba, 0}; }

inline SchedulerConfig make_config(std::vector<SchedulerGroup> groups, std::int64_t block_size = 4,
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
inline Strs hashes(const std::string& prefix, int n) {
  Strs out;
  for (int i = 0; i < n; ++i) out.push_back(prefix + std::to_string(i));
  return out;
}

/// Offload key: hash bytes + one group byte.
inline std::string key(std::string_view hash, int group) {
  std::string k(hash);
  k.push_back(static_cast<char>(static_cast<unsigned char>(group)));
  return k;
}

inline void add(OffloadingScheduler& s, std::string_view id, const Strs& hs,
                std::int64_t num_tokens, std::size_t start = 0) {
  std::vector<std::string_view> views(hs.begin(), hs.end());
  s.update_request(id, start, views, num_tokens);
}

/// `id` must outlive the step it is scheduled in (string literals, or a caller's string).
inline ScheduledRequest sched(std::string_view id, Table new_ids, std::int64_t computed,
                              std::int64_t scheduled, bool resumed = false) {
  ScheduledRequest r;
  r.request_id = id;
  r.new_block_ids = std::move(new_ids);
  r.num_computed_tokens = computed;
  r.num_scheduled_tokens = scheduled;
  r.resumed_from_preemption = resumed;
  return r;
}

inline ConnectorMeta step(OffloadingScheduler& s, std::vector<ScheduledRequest> scheduled,
                          Strs finished = {}, Strs preempted = {}) {
  return s.build_connector_meta(scheduled, finished, preempted);
}

/// One report per id (one rank).
inline ConnectorOutput report(OffloadingScheduler& s, Ids ids, bool success = true) {
  std::vector<JobReport> reps;
  for (JobId id : ids) reps.push_back(JobReport{id, success});
  return s.update_connector_output(reps);
}

inline Ids ids_of(const std::vector<TransferJob>& jobs) {
  Ids out;
  for (const auto& j : jobs) out.push_back(j.job_id);
  return out;
}

/// Invariant 1 on every GPU side, and the CPU side matches the manager's slots.
inline void check_job(const OffloadingScheduler& s, const TransferJob& j) {
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

inline void expect_job(const OffloadingScheduler& s, const TransferJob& j, bool is_store,
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
inline void seed(OffloadingScheduler& s, const std::string& id, const Strs& hs, Table table) {
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

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected std::invalid_argument";
  return "";
}

inline void expect_names(const std::string& msg, std::initializer_list<std::string_view> parts) {
  for (auto p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
}

inline MatchResult hit(std::int64_t n) { return MatchResult{n, true}; }
inline MatchResult miss() { return MatchResult{0, false}; }
inline MatchResult retry() { return MatchResult{std::nullopt, false}; }

inline void expect_match(const MatchResult& got, const MatchResult& want) {
  EXPECT_EQ(got.num_tokens, want.num_tokens);
  EXPECT_EQ(got.load_async, want.load_async);
}

// Request "r" (blocks a0, a1 and one token more) hits both stored blocks and gets GPU blocks
// 5, 6, 7: its 2-block load is prepared (and emitted by the next step).
inline void prepare_load_of_a0_a1(OffloadingScheduler& s) {
  add(s, "r", {"a0", "a1"}, 9);
  expect_match(s.get_num_new_matched_tokens("r", 0), hit(8));
  s.update_state_after_alloc("r", Table{{5, 6, 7}}, 8);
}

}  // namespace kvoff::scheduler_test
