// OffloadingScheduler, the end of jobs and requests: update_connector_output (the workers'
// reports complete jobs), reset_cache, request_finished / finish_request, and the request
// records' life (new_request, erase_request: records are reused). The rest of the scheduler is
// in offloading_scheduler.cpp and offloading_scheduler_step.cpp.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvoff/offloading_scheduler.h"
#include "offloading_scheduler_internal.h"

namespace kvoff {

using namespace scheduler_detail;

// ------------------------------------------------------------------------------ completion

ConnectorOutput OffloadingScheduler::update_connector_output(std::span<const JobReport> reports) {
  refuse_reentry("update_connector_output");
  // Validate first (a bad report changes nothing); each job is looked up once. Reports of this
  // call are counted in Job::new_reports, cleared again when validation ends (or throws).
  std::vector<Job*>& resolved = report_resolved_;  // kept between calls, like the scratch below
  resolved.clear();
  resolved.reserve(reports.size());
  {
    struct ClearNewReports {
      std::vector<Job*>& jobs;
      ~ClearNewReports() {
        for (Job* j : jobs) j->new_reports = 0;
      }
    } clear{resolved};
    for (const auto& rep : reports) {
      auto it = jobs_.find(rep.job_id);
      if (it == jobs_.end() || !it->second.emitted) {
        throw std::invalid_argument(
            "update_connector_output: job " + std::to_string(rep.job_id) +
            " is not in flight (never emitted, already completed, or cancelled); report only "
            "jobs from build_connector_meta, once per rank");
      }
      Job& j = it->second;
      resolved.push_back(&j);
      const std::uint64_t n = ++j.new_reports + std::uint64_t{j.reports};
      if (n > static_cast<std::uint64_t>(config_.world_size)) {
        throw std::invalid_argument(
            "update_connector_output: job " + std::to_string(rep.job_id) + " reported " +
            std::to_string(n) + " times but world_size is " +
            std::to_string(config_.world_size) + "; each rank reports a job once");
      }
    }
  }
  ConnectorOutput out;
  if (!flushed_unstored_.empty()) {  // flushes that stored nothing: their blocks are free now
    out.finished_storing = std::move(flushed_unstored_);
    flushed_unstored_.clear();
  }
  out.completed_jobs.reserve(reports.size());  // one allocation, not one per doubling
  // The blocks of every successful store complete in one manager call at the end, by their CPU
  // slots (a pending block cannot move: no key is hashed or looked up again). Scratch vectors
  // keep their memory between calls.
  std::vector<std::uint32_t>& stored = report_stored_slots_;
  std::vector<JobId>& completed = report_completed_;
  std::vector<std::size_t>& event_ends = report_event_ends_;
  stored.clear();
  completed.clear();
  event_ends.clear();
  for (std::size_t i = 0; i < reports.size(); ++i) {
    const JobReport& rep = reports[i];
    Job& j = *resolved[i];  // still there: a job is erased only at its last report
    ++j.reports;
    j.failed = j.failed || !rep.success;
    if (j.reports < static_cast<std::uint64_t>(config_.world_size)) continue;
    const TransferJob& job = j.job;
    clear_fences(job);
    Request& r = *j.request;
    if (job.is_store) {
      if (j.failed || j.stale) {
        pool_->complete_store_blocks(job.cpu_block_ids, false, true, {});  // frees its slots
      } else {
        stored.insert(stored.end(), job.cpu_block_ids.begin(), job.cpu_block_ids.end());
        if (config_.enable_events) event_ends.push_back(stored.size());  // an event per job
      }
      --r.stores_in_flight;
    } else {
      pool_->complete_load_blocks(job.cpu_block_ids);  // the blocks prepare_load pinned
      if (j.failed || j.stale) {
        // The blocks could not be read: never offer them again (a retry of the request would
        // fail the same way), so that the engine recomputes them and stores them anew.
        std::vector<std::string_view>& keys = report_key_views_;
        keys.assign(job.keys.begin(), job.keys.end());
        stats_.blocks_discarded += pool_->discard(keys);
      }
      --r.loads_in_flight;
      r.load_failed = r.load_failed || j.failed;
      if (r.loads_in_flight == 0 && !r.finished) {
        (r.load_failed ? out.failed_loading : out.finished_loading).push_back(r.id);
        r.load_failed = false;
      }
    }
    out.completed_jobs.push_back(job.job_id);
    if (j.failed) {
      out.failed_jobs.push_back(job.job_id);
      ++stats_.failed_jobs;
    }
    completed.push_back(rep.job_id);
    if (r.finished && r.loads_in_flight == 0 && r.stores_in_flight == 0) {
      out.finished_storing.push_back(r.id);  // request_finished returned true for it
      set_idle(r, false);
      erase_request(r);
    }
  }
  if (!stored.empty()) pool_->complete_store_blocks(stored, true, true, event_ends);
  for (const JobId id : completed) retire_job(id);
  return out;
}

std::size_t OffloadingScheduler::reset_cache() {
  refuse_reentry("reset_cache");
  for (auto& [id, j] : jobs_) j.stale = true;
  // Blocks computed before the reset and not stored yet (waiting for a store batch, a store
  // refused for lack of room, or due at a finish) are never stored after it: their KV is that
  // of the old weights. Live requests store from the tokens of their last step on.
  flushed_unstored_.reserve(flushed_unstored_.size() + flush_pending_.size());
  for (auto& p : live_requests_) {
    Request& r = *p;
    std::int64_t tokens = r.tokens_seen;
    if (r.idle) {
      if (const IdleEntry* e = idle_.find(r.id_hash, kAnyEntry)) {
        tokens = std::max(tokens, e->tokens);
      }
    }
    r.next_store = std::max(r.next_store, tokens / offloaded_block_size_);
  }
  for (Request* r : flush_pending_) {
    r->flush_pending = false;
    for (auto& t : r->table) t.clear();
    if (r->stores_in_flight == 0) {  // the engine may free its blocks: listed as done
      flushed_unstored_.push_back(r->id);  // reserved: no throw
      erase_request(*r);
    }
  }
  flush_pending_.clear();
  return pool_->clear(false);
}

// --------------------------------------------------------------------------------- finish

void OffloadingScheduler::release(Request& r, bool keep_table) {
  if (r.finished) return;
  set_idle(r, false);  // a finished request listed again must reach get() (which rejects it)
  r.finished = true;
  cancel_unemitted_loads(r);
  r.match.reset();
  if (!keep_table) {
    for (auto& t : r.table) t.clear();
  }
}

OffloadingScheduler::Request& OffloadingScheduler::new_request(std::string_view request_id,
                                                               std::uint64_t id_hash) {
  live_requests_.reserve(live_requests_.size() + 1);  // first: a bad_alloc changes nothing
  std::unique_ptr<Request> r;
  if (spare_requests_.empty()) {
    r = std::make_unique<Request>();
    r->id.assign(request_id);
    r->table.resize(config_.groups.size());
  } else {
    // Every field as a fresh Request has it (a field added later is reset too); only the
    // buffers move over, emptied. Nothing here allocates: the id fits the buffer it had or
    // is assigned before the spare is taken.
    Request& old = *spare_requests_.back();
    old.id.assign(request_id);
    Request fresh;
    fresh.id = std::move(old.id);
    fresh.hashes = std::move(old.hashes);
    fresh.hashes.clear();
    fresh.table = std::move(old.table);
    fresh.table.resize(config_.groups.size());
    for (auto& t : fresh.table) t.clear();
    fresh.unemitted_loads = std::move(old.unemitted_loads);
    fresh.unemitted_loads.clear();
    old = std::move(fresh);
    r = std::move(spare_requests_.back());
    spare_requests_.pop_back();
  }
  r->id_hash = id_hash;
  r->slot = live_requests_.size();
  live_requests_.push_back(std::move(r));  // reserved: no throw
  return *live_requests_.back();
}

void OffloadingScheduler::erase_request(Request& r) {
  request_index_.erase(r.id_hash, [&r](const Request* x) { return x == &r; });
  const std::size_t slot = r.slot;
  std::unique_ptr<Request> kept = std::move(live_requests_[slot]);
  if (slot + 1 != live_requests_.size()) {
    live_requests_[slot] = std::move(live_requests_.back());
    live_requests_[slot]->slot = slot;
  }
  live_requests_.pop_back();
  std::size_t bytes = kept->id.capacity() + kept->hashes.capacity_bytes() +
                      kept->unemitted_loads.capacity() * sizeof(JobId);
  for (const auto& t : kept->table) bytes += t.capacity() * sizeof(TableEntry);
  if (spare_requests_.size() < kMaxSpareRequests && bytes <= kMaxSpareRequestBytes) {
    spare_requests_.push_back(std::move(kept));  // reserved: no throw; else freed here
  }
}

void OffloadingScheduler::erase_if_done(std::string_view request_id) {
  Request* r = find(request_id);
  if (r != nullptr && r->finished && !r->flush_pending && r->loads_in_flight == 0 &&
      r->stores_in_flight == 0) {
    set_idle(*r, false);
    erase_request(*r);
  }
}

void OffloadingScheduler::touch_at_finish(const Request& r) {
  // Every offloaded block the request used (loaded, found in the engine's cache, computed), of
  // every group, in (block, group) order: its head ends the most recent, and every group's
  // tail goes before any group's head (invariant 8). Blocks others had computed (below
  // reuse_end) are a reuse; its own stores are only ordered. Blocks not held are passed by.
  const std::int64_t used = std::max(known_blocks(r, r.tokens_seen),
                                     std::min<std::int64_t>(r.reuse_end, r.hashes.size() /
                                                                              hashes_per_block_));
  if (used <= 0) return;
  KeyList& keys = finish_keys_;  // scratch: memory reused from call to call
  keys.clear();
  finish_flags_.clear();
  for (std::int64_t j = 0; j < used; ++j) {
    for (std::size_t g = 0; g < config_.groups.size(); ++g) {
      if (first_needed_sub_block(g) >= config_.block_size_factor) continue;  // never stored
      append_key(keys, r, j, g);
      finish_flags_.push_back(j < r.reuse_end ? 1 : 0);
    }
  }
  finish_key_views_.assign(keys.begin(), keys.end());
  pool_->touch(finish_key_views_, finish_flags_);
}

bool OffloadingScheduler::request_finished(std::string_view request_id) {
  const FinishResult f = finish_request(request_id);
  return f.jobs_in_flight || f.store_due;
}

FinishResult OffloadingScheduler::finish_request(std::string_view request_id) {
  refuse_reentry("request_finished");
  Request* r = find(request_id);
  if (r == nullptr) return {};
  if (flush_pending_.capacity() == flush_pending_.size()) {
    flush_pending_.reserve(2 * flush_pending_.size() + 8);  // first: nothing throws after it
  }
  set_idle(*r, false);  // tokens_seen then counts the steps it was skipped in
  if (!r->finished) touch_at_finish(*r);
  // Store batching: blocks full after its last step and not stored yet are stored by the next
  // build_connector_meta (its table is kept until then).
  const bool flush = store_batch_ > 1 && !r->finished && r->scheduled_before &&
                     r->loads_in_flight == 0 && r->unemitted_loads.empty() &&
                     known_storable_blocks(*r, r->tokens_seen) > r->next_store;
  release(*r, /*keep_table=*/flush);
  if (flush) {
    r->flush_pending = true;
    flush_pending_.push_back(r);  // reserved: no throw
  }
  const FinishResult out{r->loads_in_flight > 0 || r->stores_in_flight > 0, flush};
  erase_if_done(request_id);
  return out;
}

}  // namespace kvoff
