"""``kvoff replay --engines N --node-pool``: N engines as separate processes on one node pool.

The trace is split across the engines (``--assign round_robin|session``, as for in-process
engines); each engine is a process of its own running :func:`kvoff.tools.replay.run_replay` on
its requests with a :class:`kvoff.node_pool.NodePoolClient` for an index and the pool's slots
mapped for a CPU pool, so every byte it loads was copied into the shared slots by whichever
engine stored it, and is checked against the pattern it was computed with. Without a socket, a
pool of the run's size (``--cpu-blocks`` / ``--cpu-bytes``) is started for the run and stopped
after it.

The engines take turns in trace order (request ``i`` starts when request ``i − 1`` has ended,
in whichever process), so that the hit rate compares with one engine's on the same pool: the
engine waits for its request's stores before it passes the turn on (a replay of hit rates, not
of time: ``--compute`` is not offered here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvoff.tools.request_loop import ReplayConfig, replay_requests
from kvoff.tools.traces import TraceRequest

__all__ = ["run_node_pool_replay"]


def _engine_main(
    config: ReplayConfig,
    requests: list[TraceRequest],
    indices: list[int],
    turn: Any,
    results: Any,
    engine: int,
) -> None:
    """One engine process: its requests in turn; its summary (or its error) to ``results``."""
    from kvoff.tools import replay as replay_mod

    try:

        def before(i: int) -> None:
            while turn.value < indices[i]:
                time.sleep(0.0002)

        def after(done: int) -> None:
            with turn.get_lock():
                turn.value = indices[done - 1] + 1

        res = replay_mod.run_replay(config, requests=requests, before=before, progress=after)
        results.put((engine, res.summary(), None))
    except Exception as e:  # reported by the parent, which stops the others
        results.put((engine, None, f"{type(e).__name__}: {e}"))


def _pool_for(config: ReplayConfig, socket_path: str, region: str) -> Any:
    """A pool of the run's size and policy in a child process (a context manager)."""
    from kvoff.node_pool.process import pool_process
    from kvoff.tools.replay import replay_cpu_blocks

    slots, slot_bytes = replay_cpu_blocks(config)
    return pool_process(socket_path, slots, slot_bytes, region=region, policy=config.policy)


def run_node_pool_replay(
    config: ReplayConfig,
    requests: list[TraceRequest] | None = None,
    socket_path: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Replays ``config`` with ``config.engines`` engine processes on one node pool.

    Args:
        config: the replay (its ``cpu_blocks`` / ``cpu_bytes`` and ``policy`` size the pool
            started for the run; ignored with ``socket_path``).
        requests: already loaded requests (else the trace is read).
        socket_path: a running pool's socket (``kvoff pool serve``); None: one is started.
        progress: called with the number of requests done, about every 0.2 s.

    Returns:
        ``{"engines": [summary per engine], "total": {...}, "pool": status}``: the total has
        requests, input and hit tokens, ``hit_rate``, ``corrupted_blocks``,
        ``failed_transfers``, ``lost_lookups`` and the loads by source (``blocks_loaded``: all
        from the node pool's slots).

    Raises:
        ValueError: tiers, ``compute`` or a GPU prefix cache with engines on a node pool
            (not supported yet), or a bad configuration (as :func:`run_replay`).
        RuntimeError: the pool did not start, or an engine failed (its error quoted).
    """
    from kvoff.tools.replay import _engine_of

    if config.disk_path or config.remote_url or config.compute or config.warmup_requests:
        raise ValueError(
            "engines on a node pool replay without tiers, --compute or --warmup for now; drop them"
        )
    reqs = replay_requests(config, requests)
    n = config.engines
    shares: list[list[TraceRequest]] = [[] for _ in range(n)]
    indices: list[list[int]] = [[] for _ in range(n)]
    for i, r in enumerate(reqs):
        e = _engine_of(r, i, config)
        shares[e].append(r)
        indices[e].append(i)
    tmp = tempfile.mkdtemp(prefix="kvoff-node-pool-")
    own = socket_path is None
    sock = socket_path or os.path.join(tmp, "pool.sock")
    stack = contextlib.ExitStack()
    if own:
        stack.enter_context(_pool_for(config, sock, f"kvoff-replay-{os.getpid()}"))
    ctx = mp.get_context("spawn")
    turn = ctx.Value("q", 0)
    results = ctx.Queue()
    engine_config = dataclasses.replace(
        config, engines=1, node_pool=sock, limit=None, start=0, assign="round_robin"
    )
    procs = [
        ctx.Process(
            target=_engine_main,
            args=(engine_config, shares[e], indices[e], turn, results, e),
            daemon=True,
        )
        for e in range(n)
        if shares[e]
    ]
    with stack:
        summaries = _run_engines(procs, results, turn, progress, len(reqs))
        from kvoff.node_pool import NodePoolClient

        status = NodePoolClient(sock, b"kvoff replay", name="kvoff replay").status()
    engines = [summaries[e] for e in sorted(summaries)]
    total: dict[str, Any] = {"engines": n}
    for k in ("requests", "input_tokens", "gpu_hit_tokens", "cpu_hit_tokens", "hit_tokens",
              "blocks_loaded", "blocks_stored", "blocks_verified", "corrupted_blocks",
              "failed_transfers", "lost_lookups", "lookup_retries", "bytes_loaded",
              "bytes_stored"):  # fmt: skip
        total[k] = sum(s[k] for s in engines)
    total["hit_rate"] = total["hit_tokens"] / total["input_tokens"] if total["input_tokens"] else 0
    total["loads_by_source"] = {"node_pool": total["blocks_loaded"]}
    total["cpu_blocks"] = status["num_slots"]
    total["policy"] = status["policy"]
    total["evictions"] = status["evictions"]
    return {"engines": engines, "total": total, "pool": status}


def _run_engines(
    procs: list[Any], results: Any, turn: Any, progress: Callable[[int], None] | None, total: int
) -> dict[int, dict[str, Any]]:
    """Starts the engine processes and collects their summaries (engine index -> summary);
    the processes are joined (or killed) on the way out, also on an error.

    Raises:
        RuntimeError: an engine died or reported an error.
    """
    summaries: dict[int, dict[str, Any]] = {}
    try:
        for proc in procs:
            proc.start()
        last = -1
        while len(summaries) < len(procs):
            try:
                engine, summary, error = results.get(timeout=0.2)
            except Exception:  # queue.Empty: check the engines are alive
                if progress is not None and turn.value != last:
                    last = turn.value
                    progress(last)
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"an engine process died (exit code {dead[0].exitcode})"
                    ) from None
                continue
            if error is not None:
                raise RuntimeError(f"engine {engine} failed: {error}")
            summaries[engine] = summary
        if progress is not None:
            progress(total)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return summaries
