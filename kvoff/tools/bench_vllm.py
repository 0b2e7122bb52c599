"""``kvoff bench scheduler --vs-vllm``: kvoff's scheduler side against vLLM's own offloading, in
one run, on vLLM's own types.

Two measurements:

* **Per engine step** (``steps``): a real vLLM ``Scheduler`` (``vllm.v1.core.sched``) schedules
  the same request stream four times: with ``KvoffConnector`` (kvoff's C++
  ``OffloadingScheduler``); with vLLM's ``OffloadingConnector`` as vLLM ships it
  (``vllm_cpu_spec``: its default ``CPUOffloadingSpec``, whose scheduler side, vLLM's Python
  ``OffloadingConnectorScheduler`` over vLLM's ``CPUOffloadingManager``, runs on any platform;
  only its GPU worker refuses the CPU, and no worker runs here); with ``OffloadingConnector``
  running ``KvoffOffloadingSpec`` (``vllm_offloading``: vLLM's Python scheduler over kvoff's
  C++ manager, so the difference to ``kvoff`` is the scheduler alone); and with no connector.
  No model runs: after each ``schedule()`` the driver hands ``update_from_output`` one sampled
  token per request that finished its prompt and reports every job of the step as done (a
  worker whose copies finish within the step). Every call
  the engine makes into the connector's scheduler role is timed (``get_num_new_matched_tokens``,
  ``update_state_after_alloc``, ``build_connector_meta``, ``update_connector_output``,
  ``request_finished``, ``take_events``, ``get_kv_connector_stats``, ...); ``connector_us``
  is their sum per step, median over the timed steps. ``step_us`` is the whole
  ``schedule()`` + ``update_from_output()`` with the connector inside. The stream: ``B``
  running requests (``max_num_seqs``), prompts of ``prompt_tokens`` whose first half is one of
  ``prefixes_per_request × B`` shared prefixes (taken in turn), between ``output_tokens / 2``
  and ``1.5 × output_tokens`` generated each; a finished request is replaced by the next one,
  so new prompts are prefilled while the others decode. A prefix comes back after about
  ``prefixes_per_request × output_tokens`` steps, longer than a request lives, and the GPU has
  room for only 8 requests beyond the batch, so the engine's prefix cache has lost it by then
  while the CPU pool (sized to hold every block of the run: no eviction) still has it: the
  connectors find hits, load and store. The schedules of the three connectors are
  compared step by step (``same_schedule``): equal hits give equal schedules. Every
  configuration runs ``rounds`` times in alternating order (the shared machine's speed drifts
  over tens of seconds); medians over rounds and each round's ratio are reported.
* **Manager calls** (``manager``): the CPU pool's manager through Python with calls of
  ``batch`` keys on a full pool of ``num_blocks``: per round, ``lookup`` of ``batch`` held keys,
  ``touch`` of them, ``prepare_store`` of ``batch`` new keys (evicting as many) and
  ``complete_store``. kvoff's binding (``kvoff.CPUOffloadingManager``: one call per batch)
  against vLLM's ``CPUOffloadingManager`` (lookups one key per call, as its scheduler makes
  them); the same 36-byte keys (a 32-byte hash and a 4-byte group, vLLM's ``OffloadKey``).
  Reported as key operations per second (4 × ``batch`` per round) and their ratio.

Requires vLLM (the ``vllm`` extra: ``pip install 'kvoff[vllm]'``).
"""

from __future__ import annotations

import gc
import hashlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvoff._optional import require

__all__ = [
    "CONNECTORS",
    "DEFAULT_RUNNING",
    "NODE_POOL",
    "TARGET_MANAGER_SPEEDUP",
    "TARGET_NODE_POOL_RATIO",
    "TARGET_STEP_RATIO",
    "VsVllmParams",
    "bench_manager_vs_vllm",
    "bench_steps_vs_vllm",
    "format_vs_vllm",
    "run_vs_vllm",
]

VS_VLLM_FEATURE = "kvoff bench scheduler --vs-vllm"
"""What needs vLLM here, as :class:`kvoff._optional.MissingExtraError` names it."""

DEFAULT_RUNNING = (64, 256, 1024)
"""Running requests (``max_num_seqs``) measured by default (issue 13)."""
TARGET_STEP_RATIO = 20.0
"""Target: vLLM's OffloadingConnectorScheduler costs at least 20× KvoffConnector's scheduler
role per step at 256 running requests (issue 13, which compares like for like: vLLM's
scheduler over kvoff's manager, ``vllm_offloading``). Also reported against vLLM as shipped
(``vllm_cpu_spec``)."""
TARGET_MANAGER_SPEEDUP = 20.0
"""Target: kvoff's manager through Python at least 20× vLLM's CPU manager at 32-key calls."""
CONNECTORS = ("kvoff", "vllm_cpu_spec", "vllm_offloading", "none")
"""The four configurations of the step benchmark (see the module docstring)."""
NODE_POOL = "vllm_offloading_node_pool"
"""The configuration with ``--node-pool``: ``vllm_offloading`` whose manager is a node pool's
(:class:`kvoff.node_pool.NodePoolClient`, every call through the pool's socket)."""
KVOFF_NODE_POOL = "kvoff_node_pool"
"""The other configuration with ``--node-pool``: ``kvoff`` (KvoffConnector, kvoff's C++
scheduler) whose CPU pool is a node pool's
(:class:`kvoff.node_pool.block_manager.NodePoolBlockManager`)."""
PRIVATE_OF = {NODE_POOL: "vllm_offloading", KVOFF_NODE_POOL: "kvoff"}
"""Each node-pool configuration's private-pool counterpart."""
TARGET_NODE_POOL_RATIO = 1.5
"""Target: the connector's scheduler cost per step on a node pool at most 1.5x the same
spec's on a private pool at 256 running requests (issue 56)."""
_VLLM_CONNECTORS = ("vllm_cpu_spec", "vllm_offloading")
"""The configurations that run vLLM's ``OffloadingConnector`` (and :data:`NODE_POOL`)."""

# The connector methods the engine's scheduler calls (vLLM 0.32's KVConnectorBase_V1).
_SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "get_kv_connector_stats",
    "get_finished_count",
    "has_pending_push_work",
    "get_external_cache_hit_sources",
)


@dataclass(frozen=True)
class VsVllmParams:
    """Parameters of ``kvoff bench scheduler --vs-vllm`` (see the module docstring).

    Attributes:
        running: running requests (``max_num_seqs``) per step measurement.
        block_size: tokens per GPU block (and per offloaded block): vLLM's default on GPUs.
        prompt_tokens: tokens per prompt; the first half is a shared prefix.
        output_tokens: mean tokens generated per request.
        prefixes_per_request: distinct shared prefixes per running request.
        steps: timed engine steps per configuration (after the warm-up that fills the batch).
        rounds: runs of every configuration per running count, in alternating order
            (kvoff, vLLM, none, then none, vLLM, kvoff, ...): the machine's noise over tens of
            seconds hits every configuration alike; medians over rounds are reported.
        manager_blocks: CPU pool slots of the manager measurement.
        manager_batch: keys per manager call.
        manager_rounds: timed rounds of the manager measurement.
        seed: token stream seed.
        store_batch_blocks: KvoffConnector's ``store_batch_blocks``; ``None``: the library's
            default (:class:`kvoff.OffloadingConfig`), as shipped. vLLM's connector stores every
            offloaded block in the step it fills whatever this says.
        offload_prompt_only: every connector stores the blocks of prompts only (the default of
            vLLM 0.32 and of kvoff); False: also those decode fills (the same key for all
            three).
        node_pool: also run :data:`NODE_POOL`: ``KvoffOffloadingSpec`` attached to a node pool
            (``kvoff pool serve`` in a child process, a fresh one per run, sized like the
            private pool), next to ``vllm_offloading`` on a private pool
            (``node_pool_vs_private``), and :data:`KVOFF_NODE_POOL`: KvoffConnector on one,
            next to ``kvoff`` (``kvoff_node_pool_vs_private``).
    """

    running: tuple[int, ...] = DEFAULT_RUNNING
    block_size: int = 16
    prompt_tokens: int = 1024
    output_tokens: int = 128
    prefixes_per_request: int = 2
    steps: int = 64
    rounds: int = 3
    manager_blocks: int = 100_000
    manager_batch: int = 32
    manager_rounds: int = 3000
    seed: int = 0
    store_batch_blocks: int | None = None
    offload_prompt_only: bool = True
    node_pool: bool = False

    def __post_init__(self) -> None:
        names = ("block_size", "prompt_tokens", "output_tokens", "prefixes_per_request")
        names += ("steps", "rounds", "manager_blocks", "manager_batch", "manager_rounds")
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"VsVllmParams.{name} must be >= 1, got {getattr(self, name)}")
        if not self.running or min(self.running) < 1:
            raise ValueError(f"VsVllmParams.running must be counts >= 1, got {self.running}")
        if self.prompt_tokens < 2 * self.block_size:
            raise ValueError(
                f"prompt_tokens ({self.prompt_tokens}) must cover two blocks of {self.block_size}"
            )
        if self.manager_blocks < 2 * self.manager_batch:
            raise ValueError("manager_blocks must be at least twice manager_batch")


# ------------------------------------------------------------------------------- the engine


VLLM_LAYERS = 4
"""Attention layers of :func:`vllm_scheduler`'s model."""
VLLM_BLOCK_BYTES_PER_TOKEN = VLLM_LAYERS * 2 * 2 * 64 * 2
"""KV bytes per token over all layers of that model (K and V × 2 heads × 64 × bf16)."""


def _model_dir() -> str:
    """A model folder with a config.json only (the scheduler never loads weights)."""
    root = Path(tempfile.gettempdir()) / "kvoff-bench-vllm-model"
    if not (root / "config.json").exists():
        from transformers import LlamaConfig

        LlamaConfig(
            vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=VLLM_LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=1 << 16,
        ).save_pretrained(root)  # fmt: skip
    return str(root)


def vllm_scheduler(
    kv_transfer_config: Any,
    *,
    num_gpu_blocks: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> tuple[Any, Callable]:
    """A real vLLM ``Scheduler`` (no model, no workers) over ``num_gpu_blocks`` GPU blocks of
    ``block_size`` tokens for a 4-layer Llama-like model (2 KV heads of 64, bf16: 8 KiB per
    block and layer), with ``kv_transfer_config`` (a vLLM ``KVTransferConfig``, or None for no
    connector), and the engine's request block hasher. Used by the benchmark and by the tests
    that step vLLM's scheduler by hand.

    Raises:
        whatever vLLM raises for the configuration (e.g. the connector's own refusals).
    """
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(VLLM_LAYERS)]
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )
    page = spec.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=num_gpu_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_gpu_blocks * len(layers),
                layers=layers,
                layer_stride=page * num_gpu_blocks,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    config = VllmConfig(
        model_config=ModelConfig(
            model=_model_dir(),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=max_model_len,
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=kv_transfer_config,
    )
    config.cache_config.num_gpu_blocks = num_gpu_blocks  # what the engine sets after profiling
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        log_stats=True,
    )
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return scheduler, get_request_block_hasher(block_size, hash_fn)


def _engine(
    connector: str, running: int, total_requests: int, p: VsVllmParams, node_pool: str = ""
) -> tuple[Any, Callable, int]:
    """A vLLM Scheduler with ``connector``, its request block hasher and its GPU block count;
    ``node_pool``: the socket of the pool that :data:`NODE_POOL` attaches to."""
    from vllm.config import KVTransferConfig

    bs = p.block_size
    max_len = p.prompt_tokens + p.output_tokens + bs
    blocks_per_request = -(-max_len // bs)
    # Room for the running batch and a few requests more: finished requests' blocks, and with
    # them the prefixes, are reused within a few steps, so the CPU pool serves the repeats.
    num_gpu_blocks = running * blocks_per_request + 8 * blocks_per_request + 1
    cpu_bytes = _cpu_bytes(total_requests, p)
    transfer = None
    if connector in ("kvoff", KVOFF_NODE_POOL):  # KVOFF_NODE_POOL: the pool sizes itself
        pool = (
            {"cpu_bytes_to_use": cpu_bytes}
            if connector != KVOFF_NODE_POOL
            else {"node_pool": node_pool}
        )
        transfer = KVTransferConfig(
            kv_connector="KvoffConnector", kv_connector_module_path="kvoff.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config={
                **pool, "offload_prompt_only": p.offload_prompt_only,
                **({} if p.store_batch_blocks is None
                   else {"store_batch_blocks": p.store_batch_blocks}),
            },
            kv_load_failure_policy="recompute",
        )  # fmt: skip
    elif connector == "vllm_cpu_spec":  # vLLM's default spec: CPUOffloadingSpec, LRU
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": cpu_bytes, "offload_prompt_only": p.offload_prompt_only,
            },
            kv_load_failure_policy="recompute",
        )  # fmt: skip
    elif connector in ("vllm_offloading", NODE_POOL):  # NODE_POOL: the pool sizes itself
        pool = (
            {"cpu_bytes_to_use": cpu_bytes} if connector != NODE_POOL else {"node_pool": node_pool}
        )
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={
                **pool, "spec_name": "KvoffOffloadingSpec",
                "spec_module_path": "kvoff.integrations.vllm",
                "offload_prompt_only": p.offload_prompt_only,
            },
            kv_load_failure_policy="recompute",
        )  # fmt: skip
    scheduler, hasher = vllm_scheduler(
        transfer, num_gpu_blocks=num_gpu_blocks, block_size=bs, max_model_len=max_len,
        max_num_seqs=running, max_num_batched_tokens=8192 + running,
    )  # fmt: skip
    return scheduler, hasher, num_gpu_blocks


def _cpu_bytes(total_requests: int, p: VsVllmParams) -> int:
    """A CPU pool that holds every block of the run (no eviction: every connector must find
    the same hits whatever its eviction order). The scheduler role allocates no pool."""
    max_len = p.prompt_tokens + p.output_tokens + p.block_size
    blocks_per_request = -(-max_len // p.block_size)
    return VLLM_BLOCK_BYTES_PER_TOKEN * p.block_size * blocks_per_request * (total_requests + 1)


def _prompts(p: VsVllmParams, running: int, count: int) -> list[list[int]]:
    """``count`` prompts: a shared prefix (one of ``prefixes_per_request × running``, in turn)
    and a unique tail."""
    import numpy as np

    rng = np.random.default_rng(p.seed)
    half = p.prompt_tokens // 2
    num_prefixes = p.prefixes_per_request * running
    prefixes = rng.integers(1, 32000, size=(num_prefixes, half)).tolist()
    tails = rng.integers(1, 32000, size=(count, p.prompt_tokens - half)).tolist()
    return [prefixes[i % num_prefixes] + tails[i] for i in range(count)]


class _Timed:
    """Wraps the connector's scheduler hooks on the instance and sums their time per step. A
    hook called from inside another (e.g. ``request_finished_all_groups`` calling
    ``request_finished``) is counted once, in the outer hook."""

    def __init__(self, connector: Any) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0
        self.per_hook: dict[str, float] = {}
        for name in _SCHEDULER_HOOKS:
            fn = getattr(connector, name, None)
            if fn is not None:
                setattr(connector, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Callable) -> Callable:
        clock = time.perf_counter
        per_hook = self.per_hook
        per_hook[name] = 0.0

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # nested: the outer hook's time includes it
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                self._depth -= 1
                self.seconds += dt
                per_hook[name] += dt
                self.calls += 1

        return timed


def _worker_output(connector: str, meta: Any) -> Any:
    """What every rank's worker reports for a step whose jobs all finished: KvoffConnector's
    ``KvoffWorkerMetadata`` or vLLM's ``OffloadingWorkerMetadata``, the requests whose loads
    finished (``finished_recving``) and, for KvoffConnector, the finished requests whose
    blocks vLLM kept for a store due at their finish (``finished_sending``, as its workers
    report them)."""
    from vllm.v1.outputs import KVConnectorOutput

    if connector in ("kvoff", KVOFF_NODE_POOL):
        from kvoff.integrations.vllm import KvoffWorkerMetadata

        jobs = (*meta.load_jobs, *meta.store_jobs)
        if not jobs and not meta.finished_flushes:
            return None
        return KVConnectorOutput(
            finished_sending=set(meta.finished_flushes) or None,
            finished_recving={j.request_id for j in meta.load_jobs} or None,
            kv_connector_worker_meta=KvoffWorkerMetadata({j.job_id: [1, 0] for j in jobs}),
        )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )

    jobs = {**meta.load_jobs, **meta.store_jobs}
    if not jobs:
        return None
    return KVConnectorOutput(
        finished_recving={j.req_id for j in meta.load_jobs.values()} or None,
        kv_connector_worker_meta=OffloadingWorkerMetadata(dict.fromkeys(jobs, 1)),
    )


def _total_requests(running: int, p: VsVllmParams) -> int:
    """Requests of one run: the warm-up's and the timed steps', with a margin."""
    g = p.output_tokens
    # steps to prefill a whole batch (8192 + running tokens per step, see _engine): requests
    # finish meanwhile, so the warm-up consumes more of the stream at large batches
    prefill_steps = -(-running * p.prompt_tokens // (8192 + running))
    return 2 * running + 8 + (2 * (3 * g // 2 + p.steps + prefill_steps) * running) // g


def _drive(connector: str, running: int, p: VsVllmParams) -> dict[str, Any]:
    """Runs one configuration: warm-up until ``running`` requests decode, then ``p.steps`` timed
    steps. Returns timings, totals and the per-step schedule (for the comparison).
    :data:`NODE_POOL` runs on a fresh node pool of the private pool's size, started for it."""
    if connector not in PRIVATE_OF:
        return _drive_engine(connector, running, p)
    from kvoff.node_pool.process import pool_process

    slot_bytes = VLLM_BLOCK_BYTES_PER_TOKEN * p.block_size
    slots = _cpu_bytes(_total_requests(running, p), p) // slot_bytes
    with tempfile.TemporaryDirectory(prefix="kvoff-bench-pool-") as tmp:
        sock = os.path.join(tmp, "pool.sock")
        region = f"kvoff-bench-vllm-{os.getpid()}-{running}"
        with pool_process(sock, slots, slot_bytes, region=region):
            return _drive_engine(connector, running, p, sock)


def _drive_engine(
    connector: str, running: int, p: VsVllmParams, node_pool: str = ""
) -> dict[str, Any]:
    """:func:`_drive` on a pool that is there (``node_pool``: its socket)."""
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    # Output lengths spread over [G/2, 3G/2) so that requests finish at different steps; the
    # warm-up runs until `running` requests finished (the batch turns over), then the timed
    # steps. Requests for both, with a margin.
    g = p.output_tokens
    lengths = [max(1, g // 2 + (i * 37) % g) for i in range(g)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in lengths]
    total = _total_requests(running, p)
    prompts = _prompts(p, running, total)
    scheduler, hasher, num_gpu_blocks = _engine(connector, running, total, p, node_pool)
    conn = scheduler.connector
    timer = _Timed(conn) if conn is not None else None
    hook_s: dict[str, float] = {}
    timed_steps = 0
    running_sum = 0
    submitted = 0

    def submit(n: int) -> None:
        nonlocal submitted
        for _ in range(n):
            if submitted >= total:
                return
            scheduler.add_request(
                Request(
                    f"r{submitted}",
                    prompts[submitted],
                    params[submitted % g],
                    None,
                    block_hasher=hasher,
                )
            )
            submitted += 1

    submit(running + 8)
    step_s: list[float] = []
    conn_s: list[float] = []
    schedule: list[tuple] = []
    warm = False
    hit_tokens = {"engine": 0, "connector": 0}  # over the whole run
    clock = time.perf_counter
    gc_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        while len(step_s) < p.steps:
            if timer is not None:
                timer.seconds = 0.0
                timer.per_hook.update(dict.fromkeys(timer.per_hook, 0.0))
            t0 = clock()
            out = scheduler.schedule()
            ids = list(out.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                req = scheduler.requests[rid]
                sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
            kv_out = None
            if conn is not None:
                kv_out = _worker_output(connector, out.kv_connector_metadata)
            mro = ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled, kv_connector_output=kv_out,
            )  # fmt: skip
            outputs = scheduler.update_from_output(out, mro)
            t1 = clock()
            for eco in outputs.values():
                st = eco.scheduler_stats
                if st is None:
                    continue
                if st.prefix_cache_stats is not None:
                    hit_tokens["engine"] += st.prefix_cache_stats.hits
                if st.connector_prefix_cache_stats is not None:
                    hit_tokens["connector"] += st.connector_prefix_cache_stats.hits
            if warm:
                step_s.append(t1 - t0)
                conn_s.append(timer.seconds if timer is not None else 0.0)
                timed_steps += 1
                if timer is not None:
                    for name, sec in timer.per_hook.items():
                        hook_s[name] = hook_s.get(name, 0.0) + sec
                schedule.append(tuple(sorted(out.num_scheduled_tokens.items())))
                running_sum += len(ids)
            else:
                finished = submitted - scheduler.get_num_unfinished_requests()
                # warm: the batch turned over and is (nearly) full; at large batches the GPU
                # blocks keep a few requests waiting at any step (``mean_running`` says how many
                # ran)
                warm = finished >= running and len(scheduler.running) >= running - running // 8
            submit(running + 8 - len(scheduler.running) - len(scheduler.waiting))
            if not scheduler.has_requests() and submitted >= total:
                raise RuntimeError("bench: the request stream ran dry before the timed steps")
    finally:
        if gc_enabled:
            gc.enable()
    stats = {}
    manager = None  # the offloading manager behind the connector's scheduler role
    names = ("misses_while_detached", "round_trips", "answered_ahead", "answered_by_filter",
             "loads_on_lease", "stores_on_reservation",
             "async_errors")  # fmt: skip
    if connector == "kvoff":
        stats = dict(conn.scheduler.stats())
        from kvoff import CPUOffloadingManager

        manager = CPUOffloadingManager  # KvoffConnector's scheduler on a private pool
    elif connector == KVOFF_NODE_POOL:
        from kvoff.node_pool.block_manager import NodePoolBlockManager

        manager = NodePoolBlockManager
        client = conn.scheduler.node_pool
        stats = {**conn.scheduler.stats(), **{k: getattr(client, k) for k in names}}
    elif conn is not None:
        manager = type(conn.connector_scheduler.manager)
        if connector == NODE_POOL:  # calls answered as misses because the pool was gone
            client = conn.connector_scheduler.manager.manager
            stats = {k: getattr(client, k) for k in names}
    result = {
        "connector": connector,
        "running": running,
        "num_gpu_blocks": num_gpu_blocks,
        "step_us": statistics.median(step_s) * 1e6,
        "connector_us": statistics.median(conn_s) * 1e6,
        "connector_us_mean": statistics.fmean(conn_s) * 1e6,
        "mean_running": running_sum / max(timed_steps, 1),
        "hook_us_mean": {
            k: v / max(timed_steps, 1) * 1e6 for k, v in sorted(hook_s.items()) if v > 0
        },
        "scheduled_tokens_per_step": statistics.fmean(sum(n for _, n in s) for s in schedule),
        "requests_submitted": submitted,
        "hit_tokens": hit_tokens,
        "kvoff_stats": stats,
        "manager": None if manager is None else f"{manager.__module__}.{manager.__qualname__}",
    }
    result["_schedule"] = schedule
    return result


def bench_steps_vs_vllm(
    p: VsVllmParams, log: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """The per-step measurement for every ``p.running``: one entry per running count with the
    four configurations of :data:`CONNECTORS`, each run ``p.rounds`` times in alternating
    order. Per configuration: the round with the median ``connector_us`` (its hooks, stats,
    step time), plus ``connector_us_rounds`` (every round's median µs per step, in run order).
    ``vllm_cpu_spec_vs_kvoff``: the median over rounds of vLLM-as-shipped's connector µs per
    step over the median of kvoff's; ``vllm_vs_kvoff``: the same for vLLM's scheduler over
    kvoff's manager (``vllm_offloading``); ``*_rounds``: the ratio within each round (runs next
    to each other in time). ``same_schedule``: every run of the three connectors scheduled the
    same tokens at every step.

    Raises:
        RuntimeError: the request stream ran dry (a parameter mix that never fills the batch).
        kvoff._optional.MissingExtraError: vLLM is not installed (an ``ImportError``).
    """
    require("vllm", VS_VLLM_FEATURE)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    entries = []
    pools = tuple(PRIVATE_OF) if p.node_pool else ()
    connectors = (*CONNECTORS, *pools)
    compared = ("kvoff", *_VLLM_CONNECTORS, *pools)
    for running in p.running:
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in connectors}
        schedules: dict[str, list[Any]] = {c: [] for c in connectors}
        for k in range(p.rounds):
            for connector in connectors if k % 2 == 0 else tuple(reversed(connectors)):
                if log:
                    log(f"steps: {running} running requests, connector {connector}, "
                        f"round {k + 1}/{p.rounds}")  # fmt: skip
                result = _drive(connector, running, p)
                schedules[connector].append(result.pop("_schedule"))
                runs[connector].append(result)
        configurations = {}
        for c, results in runs.items():
            us = [r["connector_us"] for r in results]
            chosen = sorted(results, key=lambda r: r["connector_us"])[(len(results) - 1) // 2]
            configurations[c] = {**chosen, "connector_us_rounds": us}
        kv = runs["kvoff"]
        reference = schedules["kvoff"][0]
        entry: dict[str, Any] = {
            "running": running,
            "configurations": configurations,
            "same_schedule": all(s == reference for c in compared for s in schedules[c]),
        }
        for c, prefix in (("vllm_offloading", "vllm"), ("vllm_cpu_spec", "vllm_cpu_spec")):
            vl = runs[c]
            entry[f"{prefix}_vs_kvoff"] = statistics.median(r["connector_us"] for r in vl) / max(
                statistics.median(r["connector_us"] for r in kv), 1e-9
            )
            entry[f"{prefix}_vs_kvoff_rounds"] = [
                v["connector_us"] / max(k["connector_us"], 1e-9)
                for k, v in zip(kv, vl, strict=True)
            ]
        if p.node_pool:
            entry.update(_node_pool_ratios(runs["vllm_offloading"], runs[NODE_POOL]))
            entry.update(
                {
                    f"kvoff_{k}": v
                    for k, v in _node_pool_ratios(runs["kvoff"], runs[KVOFF_NODE_POOL]).items()
                }
            )
        entries.append(entry)
    return entries


def _node_pool_ratios(private: list[dict[str, Any]], pool: list[dict[str, Any]]) -> dict:
    """``node_pool_vs_private``: the node pool's median connector µs per step over the private
    pool's (the same spec; target at most :data:`TARGET_NODE_POOL_RATIO`), ``*_rounds``: within
    each round; ``node_pool_mean_vs_private``: the same for the mean µs per step (the steps
    that admit requests, where the look-ups are, weigh in); ``node_pool_step_vs_private``: for
    the whole engine step."""
    out: dict[str, Any] = {}
    for name, field in (("node_pool_vs_private", "connector_us"),
                        ("node_pool_mean_vs_private", "connector_us_mean"),
                        ("node_pool_step_vs_private", "step_us")):  # fmt: skip
        out[name] = statistics.median(r[field] for r in pool) / max(
            statistics.median(r[field] for r in private), 1e-9
        )
        out[f"{name}_rounds"] = [
            b[field] / max(a[field], 1e-9) for a, b in zip(private, pool, strict=True)
        ]
    return out


# ------------------------------------------------------------------------------ the manager


def _offload_keys(first: int, count: int) -> list[bytes]:
    """vLLM OffloadKeys: a 32-byte hash and a 4-byte group index (0)."""
    return [
        hashlib.sha256(i.to_bytes(8, "little")).digest() + b"\0\0\0\0"
        for i in range(first, first + count)
    ]


def bench_manager_vs_vllm(p: VsVllmParams) -> dict[str, Any]:
    """The manager measurement (module docstring): per implementation ``ns_per_key_op`` per
    operation and ``key_ops_per_s`` over the whole round (median of 5 repeats), and
    ``kvoff_vs_vllm`` (key-op rate ratio).

    Raises:
        RuntimeError: the two managers disagree on lookup hits or evictions.
        kvoff._optional.MissingExtraError: vLLM is not installed (an ``ImportError``).
    """
    import numpy as np

    require("vllm", VS_VLLM_FEATURE)
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmManager

    from kvoff import CPUOffloadingManager

    n, b, rounds = p.manager_blocks, p.manager_batch, p.manager_rounds
    fill = _offload_keys(0, n)
    rng = np.random.default_rng(p.seed)
    repeats = 5
    results: dict[str, Any] = {}
    for impl in ("kvoff", "vllm"):
        ctx = ReqContext(req_id="bench")
        if impl == "kvoff":
            m = CPUOffloadingManager(n, "lru")
            lookup = m.lookup
            touch, prepare, complete = m.touch, m.prepare_store, m.complete_store
        else:
            m = VllmManager(n, "lru")
            hit = LookupResult.HIT

            def lookup(keys: Sequence[bytes], _m: Any = m, _ctx: Any = ctx, _hit: Any = hit) -> int:
                count = 0
                for key in keys:
                    if _m.lookup(key, _ctx) != _hit:
                        break
                    count += 1
                return count

            def touch(keys: Sequence[bytes], _m: Any = m, _ctx: Any = ctx) -> None:
                _m.touch(keys, _ctx)

            def prepare(keys: Sequence[bytes], _m: Any = m, _ctx: Any = ctx) -> Any:
                return _m.prepare_store(keys, _ctx)

            def complete(keys: Sequence[bytes], _m: Any = m, _ctx: Any = ctx) -> None:
                _m.complete_store(keys, _ctx)

        for i in range(0, n, b):
            prepare(fill[i : i + b])
            complete(fill[i : i + b])
        # Lookups ask for keys stored in the last `window` keys' time: held under any policy
        # that evicts in recency order (at most 2 × window newer insertions and touches).
        window = min(n // 3, 1000 * b) // b * b
        recent = fill[n - window :]  # a ring: the last `window` keys stored
        pos = 0
        next_id = n
        per_repeat = []
        hits = evicted = 0
        for _ in range(repeats):
            picks = rng.integers(0, window, size=(rounds, b))
            new = _offload_keys(next_id, rounds * b)
            next_id += rounds * b
            t = dict.fromkeys(("lookup", "touch", "prepare_store", "complete_store"), 0.0)
            clock = time.perf_counter
            gc.collect()
            gc.disable()
            try:
                for r in range(rounds):
                    keys = [recent[j] for j in picks[r]]
                    fresh = new[r * b : (r + 1) * b]
                    t0 = clock()
                    hits += lookup(keys) or 0
                    t1 = clock()
                    touch(keys)
                    t2 = clock()
                    out = prepare(fresh)
                    t3 = clock()
                    complete(fresh)
                    t4 = clock()
                    evicted += len(out.evicted_keys)
                    t["lookup"] += t1 - t0
                    t["touch"] += t2 - t1
                    t["prepare_store"] += t3 - t2
                    t["complete_store"] += t4 - t3
                    recent[pos : pos + b] = fresh
                    pos = (pos + b) % window
            finally:
                gc.enable()
            per_repeat.append(t)
        total = sorted(per_repeat, key=lambda t: sum(t.values()))[repeats // 2]
        results[impl] = {
            "ns_per_key_op": {op: s * 1e9 / (rounds * b) for op, s in total.items()},
            "key_ops_per_s": 4 * rounds * b / sum(total.values()),
            "lookup_hits": hits,
            "evicted": evicted,
        }
    for total in ("lookup_hits", "evicted"):
        if results["kvoff"][total] != results["vllm"][total]:
            raise RuntimeError(
                f"bench: kvoff's and vLLM's managers disagree on {total} "
                f"({results['kvoff'][total]} vs {results['vllm'][total]}): not the same workload"
            )
    results["kvoff_vs_vllm"] = results["kvoff"]["key_ops_per_s"] / results["vllm"]["key_ops_per_s"]
    results["num_blocks"], results["batch"], results["rounds"] = n, b, rounds
    return results


# ------------------------------------------------------------------------------ the command


def format_vs_vllm(document: dict[str, Any]) -> str:
    """The text tables of a ``--vs-vllm`` document."""
    lines = [
        "Scheduler cost per engine step (median us; a real vLLM Scheduler, no model).",
        "vLLM: OffloadingConnector as shipped (CPUOffloadingSpec); vLLM+kvoff mgr: "
        "OffloadingConnector with KvoffOffloadingSpec",
        f"{'running':>8} {'kvoff':>8} {'vLLM':>8} {'vLLM/kvoff':>11} {'vLLM+kvoff mgr':>15} "
        f"{'ratio':>7} {'step kvoff':>11} {'step vLLM':>10} {'step none':>10} "
        f"{'same sched':>11}  vLLM/kvoff per round",
    ]
    for e in document["steps"]:
        c = e["configurations"]
        stock = c.get("vllm_cpu_spec")  # absent from documents before 2026-11-25 13:30
        lines.append(
            f"{e['running']:>8} {c['kvoff']['connector_us']:>8.1f} "
            + (
                f"{stock['connector_us']:>8.1f} {e['vllm_cpu_spec_vs_kvoff']:>10.1f}x "
                if stock
                else f"{'-':>8} {'-':>11} "
            )
            + f"{c['vllm_offloading']['connector_us']:>15.1f} {e['vllm_vs_kvoff']:>6.1f}x "
            f"{c['kvoff']['step_us']:>11.1f} "
            f"{(stock or c['vllm_offloading'])['step_us']:>10.1f} "
            f"{c['none']['step_us']:>10.1f} {e['same_schedule']!s:>11}  "
            + " ".join(
                f"{r:.1f}x"
                for r in e.get("vllm_cpu_spec_vs_kvoff_rounds", e.get("vllm_vs_kvoff_rounds", ()))
            )
        )
    pooled = [e for e in document["steps"] if "node_pool_vs_private" in e]
    if pooled:
        lines += [
            "",
            "On a node pool vs a private pool (connector us per step; KvoffOffloadingSpec: "
            "vllm_offloading, KvoffConnector: kvoff)",
            f"{'running':>8} {'private':>8} {'node pool':>10} {'ratio':>7} "
            f"{'mean ratio':>11} {'step ratio':>11}  per round",
        ]
        for e in pooled:
            c = e["configurations"]
            for pool, private in PRIVATE_OF.items():
                pre = "kvoff_" if pool == KVOFF_NODE_POOL else ""
                if f"{pre}node_pool_vs_private" not in e:
                    continue
                lines.append(
                    f"{e['running']:>8} {c[private]['connector_us']:>8.1f} "
                    f"{c[pool]['connector_us']:>10.1f} {e[f'{pre}node_pool_vs_private']:>6.2f}x "
                    f"{e[f'{pre}node_pool_mean_vs_private']:>10.2f}x "
                    f"{e[f'{pre}node_pool_step_vs_private']:>10.2f}x  "
                    + " ".join(f"{r:.2f}x" for r in e[f"{pre}node_pool_vs_private_rounds"])
                    + f"  ({private})"
                )
    m = document.get("manager")
    if m:
        lines += [
            "",
            f"Manager through Python, {m['batch']}-key calls, {m['num_blocks']:,} slots "
            "(ns per key op)",
            f"{'':>8} {'lookup':>8} {'touch':>8} {'prepare':>8} {'complete':>9} {'Mkeyops/s':>10}",
        ]
        for impl in ("kvoff", "vllm"):
            r = m[impl]
            ns = r["ns_per_key_op"]
            lines.append(
                f"{impl:>8} {ns['lookup']:>8.1f} {ns['touch']:>8.1f} {ns['prepare_store']:>8.1f} "
                f"{ns['complete_store']:>9.1f} {r['key_ops_per_s'] / 1e6:>10.2f}"
            )
        lines.append(f"kvoff / vLLM: {m['kvoff_vs_vllm']:.1f}x")
    return "\n".join(lines)


def run_vs_vllm(
    p: VsVllmParams,
    json_path: Path | None = None,
    argv: Sequence[str] | None = None,
    out: Callable[[str], None] = print,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Runs both measurements, prints the tables with ``out``, writes the JSON document
    (``run``: machine, date, versions and command; ``parameters``; ``steps``; ``manager``;
    ``targets``) to ``json_path`` and returns it.

    Raises:
        kvoff._optional.MissingExtraError: vLLM is not installed (an ``ImportError`` naming
            the ``vllm`` extra).
        RuntimeError: as :func:`bench_steps_vs_vllm` and :func:`bench_manager_vs_vllm`.
        OSError: the JSON file cannot be written.
    """
    import json

    vllm = require("vllm", VS_VLLM_FEATURE)

    from kvoff.tools.bench import run_info

    steps = bench_steps_vs_vllm(p, log=log)
    if log:
        log(f"manager: {p.manager_blocks:,} slots, {p.manager_batch}-key calls")
    manager = bench_manager_vs_vllm(p)
    params = asdict(p)
    params["running"] = list(p.running)
    document = {
        "benchmark": "kvoff bench scheduler --vs-vllm",
        "run": {**run_info(argv), "vllm": vllm.__version__},
        "parameters": params,
        "units": "*_us: microseconds per engine step (median over the timed steps); "
        "ns_per_key_op: nanoseconds per key and operation; key_ops_per_s over whole rounds",
        "targets": {
            "vllm_cpu_spec_vs_kvoff_at_256_running_min": TARGET_STEP_RATIO,
            "vllm_vs_kvoff_at_256_running_min": TARGET_STEP_RATIO,
            "manager_kvoff_vs_vllm_min": TARGET_MANAGER_SPEEDUP,
            **(
                {
                    "node_pool_vs_private_at_256_running_max": TARGET_NODE_POOL_RATIO,
                    "kvoff_node_pool_vs_private_at_256_running_max": TARGET_NODE_POOL_RATIO,
                }
                if p.node_pool
                else {}
            ),
        },
        "steps": steps,
        "manager": manager,
    }
    out(format_vs_vllm(document))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(document, indent=2) + "\n")
        out(f"JSON written to {json_path}")
    return document
