// The offloading scheduler: per engine step, which blocks of which request are loaded from and
// stored to the CPU pool, for every KV cache group (docs/design.md "One engine step", invariants 1,
// 4, 6, 7 and 8).
//
// The scheduler owns a CPUOffloadingManager and the engine-facing hooks:
//   get_num_new_matched_tokens -> update_state_after_alloc -> build_connector_meta
//   -> (worker runs jobs) -> update_connector_output -> request_finished / take_events.
// It knows nothing of torch or Python: requests are ids, block hashes are byte strings, block
// ids are integers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvoff/flat_hash_table.h"
#include "kvoff/key.h"
#include "kvoff/offloading_manager.h"

namespace kvoff {

/// The attention type of a KV cache group, as far as the scheduler cares: which cached tokens
/// a request needs before position N to compute from N on.
enum class GroupKind : std::uint8_t {
  kFullAttention = 0,  ///< every token before N (also MLA)
  kSlidingWindow = 1,  ///< the last sliding_window - 1 tokens before N
  kMamba = 2,          ///< the state after token N - 1: the block holding token N - 1
};

/// One KV cache group of the engine.
struct SchedulerGroup {
  GroupKind kind = GroupKind::kFullAttention;
  /// Tokens of the attention window (kSlidingWindow only; >= 1).
  std::int64_t sliding_window = 0;
};

/// Everything the scheduler needs to know about the engine and the CPU pool.
struct SchedulerConfig {
  /// CPU pool slots (offloaded blocks), >= 1.
  std::int64_t num_cpu_blocks = 0;
  /// Eviction policy name (see eviction_policy_names()).
  std::string eviction_policy = "lru";
  /// Record BlockStored / BlockRemoved events.
  bool enable_events = false;
  /// Tokens per GPU block (every group), >= 1.
  std::int64_t gpu_block_size = 0;
  /// GPU blocks per offloaded block, >= 1.
  std::int64_t block_size_factor = 1;
  /// Tokens per block hash; gpu_block_size must be a multiple of it. 0 means gpu_block_size.
  std::int64_t hash_block_size = 0;
  /// Tensor-parallel ranks that each report every job, >= 1.
  std::int64_t world_size = 1;
  /// GPU blocks of the engine's cache (block ids in [0, num_gpu_blocks); 0 is the null block).
  std::int64_t num_gpu_blocks = 0;
  /// The KV cache groups, in the engine's group order (>= 1, at most 256).
  std::vector<SchedulerGroup> groups;
  /// Store batching, in offloaded blocks (1 to 2^20): a running request's full offloaded
  /// blocks are stored once at least this many wait (a prefill chunk usually completes that
  /// many at once; decode completes one block every block size tokens), and those still
  /// waiting when it finishes are stored by the next build_connector_meta, unless the engine
  /// reallocated their GPU blocks by then (stale, invariant 4). 1 stores every block in the
  /// step it fills (docs/design.md "One engine step", step 2). Models with a sliding-window or
  /// Mamba group always use 1: their blocks can leave the window, and be freed, while waiting.
  std::int64_t store_batch_blocks = 1;
  /// Store only offloaded blocks that lie wholly inside each request's prompt (vLLM 0.32's
  /// `offload_prompt_only`, the default of its OffloadingConnector): blocks that decode fills
  /// are not stored. Each request's prompt length comes from set_prompt_tokens (a request
  /// whose prompt length was never given is not limited). Once a request's prompt blocks are
  /// all full, those still waiting for a store batch are stored in that step.
  bool offload_prompt_only = false;
  /// Store admission (CPUOffloadingManager's store_threshold, vLLM's): an offloaded block not
  /// held is stored only once build_connector_meta offered it this many times (each request
  /// storing it is one offer; 0 or 1: every block is stored; at most 2^20). A skipped block is
  /// not copied, and the request's store position moves past it as past a held block, so a
  /// later request with the same prefix offers it again.
  std::int64_t store_threshold = 0;
  /// Keys the admission filter tracks at most (1 to 2^31-1; used when store_threshold >= 2).
  std::int64_t max_tracker_size = CPUOffloadingManager::kDefaultMaxTrackerSize;
};

/// Identifier of a job, unique for the scheduler's lifetime (starts at 1).
using JobId = std::uint64_t;

/// One load (CPU -> GPU) or store (GPU -> CPU) job.
///
/// GPU side (docs/design.md "job", invariant 1): gpu_block_ids holds the GPU block ids of all
/// groups concatenated in group order, group_sizes[g] how many belong to group g (0 allowed),
/// block_indices[g] the logical index (position in the request, in GPU blocks) of group g's
/// first block; within a group the logical indices are consecutive. CPU side: cpu_block_ids
/// holds, group by group, the CPU slot of every offloaded block the group's blocks fall in, and
/// keys the offload key of each of those slots (same order; one buffer, see KeyList).
struct TransferJob {
  JobId job_id = 0;
  std::string request_id;
  bool is_store = false;
  std::vector<std::int64_t> gpu_block_ids;
  std::vector<std::int64_t> group_sizes;
  std::vector<std::int64_t> block_indices;
  std::vector<std::uint32_t> cpu_block_ids;
  KeyList keys;
};

/// What a step's scheduling output says about one scheduled request.
struct ScheduledRequest {
  /// The request's id; the caller keeps the bytes alive during the build_connector_meta call.
  std::string_view request_id;
  /// Per group: block ids newly allocated to the request this step, appended to its block
  /// table — or, for a request scheduled for the first time or resumed from preemption, its
  /// whole block table.
  std::vector<std::vector<std::int64_t>> new_block_ids;
  /// Tokens computed before this step (>= 0).
  std::int64_t num_computed_tokens = 0;
  /// Tokens scheduled in this step (>= 0); with async scheduling some may not be known yet.
  std::int64_t num_scheduled_tokens = 0;
  /// The request was preempted earlier and new_block_ids is its new, whole block table.
  bool resumed_from_preemption = false;
  /// new_block_ids is the request's whole block table even if this scheduler has seen the
  /// request before: the engine schedules it as a new request (vLLM's scheduled_new_reqs,
  /// which also carries a streaming-input session resumed under its old id). The table then
  /// replaces the one kept, as for a request scheduled for the first time.
  bool whole_table = false;
};

/// The output of build_connector_meta for the worker(s).
struct ConnectorMeta {
  std::vector<TransferJob> load_jobs;
  std::vector<TransferJob> store_jobs;
  /// In-flight jobs whose GPU blocks are reallocated this step: the worker must wait for them
  /// before the new owners write (fences, invariant 4).
  std::vector<JobId> jobs_to_flush;
};

/// ConnectorMeta without copies: the jobs are the scheduler's own records, valid until the
/// next call that changes the scheduler (the binding packs them for the workers at once).
struct ConnectorMetaView {
  std::vector<const TransferJob*> load_jobs;
  std::vector<const TransferJob*> store_jobs;
  std::vector<JobId> jobs_to_flush;
};

/// One rank's report on one job.
struct JobReport {
  JobId job_id = 0;
  bool success = true;
};

/// What update_connector_output concluded.
struct ConnectorOutput {
  /// Requests whose loads all completed successfully: they may be scheduled now.
  std::vector<std::string> finished_loading;
  /// Requests with a failed load: their loaded tokens must be recomputed.
  std::vector<std::string> failed_loading;
  /// Finished requests whose last in-flight job (load or store) completed: their GPU blocks
  /// may be freed now (exactly the requests for which request_finished returned true).
  std::vector<std::string> finished_storing;
  /// Jobs completed by this call (reported by all ranks), successful or not.
  std::vector<JobId> completed_jobs;
  /// The subset of completed_jobs that failed on at least one rank.
  std::vector<JobId> failed_jobs;
};

/// finish_request's answer: why the engine should keep a finished request's GPU blocks.
struct FinishResult {
  /// Loads or stores of the request are in flight.
  bool jobs_in_flight = false;
  /// Store batching: its blocks that waited for a batch are stored by the next
  /// build_connector_meta.
  bool store_due = false;
};

/// get_num_new_matched_tokens's answer: num_tokens == nullopt means "retry later".
struct MatchResult {
  std::optional<std::int64_t> num_tokens;
  bool load_async = false;
};

/// Counters for operators (monotonic since construction).
struct SchedulerStats {
  std::uint64_t lookups = 0;             ///< get_num_new_matched_tokens calls
  std::uint64_t lookup_retries = 0;      ///< of which answered "retry later"
  std::uint64_t hit_tokens = 0;          ///< tokens promised to loads
  std::uint64_t load_jobs = 0;
  std::uint64_t store_jobs = 0;
  std::uint64_t blocks_loaded = 0;       ///< GPU blocks in load jobs
  std::uint64_t blocks_stored = 0;       ///< GPU blocks in store jobs
  std::uint64_t store_refusals = 0;      ///< prepare_store found no room (retried later)
  std::uint64_t blocks_evicted = 0;      ///< offloaded blocks evicted to make room for stores
  std::uint64_t stale_blocks_skipped = 0;  ///< remembered block ids found reallocated (inv. 4)
  std::uint64_t jobs_flushed = 0;        ///< jobs put in jobs_to_flush
  std::uint64_t failed_jobs = 0;
  std::uint64_t blocks_discarded = 0;    ///< offloaded blocks dropped after a failed load
  std::uint64_t stores_skipped = 0;  ///< offloaded blocks the store_threshold filter skipped
};

/// The per-step offloading scheduler of one engine (docs/design.md "Scheduler hooks").
///
/// Offload keys: offloaded block j of group g has the key block_hashes[(j + 1) * H - 1] + one
/// byte g, H = offloaded block size / hash_block_size (the hash of the last hash block inside
/// it, plus the group index).
///
/// Guarantees:
///  * every GPU side has one group_sizes and one block_indices entry per group and
///    sum(group_sizes) == gpu_block_ids.size(); null blocks (id 0) are never copied; within a
///    group the logical indices of a job are consecutive (a job is split when they would not
///    be) (invariant 1).
///  * a remembered block id at a position not yet stored is used only if the block was not
///    reallocated since the scheduler saw it; an in-flight job whose GPU block is reallocated
///    is put in jobs_to_flush (invariant 4).
///  * a job completes only when world_size ranks reported it; a store is a hit only after all
///    ranks succeeded; a failed store frees its slots; the blocks of a failed load are dropped
///    (unless another load still pins them), so they are never offered again; a request never
///    has a load and a store in flight at once (stores wait for its loads) (invariants 6, 7).
///  * every hook validates its whole input before changing anything and throws
///    std::invalid_argument naming the bad value; the scheduler is then unchanged.
/// Not thread-safe: call it from the engine's scheduler thread.
class OffloadingScheduler {
  struct Request;  // defined in the private section below

 public:
  /// Takes new block hashes of one request for build_connector_meta's hash source.
  class HashSink {
   public:
    /// Appends hashes from the index the source was given (views valid during the call) and
    /// sets the request's token count; throws std::invalid_argument as update_request does.
    void add(std::span<const std::string_view> new_hashes, std::int64_t num_tokens);
    /// add() without a token count: the request keeps its own, raised to what its hashes
    /// then cover (tokens). For sources that read hashes only: a running request's token
    /// count matters only to get_num_new_matched_tokens, and engines pass it there (the
    /// Python binding skips reading vLLM's num_tokens property in the step's hash pulls).
    void add(std::span<const std::string_view> new_hashes);

   private:
    friend class OffloadingScheduler;
    HashSink(OffloadingScheduler& scheduler, OffloadingScheduler::Request& request)
        : scheduler_(scheduler), request_(request), start_(request.hashes.size()) {}
    OffloadingScheduler& scheduler_;
    OffloadingScheduler::Request& request_;
    std::size_t start_;
  };
  /// build_connector_meta's source of missing block hashes: (index of the request in the
  /// step's scheduled list, its id, hashes known, sink).
  using HashSource = std::function<void(std::size_t, std::string_view, std::size_t, HashSink&)>;

  /// Throws std::invalid_argument (naming the value) for a config out of range: sizes < 1,
  /// gpu_block_size not a multiple of hash_block_size, no group or more than 256, a sliding
  /// window < 1, an unknown eviction policy, a store_threshold outside [0, 2^20] or a
  /// max_tracker_size outside [1, 2^31-1] (0 is accepted while store_threshold < 2).
  ///
  /// `node_pool`: the manager of a pool this scheduler shares with other engines (a node
  /// pool's client, which the bindings supply); null: a CPUOffloadingManager of
  /// config.num_cpu_blocks slots of its own. With a node pool, the config's eviction_policy,
  /// enable_events, store_threshold and max_tracker_size are the pool's business (its
  /// events come through take_events all the same), and manager() throws.
  explicit OffloadingScheduler(SchedulerConfig config,
                               std::shared_ptr<BlockManager> node_pool = nullptr);
  ~OffloadingScheduler();
  OffloadingScheduler(const OffloadingScheduler&) = delete;
  OffloadingScheduler& operator=(const OffloadingScheduler&) = delete;

  /// Throws std::logic_error naming `hook` when called from inside this scheduler's own
  /// hash_source (engine code run mid-step, e.g. a Python property): the step holds pointers to
  /// request records that a call from there could erase or hand to another request. Every call
  /// below that changes the scheduler (update_request, get_num_new_matched_tokens,
  /// update_state_after_alloc, build_connector_meta(_view), update_connector_output,
  /// request_finished, take_events, reset_cache) starts with it, so such a call changes nothing;
  /// const calls and calls on other schedulers are allowed. Bindings that do work of their own
  /// before a hook call it first, so that the error names the hook the engine called.
  void refuse_reentry(const char* hook) const {
    if (in_hash_source_) [[unlikely]] {
      throw_reentry(hook);
    }
  }

  /// Adds block hashes to request `request_id` (creating the request on first use) and sets its
  /// token count. `start` is the index of new_hashes[0] in the request's hash list; hashes
  /// already known (index < current count) are ignored. Throws std::invalid_argument when
  /// start is past the known count (a gap), a hash is empty, num_tokens < 0, the request is
  /// finished, or num_tokens is smaller than the hashes cover (hashes * hash_block_size).
  void update_request(std::string_view request_id, std::size_t start,
                      std::span<const std::string_view> new_hashes, std::int64_t num_tokens);

  /// update_request without a token count: the request keeps its own, raised to what its
  /// hashes then cover. For a finishing request's last hashes with store batching (a step
  /// pulls hashes only when a batch is due). Throws std::invalid_argument as update_request,
  /// and for an unknown or finished request.
  void add_hashes(std::string_view request_id, std::size_t start,
                  std::span<const std::string_view> new_hashes);

  /// Tokens of request `request_id`'s prompt (>= 0), for offload_prompt_only: blocks past
  /// its last full prompt block are never stored. Ignored (only checked) without
  /// offload_prompt_only. A streaming-input session whose prompt grew gets its new length.
  /// Throws std::invalid_argument (changing nothing) for an unknown or finished request or a
  /// negative or absurd (> 2^61) count.
  void set_prompt_tokens(std::string_view request_id, std::int64_t prompt_tokens);

  /// How many tokens beyond `num_computed_tokens` (the engine's own GPU prefix hit, a multiple
  /// of gpu_block_size) can be loaded from the CPU pool for a known request; see the class
  /// notes. {nullopt, false}: retry later (a needed block is being stored, or being loaded for
  /// another request); {0, false}: no hit; {n, true}: n tokens, loaded asynchronously.
  /// A {0, false} answer leaves the request as update_state_after_alloc(request_id, {}, 0)
  /// right after it would (the engine's own hit noted, no load pending): an engine may skip
  /// that call, as the Python scheduler does (most new requests load nothing).
  /// Throws std::invalid_argument for an unknown request or a bad num_computed_tokens.
  MatchResult get_num_new_matched_tokens(std::string_view request_id,
                                         std::int64_t num_computed_tokens);

  /// After the engine allocated the request's blocks: builds its load job(s) (emitted by the
  /// next build_connector_meta) for `num_external_tokens`, which must be 0 or the value the
  /// last get_num_new_matched_tokens returned. block_ids_per_group: the request's whole block
  /// table per group (may be empty, no group at all, when num_external_tokens is 0). Pins the
  /// loaded CPU blocks (prepare_load); their recency comes when the request finishes.
  /// Throws std::invalid_argument (changing nothing) for an unknown request, a token count
  /// that does not match, a table too short or with out-of-range ids, a wrong group count.
  void update_state_after_alloc(std::string_view request_id,
                                std::span<const std::vector<std::int64_t>> block_ids_per_group,
                                std::int64_t num_external_tokens);

  /// End of a scheduling step: records new block tables, computes fences, emits pending loads
  /// and builds store jobs for offloaded blocks that became full (at most the tokens whose
  /// hashes are known). Preempted requests lose their block table; finished requests are
  /// released as by request_finished. `rewritten_block_ids`: GPU blocks the engine overwrites
  /// this step outside the scheduled requests' new blocks (copy-on-write destinations, blocks
  /// it zeroes): fenced and marked reallocated like new blocks (invariant 4). Throws
  /// std::invalid_argument (changing nothing) for an unknown or repeated request id, a wrong
  /// group count, out-of-range block ids or negative token counts.
  ///
  /// `hash_source` (optional): called, before anything else changes, for each scheduled
  /// request whose blocks full after this step (num_computed_tokens + num_scheduled_tokens,
  /// rounded down to offloaded blocks) need more block hashes than are known, with the request
  /// id and the number of hashes known; it may pass the hashes from that index on and the
  /// token count to HashSink::add, as update_request would take them. Engines whose requests
  /// grow hashes while they run (vLLM) then hand over hashes once per offloaded block instead
  /// of looking every request up every step. Hashes taken this way stay even if the step is
  /// then refused (the next call would take them anyway); HashSink::add throws as
  /// update_request does.
  ConnectorMeta build_connector_meta(std::span<const ScheduledRequest> scheduled,
                                     std::span<const std::string> finished_request_ids = {},
                                     std::span<const std::string> preempted_request_ids = {},
                                     std::span<const std::int64_t> rewritten_block_ids = {},
                                     const HashSource& hash_source = {});
  /// build_connector_meta without copying the jobs: pointers to the scheduler's records,
  /// valid until the next non-const call. Same arguments, effects and errors.
  ConnectorMetaView build_connector_meta_view(
      std::span<const ScheduledRequest> scheduled,
      std::span<const std::string> finished_request_ids = {},
      std::span<const std::string> preempted_request_ids = {},
      std::span<const std::int64_t> rewritten_block_ids = {}, const HashSource& hash_source = {});

  /// Counts reports from ranks; a job completes when world_size reports arrived. Completed
  /// stores run complete_store (success only if every rank succeeded), loads complete_load.
  /// Throws std::invalid_argument (changing nothing) for a job id that is not in flight or
  /// reported more than world_size times.
  ConnectorOutput update_connector_output(std::span<const JobReport> reports);

  /// The request is finished (or aborted): its offloaded blocks that the pool holds become the
  /// most recent, head first by position across groups (invariant 8; those it loaded or found
  /// in the engine's cache count as a reuse, its own stores are only ordered: the recency
  /// vLLM 0.32's managers apply when a request finishes, which keeps a repeated prefix longer
  /// than recency at load time does), a pending, unemitted load is cancelled (its blocks
  /// unpinned), the request is forgotten once its in-flight jobs complete. With store batching
  /// (store_batch_blocks > 1), its full blocks not stored yet (as far as its hashes are known
  /// and up to the tokens of its last scheduled step) are stored by the next
  /// build_connector_meta. Returns true when jobs of the request are still in flight or such a
  /// store is due: the engine should keep its GPU blocks until the request appears in
  /// ConnectorOutput::finished_storing (if it frees them earlier, the fences flush the jobs, and
  /// a due block the engine reallocated before that step is stale: never copied). Unknown ids
  /// return false.
  bool request_finished(std::string_view request_id);
  /// request_finished, telling its two reasons apart: jobs of the request in flight (fences
  /// protect them if the engine frees the blocks anyway), and a store due at its finish (its
  /// blocks must stay until the next build_connector_meta, or what was reused is not stored).
  FinishResult finish_request(std::string_view request_id);

  /// The manager's events since the last call (BlockStored / BlockRemoved, medium "CPU").
  std::vector<OffloadingEvent> take_events() {
    refuse_reentry("take_events");
    return pool_->take_events();
  }
  /// Empties the CPU pool of every block no job uses (CPUOffloadingManager::clear: ready and
  /// unpinned), e.g. for an engine's cache reset after a weight update; returns how many. The
  /// jobs in flight become stale: they complete as usual for the engine, but a stale store
  /// frees its slots instead of making its blocks hits (their KV was computed before the
  /// reset), and a stale load's blocks are discarded once it has read them. A block pinned by a
  /// load in flight stays a hit until that load completes. Blocks computed before the reset
  /// and not stored yet (waiting for a store batch, refused for lack of room, or due at a
  /// finish) are never stored: a request stores from the tokens of its last step on, and a
  /// store due at a finish is dropped (the request is listed in the next
  /// update_connector_output's finished_storing).
  std::size_t reset_cache();

  /// The CPU pool manager (read access for tests and metrics). Throws std::logic_error on a
  /// node pool (the pool's process owns its manager).
  const CPUOffloadingManager& manager() const { return local_manager(); }
  /// The CPU pool manager, for a tier coordinator (kvoff/tiers/coordinator.py) on the engine
  /// thread: promotions are stores no job made (prepare_store + complete_store of keys no
  /// request is storing), and write-through runs on the manager's thread-safe calls. Any other
  /// write through it breaks the scheduler's job bookkeeping.
  CPUOffloadingManager& manager() {
    return const_cast<CPUOffloadingManager&>(local_manager());
  }
  /// Whether the CPU pool is a node pool (constructed with one).
  bool has_node_pool() const noexcept { return node_pool_ != nullptr; }
  const SchedulerConfig& config() const noexcept { return config_; }
  const SchedulerStats& stats() const noexcept { return stats_; }
  /// Requests the scheduler currently tracks.
  std::size_t num_requests() const noexcept { return live_requests_.size(); }
  /// Requests that are idle: a step that gives them no new block and completes none of their
  /// offloaded blocks changes nothing, so build_connector_meta skips them without a lookup.
  /// A request is idle after a step that stored (or found held) every offloaded block full
  /// after it but fewer than store_batch_blocks(), with no load pending; a refused store, missing
  /// hashes, a load, a preemption or its end make it busy again. For tests and metrics.
  std::size_t num_idle_requests() const noexcept { return idle_.size(); }
  /// Jobs emitted and not yet completed.
  std::size_t num_jobs_in_flight() const noexcept { return jobs_.size() - pending_loads_.size(); }
  /// Block hashes known for a request (0 if it is unknown): the next update_request starts
  /// there.
  std::size_t num_hashes(std::string_view request_id) const noexcept;
  /// Index of the next offloaded block to consider for storing (tests, debugging); -1 if the
  /// request is unknown.
  std::int64_t next_store_block(std::string_view request_id) const;
  /// The store batch in effect (offloaded blocks): config().store_batch_blocks, or 1 for a
  /// model with a sliding-window or Mamba group.
  std::int64_t store_batch_blocks() const noexcept { return store_batch_; }
  /// Finished requests whose waiting blocks the next build_connector_meta stores.
  std::size_t num_flushes_pending() const noexcept { return flush_pending_.size(); }

 private:
  struct TableEntry {
    std::uint32_t block_id;
    std::uint32_t step;  // step at which the scheduler saw this entry
  };
  struct Match {
    std::int64_t computed_tokens;  // the engine's own hit
    std::int64_t end_block;        // N: offloaded blocks covered after the load
  };
  struct Request {
    std::string id;
    KeyList hashes;
    std::int64_t num_tokens = 0;
    std::vector<std::vector<TableEntry>> table;  // per group
    std::int64_t next_store = 0;                 // offloaded block index
    std::int64_t store_limit = std::numeric_limits<std::int64_t>::max();  // tokens (prompt)
    // offloaded blocks from its start that others computed: its engine-cache hit and its loads
    // (a reuse at touch_at_finish)
    std::int64_t reuse_end = 0;
    std::optional<Match> match;                  // from get_num_new_matched_tokens
    std::int64_t last_computed_tokens = 0;       // its num_computed_tokens
    std::int64_t gpu_hit_tokens = 0;  // engine-cached prefix of the table set this step
    std::vector<JobId> unemitted_loads;
    std::uint32_t loads_in_flight = 0;
    std::uint32_t stores_in_flight = 0;
    bool load_failed = false;
    std::uint64_t validation_stamp = 0;  // build_connector_meta call that last listed it
    bool scheduled_before = false;  // a block table was recorded (since the last preemption)
    bool finished = false;
    bool flush_pending = false;     // finished with blocks waiting (in flush_pending_)
    std::int64_t tokens_seen = 0;   // tokens computed after its last non-idle step
    bool idle = false;              // in idle_ (id_hash)
    std::uint64_t id_hash = 0;      // id_hash_of(id)
    std::size_t slot = 0;           // its index in live_requests_
  };
  struct Job {
    TransferJob job;
    Request* request = nullptr;  // its request (alive while the job is: see erase_if_done)
    std::uint32_t reports = 0;
    std::uint32_t new_reports = 0;  // update_connector_output's count while it validates
    bool failed = false;
    bool emitted = false;
    bool stale = false;  // in flight at reset_cache: its blocks never become (or stay) hits
  };
  // One contiguous run of logical GPU blocks of one group, and the offloaded blocks it covers.
  struct Segment {
    std::size_t group;
    std::int64_t first_logical;
    std::vector<std::int64_t> gpu_ids;
    std::vector<std::uint32_t> cpu_ids;
    KeyList keys;
  };

  /// Removes a request from live_requests_ and request_index_ (its jobs must be done).
  void erase_request(Request& r);
  Request* find(std::string_view request_id) noexcept;
  const Request* find(std::string_view request_id) const noexcept;
  Request& get(std::string_view request_id, const char* hook);
  /// get() with the id's hash already computed (id_hash_of).
  Request& get(std::string_view request_id, std::uint64_t hash, const char* hook);
  /// Tokens after which no cached token is needed for group g (INT64_MAX for full attention).
  std::int64_t needed_tokens(std::size_t g) const noexcept;
  /// First sub-block (0..factor) of an offloaded block that lookups of group g can need.
  std::int64_t first_needed_sub_block(std::size_t g) const noexcept;
  /// The engine hash that names offloaded block j (of the last hash block inside it).
  std::string_view block_hash(const Request& r, std::int64_t j) const;
  /// Appends the offload key of offloaded block j of group g (hash bytes + one group byte).
  void append_key(KeyList& out, const Request& r, std::int64_t j, std::size_t g) const;
  /// That key in `buf` (its memory reused from call to call), as a view of it.
  std::string_view key_in(std::string& buf, const Request& r, std::int64_t j,
                          std::size_t g) const;
  std::int64_t known_blocks(const Request& r, std::int64_t tokens) const noexcept;
  /// Offloaded blocks of r that may ever be stored (its store_limit in blocks; huge without
  /// one).
  std::int64_t storable_blocks(const Request& r) const noexcept {
    return r.store_limit / offloaded_block_size_;
  }
  /// known_blocks of the tokens that may be stored (at most r's store_limit).
  std::int64_t known_storable_blocks(const Request& r, std::int64_t tokens) const noexcept {
    return known_blocks(r, std::min(tokens, r.store_limit));
  }
  /// Throws std::invalid_argument (as update_request) unless the hashes can be appended.
  void check_hashes(const Request* r, std::string_view request_id, std::size_t start,
                    std::span<const std::string_view> new_hashes, std::int64_t num_tokens,
                    const char* hook) const;
  /// Appends the hashes not known yet (after check_hashes) and sets num_tokens.
  void append_hashes(Request& r, std::size_t start, std::span<const std::string_view> new_hashes,
                     std::int64_t num_tokens);
  void validate_block_ids(std::span<const std::vector<std::int64_t>> ids, const char* what,
                          std::string_view request_id) const;
  /// The load jobs of `segments` (their CPU slots known), in recycled records (new_job), added
  /// to the request's unemitted loads and to pending_loads_.
  void emit_load_jobs(Request& r, const std::vector<Segment>& segments);
  /// Records that the engine (re)allocated GPU block `block_id` this step: later remembered
  /// uses of it are stale, and in-flight jobs on it go to meta.jobs_to_flush.
  void mark_allocated(std::int64_t block_id, std::vector<JobId>& flush);
  void register_fences(const TransferJob& job);
  void clear_fences(const TransferJob& job);
  /// A request with blocks to store this step: its items are [begin, end) of store_items_
  /// (one key each, same positions in store_keys_).
  struct StoreCandidate {
    Request* request;
    std::int64_t full;          // offloaded blocks full after the step (next_store once stored)
    std::int64_t tokens_after;  // tokens computed after the step
    std::size_t begin;
    std::size_t end;
  };
  /// Appends the request's blocks to store this step (full, live, not stored yet) to the
  /// step's scratch and to store_candidates_; false when it has none (next_store may move on)
  /// or, unless `flush`, fewer than store_batch_ wait.
  bool collect_stores(Request& r, std::int64_t tokens_after, bool flush = false);
  /// Prepares the step's candidates' stores (one manager call for all when they fit, else one
  /// per request in order; a refused request retries next step) and emits their jobs.
  void build_stores(std::vector<const TransferJob*>& out);
  /// One prepare_store for `candidates`' keys (later requests first), then their jobs; false
  /// (nothing changed) when they do not fit.
  bool prepare_stores(std::span<const StoreCandidate> candidates,
                      std::vector<const TransferJob*>& out);
  /// The jobs of one candidate whose items have their slots (each group one contiguous run per
  /// job).
  void emit_store_jobs(const StoreCandidate& c, std::vector<const TransferJob*>& out);
  void set_idle_after_stores(Request& r, std::int64_t tokens_after);
  void cancel_unemitted_loads(Request& r);
  /// The request's recency, when it finishes (as vLLM 0.32's managers apply it at
  /// on_request_finished): its blocks become the most recent, head first across groups.
  void touch_at_finish(const Request& r);
  /// Marks it finished; its block table is dropped unless `keep_table` (a flush pending).
  void release(Request& r, bool keep_table = false);
  void erase_if_done(std::string_view request_id);

  SchedulerConfig config_;
  std::int64_t offloaded_block_size_;
  std::int64_t hashes_per_block_;  // hash blocks per offloaded block
  bool any_partial_group_;         // a sliding-window or Mamba group exists
  std::int64_t store_batch_;       // store_batch_blocks in effect (1 with a partial group)
  /// Finished requests with blocks waiting for the next build_connector_meta to store (alive
  /// until then: erase_if_done skips them).
  std::vector<Request*> flush_pending_;
  /// Ids of flushes that stored nothing, for the next update_connector_output's
  /// finished_storing (request_finished returned true for them).
  std::vector<std::string> flushed_unstored_;
  /// The pool's manager: this scheduler's own, or a node pool's client (pool_ is the one).
  std::unique_ptr<CPUOffloadingManager> manager_;
  std::shared_ptr<BlockManager> node_pool_;
  BlockManager* pool_;
  const CPUOffloadingManager& local_manager() const;
  /// Every live request's record, owned here; Request::slot is its index (an erase moves the
  /// last record's pointer into the hole). Records never move, so request_index_ and jobs keep
  /// pointers to them. No map by id string: request_index_ finds a record, and finishing a
  /// request needs no lookup beyond it (a std::unordered_map<std::string, ...> rehashed the
  /// ids of its bucket's nodes at every insert and erase).
  std::vector<std::unique_ptr<Request>> live_requests_;
  // Erased requests' records, kept for the next new requests: the record, its id, hash buffer
  // and block tables keep their memory, so admitting a request allocates nothing once warm
  // (engines admit and finish a few requests every step). At most kMaxSpareRequests are kept
  // (reserved up front: keeping one never allocates), each only if its buffers hold at most
  // kMaxSpareRequestBytes (about 1,500 hashes: a long context's record is freed), so spares
  // hold at most 16 MiB.
  std::vector<std::unique_ptr<Request>> spare_requests_;
  static constexpr std::size_t kMaxSpareRequests = 256;
  static constexpr std::size_t kMaxSpareRequestBytes = 64 * 1024;
  /// A new request's record in live_requests_ (from spare_requests_ when it has one), as a
  /// fresh Request would be but for its buffers' memory. Strong guarantee: on bad_alloc nothing
  /// changed.
  Request& new_request(std::string_view request_id, std::uint64_t id_hash);
  /// Every request in live_requests_ by the 64-bit hash of its id (id_hash_of), matched by id:
  /// one or two adjacent cache lines per lookup. The pointers stay valid until the request is
  /// erased.
  detail::FlatHashTable<Request*> request_index_;
  /// Requests that need nothing in a step unless they get new blocks or their tokens fill
  /// their next store batch ("idle"): their ids' 64-bit hashes, with the last
  /// build_connector_meta call that listed each (duplicate detection) and the tokens of the
  /// last step that skipped each (for a store at finish). A decode step checks most running
  /// requests here, without touching their records (a 64-bit hash names the request: two live ids
  /// sharing one are not told apart).
  struct IdleEntry {
    std::uint64_t stamp = 0;        // the last build_connector_meta call that listed it
    std::int64_t wake_tokens = 0;   // a step whose tokens reach this is not skipped
    std::int64_t tokens = 0;        // tokens after the last step it was skipped in
  };
  detail::FlatHashTable<IdleEntry> idle_;
  /// std::hash of a request id, 0 mapped to 1 (0 marks an empty table entry).
  static std::uint64_t id_hash_of(std::string_view id) noexcept;
  // build_connector_meta's scratch, per scheduled request: its id's hash; whether it may be idle
  std::vector<std::uint64_t> step_hashes_;
  std::vector<char> step_maybe_idle_;
  std::vector<Request*> step_resolved_;  // each scheduled request's record (null: idle)
  /// True while build_connector_meta runs the engine's hash_source (see refuse_reentry).
  bool in_hash_source_ = false;
  [[noreturn]] static void throw_reentry(const char* hook);
  /// Adds r to idle_ (or updates its entry) until a step's tokens reach `wake_tokens`, or
  /// removes it (its tokens_seen raised to those of the steps it was skipped in).
  void set_idle(Request& r, bool idle, std::int64_t wake_tokens = 0);
  /// The request loads nothing now: no match pending, the engine's own hit (its last
  /// get_num_new_matched_tokens' num_computed_tokens) noted for its next table, not idle.
  /// What update_state_after_alloc(.., 0) and a no-hit lookup both leave.
  void settle_without_load(Request& r);
  std::unordered_map<JobId, Job> jobs_;
  // Completed jobs' map nodes, kept for the next ones: a node, its TransferJob's vectors and key
  // buffer keep their memory, so a job costs no allocation once the pool is warm. At most
  // kMaxSpareJobs are kept, each sized for at most kMaxSpareJobBlocks GPU blocks (decode stores
  // and most loads; a long prefill's job is freed), so spares hold at most about 14 MiB.
  std::vector<std::unordered_map<JobId, Job>::node_type> spare_jobs_;
  static constexpr std::size_t kMaxSpareJobs = 1024;
  static constexpr std::size_t kMaxSpareJobBlocks = 256;
  /// A job's record in jobs_ under a new id, emptied (from spare_jobs_ when it has one).
  Job& new_job();
  /// new_job for request `r`, its fields set and its vectors sized for `num_gpu` GPU blocks and
  /// `num_cpu` keys of `key_bytes` bytes.
  Job& new_job(Request& r, bool is_store, std::size_t num_gpu, std::size_t num_cpu,
               std::size_t key_bytes);
  /// Erases a completed job, keeping its node in spare_jobs_ (within the limits above).
  void retire_job(JobId id);
  std::vector<JobId> pending_loads_;  // built by update_state_after_alloc, not yet emitted
  // build_stores' scratch (memory kept between calls: a store job costs no allocation here)
  struct StoreItem {
    std::int64_t j;          // offloaded block index
    std::size_t g;           // KV cache group
    std::int64_t first_sub;  // first sub-block stored
    std::uint32_t slot;      // CPU slot prepare_store gave it (kNoSlot: already held)
    std::size_t run;         // its run in store_runs_ (items of groups interleave)
  };
  struct StoreRun {  // consecutive stored items of one group, within [begin, end) of store_items_
    std::size_t g;
    std::size_t begin;
    std::size_t end;
    std::size_t rank;  // runs of its group before it (the job it goes to)
  };
  // get_num_new_matched_tokens' scratch: one chunk of keys, their views and states
  KeyList lookup_keys_;
  std::vector<std::string_view> lookup_key_views_;
  std::vector<std::pair<BlockState, std::uint32_t>> lookup_states_;
  KeyList store_keys_;
  PrepareStoreResult store_result_;
  // touch_at_finish's scratch: the request's keys, their views and reuse flags
  KeyList finish_keys_;
  std::vector<std::string_view> finish_key_views_;
  std::vector<std::uint8_t> finish_flags_;
  std::vector<std::string_view> store_key_views_;
  // update_connector_output's scratch: one load job's keys; every successful store's CPU
  // slots; the jobs completed (retired once the stores are)
  std::vector<std::string_view> report_key_views_;
  std::vector<std::uint32_t> report_stored_slots_;
  std::vector<std::size_t> report_event_ends_;  // with events: where each store job's slots end
  std::vector<JobId> report_completed_;
  std::vector<Job*> report_resolved_;  // each report's job, looked up once
  std::size_t last_num_store_jobs_ = 0;  // the last step's (build_connector_meta reserves it)
  std::vector<StoreItem> store_items_;
  std::vector<StoreCandidate> store_candidates_;
  std::vector<std::size_t> load_group_first_;  // emit_load_jobs' scratch, per group
  std::vector<std::size_t> load_group_count_;
  std::vector<std::size_t> store_view_items_;  // build_stores: call position -> item
  std::vector<StoreRun> store_runs_;
  std::vector<std::size_t> store_open_;  // per group: its open run + 1 (0: none)
  std::vector<std::size_t> store_rank_;  // per group: runs so far
  std::vector<std::size_t> store_by_rank_;  // per (job, group): its run + 1 (0: none)
  std::vector<std::uint32_t> alloc_step_;  // per GPU block: step of its last allocation
  std::vector<JobId> store_fence_;         // per GPU block: newest in-flight store reading it
  std::vector<JobId> load_fence_;          // per GPU block: newest in-flight load writing it
  std::uint32_t step_ = 0;
  std::uint64_t validation_stamp_ = 0;
  JobId next_job_id_ = 1;
  SchedulerStats stats_;
};

}  // namespace kvoff
