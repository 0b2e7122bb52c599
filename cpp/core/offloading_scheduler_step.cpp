// OffloadingScheduler's step: which blocks each request stores (collect_stores,
// prepare_stores, emit_store_jobs) and build_connector_meta, which plans one engine step's load
// and store jobs and the fences of rewritten blocks. The rest of the scheduler is in
// offloading_scheduler.cpp and offloading_scheduler_completion.cpp.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvoff/offloading_scheduler.h"
#include "offloading_scheduler_internal.h"

namespace kvoff {

using namespace scheduler_detail;

// --------------------------------------------------------------------------------- stores

bool OffloadingScheduler::collect_stores(Request& r, std::int64_t tokens_after, bool flush) {
  if (r.loads_in_flight > 0 || !r.unemitted_loads.empty()) return false;  // invariant 7
  const std::int64_t full = known_storable_blocks(r, tokens_after);
  if (full <= r.next_store) return false;
  // The batch is not full yet (unless the request's last storable block is: nothing more will
  // join it)
  if (!flush && full - r.next_store < store_batch_ && full < storable_blocks(r)) return false;
  const std::int64_t f = config_.block_size_factor;
  const std::size_t num_groups = config_.groups.size();
  constexpr std::uint32_t kNoSlot = std::numeric_limits<std::uint32_t>::max();

  auto& items = store_items_;  // the step's scratch: memory reused from step to step
  KeyList& keys = store_keys_;
  const std::size_t begin = items.size();
  for (std::int64_t j = r.next_store; j < full; ++j) {
    for (std::size_t g = 0; g < num_groups; ++g) {
      const std::int64_t k0 = first_needed_sub_block(g);
      if (k0 >= f) continue;  // this group never needs cached blocks
      auto& table = r.table[g];
      bool live = true;
      for (std::int64_t k = k0; k < f && live; ++k) {
        const auto l = static_cast<std::size_t>(j * f + k);
        if (l >= table.size() || table[l].block_id == 0) {
          live = false;
        } else if (alloc_step_[table[l].block_id] > table[l].step) {
          live = false;  // reallocated since we saw it: stale (invariant 4)
          ++stats_.stale_blocks_skipped;
          table[l].block_id = 0;  // null from now on: counted once if the store is retried
        }
      }
      if (!live) continue;
      items.push_back(StoreItem{j, g, k0, kNoSlot, 0});
      append_key(keys, r, j, g);
    }
  }
  if (items.size() == begin) {
    r.next_store = full;
    return false;
  }
  store_candidates_.push_back(StoreCandidate{&r, full, tokens_after, begin, items.size()});
  return true;
}

bool OffloadingScheduler::prepare_stores(std::span<const StoreCandidate> candidates,
                                         std::vector<const TransferJob*>& out) {
  // The later request's keys come first: each request's keys then end more recent than the
  // previous request's, as one call per request in scheduling order leaves them, with each
  // request's first key the most recent of its own (invariant 8). The keys of every request of
  // the call are protected from the others' evictions.
  auto& key_views = store_key_views_;
  auto& item_of = store_view_items_;  // position in the call -> index in store_items_
  key_views.clear();
  item_of.clear();
  for (auto c = candidates.rbegin(); c != candidates.rend(); ++c) {
    for (std::size_t i = c->begin; i < c->end; ++i) {
      key_views.push_back(store_keys_[i]);
      item_of.push_back(i);
    }
  }
  PrepareStoreResult& result = store_result_;  // scratch: memory reused from call to call
  if (!pool_->prepare_store(key_views, result, true)) return false;  // nothing changed
  stats_.blocks_evicted += result.evicted_keys.size();
  // store_threshold: skipped keys have no block (their items keep kNoSlot: not copied, like
  // held ones, and next_store moves past them as vLLM's connector does). The new blocks enter
  // the policy as the most recent (the call's first key most recent); the request's held
  // blocks get their recency when it finishes (touch_at_finish).
  stats_.stores_skipped += result.skipped_indices.size();
  for (std::size_t k = 0; k < result.store_indices.size(); ++k) {
    store_items_[item_of[result.store_indices[k]]].slot = result.block_ids[k];
  }
  for (const StoreCandidate& c : candidates) {
    c.request->next_store = c.full;
    emit_store_jobs(c, out);
  }
  return true;
}

void OffloadingScheduler::build_stores(std::vector<const TransferJob*>& out) {
  const std::span<const StoreCandidate> candidates = store_candidates_;
  // One manager call for the whole step, so that the index probes and recency updates of every
  // storing request overlap in one software pipeline instead of a short one each.
  if (candidates.size() > 1 && prepare_stores(candidates, out)) return;
  // One request (or no room for all of them): one call per request, in order, as some may
  // still fit. A refused request changes nothing and is retried next step (invariant 6).
  for (std::size_t k = 0; k < candidates.size(); ++k) {
    if (!prepare_stores(candidates.subspan(k, 1), out)) ++stats_.store_refusals;
  }
}

void OffloadingScheduler::emit_store_jobs(const StoreCandidate& c,
                                          std::vector<const TransferJob*>& out) {
  Request& r = *c.request;
  const std::int64_t f = config_.block_size_factor;
  const std::size_t num_groups = config_.groups.size();
  constexpr std::uint32_t kNoSlot = std::numeric_limits<std::uint32_t>::max();
  auto& items = store_items_;
  const KeyList& keys = store_keys_;
  // Runs: per group, consecutive items that were stored and whose GPU blocks are contiguous
  // in the table (items are ordered by j, then g). An item already held ends its group's run.
  auto& runs = store_runs_;
  auto& open = store_open_;
  runs.clear();
  open.assign(num_groups, 0);
  std::size_t num_jobs = 0;
  std::vector<std::size_t>& rank = store_rank_;
  rank.assign(num_groups, 0);
  for (std::size_t i = c.begin; i < c.end; ++i) {
    const StoreItem& it = items[i];
    std::size_t& o = open[it.g];
    if (it.slot == kNoSlot) {
      o = 0;
      continue;
    }
    if (o != 0) {
      StoreRun& run = runs[o - 1];
      const StoreItem& last = items[run.end - 1];
      if ((last.j + 1) * f == it.j * f + it.first_sub) {
        run.end = i + 1;
        items[i].run = o - 1;
        continue;
      }
    }
    runs.push_back(StoreRun{it.g, i, i + 1, rank[it.g]++});
    o = runs.size();
    items[i].run = o - 1;
    num_jobs = std::max(num_jobs, rank[it.g]);
  }
  // Job k takes the k-th run of every group, so each group is one contiguous run per job. The
  // job's vectors are sized once (a job costs a fixed number of allocations).
  auto& by_rank = store_by_rank_;  // [k * num_groups + g]: run index + 1 (0: none)
  by_rank.assign(num_jobs * num_groups, 0);
  for (std::size_t ri = 0; ri < runs.size(); ++ri) {
    by_rank[runs[ri].rank * num_groups + runs[ri].g] = ri + 1;
  }
  const std::size_t key_bytes = keys[c.begin].size();
  for (std::size_t k = 0; k < num_jobs; ++k) {
    std::size_t num_gpu = 0;
    std::size_t num_cpu = 0;
    for (std::size_t g = 0; g < num_groups; ++g) {
      const std::size_t ri = by_rank[k * num_groups + g];
      if (ri == 0) continue;
      for (std::size_t i = runs[ri - 1].begin; i < runs[ri - 1].end; ++i) {
        const StoreItem& it = items[i];
        if (it.run != ri - 1 || it.slot == kNoSlot) continue;  // another group's item
        num_gpu += static_cast<std::size_t>(f - it.first_sub);
        ++num_cpu;
      }
    }
    // The scheduler keeps the job (completion needs its request, keys and GPU blocks); the
    // caller reads it in place.
    Job& kept = new_job(r, /*is_store=*/true, num_gpu, num_cpu, key_bytes);
    kept.emitted = true;
    TransferJob& job = kept.job;
    for (std::size_t g = 0; g < num_groups; ++g) {
      const std::size_t ri = by_rank[k * num_groups + g];
      if (ri == 0) continue;
      const StoreRun& run = runs[ri - 1];
      const StoreItem& first = items[run.begin];
      const std::size_t before = job.gpu_block_ids.size();
      job.block_indices[g] = first.j * f + first.first_sub;
      const auto& table = r.table[g];
      for (std::size_t i = run.begin; i < run.end; ++i) {
        const StoreItem& it = items[i];
        if (it.run != ri - 1 || it.slot == kNoSlot) continue;  // another group's item
        for (std::int64_t s = it.first_sub; s < f; ++s) {
          job.gpu_block_ids.push_back(table[static_cast<std::size_t>(it.j * f + s)].block_id);
        }
        job.cpu_block_ids.push_back(it.slot);
        job.keys.push_back(keys[i]);
      }
      job.group_sizes[g] = static_cast<std::int64_t>(job.gpu_block_ids.size() - before);
    }
    stats_.blocks_stored += job.gpu_block_ids.size();
    ++stats_.store_jobs;
    register_fences(job);
    ++r.stores_in_flight;
    out.push_back(&kept.job);
  }
}

// ----------------------------------------------------------------------------------- step

void OffloadingScheduler::mark_allocated(std::int64_t block_id, std::vector<JobId>& flush) {
  const auto id = static_cast<std::size_t>(block_id);
  alloc_step_[id] = step_;
  for (JobId* fence : {&store_fence_[id], &load_fence_[id]}) {
    if (*fence != 0) {
      flush.push_back(*fence);
      *fence = 0;
    }
  }
}

ConnectorMeta OffloadingScheduler::build_connector_meta(
    std::span<const ScheduledRequest> scheduled, std::span<const std::string> finished_request_ids,
    std::span<const std::string> preempted_request_ids,
    std::span<const std::int64_t> rewritten_block_ids, const HashSource& hash_source) {
  ConnectorMetaView view = build_connector_meta_view(scheduled, finished_request_ids,
                                                     preempted_request_ids, rewritten_block_ids,
                                                     hash_source);
  ConnectorMeta meta;
  meta.load_jobs.reserve(view.load_jobs.size());
  for (const TransferJob* j : view.load_jobs) meta.load_jobs.push_back(*j);
  meta.store_jobs.reserve(view.store_jobs.size());
  for (const TransferJob* j : view.store_jobs) meta.store_jobs.push_back(*j);
  meta.jobs_to_flush = std::move(view.jobs_to_flush);
  return meta;
}

ConnectorMetaView OffloadingScheduler::build_connector_meta_view(
    std::span<const ScheduledRequest> scheduled, std::span<const std::string> finished_request_ids,
    std::span<const std::string> preempted_request_ids,
    std::span<const std::int64_t> rewritten_block_ids, const HashSource& hash_source) {
  constexpr const char* kHook = "build_connector_meta";
  refuse_reentry(kHook);
  // Validate everything first: a bad step changes nothing.
  for (std::size_t i = 0; i < rewritten_block_ids.size(); ++i) {
    const std::int64_t id = rewritten_block_ids[i];
    if (id < 0 || id >= config_.num_gpu_blocks) {
      throw std::invalid_argument(
          std::string(kHook) + ": rewritten_block_ids[" + std::to_string(i) + "] = " +
          std::to_string(id) + " is outside [0, num_gpu_blocks=" +
          std::to_string(config_.num_gpu_blocks) + "); pass GPU block ids of this engine");
    }
  }
  // Each scheduled request is looked up once; the pointers stay valid through this call
  // (requests are erased only at its end, and unordered_map nodes do not move). The vector is
  // kept between steps (its memory is reused), like step_hashes_ below.
  std::vector<Request*>& resolved = step_resolved_;
  resolved.clear();
  resolved.reserve(scheduled.size());
  {
    ++validation_stamp_;  // marks requests seen in this call (duplicates) without allocating
    const std::int64_t obs = offloaded_block_size_;
    // An idle request (see idle_) that gets no new block and completes no offloaded block
    // needs nothing this step: it is not looked up at all. Every request's entry (in the idle
    // set where it may be idle, else in the request index) is fetched first, all at once, so
    // that the misses overlap.
    std::vector<std::uint64_t>& hashes = step_hashes_;  // per request: its id's hash
    std::vector<char>& maybe_idle = step_maybe_idle_;
    hashes.resize(scheduled.size());
    maybe_idle.assign(scheduled.size(), 0);
    for (std::size_t i = 0; i < scheduled.size(); ++i) {
      const ScheduledRequest& s = scheduled[i];
      hashes[i] = id_hash_of(s.request_id);
      // (whether its tokens reach the block that wakes it is read from its idle entry)
      if (idle_.size() != 0 && s.new_block_ids.empty() && !s.resumed_from_preemption &&
          !s.whole_table && token_counts_valid(s) && s.num_scheduled_tokens < obs) {
        maybe_idle[i] = 1;
        idle_.prefetch(hashes[i]);
      } else {
        request_index_.prefetch(hashes[i]);
      }
    }
    for (const auto& s : scheduled) {
      const auto i = static_cast<std::size_t>(&s - scheduled.data());
      if (maybe_idle[i] != 0) {
        IdleEntry* e = idle_.find(hashes[i], kAnyEntry);
        const std::int64_t tokens_after = s.num_computed_tokens + s.num_scheduled_tokens;
        if (e != nullptr && tokens_after < e->wake_tokens) {
          if (e->stamp == validation_stamp_) {
            throw std::invalid_argument(
                hook_error(kHook, s.request_id, "scheduled twice in one step; list it once"));
          }
          e->stamp = validation_stamp_;
          e->tokens = tokens_after;  // (tokens_seen, should it finish while idle)
          resolved.push_back(nullptr);
          continue;
        }
      }
      Request& r = get(s.request_id, hashes[i], kHook);
      resolved.push_back(&r);
      if (hash_source && token_counts_valid(s)) {
        // Pull hashes only when the blocks full after this step need more than are known (in
        // decode: once per offloaded block, not every step).
        const std::int64_t full =
            std::min(s.num_computed_tokens + s.num_scheduled_tokens, r.store_limit) /
            offloaded_block_size_ * offloaded_block_size_;
        // With store batching, only when a batch is due (a finished request's last blocks are
        // pulled by request_finished's caller), or the last storable block is full.
        const std::int64_t full_blocks = full / offloaded_block_size_;
        if (static_cast<std::int64_t>(r.hashes.size()) * config_.hash_block_size < full &&
            (full_blocks - r.next_store >= store_batch_ || full_blocks >= storable_blocks(r))) {
          HashSink sink(*this, r);
          in_hash_source_ = true;  // engine code runs: calls back into this scheduler refused
          struct Reset {
            bool& flag;
            ~Reset() { flag = false; }
          } reset{in_hash_source_};
          hash_source(static_cast<std::size_t>(&s - scheduled.data()), s.request_id,
                      r.hashes.size(), sink);
        }
      }
      IdleEntry* idle_entry = r.idle ? idle_.find(r.id_hash, kAnyEntry) : nullptr;
      if (r.validation_stamp == validation_stamp_ ||
          (idle_entry != nullptr && idle_entry->stamp == validation_stamp_)) {
        throw std::invalid_argument(
            hook_error(kHook, s.request_id, "scheduled twice in one step; list it once"));
      }
      r.validation_stamp = validation_stamp_;
      if (idle_entry != nullptr) idle_entry->stamp = validation_stamp_;
      if (!s.new_block_ids.empty()) {
        validate_block_ids(s.new_block_ids, kHook, s.request_id);
      }
      if (!token_counts_valid(s)) {
        throw std::invalid_argument(hook_error(
            kHook, s.request_id,
            "num_computed_tokens (" + std::to_string(s.num_computed_tokens) +
                ") and num_scheduled_tokens (" + std::to_string(s.num_scheduled_tokens) +
                ") must be in [0, 2^61]"));
      }
    }
  }
  ++step_;
  ConnectorMetaView meta;
  meta.store_jobs.reserve(last_num_store_jobs_);  // about as many as last step: no regrowth
  for (const auto& id : preempted_request_ids) {
    if (Request* r = find(id)) {
      for (auto& t : r->table) t.clear();
      r->scheduled_before = false;
      set_idle(*r, false);
    }
  }
  // New block tables and allocations; fences for reallocated blocks.
  for (std::size_t i = 0; i < scheduled.size(); ++i) {
    const ScheduledRequest& s = scheduled[i];
    if (resolved[i] == nullptr) continue;  // idle
    Request& r = *resolved[i];
    const bool whole_table = s.resumed_from_preemption || s.whole_table || !r.scheduled_before;
    // A known request's whole table that is not a resumption from preemption (a streaming-input
    // session scheduled again as new) keeps the blocks it already had where they are: those
    // entries keep their steps (no flush, not stale); only blocks at other positions are new.
    const bool keep_known = s.whole_table && !s.resumed_from_preemption && r.scheduled_before;
    const std::int64_t cached_blocks = whole_table ? r.gpu_hit_tokens / config_.gpu_block_size : 0;
    for (std::size_t g = 0; g < s.new_block_ids.size(); ++g) {
      auto& table = r.table[g];
      const std::size_t kept = keep_known ? table.size() : 0;
      if (whole_table && !keep_known) table.clear();
      const auto& ids = s.new_block_ids[g];
      const std::size_t base = keep_known ? 0 : table.size();
      for (std::size_t k = 0; k < ids.size(); ++k) {
        const auto id = static_cast<std::uint32_t>(ids[k]);
        const std::size_t l = base + k;
        if (l < kept && table[l].block_id == id) continue;  // its block there: unchanged
        if (l < kept) {
          table[l] = TableEntry{id, step_};
        } else {
          table.push_back(TableEntry{id, step_});
        }
        // null, or a block the engine had cached
        if (id == 0 || static_cast<std::int64_t>(l) < cached_blocks) continue;
        mark_allocated(id, meta.jobs_to_flush);
      }
      if (keep_known && ids.size() < table.size()) {
        table.erase(table.begin() + static_cast<std::ptrdiff_t>(ids.size()), table.end());
      }
    }
    r.scheduled_before = true;
    r.gpu_hit_tokens = 0;
  }
  for (const std::int64_t id : rewritten_block_ids) {
    if (id != 0) mark_allocated(id, meta.jobs_to_flush);
  }
  for (const auto& id : finished_request_ids) {
    if (Request* r = find(id)) release(*r);
  }
  // Loads prepared by update_state_after_alloc. Their destinations were allocated by the
  // engine for a request that is usually not scheduled until the load completes: they are new
  // allocations now (fences and staleness), since the load writes them now.
  for (const JobId id : pending_loads_) {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) continue;  // cancelled
    Job& j = it->second;
    for (const std::int64_t id64 : j.job.gpu_block_ids) mark_allocated(id64, meta.jobs_to_flush);
  }
  for (const JobId id : pending_loads_) {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) continue;
    Job& j = it->second;
    j.emitted = true;
    register_fences(j.job);
    Request& r = *j.request;
    std::erase(r.unemitted_loads, id);
    ++r.loads_in_flight;
    ++stats_.load_jobs;
    stats_.blocks_loaded += j.job.gpu_block_ids.size();
    meta.load_jobs.push_back(&j.job);
  }
  pending_loads_.clear();
  std::sort(meta.jobs_to_flush.begin(), meta.jobs_to_flush.end());
  meta.jobs_to_flush.erase(std::unique(meta.jobs_to_flush.begin(), meta.jobs_to_flush.end()),
                           meta.jobs_to_flush.end());
  stats_.jobs_flushed += meta.jobs_to_flush.size();
  // Stores: every scheduled request's blocks to store are collected first, then prepared in
  // one manager call (build_stores), then made into jobs request by request.
  store_items_.clear();
  store_keys_.clear();
  store_candidates_.clear();
  for (std::size_t i = 0; i < scheduled.size(); ++i) {
    const ScheduledRequest& s = scheduled[i];
    if (resolved[i] == nullptr) continue;  // idle
    Request& r = *resolved[i];
    if (r.finished) continue;  // finished (or preempted and finished) in this very step
    const std::int64_t tokens_after = s.num_computed_tokens + s.num_scheduled_tokens;
    r.tokens_seen = tokens_after;
    if (!collect_stores(r, tokens_after)) set_idle_after_stores(r, tokens_after);
  }
  // Finished requests' waiting blocks (store batching): after this step's allocations were
  // marked, so that a block the engine reallocated since it freed it is stale, never copied.
  for (Request* r : flush_pending_) {
    r->flush_pending = false;
    collect_stores(*r, r->tokens_seen, /*flush=*/true);
  }
  build_stores(meta.store_jobs);
  for (Request* r : flush_pending_) {
    if (r->stores_in_flight == 0) {  // nothing stored (stale, held already or no room)
      flushed_unstored_.push_back(r->id);
      erase_request(*r);
    }
  }
  flush_pending_.clear();
  for (const StoreCandidate& c : store_candidates_) {
    if (!c.request->finished) set_idle_after_stores(*c.request, c.tokens_after);
  }
  for (const auto& id : finished_request_ids) erase_if_done(id);
  last_num_store_jobs_ = meta.store_jobs.size();
  return meta;
}

}  // namespace kvoff
