"""Recording for ``kvoff bench manager-calls`` (:mod:`kvoff.tools.bench_manager_calls`, whose
docstring gives the log's format): one vLLM engine in a child process with vLLM's
``OffloadingConnector`` over :class:`kvoff.integrations.vllm.KvoffOffloadingSpec`, every call of
``KvoffOffloadingManager`` (and of the connector scheduler's ``get_num_new_matched_tokens`` and
``update_connector_output``) written as one JSON line, in call order.

Run as ``python -m kvoff.tools.manager_calls_record PLAN.json LOG.jsonl`` by
:func:`record_manager_calls` (vLLM keeps process-wide state). Needs vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvoff._optional import require
from kvoff.sizing import bytes_per_gpu_block

__all__ = ["LOG_VERSION", "RecordConfig", "record_manager_calls"]

LOG_VERSION = 1
"""The log format's version (the header's ``version``)."""


# ------------------------------------------------------------------------------ recording


@dataclass(frozen=True)
class RecordConfig:
    """The recorded engine run.

    Attributes:
        trace: a bundled trace name (``conversation``, ``synthetic``) or a JSONL path.
        limit: the first ``limit`` requests of the trace.
        trace_block_size: tokens per trace hash id in the trace (512 for Mooncake).
        tokens_per_hash: prompt tokens per hash id in the run (scales the trace down).
        max_tokens: tokens generated per request (greedy, ``ignore_eos``).
        concurrency: requests in flight (closed loop; vLLM's ``max_num_seqs``).
        block_size: vLLM's tokens per GPU block (= per offloaded block here; a multiple of 32 on
            the CPU backend).
        num_gpu_blocks: vLLM's ``num_gpu_blocks_override`` (None: room for ``concurrency`` of
            the longest requests, as ``kvoff replay --engine vllm``).
        cpu_blocks: CPU pool slots; ``cpu_bytes_to_use`` is this × the model's KV bytes per
            block (the recorded header has the slots the spec made).
        eviction_policy: kvoff's policy in the recorded engine.
        model: a tiny model kind (``llama``, ...) or a model folder.
        dtype: the engine's dtype.
    """

    trace: str = "conversation"
    limit: int = 500
    trace_block_size: int = 512
    tokens_per_hash: int = 32
    max_tokens: int = 16
    concurrency: int = 8
    block_size: int = 32
    num_gpu_blocks: int | None = None
    cpu_blocks: int = 4096
    eviction_policy: str = "lru"
    model: str = "llama"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("limit", "trace_block_size", "tokens_per_hash", "max_tokens", "concurrency",
                     "block_size", "cpu_blocks"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2, got {self.num_gpu_blocks}")


def _kv_bytes_per_block(model_dir: Path, dtype: str, block_size: int) -> int:
    """KV bytes of one GPU block over all layers (K and V) of a full-attention model folder."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    itemsize = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}.get(dtype)
    if itemsize is None:
        raise ValueError(f"dtype {dtype!r}: use float32, bfloat16 or float16")
    # K and V per layer, each block_size tokens × heads × head_dim
    chunk = int(heads) * int(head_dim) * itemsize * block_size
    return bytes_per_gpu_block([chunk] * (2 * int(cfg["num_hidden_layers"])), 1)


def _plan(config: RecordConfig) -> dict[str, Any]:
    """The child's plan: prompts and engine settings as ``kvoff replay --engine vllm`` makes
    them, with the spec connector and a pool of ``cpu_blocks`` slots."""
    from kvoff.tools.replay_vllm import VllmReplayConfig, replay_plans

    prompts, base = replay_plans(
        VllmReplayConfig(
            trace=config.trace, limit=config.limit, trace_block_size=config.trace_block_size,
            tokens_per_hash=config.tokens_per_hash, max_tokens=config.max_tokens,
            concurrency=config.concurrency, block_size=config.block_size,
            num_gpu_blocks=config.num_gpu_blocks, model=config.model, dtype=config.dtype,
            engines=("kvoff",),
        )
    )  # fmt: skip
    per_block = _kv_bytes_per_block(Path(base["model"]), config.dtype, config.block_size)
    extra = {
        "cpu_bytes_to_use": config.cpu_blocks * per_block,
        "eviction_policy": config.eviction_policy,
    }
    return {**base, "prompts": prompts, "extra": extra, "config": asdict(config)}


def _keys_json(ctx: Any, keys: Iterable[bytes]) -> list[list[Any]]:
    """``[[hex, position], ...]`` of keys, in the given order."""
    return [[bytes(k).hex(), ctx.get_offload_key_position(k)] for k in keys]


def _install_recorder(emit: Callable[[dict[str, Any]], None]) -> None:
    """Wraps ``KvoffOffloadingManager`` (every manager call) and vLLM's
    ``OffloadingConnectorScheduler`` (``get_num_new_matched_tokens``,
    ``update_connector_output``) so that each call is emitted after it ran."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )

    import kvoff.integrations.vllm as kv

    cls = kv.KvoffOffloadingManager
    real = {n: getattr(cls, n) for n in ("on_new_request", "lookup", "prepare_load",
            "complete_load", "prepare_store", "complete_store", "touch",
            "on_request_finished")}  # fmt: skip

    def on_new_request(self: Any, ctx: Any) -> Any:
        out = real["on_new_request"](self, ctx)
        emit({"ev": "new", "req": ctx.req_id})
        return out

    def lookup(self: Any, key: bytes, ctx: Any) -> Any:
        out = real["lookup"](self, key, ctx)
        emit({"ev": "lookup", "req": ctx.req_id, "key": _keys_json(ctx, [key])[0],
              "result": out.name})  # fmt: skip
        return out

    def keyed(name: str) -> Callable[..., Any]:
        def call(self: Any, keys: Any, ctx: Any, *args: Any, **kwargs: Any) -> Any:
            keys = list(keys)
            out = real[name](self, keys, ctx, *args, **kwargs)
            order = sorted(keys, key=lambda k: ctx.get_offload_key_position(k) or 0)
            ev: dict[str, Any] = {"ev": name, "req": ctx.req_id, "keys": _keys_json(ctx, order)}
            if name == "complete_store":
                ev["success"] = bool(args[0] if args else kwargs.get("success", True))
            emit(ev)
            return out

        return call

    def prepare_store(self: Any, keys: Any, ctx: Any) -> Any:
        keys = list(keys)
        out = real["prepare_store"](self, keys, ctx)
        emit({
            "ev": "prepare_store", "req": ctx.req_id, "keys": _keys_json(ctx, keys),
            "stored": None if out is None else [bytes(k).hex() for k in out.keys_to_store],
            "evicted": [] if out is None else [bytes(k).hex() for k in out.evicted_keys],
        })  # fmt: skip
        return out

    def on_request_finished(self: Any, ctx: Any) -> None:
        real["on_request_finished"](self, ctx)
        emit({"ev": "finish", "req": ctx.req_id})

    cls.on_new_request = on_new_request  # type: ignore[method-assign]
    cls.lookup = lookup  # type: ignore[method-assign]
    cls.prepare_store = prepare_store  # type: ignore[method-assign]
    cls.on_request_finished = on_request_finished  # type: ignore[method-assign]
    for name in ("prepare_load", "complete_load", "complete_store", "touch"):
        setattr(cls, name, keyed(name))

    sched = OffloadingConnectorScheduler
    real_match, real_update = sched.get_num_new_matched_tokens, sched.update_connector_output

    def match(self: Any, request: Any, num_computed_tokens: int, *args: Any, **kw: Any) -> Any:
        out = real_match(self, request, num_computed_tokens, *args, **kw)
        status = self._req_status.get(request.request_id)
        if status is not None:
            ctx = status.req_context
            keys = [k for g in status.group_states for k in g.offload_keys]
            emit({"ev": "round", "req": ctx.req_id, "computed": num_computed_tokens,
                  "result": out[0], "keys": _keys_json(ctx, keys)})  # fmt: skip
        return out

    def update(self: Any, connector_output: Any) -> Any:
        emit({"ev": "update"})
        return real_update(self, connector_output)

    sched.get_num_new_matched_tokens = match  # type: ignore[method-assign]
    sched.update_connector_output = update  # type: ignore[method-assign]


def _record_child(plan: dict[str, Any], log_path: str) -> None:
    """The engine run in the child process (vLLM keeps process-wide state)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    with open(log_path, "w") as out:

        def emit(ev: dict[str, Any]) -> None:
            out.write(json.dumps(ev, separators=(",", ":")) + "\n")

        _install_recorder(emit)
        extra = {**plan["extra"], "spec_name": "KvoffOffloadingSpec",
                 "spec_module_path": "kvoff.integrations.vllm"}  # fmt: skip
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config=extra, kv_load_failure_policy="recompute",
        )  # fmt: skip
        llm = LLM(model=plan["model"], kv_transfer_config=transfer, **plan["engine"])
        engine = llm.llm_engine
        sched = engine.engine_core.engine_core.scheduler.connector.connector_scheduler
        groups = sched.config.kv_group_configs
        if len(groups) != 1:
            raise ValueError(
                f"the model has {len(groups)} KV cache groups; the replay handles one "
                "(full attention: --engine-model llama)"
            )
        emit({
            "ev": "header", "version": LOG_VERSION, "cpu_blocks": int(sched.manager.num_blocks),
            "tokens_per_chunk": int(groups[0].tokens_per_chunk),
            "block_size": int(plan["engine"]["block_size"]),
            "policy": plan["extra"]["eviction_policy"], "manager": "kvoff",
            "cpu_bytes_to_use": plan["extra"]["cpu_bytes_to_use"], "config": plan["config"],
            "engine": {k: v for k, v in plan["engine"].items() if k != "gpu_memory_utilization"},
            "model": plan["model"],
        })  # fmt: skip
        prompts: list[list[int]] = plan["prompts"]
        params = SamplingParams(max_tokens=plan["max_tokens"], temperature=0.0, ignore_eos=True)
        queue = deque(range(len(prompts)))
        in_flight: set[str] = set()
        done = 0
        start = time.perf_counter()
        while queue or in_flight:
            while queue and len(in_flight) < plan["concurrency"]:
                i = queue.popleft()
                rid = f"req-{i}"
                engine.add_request(rid, TokensPrompt(prompt_token_ids=prompts[i]), params)
                in_flight.add(rid)
            for o in engine.step():
                if o.finished:
                    in_flight.discard(o.request_id)
                    done += 1
                    if done % 50 == 0:
                        print(f"recorded {done}/{len(prompts)} requests", file=sys.stderr,
                              flush=True)  # fmt: skip
        while sched.has_pending_push_work():  # the last stores complete
            engine.step()
        wall = time.perf_counter() - start
        metrics = {
            m.name: m.value
            for m in llm.get_metrics()
            if isinstance(getattr(m, "value", None), (int, float))
        }
        keep = ("vllm:prompt_tokens", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
                "vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_queries",
                "vllm:num_preemptions")  # fmt: skip
        emit({"ev": "end", "wall_s": wall, "requests": len(prompts),
              "input_tokens": sum(len(p) for p in prompts),
              "metrics": {k: metrics.get(k) for k in keep}})  # fmt: skip


def record_manager_calls(
    config: RecordConfig, log_path: Path, log: Callable[[str], None] | None = None
) -> float:
    """Runs the engine of ``config`` in a child process and writes its manager-call log (JSON
    lines, see the module docstring) to ``log_path``. Returns the child's wall time in seconds.

    Raises:
        ValueError: a bad trace or configuration.
        RuntimeError: the engine run failed (its output's tail is in the message).
        kvoff._optional.MissingExtraError: vLLM is not installed (an ``ImportError``).
    """
    # fail early, in this process, when vLLM is missing
    require("vllm", "recording vLLM's manager calls (kvoff bench manager-calls)")

    plan = _plan(config)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvoff-manager-calls-") as tmp:
        plan_path = Path(tmp) / "plan.json"
        plan_path.write_text(json.dumps(plan))
        if log:
            log(f"recording {len(plan['prompts'])} requests through vLLM ({plan['model']}, "
                f"{config.cpu_blocks} CPU slots requested)")  # fmt: skip
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "kvoff.tools.manager_calls_record", str(plan_path),
             str(log_path)],
            capture_output=True, text=True, check=False,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        )  # fmt: skip
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(
            f"the recording engine run failed (exit {proc.returncode}):\n"
            + (proc.stdout[-2000:] + proc.stderr[-4000:]).strip()
        )
    return wall


def _child_main(argv: Sequence[str]) -> int:
    plan_path, log_path = argv
    _record_child(json.loads(Path(plan_path).read_text()), log_path)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
