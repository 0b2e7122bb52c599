// kvoff._bench: benchmark drivers of the C++ core for `kvoff bench scheduler` and `kvoff bench
// policies` (kvoff/tools/bench.py, kvoff/tools/bench_policies.py). A module of its own, beside
// kvoff._scheduler, so that benchmark code stays out of the production library (kvoff_core)
// and module. Private (underscore): not a stable API.
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "manager_bench.h"

namespace py = pybind11;

PYBIND11_MODULE(_bench, m) {
  py::options options;
  options.disable_function_signatures();  // signatures are written in the docstrings
  m.doc() = "Benchmark drivers of kvoff's C++ core (private: not a stable API).";

  // `kvoff bench scheduler`: the manager's in-core path, timed in C++ with keys generated in
  // C++ (manager_bench.h).
  m.def(
      "bench_manager",
      [](std::int64_t num_blocks, const std::string& eviction_policy, std::size_t key_bytes,
         std::size_t batch, std::size_t batches_per_round, std::size_t repeat,
         std::uint64_t seed) {
        kvoff::ManagerBenchConfig config;
        config.num_blocks = num_blocks;
        config.eviction_policy = eviction_policy;
        config.key_bytes = key_bytes;
        config.batch = batch;
        config.batches_per_round = batches_per_round;
        config.repeat = repeat;
        config.seed = seed;
        kvoff::ManagerBenchResult r;
        {
          py::gil_scoped_release release;
          r = kvoff::run_manager_bench(config);
        }
        const auto timing = [](const kvoff::ManagerBenchTiming& t) {
          py::dict d;
          d["keys"] = t.keys;
          d["calls"] = t.calls;
          d["seconds"] = t.seconds;
          d["best_seconds"] = t.best_seconds;
          d["ns_per_key"] = t.ns_per_key;
          d["keys_per_s"] = t.keys_per_s;
          d["calls_per_s"] = t.calls_per_s;
          return d;
        };
        py::dict out;
        out["lookup"] = timing(r.lookup);
        out["prepare_store"] = timing(r.prepare_store);
        out["complete_store"] = timing(r.complete_store);
        out["lookup_hits"] = r.lookup_hits;
        out["evicted"] = r.evicted;
        out["setup_seconds"] = r.setup_seconds;
        return out;
      },
      py::arg("num_blocks"), py::arg("eviction_policy") = "lru", py::arg("key_bytes") = 9,
      py::arg("batch") = 256, py::arg("batches_per_round") = 1024, py::arg("repeat") = 5,
      py::arg("seed") = 0,
      py::doc("bench_manager(num_blocks: int, eviction_policy: str = \"lru\", key_bytes: int = "
              "9, batch: int = 256, batches_per_round: int = 1024, repeat: int = 5, seed: int = "
              "0) -> dict\n\n"
              "Benchmarks CPUOffloadingManager in C++ (keys generated and passed in C++, the GIL "
              "released): fills a pool of num_blocks slots, then times lookup, prepare_store "
              "(with eviction) and complete_store calls of `batch` keys; see "
              "cpp/bench/manager_bench.h for the exact workload. Returns {op: {keys, calls, "
              "seconds (median round), best_seconds, ns_per_key, keys_per_s, calls_per_s}} for "
              "op in lookup, prepare_store, complete_store, plus lookup_hits and evicted "
              "(workload totals of one round) and setup_seconds.\n\n"
              "Raises:\n    ValueError: a parameter out of range or an unknown eviction policy "
              "(naming it)."));
}
