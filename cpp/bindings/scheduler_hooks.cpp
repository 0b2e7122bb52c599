// The scheduler's per-step hooks on Python arguments (declared in scheduler_hooks.h): an
// engine step's columns and request objects read into the core's types, and the core's answers
// as Python objects. Both the pybind11 methods and the fast hooks call these functions.
#include "scheduler_hooks.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bindings.h"
#include "convert.h"
#include "kvoff/offloading_scheduler.h"

namespace kvoff::bindings {

namespace {

/// A job as a tuple; `with_keys` false leaves its keys out (an empty list): workers that
/// only copy blocks do not need them.
py::tuple job_tuple(const kvoff::TransferJob& j, bool with_keys = true) {
  return py::make_tuple(j.job_id, j.request_id, j.is_store, int64_list(j.gpu_block_ids),
                        int64_list(j.group_sizes), int64_list(j.block_indices),
                        to_int_list(j.cpu_block_ids),
                        with_keys ? to_bytes_list(j.keys) : py::list());
}

py::list job_list(const std::vector<kvoff::TransferJob>& jobs, bool with_keys = true) {
  py::list out(jobs.size());
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    out[i] = job_tuple(jobs[i], with_keys);
  }
  return out;
}

/// The step's jobs packed for shipping (see kvoff.scheduler.OffloadingScheduler.
/// build_connector_meta_packed): one bytes object of native int64s, [num_jobs, num_load_jobs,
/// num_groups], then per job [job_id, is_store, len(gpu_block_ids), len(cpu_block_ids),
/// group_sizes..., block_indices..., gpu_block_ids..., cpu_block_ids...]; and the request id
/// of every job, in the same order (loads first). Keys stay with the scheduler.
py::tuple packed_jobs(const kvoff::ConnectorMetaView& meta, std::size_t num_groups) {
  std::size_t words = 3;
  for (const auto* jobs : {&meta.load_jobs, &meta.store_jobs}) {
    for (const kvoff::TransferJob* j : *jobs) {
      words += 4 + 2 * num_groups + j->gpu_block_ids.size() + j->cpu_block_ids.size();
    }
  }
  const std::size_t num_jobs = meta.load_jobs.size() + meta.store_jobs.size();
  py::bytes packed = py::reinterpret_steal<py::bytes>(
      PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(words * sizeof(std::int64_t))));
  if (!packed) throw py::error_already_set();
  py::tuple ids(num_jobs);
  auto* w = reinterpret_cast<std::int64_t*>(PyBytes_AS_STRING(packed.ptr()));
  *w++ = static_cast<std::int64_t>(num_jobs);
  *w++ = static_cast<std::int64_t>(meta.load_jobs.size());
  *w++ = static_cast<std::int64_t>(num_groups);
  std::size_t k = 0;
  for (const auto* jobs : {&meta.load_jobs, &meta.store_jobs}) {
    for (const kvoff::TransferJob* job : *jobs) {
      const kvoff::TransferJob& j = *job;
      *w++ = static_cast<std::int64_t>(j.job_id);
      *w++ = j.is_store ? 1 : 0;
      *w++ = static_cast<std::int64_t>(j.gpu_block_ids.size());
      *w++ = static_cast<std::int64_t>(j.cpu_block_ids.size());
      w = std::copy(j.group_sizes.begin(), j.group_sizes.end(), w);
      w = std::copy(j.block_indices.begin(), j.block_indices.end(), w);
      w = std::copy(j.gpu_block_ids.begin(), j.gpu_block_ids.end(), w);
      w = std::copy(j.cpu_block_ids.begin(), j.cpu_block_ids.end(), w);
      PyObject* id = PyUnicode_FromStringAndSize(j.request_id.data(),
                                                 static_cast<Py_ssize_t>(j.request_id.size()));
      if (id == nullptr) throw py::error_already_set();
      PyTuple_SET_ITEM(ids.ptr(), static_cast<Py_ssize_t>(k++), id);
    }
  }
  return py::make_tuple(std::move(packed), std::move(ids));
}

/// The request columns of build_step (request ids, new block ids, computed tokens), each one
/// sequence, or a sequence followed by the matching column of `tail` (vLLM keeps its running
/// and its new requests apart): read as one column without building a joined list, whose
/// reference counts would touch every item.
class StepColumns {
 public:
  /// `joined`: storage for the joined columns (its memory reused between steps).
  StepColumns(py::handle request_ids, py::handle new_block_ids, py::handle num_computed_tokens,
              py::handle tail, std::array<std::vector<PyObject*>, 3>& joined)
      : joined_(joined) {
    static constexpr const char* kNames[3] = {"request_ids", "new_block_ids",
                                              "num_computed_tokens"};
    static constexpr const char* kTailNames[3] = {"tail request_ids", "tail new_block_ids",
                                                  "tail num_computed_tokens"};
    read(0, request_ids, new_block_ids, num_computed_tokens, kNames);
    if (tail.is_none()) {
      for (std::size_t c = 0; c < 3; ++c) items_[c] = PySequence_Fast_ITEMS(seqs_[0][c].ptr());
      return;
    }
    if (!PyTuple_Check(tail.ptr()) || PyTuple_GET_SIZE(tail.ptr()) != 3) {
      throw py::type_error(std::string("tail must be None or a tuple (request_ids, new_block_ids, "
                                       "num_computed_tokens) of the requests after the columns, "
                                       "got ") + Py_TYPE(tail.ptr())->tp_name);
    }
    read(1, PyTuple_GET_ITEM(tail.ptr(), 0), PyTuple_GET_ITEM(tail.ptr(), 1),
         PyTuple_GET_ITEM(tail.ptr(), 2), kTailNames);
    for (std::size_t c = 0; c < 3; ++c) {
      PyObject** head = PySequence_Fast_ITEMS(seqs_[0][c].ptr());
      PyObject** more = PySequence_Fast_ITEMS(seqs_[1][c].ptr());
      joined_[c].assign(head, head + sizes_[0]);
      joined_[c].insert(joined_[c].end(), more, more + sizes_[1]);
      items_[c] = joined_[c].data();
    }
  }
  Py_ssize_t size() const noexcept { return sizes_[0] + sizes_[1]; }
  /// Entries before this index come from the first columns, the others from `tail`.
  Py_ssize_t tail_start() const noexcept { return sizes_[0]; }
  PyObject** ids() const noexcept { return items_[0]; }
  PyObject** blocks() const noexcept { return items_[1]; }
  PyObject** computed() const noexcept { return items_[2]; }

 private:
  void read(std::size_t part, py::handle ids, py::handle blocks, py::handle computed,
            const char* const (&names)[3]) {
    seqs_[part][0] = fast_sequence(ids.ptr(), Where{names[0]}, "str");
    seqs_[part][1] = fast_sequence(blocks.ptr(), Where{names[1]}, "block id lists or None");
    seqs_[part][2] = fast_sequence(computed.ptr(), Where{names[2]}, "ints");
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seqs_[part][0].ptr());
    for (std::size_t c = 1; c < 3; ++c) {
      const Py_ssize_t m = PySequence_Fast_GET_SIZE(seqs_[part][c].ptr());
      if (m != n) {
        throw py::value_error(std::string(names[c]) + " has " + std::to_string(m) +
                              " entries but " + names[0] + " has " + std::to_string(n) +
                              "; give one entry per scheduled request");
      }
    }
    sizes_[part] = n;
  }
  py::object seqs_[2][3];
  Py_ssize_t sizes_[2] = {0, 0};
  std::array<std::vector<PyObject*>, 3>& joined_;
  PyObject** items_[3] = {nullptr, nullptr, nullptr};
};

/// build_step's per-request records and joined columns, kept between steps on the calling
/// thread (Borrowed): `reqs` never shrinks, so each record keeps its block id vectors' memory.
struct StepScratch {
  std::vector<kvoff::ScheduledRequest> reqs;
  /// Per record: its new_block_ids' vectors while it has none this step (the core reads an
  /// empty outer vector as "no new blocks"; clearing it would free the inner vectors).
  std::vector<std::vector<std::vector<std::int64_t>>> spare;
  std::array<std::vector<PyObject*>, 3> joined;
};

/// An engine request object (attributes `request_id` (str), `block_hashes` (a list of bytes or
/// int hashes), `num_tokens` (int) and, with offload_prompt_only, `num_prompt_tokens` (int))
/// handed to the core in one call: its block hashes beyond
/// those the core has are read in place (no slice), then update_request; the object is kept in
/// `requests` (a dict by request id, read by build_connector_meta's hash source). Returns the
/// id object (a new reference; the view the hooks take is valid while it lives). Raises as
/// update_request; a missing attribute raises AttributeError. Nothing changes on an error.
py::object sync_request(kvoff::OffloadingScheduler& self, py::handle request,
                        py::handle requests) {
  static PyObject* const kId = PyUnicode_InternFromString("request_id");
  static PyObject* const kHashes = PyUnicode_InternFromString("block_hashes");
  static PyObject* const kTokens = PyUnicode_InternFromString("num_tokens");
  py::object id = py::reinterpret_steal<py::object>(PyObject_GetAttr(request.ptr(), kId));
  if (!id) throw py::error_already_set();
  const std::string_view rid = id_view(id.ptr(), Where{"request.request_id"});
  py::object hashes = py::reinterpret_steal<py::object>(PyObject_GetAttr(request.ptr(), kHashes));
  if (!hashes) throw py::error_already_set();
  py::object tokens = py::reinterpret_steal<py::object>(PyObject_GetAttr(request.ptr(), kTokens));
  if (!tokens) throw py::error_already_set();
  // offload_prompt_only: the prompt's length (vLLM's num_prompt_tokens), read and checked
  // before anything changes
  std::int64_t prompt_tokens = -1;
  if (self.config().offload_prompt_only) {
    static PyObject* const kPrompt = PyUnicode_InternFromString("num_prompt_tokens");
    py::object prompt =
        py::reinterpret_steal<py::object>(PyObject_GetAttr(request.ptr(), kPrompt));
    if (!prompt) throw py::error_already_set();
    if (!prompt.is_none()) {  // None: the prompt's length is unknown, nothing is limited
      prompt_tokens = to_int64(prompt.ptr(), "request.num_prompt_tokens");
      if (prompt_tokens < 0) {
        throw py::value_error("request.num_prompt_tokens is " + std::to_string(prompt_tokens) +
                              "; it must be the prompt's length in tokens (>= 0)");
      }
    }
  }
  const std::size_t known = self.num_hashes(rid);
  struct SyncViews;
  Borrowed<std::vector<std::string_view>, SyncViews> storage;  // kept between calls
  KeyBatch batch(hashes, static_cast<Py_ssize_t>(known), &storage.get());  // the new ones only
  self.update_request(rid, known, batch.span(), to_int64(tokens.ptr(), "request.num_tokens"));
  if (prompt_tokens >= 0) self.set_prompt_tokens(rid, prompt_tokens);  // checked: no throw
  if (PyDict_Check(requests.ptr()) && PyDict_SetItem(requests.ptr(), id.ptr(), request.ptr()) < 0) {
    throw py::error_already_set();
  }
  return id;
}

/// After a refused call that sync_request began: a request it registered (the count of
/// requests grew from `before`) is forgotten again, in the core and in `requests`, so that a
/// bad call leaves nothing behind. A request known before keeps its state (hashes it was
/// given stay, as the next call would add them anyway).
void forget_if_new(kvoff::OffloadingScheduler& self, std::size_t before, std::string_view rid,
                   const py::object& id, py::handle requests) {
  if (self.num_requests() <= before) return;
  try {
    self.request_finished(rid);  // a new request has no jobs: erased at once
  } catch (...) {
    return;  // the caller's own error is the one to report
  }
  if (PyDict_Check(requests.ptr()) && PyDict_DelItem(requests.ptr(), id.ptr()) < 0) {
    PyErr_Clear();
  }
}

/// With store batching, a finishing request's block hashes the core lacks are read from the
/// engine's request object (`block_hashes`) first, so that its last blocks can be stored; a
/// request whose hashes cannot be read finishes anyway, storing the blocks whose hashes are
/// known.
void pull_last_hashes(kvoff::OffloadingScheduler& core, std::string_view rid,
                      PyObject* request) {
  if (request == Py_None || core.store_batch_blocks() <= 1 || core.next_store_block(rid) < 0) {
    return;
  }
  static PyObject* const kHashes = PyUnicode_InternFromString("block_hashes");
  py::object hashes = py::reinterpret_steal<py::object>(PyObject_GetAttr(request, kHashes));
  if (!hashes) {
    PyErr_Clear();
    return;
  }
  const std::size_t known = core.num_hashes(rid);
  const Py_ssize_t n = PyList_Check(hashes.ptr()) ? PyList_GET_SIZE(hashes.ptr())
                                                  : PyObject_Length(hashes.ptr());
  if (n < 0) {
    PyErr_Clear();
    return;
  }
  if (static_cast<std::size_t>(n) <= known) return;
  try {
    KeyBatch batch(hashes, static_cast<Py_ssize_t>(known));
    core.add_hashes(rid, known, batch.span());
  } catch (const py::error_already_set&) {  // bad hashes: the blocks whose hashes are known
  } catch (const py::builtin_exception&) {   // are stored
  } catch (const std::invalid_argument&) {
  }
}

}  // namespace

std::array<std::uint64_t, kCounterNames.size()> counter_values(const kvoff::SchedulerStats& s) {
  return {s.lookups,       s.lookup_retries, s.hit_tokens,     s.load_jobs,
          s.store_jobs,    s.blocks_loaded,  s.blocks_stored,  s.store_refusals,
          s.blocks_evicted, s.blocks_discarded, s.stale_blocks_skipped, s.jobs_flushed,
          s.failed_jobs,   s.stores_skipped};
}

py::tuple match_tuple(const kvoff::MatchResult& r) {
  py::object n = r.num_tokens ? py::object(py::int_(*r.num_tokens)) : py::none();
  return py::make_tuple(n, r.load_async);
}

py::tuple build_step(kvoff::OffloadingScheduler& self, py::handle request_ids,
                     py::handle new_block_ids, py::handle num_computed_tokens,
                     py::handle num_scheduled_tokens, py::handle resumed_request_ids,
                     py::handle finished, py::handle preempted, py::handle rewritten,
                     py::handle requests, bool with_keys, bool packed, py::handle tail) {
  reject_str(request_ids, "request_ids");
  reject_str(resumed_request_ids, "resumed_request_ids");
  // Any container of resumed ids but the built-in ones becomes a frozenset first: its own
  // __contains__ / __len__ would run while the columns' items are held as borrowed pointers
  py::object resumed_set;
  if (!resumed_request_ids.is_none() && !PyAnySet_CheckExact(resumed_request_ids.ptr()) &&
      !PyList_CheckExact(resumed_request_ids.ptr()) &&
      !PyTuple_CheckExact(resumed_request_ids.ptr())) {
    resumed_set = py::reinterpret_steal<py::object>(PyFrozenSet_New(resumed_request_ids.ptr()));
    if (!resumed_set) throw py::error_already_set();
    resumed_request_ids = resumed_set;
  }
  // The step's records are kept from the last step (their memory is reused); a nested
  // call (a hash source running Python that steps another scheduler) makes its own.
  Borrowed<StepScratch, StepScratch> scratch;
  const StepColumns columns(request_ids, new_block_ids, num_computed_tokens, tail,
                            scratch.get().joined);
  const Py_ssize_t n = columns.size();
  const Py_ssize_t tail_start = tail.is_none() ? n : columns.tail_start();
  PyObject* scheduled_dict = PyDict_Check(num_scheduled_tokens.ptr()) ? num_scheduled_tokens.ptr()
                                                                       : nullptr;
  py::object scheduled_seq;
  if (scheduled_dict == nullptr) {
    scheduled_seq = fast_sequence(num_scheduled_tokens.ptr(), Where{"num_scheduled_tokens"},
                                  "ints (or a dict by request id)");
    if (PySequence_Fast_GET_SIZE(scheduled_seq.ptr()) != n) {
      throw py::value_error("num_scheduled_tokens has " +
                            std::to_string(PySequence_Fast_GET_SIZE(scheduled_seq.ptr())) +
                            " entries but request_ids has " + std::to_string(n));
    }
  }
  const bool any_resumed =
      !resumed_request_ids.is_none() && PyObject_IsTrue(resumed_request_ids.ptr());
  PyObject* request_dict = PyDict_Check(requests.ptr()) ? requests.ptr() : nullptr;
  static PyObject* const kHashes = PyUnicode_InternFromString("block_hashes");

  PyObject** id_items = columns.ids();
  PyObject** block_items = columns.blocks();
  PyObject** computed_items = columns.computed();
  std::vector<kvoff::ScheduledRequest>& all_reqs = scratch.get().reqs;
  std::vector<std::vector<std::vector<std::int64_t>>>& spare = scratch.get().spare;
  if (all_reqs.size() < static_cast<std::size_t>(n)) {
    all_reqs.resize(static_cast<std::size_t>(n));
    spare.resize(static_cast<std::size_t>(n));
  }
  const std::span<kvoff::ScheduledRequest> reqs(all_reqs.data(), static_cast<std::size_t>(n));
  // The engine's objects are scattered and mostly out of cache by now: the id and count of the
  // request kPrefetchAhead positions on are fetched while this one is read, so that the misses
  // overlap instead of queueing one after the other.
  constexpr Py_ssize_t kPrefetchAhead = 8;
  for (Py_ssize_t i = 0; i < std::min(n, kPrefetchAhead); ++i) {
    __builtin_prefetch(id_items[i]);
    __builtin_prefetch(computed_items[i]);
  }
  // vLLM fills num_scheduled_tokens in scheduling order (running requests first): the dict's
  // next entry is tried first (its key compared by identity, no hashing or probing), then a
  // lookup.
  Py_ssize_t dict_pos = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n) {
      __builtin_prefetch(id_items[i + kPrefetchAhead]);
      __builtin_prefetch(computed_items[i + kPrefetchAhead]);
    }
    PyObject* id_obj = id_items[i];
    kvoff::ScheduledRequest& s = reqs[static_cast<std::size_t>(i)];
    const std::string_view id = id_view(id_obj, Where{"request_ids"}.at(i));
    s.num_computed_tokens = to_int64(computed_items[i], Where{"num_computed_tokens"}.at(i));
    if (scheduled_dict != nullptr) {
      PyObject* key = nullptr;
      PyObject* v = nullptr;
      Py_ssize_t next = dict_pos;
      if (PyDict_Next(scheduled_dict, &next, &key, &v) && key == id_obj) {
        dict_pos = next;
      } else {
        v = PyDict_GetItemWithError(scheduled_dict, id_obj);
        if (v == nullptr && PyErr_Occurred()) throw py::error_already_set();
      }
      s.num_scheduled_tokens = v == nullptr ? 0 : to_int64(v, "num_scheduled_tokens");
    } else {
      s.num_scheduled_tokens = to_int64(PySequence_Fast_GET_ITEM(scheduled_seq.ptr(), i),
                                        Where{"num_scheduled_tokens"}.at(i));
    }
    s.request_id = id;  // a view of the str object, alive through the call
    auto& kept = spare[static_cast<std::size_t>(i)];
    if (block_items[i] != Py_None) {
      if (s.new_block_ids.empty() && !kept.empty()) s.new_block_ids.swap(kept);
      to_int_lists_into(block_items[i], Where{"new_block_ids"}.at(i), s.new_block_ids);
    } else if (!s.new_block_ids.empty()) {
      if (kept.empty()) {
        s.new_block_ids.swap(kept);  // kept for a later step, s.new_block_ids now empty
      } else {
        s.new_block_ids.clear();
      }
    }
    // tail entries are requests scheduled as new (vLLM's scheduled_new_reqs): their block ids
    // are the whole table, also for a request seen before (a resumed streaming-input session)
    s.whole_table = i >= tail_start;
    s.resumed_from_preemption = false;
    if (any_resumed) {
      const int in = PySequence_Contains(resumed_request_ids.ptr(), id_obj);
      if (in < 0) throw py::error_already_set();
      s.resumed_from_preemption = in == 1;
    }
  }
  const auto fin = to_strs(finished, "finished_request_ids");
  const auto pre = to_strs(preempted, "preempted_request_ids");
  std::vector<std::int64_t> rewritten_ids = to_ints(rewritten.ptr(), Where{"rewritten_block_ids"});
  // New block hashes come from the engine's request objects (`requests`), read only when the
  // core needs more than it has (once per offloaded block in decode, not every step).
  kvoff::OffloadingScheduler::HashSource source;
  if (request_dict != nullptr) {
    source = [request_dict, id_items](std::size_t index, std::string_view, std::size_t known,
                                      kvoff::OffloadingScheduler::HashSink& sink) {
      // the scheduled request's own id object (its hash is cached: no new str per lookup)
      PyObject* req = PyDict_GetItemWithError(request_dict, id_items[index]);  // borrowed
      if (req == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        return;  // not an engine request object: hashes come through update_request
      }
      py::object hashes = py::reinterpret_steal<py::object>(PyObject_GetAttr(req, kHashes));
      if (!hashes) throw py::error_already_set();
      const Py_ssize_t num = PyObject_Size(hashes.ptr());
      if (num < 0) throw py::error_already_set();
      if (static_cast<std::size_t>(num) <= known) return;  // none yet (async scheduling)
      // The hashes only: the request's token count matters to lookups, which read it
      // themselves (sync_and_match); num_tokens is a Python property in vLLM, about 0.1 us.
      struct HashViews;
      Borrowed<std::vector<std::string_view>, HashViews> storage;
      KeyBatch batch(hashes, static_cast<Py_ssize_t>(known), &storage.get());  // the new ones
      sink.add(batch.span());
    };
  }
  py::tuple res;
  if (packed) {
    const auto view = self.build_connector_meta_view(reqs, fin, pre, rewritten_ids, source);
    py::tuple jobs = packed_jobs(view, self.config().groups.size());
    py::list flush(view.jobs_to_flush.size());
    for (std::size_t i = 0; i < view.jobs_to_flush.size(); ++i) {
      flush[i] = py::int_(view.jobs_to_flush[i]);
    }
    res = py::make_tuple(jobs[0], jobs[1], flush);
  } else {
    auto meta = self.build_connector_meta(reqs, fin, pre, rewritten_ids, source);
    py::list flush(meta.jobs_to_flush.size());
    for (std::size_t i = 0; i < meta.jobs_to_flush.size(); ++i) {
      flush[i] = py::int_(meta.jobs_to_flush[i]);
    }
    res = py::make_tuple(job_list(meta.load_jobs, with_keys),
                         job_list(meta.store_jobs, with_keys), flush);
  }
  return res;
}

py::tuple sync_and_match(kvoff::OffloadingScheduler& self, py::handle request,
                         std::int64_t computed, py::handle requests) {
  self.refuse_reentry("get_num_new_matched_tokens");
  const std::size_t before = self.num_requests();
  const py::object id = sync_request(self, request, requests);
  const std::string_view rid = id_view(id.ptr(), Where{"request_id"});
  kvoff::MatchResult r;
  try {
    r = self.get_num_new_matched_tokens(rid, computed);
  } catch (...) {
    forget_if_new(self, before, rid, id, requests);
    throw;
  }
  return match_tuple(r);
}

void sync_and_alloc(kvoff::OffloadingScheduler& self, py::handle request, py::handle block_ids,
                    std::int64_t num_external_tokens, py::handle requests) {
  self.refuse_reentry("update_state_after_alloc");
  const auto ids = to_int_lists(block_ids, "block_ids");  // validated before any change
  const std::size_t before = self.num_requests();
  const py::object id = sync_request(self, request, requests);
  const std::string_view rid = id_view(id.ptr(), Where{"request_id"});
  try {
    self.update_state_after_alloc(rid, ids, num_external_tokens);
  } catch (...) {
    forget_if_new(self, before, rid, id, requests);
    throw;
  }
}

void update_connector_output_counts(kvoff::OffloadingScheduler& self, py::handle counts) {
  // {job_id: (ranks that succeeded, ranks that failed)} -> one report per rank
  if (!PyDict_Check(counts.ptr())) {
    throw py::type_error(std::string("counts must be a dict {job_id: (succeeded, "
                                     "failed)}, got ") +
                         Py_TYPE(counts.ptr())->tp_name);
  }
  struct Reports;
  Borrowed<std::vector<kvoff::JobReport>, Reports> storage;  // kept between steps
  std::vector<kvoff::JobReport>& reps = storage.get();
  reps.clear();
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(counts.ptr(), &pos, &key, &value)) {
    const std::int64_t id = to_int64(key, "job_id");
    std::array<std::int64_t, 2> pair{-1, -1};
    if ((PyList_CheckExact(value) && PyList_GET_SIZE(value) == 2) ||
        (PyTuple_CheckExact(value) && PyTuple_GET_SIZE(value) == 2)) {
      PyObject** two = PySequence_Fast_ITEMS(value);  // the fast path: no copy
      pair = {to_int64(two[0], "counts[job][0]"), to_int64(two[1], "counts[job][1]")};
    } else {
      const auto v = to_ints(value, Where{"counts[job]"});
      if (v.size() == 2) pair = {v[0], v[1]};
    }
    if (id < 0 || pair[0] < 0 || pair[1] < 0) {
      throw py::value_error(
          "counts[" + std::to_string(id) +
          "] must be a job id >= 0 mapped to (succeeded, failed) rank counts >= 0");
    }
    // checked before one report per rank is made: a huge count must not allocate
    const std::int64_t world = self.config().world_size;
    if (pair[0] > world || pair[1] > world - pair[0]) {
      throw py::value_error(
          "counts[" + std::to_string(id) + "] = (" + std::to_string(pair[0]) + ", " +
          std::to_string(pair[1]) + ") reports more ranks than world_size = " +
          std::to_string(world) + "; each rank reports a job once. Nothing was "
          "changed.");
    }
    for (std::int64_t k = 0; k < pair[0] + pair[1]; ++k) {
      reps.push_back(kvoff::JobReport{static_cast<kvoff::JobId>(id), k < pair[0]});
    }
  }
  self.update_connector_output(reps);
}

py::tuple counters_delta(const kvoff::OffloadingScheduler& self, py::handle seen) {
  // (changes since `seen` as {name: increase} or None when nothing moved, counters
  // now as a tuple); `seen` is an earlier counters() tuple, or None for all zeros
  constexpr std::size_t n = kCounterNames.size();
  const auto now = counter_values(self.stats());
  std::array<std::uint64_t, n> before{};
  if (!seen.is_none()) {
    if (!PyTuple_Check(seen.ptr()) ||
        PyTuple_GET_SIZE(seen.ptr()) != static_cast<Py_ssize_t>(n)) {
      throw py::type_error("seen must be None or a tuple of " + std::to_string(n) +
                           " ints from counters()");
    }
    for (std::size_t i = 0; i < n; ++i) {
      const std::int64_t v = to_int64(
          PyTuple_GET_ITEM(seen.ptr(), static_cast<Py_ssize_t>(i)), "seen");
      if (v < 0 || static_cast<std::uint64_t>(v) > now[i]) {
        throw py::value_error(
            std::string("seen[") + std::to_string(i) + "] (" + kCounterNames[i] +
            ") = " + std::to_string(v) + " is not an earlier value of this "
            "scheduler's counter (now " + std::to_string(now[i]) +
            "); pass None or a tuple that counters() or counters_delta() returned");
      }
      before[i] = static_cast<std::uint64_t>(v);
    }
  }
  if (now == before) {
    return py::make_tuple(py::none(), py::reinterpret_borrow<py::object>(seen));
  }
  // the names as interned str objects, made once (a stats call per engine step)
  static const std::array<PyObject*, n> names = [] {
    std::array<PyObject*, n> out{};
    for (std::size_t i = 0; i < n; ++i) {
      out[i] = PyUnicode_InternFromString(kCounterNames[i]);
      if (out[i] == nullptr) throw py::error_already_set();
    }
    return out;
  }();
  py::dict delta;
  py::tuple now_t(n);
  for (std::size_t i = 0; i < n; ++i) {
    PyObject* v = PyLong_FromUnsignedLongLong(now[i]);
    if (v == nullptr) throw py::error_already_set();
    PyTuple_SET_ITEM(now_t.ptr(), static_cast<Py_ssize_t>(i), v);
    if (now[i] != before[i]) {
      py::object d = py::reinterpret_steal<py::object>(
          PyLong_FromUnsignedLongLong(now[i] - before[i]));
      if (!d || PyDict_SetItem(delta.ptr(), names[i], d.ptr()) < 0) {
        throw py::error_already_set();
      }
    }
  }
  return py::make_tuple(std::move(delta), std::move(now_t));
}

kvoff::FinishResult finish_request(kvoff::OffloadingScheduler& self, PyObject* request_id,
                                   PyObject* request) {
  const auto rid = id_view(request_id, Where{"request_id"});
  self.refuse_reentry("request_finished");
  pull_last_hashes(self, rid, request);
  return self.finish_request(rid);
}

}  // namespace kvoff::bindings
