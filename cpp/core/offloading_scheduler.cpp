// OffloadingScheduler (kvoff/offloading_scheduler.h), its requests and loads: the
// configuration, requests and their block hashes, lookups (get_num_new_matched_tokens), jobs,
// and the loads of update_state_after_alloc. The step (stores and build_connector_meta) is in
// offloading_scheduler_step.cpp; job completion and the end of requests in
// offloading_scheduler_completion.cpp.
#include "kvoff/offloading_scheduler.h"

#include <algorithm>
#include <tuple>
#include <limits>
#include <stdexcept>
#include <utility>

#include "kvoff/key.h"
#include "offloading_scheduler_internal.h"

namespace kvoff {

using namespace scheduler_detail;

namespace {

constexpr std::size_t kMaxGroups = 256;  // the group index is one byte of the offload key
constexpr std::int64_t kMaxGpuBlocks = std::int64_t{1} << 31;
// Tokens of one offloaded block (gpu_block_size × block_size_factor): engines use 16 to a few
// thousand; the bound keeps every product of a block count and a block size inside int64.
constexpr std::int64_t kMaxOffloadedBlockTokens = std::int64_t{1} << 31;

SchedulerConfig validated(SchedulerConfig c) {
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument("OffloadingScheduler: " + msg);
  };
  need(c.gpu_block_size >= 1,
       "gpu_block_size must be >= 1 token, got " + std::to_string(c.gpu_block_size));
  need(c.block_size_factor >= 1 && c.block_size_factor <= (1 << 20),
       "block_size_factor must be in [1, 2^20], got " + std::to_string(c.block_size_factor));
  // Both are at least 1 here, so the quotient bounds the product without computing it (which
  // could overflow: a wrapped product of 0 made every lookup divide by zero).
  need(c.gpu_block_size <= kMaxOffloadedBlockTokens / c.block_size_factor,
       "an offloaded block of gpu_block_size (" + std::to_string(c.gpu_block_size) +
           ") x block_size_factor (" + std::to_string(c.block_size_factor) +
           ") tokens is more than 2^31 tokens; check the engine's block size");
  if (c.hash_block_size == 0) c.hash_block_size = c.gpu_block_size;
  need(c.hash_block_size >= 1 && c.gpu_block_size % c.hash_block_size == 0,
       "gpu_block_size (" + std::to_string(c.gpu_block_size) +
           ") must be a multiple of hash_block_size (" + std::to_string(c.hash_block_size) +
           "); use a hash block size that divides the block size");
  need(c.world_size >= 1, "world_size must be >= 1, got " + std::to_string(c.world_size));
  need(c.num_gpu_blocks >= 1 && c.num_gpu_blocks <= kMaxGpuBlocks,
       "num_gpu_blocks must be in [1, 2^31], got " + std::to_string(c.num_gpu_blocks) +
           "; pass KVCacheConfig.num_blocks");
  need(!c.groups.empty() && c.groups.size() <= kMaxGroups,
       "there must be 1 to 256 KV cache groups, got " + std::to_string(c.groups.size()));
  for (std::size_t g = 0; g < c.groups.size(); ++g) {
    const auto& grp = c.groups[g];
    need(grp.kind == GroupKind::kFullAttention || grp.kind == GroupKind::kSlidingWindow ||
             grp.kind == GroupKind::kMamba,
         "group " + std::to_string(g) + " has an unknown kind");
    if (grp.kind == GroupKind::kSlidingWindow) {
      need(grp.sliding_window >= 1, "group " + std::to_string(g) +
                                        " is a sliding-window group with sliding_window " +
                                        std::to_string(grp.sliding_window) + "; it must be >= 1");
    }
  }
  need(c.store_batch_blocks >= 1 && c.store_batch_blocks <= (1 << 20),
       "store_batch_blocks must be in [1, 2^20] offloaded blocks, got " +
           std::to_string(c.store_batch_blocks) + " (1 stores every block as it fills)");
  need(c.store_threshold >= 0 && c.store_threshold <= CPUOffloadingManager::kMaxStoreThreshold,
       "store_threshold must be in [0, 2^20] offers, got " + std::to_string(c.store_threshold) +
           " (0 or 1: store every block; n >= 2: store a block once it was offered n times)");
  need(c.max_tracker_size >= (c.store_threshold >= 2 ? 1 : 0) &&
           c.max_tracker_size <= kMaxNumBlocks,
       "max_tracker_size must be in [1, 2^31-1] keys, got " +
           std::to_string(c.max_tracker_size) + " (default " +
           std::to_string(CPUOffloadingManager::kDefaultMaxTrackerSize) + ")");
  return c;
}

}  // namespace

OffloadingScheduler::OffloadingScheduler(SchedulerConfig config,
                                         std::shared_ptr<BlockManager> node_pool)
    : config_(validated(std::move(config))),
      offloaded_block_size_(config_.gpu_block_size * config_.block_size_factor),
      hashes_per_block_(offloaded_block_size_ / config_.hash_block_size),
      any_partial_group_(std::any_of(config_.groups.begin(), config_.groups.end(),
                                     [](const SchedulerGroup& g) {
                                       return g.kind != GroupKind::kFullAttention;
                                     })),
      store_batch_(any_partial_group_ ? 1 : config_.store_batch_blocks),
      manager_(node_pool ? nullptr
                         : std::make_unique<CPUOffloadingManager>(
                               config_.num_cpu_blocks, config_.eviction_policy,
                               config_.enable_events, config_.store_threshold,
                               config_.max_tracker_size)),
      node_pool_(std::move(node_pool)),
      pool_(node_pool_ ? node_pool_.get() : manager_.get()),
      alloc_step_(static_cast<std::size_t>(config_.num_gpu_blocks), 0),
      store_fence_(static_cast<std::size_t>(config_.num_gpu_blocks), 0),
      load_fence_(static_cast<std::size_t>(config_.num_gpu_blocks), 0) {
  jobs_.reserve(1024);  // jobs in flight: rehashing while a step adds jobs costs more than this
  spare_requests_.reserve(kMaxSpareRequests);
}

OffloadingScheduler::~OffloadingScheduler() = default;

const CPUOffloadingManager& OffloadingScheduler::local_manager() const {
  if (!manager_) {
    throw std::logic_error(
        "this scheduler's CPU pool is a node pool: its manager lives in the pool's process "
        "(kvoff pool status reports its blocks)");
  }
  return *manager_;
}

// ------------------------------------------------------------------------------ helpers

std::uint64_t OffloadingScheduler::id_hash_of(std::string_view id) noexcept {
  const std::uint64_t h = std::hash<std::string_view>{}(id);
  return h == 0 ? 1 : h;
}

void OffloadingScheduler::throw_reentry(const char* hook) {
  throw std::logic_error(
      std::string(hook) +
      ": called from inside this scheduler's own build_connector_meta, while it reads block "
      "hashes from the engine (a request's block_hashes ran code that calls its scheduler "
      "back, or another thread called it meanwhile: a scheduler serves one thread); make the "
      "call after build_connector_meta returns. Nothing was changed");
}

void OffloadingScheduler::set_idle(Request& r, bool idle, std::int64_t wake_tokens) {
  if (idle) {
    IdleEntry entry{0, wake_tokens, r.tokens_seen};
    if (r.idle) {
      if (IdleEntry* e = idle_.find(r.id_hash, kAnyEntry)) {
        entry.stamp = e->stamp;  // the step's duplicate check still sees it
        *e = entry;
      }
      return;
    }
    idle_.insert(r.id_hash, entry);
  } else {
    if (!r.idle) return;
    if (const IdleEntry* e = idle_.find(r.id_hash, kAnyEntry)) {
      r.tokens_seen = std::max(r.tokens_seen, e->tokens);  // steps it was skipped in
    }
    idle_.erase(r.id_hash, kAnyEntry);
  }
  r.idle = idle;
}

void OffloadingScheduler::settle_without_load(Request& r) {
  r.match.reset();
  r.gpu_hit_tokens = r.last_computed_tokens;  // its first step's table starts with these
  set_idle(r, false);
}

void OffloadingScheduler::set_idle_after_stores(Request& r, std::int64_t tokens_after) {
  // Idle from now on when every offloaded block full after this step is stored (or held) and
  // no load of it is pending: until its next block completes, a step changes nothing.
  // With store batching, fewer than store_batch_ waiting blocks also leave it idle: a step
  // that completes no block cannot start a store (one that does is never skipped as idle).
  // It wakes when the step's tokens fill its next batch (next_store + store_batch_ blocks).
  // With a store limit (offload_prompt_only) the batch that wakes it ends at the limit's last
  // block, and a request that stored every block below the limit never wakes (decode).
  const std::int64_t target = std::min(r.next_store + store_batch_, storable_blocks(r));
  const bool quiet = r.scheduled_before && r.loads_in_flight == 0 && r.unemitted_loads.empty();
  if (target <= r.next_store) {
    set_idle(r, quiet, kAllTokens);
    return;
  }
  set_idle(r, quiet && target > tokens_after / offloaded_block_size_,
           target * offloaded_block_size_);
}

OffloadingScheduler::Request* OffloadingScheduler::find(std::string_view request_id) noexcept {
  Request** r = request_index_.find(id_hash_of(request_id),
                                    [request_id](const Request* x) { return x->id == request_id; });
  return r == nullptr ? nullptr : *r;
}

const OffloadingScheduler::Request* OffloadingScheduler::find(
    std::string_view request_id) const noexcept {
  Request* const* r = request_index_.find(
      id_hash_of(request_id), [request_id](const Request* x) { return x->id == request_id; });
  return r == nullptr ? nullptr : *r;
}

std::size_t OffloadingScheduler::num_hashes(std::string_view request_id) const noexcept {
  const Request* r = find(request_id);
  return r == nullptr ? 0 : r->hashes.size();
}

OffloadingScheduler::Request& OffloadingScheduler::get(std::string_view request_id,
                                                       const char* hook) {
  return get(request_id, id_hash_of(request_id), hook);
}

OffloadingScheduler::Request& OffloadingScheduler::get(std::string_view request_id,
                                                       std::uint64_t hash, const char* hook) {
  Request** found =
      request_index_.find(hash, [request_id](const Request* x) { return x->id == request_id; });
  Request* r = found == nullptr ? nullptr : *found;
  if (r == nullptr) {
    throw std::invalid_argument(hook_error(
        hook, request_id,
        "unknown request; pass the request (its block hashes and token count) first"));
  }
  if (r->finished) {
    throw std::invalid_argument(hook_error(
        hook, request_id, "the request was finished; a new request needs a new id"));
  }
  return *r;
}

std::int64_t OffloadingScheduler::needed_tokens(std::size_t g) const noexcept {
  const auto& grp = config_.groups[g];
  switch (grp.kind) {
    case GroupKind::kFullAttention:
      return kAllTokens;
    case GroupKind::kSlidingWindow:
      return grp.sliding_window - 1;
    case GroupKind::kMamba:
      return 1;
  }
  return kAllTokens;
}

std::int64_t OffloadingScheduler::first_needed_sub_block(std::size_t g) const noexcept {
  const std::int64_t needed = needed_tokens(g);
  if (needed >= offloaded_block_size_) return 0;
  return (offloaded_block_size_ - needed) / config_.gpu_block_size;
}

std::string_view OffloadingScheduler::block_hash(const Request& r, std::int64_t j) const {
  return r.hashes[static_cast<std::size_t>((j + 1) * hashes_per_block_ - 1)];
}

void OffloadingScheduler::append_key(KeyList& out, const Request& r, std::int64_t j,
                                     std::size_t g) const {
  const char group = static_cast<char>(static_cast<unsigned char>(g));
  out.push_back(block_hash(r, j), std::string_view(&group, 1));
}

std::string_view OffloadingScheduler::key_in(std::string& buf, const Request& r,
                                             std::int64_t j, std::size_t g) const {
  buf.assign(block_hash(r, j));
  buf.push_back(static_cast<char>(static_cast<unsigned char>(g)));
  return buf;
}

std::int64_t OffloadingScheduler::known_blocks(const Request& r,
                                               std::int64_t tokens) const noexcept {
  const std::int64_t hashed =
      static_cast<std::int64_t>(r.hashes.size()) * config_.hash_block_size;
  return std::max<std::int64_t>(0, std::min(tokens, hashed)) / offloaded_block_size_;
}

void OffloadingScheduler::validate_block_ids(std::span<const std::vector<std::int64_t>> ids,
                                             const char* what,
                                             std::string_view request_id) const {
  if (ids.size() != config_.groups.size()) {
    throw std::invalid_argument(hook_error(
        what, request_id,
        "got block ids for " + std::to_string(ids.size()) + " KV cache groups, the model has " +
            std::to_string(config_.groups.size()) + "; give one list per group (may be empty)"));
  }
  for (std::size_t g = 0; g < ids.size(); ++g) {
    for (std::size_t i = 0; i < ids[g].size(); ++i) {
      const std::int64_t id = ids[g][i];
      if (id < 0 || id >= config_.num_gpu_blocks) {
        throw std::invalid_argument(hook_error(
            what, request_id,
            "block id " + std::to_string(id) + " (group " + std::to_string(g) + ", index " +
                std::to_string(i) + ") is outside [0, num_gpu_blocks=" +
                std::to_string(config_.num_gpu_blocks) + ")"));
      }
    }
  }
}

std::int64_t OffloadingScheduler::next_store_block(std::string_view request_id) const {
  const Request* r = find(request_id);
  return r == nullptr ? -1 : r->next_store;
}

// ------------------------------------------------------------------------------- requests

void OffloadingScheduler::check_hashes(const Request* r, std::string_view request_id,
                                       std::size_t start,
                                       std::span<const std::string_view> new_hashes,
                                       std::int64_t num_tokens, const char* hook) const {
  if (r != nullptr && r->finished) {
    throw std::invalid_argument(hook_error(
        hook, request_id, "the request was finished; a new request needs a new id"));
  }
  const std::size_t known = r == nullptr ? 0 : r->hashes.size();
  if (start > known) {
    throw std::invalid_argument(hook_error(
        hook, request_id,
        "block hashes start at index " + std::to_string(start) + " but only " +
            std::to_string(known) + " are known; pass the hashes from index " +
            std::to_string(known)));
  }
  for (std::size_t i = 0; i < new_hashes.size(); ++i) {
    if (new_hashes[i].empty()) {
      throw std::invalid_argument(hook_error(
          hook, request_id,
          "block hash " + std::to_string(start + i) + " is empty; hashes are bytes or ints"));
    }
  }
  const std::size_t total = std::max(known, start + new_hashes.size());
  if (num_tokens < 0 ||
      static_cast<std::int64_t>(total) * config_.hash_block_size > num_tokens) {
    throw std::invalid_argument(hook_error(
        hook, request_id,
        "num_tokens " + std::to_string(num_tokens) + " is negative or smaller than the " +
            std::to_string(total) + " block hashes cover (" +
            std::to_string(static_cast<std::int64_t>(total) * config_.hash_block_size) +
            " tokens at hash_block_size " + std::to_string(config_.hash_block_size) + ")"));
  }
}

void OffloadingScheduler::append_hashes(Request& r, std::size_t start,
                                        std::span<const std::string_view> new_hashes,
                                        std::int64_t num_tokens) {
  const std::size_t known = r.hashes.size();
  if (const std::size_t end = start + new_hashes.size(); end > known + 8) {
    // a prompt's hashes at once: one allocation (decode adds one at a time: geometric growth)
    r.hashes.reserve_more(end - known, (end - known) * new_hashes.back().size());
  }
  for (std::size_t i = known - start; i < new_hashes.size(); ++i) {
    r.hashes.push_back(new_hashes[i]);
  }
  r.num_tokens = num_tokens;
}

void OffloadingScheduler::update_request(std::string_view request_id, std::size_t start,
                                         std::span<const std::string_view> new_hashes,
                                         std::int64_t num_tokens) {
  refuse_reentry("update_request");
  Request* r = find(request_id);
  check_hashes(r, request_id, start, new_hashes, num_tokens, "update_request");
  if (r == nullptr) {
    const std::uint64_t h = id_hash_of(request_id);
    request_index_.reserve_one();  // first: a bad_alloc here changes nothing
    r = &new_request(request_id, h);
    request_index_.insert(h, r);
  }
  append_hashes(*r, start, new_hashes, num_tokens);
}

void OffloadingScheduler::add_hashes(std::string_view request_id, std::size_t start,
                                     std::span<const std::string_view> new_hashes) {
  constexpr const char* kHook = "add_hashes";
  refuse_reentry(kHook);
  Request& r = get(request_id, kHook);
  const std::size_t total = std::max(r.hashes.size(), start + new_hashes.size());
  const std::int64_t covered = static_cast<std::int64_t>(total) * config_.hash_block_size;
  const std::int64_t num_tokens = std::max(r.num_tokens, covered);
  check_hashes(&r, request_id, start, new_hashes, num_tokens, kHook);
  append_hashes(r, start, new_hashes, num_tokens);
}

void OffloadingScheduler::set_prompt_tokens(std::string_view request_id,
                                            std::int64_t prompt_tokens) {
  constexpr const char* kHook = "set_prompt_tokens";
  refuse_reentry(kHook);
  Request& r = get(request_id, kHook);
  if (r.finished) {
    throw std::invalid_argument(hook_error(
        kHook, request_id, "the request was finished; a new request needs a new id"));
  }
  if (prompt_tokens < 0 || prompt_tokens > kMaxTokenCount) {
    throw std::invalid_argument(hook_error(
        kHook, request_id,
        "prompt_tokens " + std::to_string(prompt_tokens) +
            " must be in [0, 2^61]; pass the request's prompt length in tokens"));
  }
  if (config_.offload_prompt_only) r.store_limit = prompt_tokens;
}

void OffloadingScheduler::HashSink::add(std::span<const std::string_view> new_hashes,
                                        std::int64_t num_tokens) {
  scheduler_.check_hashes(&request_, request_.id, start_, new_hashes, num_tokens,
                          "build_connector_meta (hash source)");
  scheduler_.append_hashes(request_, start_, new_hashes, num_tokens);
}

void OffloadingScheduler::HashSink::add(std::span<const std::string_view> new_hashes) {
  const std::size_t total = std::max(request_.hashes.size(), start_ + new_hashes.size());
  const std::int64_t covered =
      static_cast<std::int64_t>(total) * scheduler_.config_.hash_block_size;
  add(new_hashes, std::max(request_.num_tokens, covered));
}

MatchResult OffloadingScheduler::get_num_new_matched_tokens(std::string_view request_id,
                                                            std::int64_t num_computed_tokens) {
  constexpr const char* kHook = "get_num_new_matched_tokens";
  refuse_reentry(kHook);
  Request& r = get(request_id, kHook);
  const std::int64_t c = num_computed_tokens;
  if (c < 0 || c % config_.gpu_block_size != 0 || c > r.num_tokens) {
    throw std::invalid_argument(hook_error(
        kHook, request_id,
        "num_computed_tokens " + std::to_string(c) +
            " must be a multiple of the block size " + std::to_string(config_.gpu_block_size) +
            " in [0, num_tokens=" + std::to_string(r.num_tokens) + "]"));
  }
  ++stats_.lookups;
  r.match.reset();
  r.last_computed_tokens = c;
  r.reuse_end = std::max(r.reuse_end, c / offloaded_block_size_);  // the engine's own hit
  // A no-hit answer settles the request as update_state_after_alloc(.., 0) does (the same
  // function), so that an engine may skip that call (see the header).
  const auto no_hit = [&]() -> MatchResult {
    settle_without_load(r);
    return {0, false};
  };
  if (r.loads_in_flight > 0 || !r.unemitted_loads.empty()) return no_hit();
  // Invariant 7: no load while the request's own stores are in flight (e.g. it was preempted
  // mid-store and resumes): retry once they complete.
  if (r.stores_in_flight > 0) {
    ++stats_.lookup_retries;
    return {std::nullopt, false};
  }

  // With a sliding-window or Mamba group the last prompt token is always recomputed, so the
  // cached window/state ends exactly where the engine resumes.
  const std::int64_t limit = r.num_tokens - (any_partial_group_ ? 1 : 0);
  const std::int64_t n_max = known_blocks(r, limit);
  const std::int64_t c0 = c / offloaded_block_size_;
  if (n_max <= c0) return no_hit();

  const std::size_t num_groups = config_.groups.size();
  const auto width = static_cast<std::size_t>(n_max - c0);
  // status[g][j - c0]: -1 unknown, 0 missing, 1 ready, 2 busy (pending, or loading elsewhere).
  // A load pin is a load in flight (a block being written through to a secondary tier is
  // pinned too, but can be loaded meanwhile: state_and_load_pins leaves that pin out).
  const auto status_code = [](BlockState st, std::uint32_t load_pins) -> std::int8_t {
    if (st == BlockState::kMissing) return 0;
    return st == BlockState::kPending || load_pins > 0 ? 2 : 1;
  };
  std::vector<std::vector<std::int8_t>> status(num_groups, std::vector<std::int8_t>(width, -1));
  std::string buf;
  auto status_of = [&](std::size_t g, std::int64_t j) -> std::int8_t {
    std::int8_t& s = status[g][static_cast<std::size_t>(j - c0)];
    if (s < 0) {
      const std::string_view key = key_in(buf, r, j, g);
      const auto [st, pins] = pool_->state_and_load_pins(key);
      s = status_code(st, pins);
    }
    return s;
  };
  // First offloaded block group g needs for a prefix of n offloaded blocks.
  auto first_needed = [&](std::size_t g, std::int64_t n) {
    const std::int64_t needed = needed_tokens(g);
    const std::int64_t end_tok = n * offloaded_block_size_;
    const std::int64_t first_tok = needed >= end_tok ? 0 : end_tok - needed;
    return std::max(c0, first_tok / offloaded_block_size_);
  };

  // Full-attention groups: the longest prefix of present blocks bounds the hit. Their keys are
  // looked up a chunk at a time in one pipelined manager call (states_until_missing), so the
  // index's cache misses overlap instead of queueing one per block; a chunk bounds the keys
  // made (and hashed) past the first missing block. Chunks grow from kFirstLookupChunk by 4x
  // up to kLookupChunk: a miss at the first block (a new prompt, the usual lookup) makes and
  // hashes 4 keys instead of the whole prompt's, and a long hit still goes in long chunks.
  constexpr std::int64_t kFirstLookupChunk = 4;
  constexpr std::int64_t kLookupChunk = 128;
  std::int64_t n = n_max;
  for (std::size_t g = 0; g < num_groups; ++g) {
    if (config_.groups[g].kind != GroupKind::kFullAttention) continue;
    std::int64_t j = c0;
    std::int64_t chunk = kFirstLookupChunk;
    while (j < n) {
      const std::int64_t end = std::min(n, j + chunk);
      chunk = std::min(kLookupChunk, 4 * chunk);
      KeyList& keys = lookup_keys_;  // scratch: memory reused from call to call
      keys.clear();
      for (std::int64_t k = j; k < end; ++k) append_key(keys, r, k, g);
      lookup_key_views_.assign(keys.begin(), keys.end());
      lookup_states_.resize(lookup_key_views_.size());
      const std::size_t held =
          pool_->states_until_missing(lookup_key_views_, lookup_states_.data());
      const std::size_t seen = std::min(held + 1, lookup_key_views_.size());
      for (std::size_t i = 0; i < seen; ++i) {
        const auto [st, pins] = lookup_states_[i];
        status[g][static_cast<std::size_t>(j - c0) + i] = status_code(st, pins);
      }
      j += static_cast<std::int64_t>(held);
      if (held < lookup_key_views_.size()) break;  // block j is missing
    }
    n = j;
  }
  // Other groups: the window before n must be present; a missing block at j forces n <= j.
  bool changed = true;
  while (n > c0 && changed) {
    changed = false;
    for (std::size_t g = 0; g < num_groups && !changed; ++g) {
      if (config_.groups[g].kind == GroupKind::kFullAttention) continue;
      for (std::int64_t j = n - 1; j >= first_needed(g, n); --j) {
        if (status_of(g, j) == 0) {
          n = j;
          changed = true;
          break;
        }
      }
    }
  }
  if (n <= c0) return no_hit();
  for (std::size_t g = 0; g < num_groups; ++g) {
    for (std::int64_t j = first_needed(g, n); j < n; ++j) {
      if (status_of(g, j) == 2) {
        ++stats_.lookup_retries;
        return {std::nullopt, false};
      }
    }
  }
  r.match = Match{c, n};
  return {n * offloaded_block_size_ - c, true};
}

// ---------------------------------------------------------------------------------- jobs

void OffloadingScheduler::emit_load_jobs(Request& r, const std::vector<Segment>& segments) {
  // Job i takes the i-th segment of every group, so each group is one contiguous run per job.
  // Segments come group by group, in logical order within a group.
  const std::size_t num_groups = config_.groups.size();
  auto& first_of = load_group_first_;  // per group: its first segment (segments.size(): none)
  auto& count_of = load_group_count_;  // per group: its segments
  first_of.assign(num_groups, segments.size());
  count_of.assign(num_groups, 0);
  std::size_t num_jobs = 0;
  for (std::size_t k = 0; k < segments.size(); ++k) {
    const std::size_t g = segments[k].group;
    if (count_of[g]++ == 0) first_of[g] = k;
    num_jobs = std::max(num_jobs, count_of[g]);
  }
  const std::size_t key_bytes = segments.front().keys[0].size();
  for (std::size_t i = 0; i < num_jobs; ++i) {
    std::size_t num_gpu = 0;
    std::size_t num_cpu = 0;
    for (std::size_t g = 0; g < num_groups; ++g) {
      if (i >= count_of[g]) continue;
      num_gpu += segments[first_of[g] + i].gpu_ids.size();
      num_cpu += segments[first_of[g] + i].keys.size();
    }
    TransferJob& job = new_job(r, /*is_store=*/false, num_gpu, num_cpu, key_bytes).job;
    for (std::size_t g = 0; g < num_groups; ++g) {
      if (i >= count_of[g]) continue;
      const Segment& seg = segments[first_of[g] + i];
      job.group_sizes[g] = static_cast<std::int64_t>(seg.gpu_ids.size());
      job.block_indices[g] = seg.first_logical;
      job.gpu_block_ids.insert(job.gpu_block_ids.end(), seg.gpu_ids.begin(), seg.gpu_ids.end());
      job.cpu_block_ids.insert(job.cpu_block_ids.end(), seg.cpu_ids.begin(), seg.cpu_ids.end());
      for (const std::string_view key : seg.keys) job.keys.push_back(key);
    }
    r.unemitted_loads.push_back(job.job_id);
    pending_loads_.push_back(job.job_id);
  }
}

OffloadingScheduler::Job& OffloadingScheduler::new_job() {
  const JobId id = next_job_id_++;
  if (spare_jobs_.empty()) {
    Job& j = jobs_[id];
    j.job.job_id = id;
    return j;
  }
  auto node = std::move(spare_jobs_.back());
  spare_jobs_.pop_back();
  node.key() = id;
  Job& j = node.mapped();
  TransferJob& t = j.job;  // emptied, memory kept
  t.job_id = id;
  t.request_id.clear();
  t.is_store = false;
  t.gpu_block_ids.clear();
  t.group_sizes.clear();
  t.block_indices.clear();
  t.cpu_block_ids.clear();
  t.keys.clear();
  j.request = nullptr;
  j.reports = 0;
  j.new_reports = 0;
  j.failed = false;
  j.emitted = false;
  j.stale = false;
  return jobs_.insert(std::move(node)).position->second;
}

OffloadingScheduler::Job& OffloadingScheduler::new_job(Request& r, bool is_store,
                                                       std::size_t num_gpu, std::size_t num_cpu,
                                                       std::size_t key_bytes) {
  // A recycled record when a finished job left one (its vectors keep their memory), sized
  // once: a job costs a fixed number of allocations, none once warm.
  Job& kept = new_job();
  kept.request = &r;
  TransferJob& job = kept.job;
  job.request_id = r.id;
  job.is_store = is_store;
  const std::size_t num_groups = config_.groups.size();
  job.group_sizes.assign(num_groups, 0);
  job.block_indices.assign(num_groups, 0);
  job.gpu_block_ids.reserve(num_gpu);
  job.cpu_block_ids.reserve(num_cpu);
  job.keys.reserve(num_cpu, num_cpu * key_bytes);
  return kept;
}

void OffloadingScheduler::retire_job(JobId id) {
  auto node = jobs_.extract(id);
  if (!node.empty() && spare_jobs_.size() < kMaxSpareJobs &&
      node.mapped().job.gpu_block_ids.capacity() <= kMaxSpareJobBlocks) {
    spare_jobs_.push_back(std::move(node));
  }
}

void OffloadingScheduler::register_fences(const TransferJob& job) {
  auto& fence = job.is_store ? store_fence_ : load_fence_;
  for (const std::int64_t id : job.gpu_block_ids) fence[static_cast<std::size_t>(id)] = job.job_id;
}

void OffloadingScheduler::clear_fences(const TransferJob& job) {
  auto& fence = job.is_store ? store_fence_ : load_fence_;
  for (const std::int64_t id : job.gpu_block_ids) {
    auto& f = fence[static_cast<std::size_t>(id)];
    if (f == job.job_id) f = 0;
  }
}

// ---------------------------------------------------------------------------------- loads

void OffloadingScheduler::update_state_after_alloc(
    std::string_view request_id, std::span<const std::vector<std::int64_t>> block_ids_per_group,
    std::int64_t num_external_tokens) {
  constexpr const char* kHook = "update_state_after_alloc";
  refuse_reentry(kHook);
  Request& r = get(request_id, kHook);
  set_idle(r, false);  // its next step sets its table from the engine's hit (gpu_hit_tokens)
  // Nothing to load: the table is not needed (engines may skip building it).
  if (num_external_tokens != 0 || !block_ids_per_group.empty()) {
    validate_block_ids(block_ids_per_group, kHook, request_id);
  }
  if (num_external_tokens == 0) {
    settle_without_load(r);
    return;
  }
  if (!r.match || num_external_tokens != r.match->end_block * offloaded_block_size_ -
                                            r.match->computed_tokens) {
    const std::string expected =
        r.match ? std::to_string(r.match->end_block * offloaded_block_size_ -
                                 r.match->computed_tokens)
                : std::string("0 (no hit is pending)");
    throw std::invalid_argument(hook_error(
        kHook, request_id,
        "num_external_tokens " + std::to_string(num_external_tokens) +
            " does not match the last get_num_new_matched_tokens answer, " + expected +
            "; pass that value, or 0 to load nothing"));
  }
  const Match m = *r.match;
  const std::int64_t f = config_.block_size_factor;
  const std::int64_t bs = config_.gpu_block_size;
  std::vector<Segment> segments;
  segments.reserve(config_.groups.size());
  const std::size_t key_bytes = r.hashes.empty() ? 0 : r.hashes[0].size() + 1;  // + group byte
  for (std::size_t g = 0; g < config_.groups.size(); ++g) {
    const std::int64_t needed = needed_tokens(g);
    const std::int64_t end_tok = m.end_block * offloaded_block_size_;
    const std::int64_t first_tok =
        std::max(m.computed_tokens, needed >= end_tok ? 0 : end_tok - needed);
    const std::int64_t first = first_tok / bs;
    const std::int64_t last = m.end_block * f;  // exclusive
    const auto& ids = block_ids_per_group[g];
    if (static_cast<std::int64_t>(ids.size()) < last && first < last) {
      throw std::invalid_argument(hook_error(
          kHook, request_id,
          "group " + std::to_string(g) + " has " + std::to_string(ids.size()) +
              " block ids but the load needs positions up to " + std::to_string(last - 1) +
              "; pass the request's whole block table per group"));
    }
    Segment* cur = nullptr;
    for (std::int64_t l = first; l < last; ++l) {
      const std::int64_t id = ids[static_cast<std::size_t>(l)];
      if (id == 0) {  // null block: not kept by this layer type, never loaded
        cur = nullptr;
        continue;
      }
      if (cur == nullptr) {
        segments.push_back(Segment{g, l, {}, {}, {}});
        cur = &segments.back();
        // sized for the rest of the group's range (a null block may end it earlier)
        const auto rest = static_cast<std::size_t>(last - l);
        const std::size_t blocks = rest / static_cast<std::size_t>(f) + 2;
        cur->gpu_ids.reserve(rest);
        cur->keys.reserve(blocks, blocks * key_bytes);
      }
      const std::int64_t j = l / f;
      if (cur->gpu_ids.empty() || (l - 1) / f != j) append_key(cur->keys, r, j, g);
      cur->gpu_ids.push_back(id);
    }
  }
  if (segments.empty()) {  // every needed block is null: nothing to load
    r.match.reset();
    r.gpu_hit_tokens = r.last_computed_tokens;
    return;
  }
  std::vector<std::string_view> keys;
  for (const auto& s : segments) keys.insert(keys.end(), s.keys.begin(), s.keys.end());
  // The keys' CPU blocks, in the keys' order (throws, changing nothing, if a key is not ready).
  // The jobs take them by block id: no key is hashed or looked up again. Their recency comes
  // when the request finishes (touch_at_finish).
  const std::vector<std::uint32_t> slots = pool_->prepare_load(keys);
  // -- no exception below this line except std::bad_alloc --
  std::size_t at = 0;
  for (auto& seg : segments) {
    seg.cpu_ids.assign(slots.begin() + static_cast<std::ptrdiff_t>(at),
                       slots.begin() + static_cast<std::ptrdiff_t>(at + seg.keys.size()));
    at += seg.keys.size();
  }
  emit_load_jobs(r, segments);
  stats_.hit_tokens += static_cast<std::uint64_t>(num_external_tokens);
  r.next_store = std::max(r.next_store, m.end_block);
  r.reuse_end = std::max(r.reuse_end, m.end_block);
  r.gpu_hit_tokens = m.computed_tokens;
  r.match.reset();
}

void OffloadingScheduler::cancel_unemitted_loads(Request& r) {
  for (const JobId id : r.unemitted_loads) {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) continue;
    pool_->complete_load_blocks(it->second.job.cpu_block_ids);  // unpins what it pinned
    jobs_.erase(it);
    std::erase(pending_loads_, id);
  }
  r.unemitted_loads.clear();
}

}  // namespace kvoff
