// The scheduler's per-step hooks on Python arguments (an internal header of cpp/bindings/):
// reading an engine step's columns and request objects into the core's types, calling the core,
// and building the Python results. Each is one function that serves both ways in: the pybind11
// methods of _OffloadingScheduler (scheduler_bindings.cpp) and the plain CPython methods of
// _FastHooks (fast_hooks.cpp), so both have the same code and the same errors.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>

#include "kvoff/offloading_scheduler.h"

namespace kvoff::bindings {

namespace py = pybind11;

/// The scheduler's monotonic counters, in the order of COUNTER_NAMES.
/// New counters go at the end: consumers keep their positions.
inline constexpr std::array<const char*, 14> kCounterNames = {
    "lookups",       "lookup_retries", "hit_tokens",     "load_jobs",
    "store_jobs",    "blocks_loaded",  "blocks_stored",  "store_refusals",
    "blocks_evicted", "blocks_discarded", "stale_blocks_skipped", "jobs_flushed",
    "failed_jobs",   "stores_skipped"};

/// The counters of `s` in the order of kCounterNames.
std::array<std::uint64_t, kCounterNames.size()> counter_values(const kvoff::SchedulerStats& s);

/// A lookup's answer as Python sees it: `(num_tokens | None, load_async)`.
py::tuple match_tuple(const kvoff::MatchResult& r);

/// build_connector_meta from columns (see kvoff.scheduler.OffloadingScheduler.
/// build_connector_meta_columns): request_ids[i], new_block_ids[i] (None or per group a
/// sequence of ints), num_computed_tokens[i]; num_scheduled_tokens a dict by request id
/// (missing: 0) or a sequence aligned with request_ids; resumed_request_ids any container.
/// When `requests` is a dict (request id -> object with block_hashes), each scheduled
/// request's new block hashes are added first (HashSink::add without a token count). Returns
/// (load job tuples, store job tuples, job ids to flush); with `packed`, (packed jobs, their
/// request ids, job ids to flush) instead. `tail`: None, or three more columns read after the
/// first three (StepColumns); a num_scheduled_tokens sequence covers both. Raises TypeError /
/// ValueError naming the bad column entry, and as the core's build_connector_meta.
py::tuple build_step(kvoff::OffloadingScheduler& self, py::handle request_ids,
                     py::handle new_block_ids, py::handle num_computed_tokens,
                     py::handle num_scheduled_tokens, py::handle resumed_request_ids,
                     py::handle finished, py::handle preempted, py::handle rewritten,
                     py::handle requests, bool with_keys, bool packed, py::handle tail);

/// _OffloadingScheduler.sync_and_match: the engine request object's new block hashes and
/// token count handed to the core, then the lookup; `(num_tokens | None, load_async)`. A
/// request the call registered is forgotten again on an error.
py::tuple sync_and_match(kvoff::OffloadingScheduler& self, py::handle request,
                         std::int64_t computed, py::handle requests);

/// _OffloadingScheduler.sync_and_alloc: as sync_and_match's first half, then
/// update_state_after_alloc. A request the call registered is forgotten again on an error.
void sync_and_alloc(kvoff::OffloadingScheduler& self, py::handle request, py::handle block_ids,
                    std::int64_t num_external_tokens, py::handle requests);

/// _OffloadingScheduler.update_connector_output_counts: `counts` is {job_id: (ranks that
/// succeeded, ranks that failed)}; every pair is checked before anything is counted.
void update_connector_output_counts(kvoff::OffloadingScheduler& self, py::handle counts);

/// _OffloadingScheduler.counters_delta: `({name: increase} | None, counters now)`.
py::tuple counters_delta(const kvoff::OffloadingScheduler& self, py::handle seen);

/// A request finishes (`request_id` a str, `request` the engine's request object or None):
/// with store batching, its block hashes the core lacks are read from `request` first, so that
/// its last blocks can be stored; then OffloadingScheduler::finish_request. Raises TypeError
/// for a request id that is not a str, RuntimeError for a call from inside another hook.
kvoff::FinishResult finish_request(kvoff::OffloadingScheduler& self, PyObject* request_id,
                                   PyObject* request);

}  // namespace kvoff::bindings
