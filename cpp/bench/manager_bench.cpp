#include "manager_bench.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvoff/block_pool.h"
#include "kvoff/offloading_manager.h"

namespace kvoff {

std::uint64_t bench_mix(std::uint64_t x) noexcept {
  std::uint64_t z = x + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

std::uint64_t bench_random(std::uint64_t seed, std::uint64_t stream, std::uint64_t n) noexcept {
  return bench_mix(seed * 0x9e3779b97f4a7c15ULL + (stream << 56) + n);
}

void bench_key(const ManagerBenchConfig& config, std::uint64_t id, char* out) noexcept {
  const std::size_t hash_bytes = config.key_bytes - 1;
  for (std::size_t w = 0; w * 8 < hash_bytes; ++w) {
    const std::uint64_t word = bench_random(config.seed, 0, id * 8 + w);
    for (std::size_t b = 0; b < 8 && w * 8 + b < hash_bytes; ++b) {
      out[w * 8 + b] = static_cast<char>((word >> (8 * b)) & 0xff);
    }
  }
  out[hash_bytes] = 0;  // group index
}

namespace {

using Clock = std::chrono::steady_clock;

void check_config(const ManagerBenchConfig& c) {
  if (c.num_blocks < 1 || c.num_blocks > kMaxNumBlocks) {
    throw std::invalid_argument("bench: num_blocks must be in [1, 2^31-1], got " +
                                std::to_string(c.num_blocks));
  }
  const auto positive = [](std::size_t v, const char* name) {
    if (v == 0) {
      throw std::invalid_argument(std::string("bench: ") + name + " must be >= 1, got 0");
    }
  };
  if (c.key_bytes < 2) {
    throw std::invalid_argument("bench: key_bytes must be >= 2 (hash bytes + 1 group byte), got " +
                                std::to_string(c.key_bytes));
  }
  positive(c.batch, "batch");
  positive(c.batches_per_round, "batches_per_round");
  positive(c.repeat, "repeat");
}

/// Keys [first, first + count) written contiguously, with views.
struct KeyBlock {
  std::vector<char> bytes;
  std::vector<std::string_view> views;

  void assign(const ManagerBenchConfig& c, const std::uint64_t* ids, std::size_t count) {
    bytes.resize(count * c.key_bytes);
    views.resize(count);
    for (std::size_t i = 0; i < count; ++i) {
      bench_key(c, ids[i], bytes.data() + i * c.key_bytes);
    }
    for (std::size_t i = 0; i < count; ++i) {
      views[i] = std::string_view(bytes.data() + i * c.key_bytes, c.key_bytes);
    }
  }
};

ManagerBenchTiming summarize(std::vector<double> seconds, std::uint64_t keys,
                             std::uint64_t calls) {
  std::sort(seconds.begin(), seconds.end());
  ManagerBenchTiming t;
  t.keys = keys;
  t.calls = calls;
  t.best_seconds = seconds.front();
  t.seconds = seconds[seconds.size() / 2];
  const double s = t.seconds > 0 ? t.seconds : 1e-12;
  t.ns_per_key = keys > 0 ? s * 1e9 / static_cast<double>(keys) : 0.0;
  t.keys_per_s = static_cast<double>(keys) / s;
  t.calls_per_s = static_cast<double>(calls) / s;
  return t;
}

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

ManagerBenchResult run_manager_bench(const ManagerBenchConfig& c) {
  check_config(c);
  ManagerBenchResult result;
  const auto n = static_cast<std::uint64_t>(c.num_blocks);
  const std::size_t batch = c.batch;
  const auto setup_start = Clock::now();
  CPUOffloadingManager manager(c.num_blocks, c.eviction_policy);

  // ---- setup: fill the pool, then shuffle recency.
  std::vector<std::uint64_t> ids(batch);
  KeyBlock call;
  for (std::uint64_t first = 0; first < n; first += batch) {
    const std::size_t count = static_cast<std::size_t>(std::min<std::uint64_t>(batch, n - first));
    for (std::size_t j = 0; j < count; ++j) {
      ids[j] = first + j;
    }
    call.assign(c, ids.data(), count);
    const auto stored = manager.prepare_store(call.views);
    if (!stored || stored->keys_to_store.size() != count) {
      throw std::logic_error("bench: filling the pool failed at key " + std::to_string(first));
    }
    manager.complete_store(call.views, true);
  }
  {
    std::vector<std::pair<std::uint64_t, std::uint64_t>> order(n);
    for (std::uint64_t i = 0; i < n; ++i) {
      order[i] = {bench_random(c.seed, 1, i), i};
    }
    std::sort(order.begin(), order.end());
    for (std::uint64_t first = 0; first < n; first += batch) {
      const std::size_t count =
          static_cast<std::size_t>(std::min<std::uint64_t>(batch, n - first));
      for (std::size_t j = 0; j < count; ++j) {
        ids[j] = order[first + j].second;
      }
      call.assign(c, ids.data(), count);
      manager.touch(call.views);
    }
  }
  result.setup_seconds = since(setup_start);

  // ---- lookup: the same calls every round, keys copied per call into one buffer.
  const std::size_t calls = c.batches_per_round;
  std::vector<std::uint64_t> lookup_ids(calls * batch);
  for (std::size_t b = 0; b < calls; ++b) {
    for (std::size_t j = 0; j < batch; ++j) {
      lookup_ids[b * batch + j] = bench_random(c.seed, 2, b * batch + j) % n;
    }
    const std::uint64_t m = bench_random(c.seed, 3, b);
    if (m % 8 == 0) {
      lookup_ids[b * batch + (m >> 3) % batch] = kBenchMissingIdBase + b;
    }
  }
  KeyBlock lookups;
  lookups.assign(c, lookup_ids.data(), lookup_ids.size());
  std::vector<double> rounds;
  std::uint64_t examined = 0;
  for (std::size_t r = 0; r < c.repeat; ++r) {
    std::uint64_t hits = 0;
    std::uint64_t keys = 0;
    const auto start = Clock::now();
    for (std::size_t b = 0; b < calls; ++b) {
      const auto found = manager.lookup(KeySpan(lookups.views.data() + b * batch, batch));
      const std::uint64_t h = found ? *found : 0;
      hits += h;
      keys += h < batch ? h + 1 : h;
    }
    rounds.push_back(since(start));
    result.lookup_hits = hits;
    examined = keys;
  }
  result.lookup = summarize(rounds, examined, calls);

  // ---- stores: new keys into the full pool, each call evicting `batch` blocks.
  KeyBlock stores;
  std::vector<std::uint64_t> store_ids(calls * batch);
  std::vector<double> prepare_rounds;
  std::vector<double> complete_rounds;
  std::uint64_t next_id = n;
  for (std::size_t r = 0; r < c.repeat; ++r) {
    for (std::size_t i = 0; i < store_ids.size(); ++i) {
      store_ids[i] = next_id + i;
    }
    next_id += store_ids.size();
    stores.assign(c, store_ids.data(), store_ids.size());
    double prepare_s = 0.0;
    double complete_s = 0.0;
    std::uint64_t evicted = 0;
    for (std::size_t b = 0; b < calls; ++b) {
      const KeySpan keys(stores.views.data() + b * batch, batch);
      const auto t0 = Clock::now();
      {
        const auto stored = manager.prepare_store(keys);  // destroyed inside the timing
        if (!stored) {
          throw std::logic_error("bench: prepare_store refused a store into a full pool");
        }
        evicted += stored->evicted_keys.size();
      }
      const auto t1 = Clock::now();
      manager.complete_store(keys, true);
      const auto t2 = Clock::now();
      prepare_s += std::chrono::duration<double>(t1 - t0).count();
      complete_s += std::chrono::duration<double>(t2 - t1).count();
    }
    prepare_rounds.push_back(prepare_s);
    complete_rounds.push_back(complete_s);
    if (r == 0) {
      result.evicted = evicted;
    }
  }
  result.prepare_store = summarize(prepare_rounds, calls * batch, calls);
  result.complete_store = summarize(complete_rounds, calls * batch, calls);
  return result;
}

}  // namespace kvoff
