// kvoff._scheduler, the scheduler's part: _OffloadingScheduler, the C++ OffloadingScheduler
// behind the Python facade kvoff.scheduler.OffloadingScheduler (which owns the argument types
// and their docstrings), and COUNTER_NAMES. The per-step hooks that parse an engine step are in
// scheduler_hooks.cpp (shared with the fast hooks, fast_hooks.cpp); argument conversion in
// convert.h.
#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "convert.h"
#include "kvoff/offloading_manager.h"
#include "kvoff/offloading_scheduler.h"
#include "scheduler_hooks.h"

namespace kvoff::bindings {

namespace {

kvoff::GroupKind to_kind(const std::string& name) {
  if (name == "full_attention") return kvoff::GroupKind::kFullAttention;
  if (name == "sliding_window") return kvoff::GroupKind::kSlidingWindow;
  if (name == "mamba") return kvoff::GroupKind::kMamba;
  throw py::value_error("unknown KV cache group kind '" + name +
                        "'; use 'full_attention', 'sliding_window' or 'mamba'");
}

}  // namespace

void bind_scheduler(py::module_& m) {
  using kvoff::CPUOffloadingManager;
  using kvoff::OffloadingScheduler;
  {
    py::tuple names(kCounterNames.size());
    for (std::size_t i = 0; i < kCounterNames.size(); ++i) names[i] = py::str(kCounterNames[i]);
    m.attr("COUNTER_NAMES") = names;
  }
  py::class_<OffloadingScheduler>(
      m, "_OffloadingScheduler",
      "_OffloadingScheduler(num_cpu_blocks, eviction_policy, enable_events, gpu_block_size, "
      "block_size_factor, hash_block_size, world_size, num_gpu_blocks, groups, "
      "store_batch_blocks=1, offload_prompt_only=False, store_threshold=0, "
      "max_tracker_size=64000, node_pool=None)\n\n"
      "The C++ per-step offloading scheduler. Private: use kvoff.OffloadingScheduler, which "
      "documents every hook (shapes, units, errors).")
      .def(py::init([](std::int64_t num_cpu_blocks, const std::string& eviction_policy,
                       py::handle enable_events, std::int64_t gpu_block_size,
                       std::int64_t block_size_factor, std::int64_t hash_block_size,
                       std::int64_t world_size, std::int64_t num_gpu_blocks,
                       py::handle groups, std::int64_t store_batch_blocks,
                       py::handle offload_prompt_only, std::int64_t store_threshold,
                       std::int64_t max_tracker_size, py::object node_pool) {
             kvoff::SchedulerConfig c;
             c.num_cpu_blocks = num_cpu_blocks;
             c.eviction_policy = eviction_policy;
             c.enable_events = to_bool(enable_events, "enable_events");
             c.gpu_block_size = gpu_block_size;
             c.block_size_factor = block_size_factor;
             c.hash_block_size = hash_block_size;
             c.world_size = world_size;
             c.num_gpu_blocks = num_gpu_blocks;
             c.store_batch_blocks = store_batch_blocks;
             c.offload_prompt_only = to_bool(offload_prompt_only, "offload_prompt_only");
             c.store_threshold = store_threshold;
             c.max_tracker_size = max_tracker_size;
             for (py::handle g : groups) {
               if (!PyTuple_Check(g.ptr()) || PyTuple_GET_SIZE(g.ptr()) != 2) {
                 throw py::type_error("groups must be (kind, sliding_window) tuples");
               }
               py::tuple t = py::reinterpret_borrow<py::tuple>(g);
               c.groups.push_back(kvoff::SchedulerGroup{to_kind(t[0].cast<std::string>()),
                                                        to_int64(t[1].ptr(), "sliding_window")});
             }
             std::shared_ptr<kvoff::BlockManager> pool;
             if (!node_pool.is_none()) pool = node_pool_manager(std::move(node_pool));
             return std::make_unique<OffloadingScheduler>(std::move(c), std::move(pool));
           }),
           py::arg("num_cpu_blocks"), py::arg("eviction_policy"), py::arg("enable_events"),
           py::arg("gpu_block_size"), py::arg("block_size_factor"), py::arg("hash_block_size"),
           py::arg("world_size"), py::arg("num_gpu_blocks"), py::arg("groups"),
           py::arg("store_batch_blocks") = 1, py::arg("offload_prompt_only") = false,
           py::arg("store_threshold") = 0,
           py::arg("max_tracker_size") = CPUOffloadingManager::kDefaultMaxTrackerSize,
           py::arg("node_pool") = py::none())
      .def("set_prompt_tokens", &OffloadingScheduler::set_prompt_tokens, py::arg("request_id"),
           py::arg("prompt_tokens"))
      .def(
          "update_request",
          [](OffloadingScheduler& self, const std::string& request_id, std::size_t start,
             py::handle hashes, std::int64_t num_tokens) {
            KeyBatch batch(hashes);
            self.update_request(request_id, start, batch.span(), num_tokens);
          },
          py::arg("request_id"), py::arg("start"), py::arg("hashes"), py::arg("num_tokens"))
      .def(
          "get_num_new_matched_tokens",
          [](OffloadingScheduler& self, const std::string& request_id, std::int64_t computed) {
            return match_tuple(self.get_num_new_matched_tokens(request_id, computed));
          },
          py::arg("request_id"), py::arg("num_computed_tokens"))
      .def(
          "sync_and_match",
          sync_and_match,
          py::arg("request"), py::arg("num_computed_tokens"), py::arg("requests"))
      .def(
          "sync_and_alloc",
          sync_and_alloc,
          py::arg("request"), py::arg("block_ids"), py::arg("num_external_tokens"),
          py::arg("requests"))
      .def(
          "update_state_after_alloc",
          [](OffloadingScheduler& self, const std::string& request_id, py::handle block_ids,
             std::int64_t num_external_tokens) {
            const auto ids = to_int_lists(block_ids, "block_ids");
            self.update_state_after_alloc(request_id, ids, num_external_tokens);
          },
          py::arg("request_id"), py::arg("block_ids"), py::arg("num_external_tokens"))
      .def(
          "build_connector_meta",
          [](OffloadingScheduler& self, py::handle request_ids, py::handle new_block_ids,
             py::handle num_computed_tokens, py::handle num_scheduled_tokens,
             py::handle resumed_request_ids, py::handle finished, py::handle preempted,
             py::handle rewritten, py::handle requests, py::handle with_keys, py::handle packed,
             py::handle tail) {
            return build_step(self, request_ids, new_block_ids, num_computed_tokens,
                              num_scheduled_tokens, resumed_request_ids, finished, preempted,
                              rewritten, requests, to_bool(with_keys, "with_keys"),
                              to_bool(packed, "packed"), tail);
          },
          py::arg("request_ids"), py::arg("new_block_ids"), py::arg("num_computed_tokens"),
          py::arg("num_scheduled_tokens"), py::arg("resumed_request_ids"),
          py::arg("finished_request_ids"), py::arg("preempted_request_ids"),
          py::arg("rewritten_block_ids"), py::arg("requests"), py::arg("with_keys") = true,
          py::arg("packed") = false, py::arg("tail") = py::none())
      .def("num_hashes", &OffloadingScheduler::num_hashes, py::arg("request_id"))
      .def(
          "update_connector_output",
          [](OffloadingScheduler& self, py::handle reports) {
            std::vector<kvoff::JobReport> reps;
            for (py::handle item : reports) {
              py::tuple t = py::reinterpret_borrow<py::tuple>(item);
              if (!PyTuple_Check(item.ptr()) || t.size() != 2) {
                throw py::type_error("reports must be (job_id, success) tuples");
              }
              const std::int64_t id = to_int64(t[0].ptr(), "job_id");
              if (id < 0) {
                throw py::value_error("job_id must be >= 0, got " + std::to_string(id));
              }
              reps.push_back(
                  kvoff::JobReport{static_cast<kvoff::JobId>(id), to_bool(t[1], "success")});
            }
            auto out = self.update_connector_output(reps);
            py::list done(out.completed_jobs.size());
            for (std::size_t i = 0; i < out.completed_jobs.size(); ++i) {
              done[i] = py::int_(out.completed_jobs[i]);
            }
            py::list failed(out.failed_jobs.size());
            for (std::size_t i = 0; i < out.failed_jobs.size(); ++i) {
              failed[i] = py::int_(out.failed_jobs[i]);
            }
            return py::make_tuple(str_list(out.finished_loading), str_list(out.failed_loading),
                                  str_list(out.finished_storing), done, failed);
          },
          py::arg("reports"))
      .def(
          "update_connector_output_counts",
          update_connector_output_counts,
          py::arg("counts"))
      .def("request_finished", &OffloadingScheduler::request_finished, py::arg("request_id"))
      .def("fast_hooks", [](py::object self) { return make_fast_hooks(std::move(self)); })
      .def("take_events",
           [](OffloadingScheduler& self) { return events_to_py(self.take_events()); })
      .def("reset_cache", &OffloadingScheduler::reset_cache)
      .def_property_readonly(
          "manager",
          [](OffloadingScheduler& self) -> CPUOffloadingManager& { return self.manager(); },
          py::return_value_policy::reference_internal,
          "The scheduler's own CPUOffloadingManager (kept alive by the scheduler object), for "
          "kvoff.tiers.coordinator.TieredPool only: promotions store keys no request stores, "
          "and write-through uses the manager's thread-safe calls. Any other call that changes "
          "it breaks the scheduler's job bookkeeping.")
      .def("stats",
           [](const OffloadingScheduler& self) {
             const auto& s = self.stats();
             py::dict d;
             d["lookups"] = s.lookups;
             d["lookup_retries"] = s.lookup_retries;
             d["hit_tokens"] = s.hit_tokens;
             d["load_jobs"] = s.load_jobs;
             d["store_jobs"] = s.store_jobs;
             d["blocks_loaded"] = s.blocks_loaded;
             d["blocks_stored"] = s.blocks_stored;
             d["store_refusals"] = s.store_refusals;
             d["blocks_evicted"] = s.blocks_evicted;
             d["blocks_discarded"] = s.blocks_discarded;
             d["stale_blocks_skipped"] = s.stale_blocks_skipped;
             d["jobs_flushed"] = s.jobs_flushed;
             d["failed_jobs"] = s.failed_jobs;
             d["stores_skipped"] = s.stores_skipped;
             d["num_requests"] = self.num_requests();
             d["num_jobs_in_flight"] = self.num_jobs_in_flight();
             if (self.has_node_pool()) return d;  // the pool's counts: kvoff pool status
             const auto& mgr = self.manager();
             d["num_cpu_blocks"] = mgr.num_blocks();
             d["num_free_blocks"] = mgr.num_free_blocks();
             d["num_stored_blocks"] = mgr.num_stored_blocks();
             d["num_pending_blocks"] = mgr.num_pending_blocks();
             d["num_retired_blocks"] = mgr.num_retired_blocks();
             d["num_evictable_blocks"] = mgr.num_evictable_blocks();
             return d;
           })
      .def("pool_usage",
           [](const OffloadingScheduler& self) {
             // (blocks, pinned by transfers, pending stores), for usage gauges every step
             const auto& mgr = self.manager();
             const std::uint32_t n = mgr.num_blocks();
             return py::make_tuple(n, mgr.num_pinned_blocks(), mgr.num_pending_blocks());
           })
      .def("counters",
           [](const OffloadingScheduler& self) {
             const auto now = counter_values(self.stats());  // the order of COUNTER_NAMES
             py::tuple out(now.size());
             for (std::size_t i = 0; i < now.size(); ++i) out[i] = py::int_(now[i]);
             return out;
           })
      .def(
          "counters_delta",
          counters_delta,
          py::arg("seen"))
      .def("block_state",
           [](const OffloadingScheduler& self, py::handle key) {
             std::array<char, 8> buf{};
             return std::string(
                 kvoff::to_string(self.manager().state(to_key(key.ptr(), "key", -1, buf))));
           },
           py::arg("key"))
      .def("block_id",
           [](const OffloadingScheduler& self, py::handle key) -> py::object {
             std::array<char, 8> buf{};
             const auto id = self.manager().block_id(to_key(key.ptr(), "key", -1, buf));
             return id ? py::object(py::int_(*id)) : py::none();
           },
           py::arg("key"))
      .def("pin_count",
           [](const OffloadingScheduler& self, py::handle key) {
             std::array<char, 8> buf{};
             return self.manager().pin_count(to_key(key.ptr(), "key", -1, buf));
           },
           py::arg("key"))
      .def("next_store_block", &OffloadingScheduler::next_store_block, py::arg("request_id"))
      .def_property_readonly("store_batch_blocks", &OffloadingScheduler::store_batch_blocks)
      .def_property_readonly(
          "offload_prompt_only",
          [](const OffloadingScheduler& self) { return self.config().offload_prompt_only; })
      .def("num_flushes_pending", &OffloadingScheduler::num_flushes_pending);
}

}  // namespace kvoff::bindings
