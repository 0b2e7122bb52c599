// A benchmark driver for CPUOffloadingManager on the in-core path: keys generated in C++ and
// passed as views, as the C++ scheduler does (no Python types). `kvoff bench scheduler` runs it
// through kvoff._bench.bench_manager and puts it beside the Python binding and a
// pure-Python baseline that replay exactly the same workload (kvoff/tools/bench.py). Benchmark
// code only: it is built into the module kvoff._bench (cpp/bench/), not into kvoff_core.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvoff {

/// Parameters of one benchmark run on one pool.
struct ManagerBenchConfig {
  /// Pool size in slots (CPU blocks), 1 .. 2^31-1.
  std::int64_t num_blocks = 65536;
  /// A name from eviction_policy_names().
  std::string eviction_policy = "lru";
  /// Key length in bytes: block-hash bytes plus one group-index byte (9: an 8-byte hash; 33: a
  /// 32-byte digest). At least 2.
  std::size_t key_bytes = 9;
  /// Keys per call (a request's prefix of offloaded blocks).
  std::size_t batch = 256;
  /// Calls per timed round, for lookup and for stores.
  std::size_t batches_per_round = 1024;
  /// Timed rounds per operation; the median round is reported (and the best one).
  std::size_t repeat = 5;
  /// Seed of every key and every random choice of the workload.
  std::uint64_t seed = 0;
};

/// Timing of one operation over `repeat` rounds: the median round, and the best.
struct ManagerBenchTiming {
  /// Keys processed per round (lookup: keys examined, up to and including the first miss).
  std::uint64_t keys = 0;
  /// Calls per round.
  std::uint64_t calls = 0;
  /// Wall time of the median round, in seconds.
  double seconds = 0.0;
  /// Wall time of the fastest round, in seconds.
  double best_seconds = 0.0;
  /// Nanoseconds per key in the median round.
  double ns_per_key = 0.0;
  /// Keys per second in the median round.
  double keys_per_s = 0.0;
  /// Calls per second in the median round.
  double calls_per_s = 0.0;
};

/// What run_manager_bench measured, plus workload totals that the Python paths reproduce (to
/// check that they ran the same workload).
struct ManagerBenchResult {
  ManagerBenchTiming lookup;          ///< lookup(batch) on the full pool
  ManagerBenchTiming prepare_store;   ///< prepare_store(batch of new keys), evicting batch keys
  ManagerBenchTiming complete_store;  ///< complete_store(keys_to_store, success)
  /// Sum of lookup() results over one round.
  std::uint64_t lookup_hits = 0;
  /// Keys evicted by the stores of one round (the first one, which is timed like the others).
  std::uint64_t evicted = 0;
  /// Seconds spent building the pool (untimed setup: fill and recency shuffle).
  double setup_seconds = 0.0;
};

/// splitmix64 (add the golden gamma, then its finalizer): the workload's random numbers.
std::uint64_t bench_mix(std::uint64_t x) noexcept;

/// Random number `n` of stream `stream` (< 256) for `seed`, all arithmetic modulo 2^64:
/// bench_mix(seed * 0x9e3779b97f4a7c15 + (stream << 56) + n). Streams: 0 key bytes (n = id * 8
/// + word), 1 recency shuffle (n = id), 2 lookup key ids (n = call * batch + position), 3 lookup
/// misses (n = call). kvoff/bench.py implements the same rule with numpy.
std::uint64_t bench_random(std::uint64_t seed, std::uint64_t stream, std::uint64_t n) noexcept;

/// Key ids of never-stored keys start here (stored ids stay below).
inline constexpr std::uint64_t kBenchMissingIdBase = std::uint64_t{1} << 40;

/// Writes key `id` (config.key_bytes bytes) to `out`: bytes [0, key_bytes-1) are the
/// little-endian words bench_random(seed, 0, id * 8 + w) for w = 0, 1, ..., truncated; the last
/// byte is the group index, 0.
void bench_key(const ManagerBenchConfig& config, std::uint64_t id, char* out) noexcept;

/// Runs the benchmark on one pool:
///  1. setup (untimed): a manager of num_blocks slots; keys 0 .. num_blocks-1 stored in calls
///     of `batch` (prepare_store + complete_store), then touched in a random order (in calls of
///     `batch`) so that recency is uncorrelated with slot order (the order: ids sorted by
///     bench_random(seed, 1, id), ties by id);
///  2. lookup: `repeat` rounds of the same `batches_per_round` calls; call b asks for the keys
///     bench_random(seed, 2, b * batch + j) % num_blocks, j < batch (copied into a per-call
///     buffer, as a scheduler computes them); when m = bench_random(seed, 3, b) is a multiple of
///     8, position (m >> 3) % batch holds the never-stored key kBenchMissingIdBase + b, where
///     the lookup stops;
///  3. stores: `repeat` rounds of `batches_per_round` calls, each storing `batch` new keys
///     (ids num_blocks, num_blocks+1, ...) into the full pool: prepare_store (evicting `batch`
///     least recent blocks) and complete_store(success), timed separately.
/// Throws std::invalid_argument (naming the value) for num_blocks, key_bytes < 2, batch,
/// batches_per_round or repeat of 0, or an unknown eviction policy; std::logic_error when the
/// manager refuses a store (a bug).
ManagerBenchResult run_manager_bench(const ManagerBenchConfig& config);

}  // namespace kvoff
