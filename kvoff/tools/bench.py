"""``kvoff bench scheduler``: the offloading manager's speed on large pools, three ways.

For each pool size the same workload (same keys, same calls, same order) runs on:

* ``in_core``: the C++ manager called from C++ with keys generated in C++ (the path of the C++
  scheduler), timed in C++ (``kvoff._bench.bench_manager``, ``cpp/bench/manager_bench.cpp``);
* ``binding``: the C++ manager through the Python binding, keys as lists of ``bytes``;
* ``python_baseline``: :class:`PyLRUManager`, a straightforward pure-Python implementation of
  the same manager semantics on an ``OrderedDict`` (LRU only).

Workload (``cpp/bench/manager_bench.h`` is the reference; :func:`workload_keys` and
:func:`lookup_ids` reproduce it with numpy): fill a pool of N slots with keys 0..N-1, touch
them in a random order, then time ``lookup`` calls of ``batch`` random held keys (one call in
eight hits a never-stored key at a random position and stops there) and, on the full pool,
``prepare_store`` calls of ``batch`` new keys (each evicting ``batch`` blocks) followed by
``complete_store``. Each operation runs ``repeat`` rounds of ``batches_per_round`` calls; the
median round is reported. Costs are nanoseconds per key (lookup: keys examined, up to and
including the first miss). The three paths must agree on the workload totals (lookup hits,
evictions), which is checked.

The results are one JSON document: ``run`` (machine, date, versions, command), ``parameters``
and ``manager`` (one entry per pool size). Other benchmark sections (per-step scheduler
numbers) are added as further top-level keys by their own functions.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvoff.tools.bench_steps import bench_scheduler_steps
from kvoff.tools.info import build_info as kvoff_build_info

__all__ = [
    "DEFAULT_POOL_SIZES",
    "LARGE_POOL_SIZE",
    "MIN_SPEEDUP",
    "ManagerBenchParams",
    "PyLRUManager",
    "PyPrepareStoreOutput",
    "format_manager_table",
    "lookup_ids",
    "machine_info",
    "run_info",
    "run_manager_bench",
    "run_scheduler_bench",
    "shuffle_order",
    "workload_keys",
]

DEFAULT_POOL_SIZES = (65_536, 1_048_576)
"""Pool sizes (slots) measured by default."""
LARGE_POOL_SIZE = 4_194_304
"""The extra pool size of ``--large``."""
MIN_SPEEDUP = 20.0
"""The target: the C++ manager in-core at least this many times faster than the baseline."""

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MISSING_ID_BASE = 1 << 40  # ids of never-stored keys (kBenchMissingIdBase)
_STREAM_KEY, _STREAM_SHUFFLE, _STREAM_LOOKUP, _STREAM_MISS = 0, 1, 2, 3

_READY = 2
_PENDING = 1


# ----------------------------------------------------------------------------- the workload


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of a uint64 array, modulo 2**64 (``bench_mix`` in manager_bench.cpp)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _random(seed: int, stream: int, n: np.ndarray) -> np.ndarray:
    """Random numbers ``n`` (uint64 array) of ``stream`` for ``seed`` (``bench_random``)."""
    base = (seed * _GOLDEN + (stream << 56)) & _MASK64
    with np.errstate(over="ignore"):
        return _mix(n.astype(np.uint64) + np.uint64(base))


def workload_keys(ids: np.ndarray | Sequence[int], key_bytes: int, seed: int) -> list[bytes]:
    """The keys of the given key ids, as the C++ driver makes them (``bench_key``): ``key_bytes
    - 1`` bytes of little-endian random words, then the group byte 0. Fresh ``bytes`` objects.

    Raises:
        ValueError: ``key_bytes`` < 2.
    """
    if key_bytes < 2:
        raise ValueError(f"key_bytes must be >= 2 (hash bytes + 1 group byte), got {key_bytes}")
    ids = np.asarray(ids, dtype=np.uint64)
    words = (key_bytes - 1 + 7) // 8
    with np.errstate(over="ignore"):
        n = ids[:, None] * np.uint64(8) + np.arange(words, dtype=np.uint64)[None, :]
    raw = _random(seed, _STREAM_KEY, n).astype("<u8").view(np.uint8).reshape(len(ids), words * 8)
    arena = np.zeros((len(ids), key_bytes), dtype=np.uint8)
    arena[:, : key_bytes - 1] = raw[:, : key_bytes - 1]
    buf = arena.tobytes()
    return [buf[i : i + key_bytes] for i in range(0, len(buf), key_bytes)]


def shuffle_order(num_blocks: int, seed: int) -> np.ndarray:
    """Key ids 0..num_blocks-1 in the setup's random touch order (sorted by their random
    number, ties by id)."""
    r = _random(seed, _STREAM_SHUFFLE, np.arange(num_blocks, dtype=np.uint64))
    return np.argsort(r, kind="stable")


def lookup_ids(num_blocks: int, batch: int, calls: int, seed: int) -> np.ndarray:
    """The key ids of the lookup calls, shape (calls, batch): random held ids, and in one call
    of eight a never-stored id (2**40 + call) at a random position."""
    n = np.arange(calls * batch, dtype=np.uint64)
    ids = (_random(seed, _STREAM_LOOKUP, n) % np.uint64(num_blocks)).reshape(calls, batch)
    m = _random(seed, _STREAM_MISS, np.arange(calls, dtype=np.uint64))
    calls_with_miss = np.nonzero(m % np.uint64(8) == 0)[0]
    pos = (m[calls_with_miss] >> np.uint64(3)) % np.uint64(batch)
    ids[calls_with_miss, pos.astype(np.int64)] = np.uint64(_MISSING_ID_BASE) + calls_with_miss
    return ids


# ------------------------------------------------------------------------ the Python baseline


class PyPrepareStoreOutput(NamedTuple):
    """What :meth:`PyLRUManager.prepare_store` decided (as ``PrepareStoreOutput``)."""

    keys_to_store: list[bytes]
    block_ids: list[int]
    evicted_keys: list[bytes]


class PyLRUManager:
    """The CPU offloading manager's semantics in plain Python (LRU only): the benchmark's
    baseline, and an executable statement of the semantics (tests compare it with the C++
    manager operation by operation).

    ``_blocks`` maps each held key to ``[slot, state, pins]`` in LRU order (first = least
    recently used); free slots are a LIFO stack like ``CPUBlockPool``'s, so the block ids match
    the C++ manager's. Keys are ``bytes``.
    """

    def __init__(self, num_blocks: int) -> None:
        """A pool of ``num_blocks`` free slots.

        Raises:
            ValueError: ``num_blocks`` < 1.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._free = list(range(num_blocks - 1, -1, -1))
        self._blocks: OrderedDict[bytes, list[int]] = OrderedDict()
        self._evictable = 0  # ready and unpinned

    def __len__(self) -> int:
        """Keys held (ready or pending)."""
        return len(self._blocks)

    def lookup(self, keys: Sequence[bytes]) -> int | None:
        """How many leading keys are ready; None when a pending key comes before the first
        missing one. Changes nothing."""
        blocks = self._blocks
        hits = 0
        for key in keys:
            block = blocks.get(key)
            if block is None:
                return hits
            if block[1] != _READY:
                return None
            hits += 1
        return hits

    def touch(self, keys: Sequence[bytes]) -> None:
        """Marks held keys most recently used, last to first (keys[0] ends the most recent)."""
        blocks = self._blocks
        for key in reversed(keys):
            if key in blocks:
                blocks.move_to_end(key)

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Pins every key (once per occurrence) and returns their slots.

        Raises:
            ValueError: a key is not ready; nothing is pinned.
        """
        blocks = [self._blocks.get(key) for key in keys]
        for i, block in enumerate(blocks):
            if block is None or block[1] != _READY:
                raise ValueError(f"prepare_load: keys[{i}] is not ready")
        for block in blocks:
            if block[2] == 0:
                self._evictable -= 1
            block[2] += 1
        return [block[0] for block in blocks]

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Unpins every key once per occurrence.

        Raises:
            ValueError: a key is not ready or not pinned as often as it occurs; nothing changes.
        """
        counts = Counter(keys)
        for key, count in counts.items():
            block = self._blocks.get(key)
            if block is None or block[1] != _READY or block[2] < count:
                raise ValueError(f"complete_load: key {key.hex()} is not being loaded")
        for key, count in counts.items():
            block = self._blocks[key]
            block[2] -= count
            if block[2] == 0:
                self._evictable += 1

    def prepare_store(self, keys: Sequence[bytes]) -> PyPrepareStoreOutput | None:
        """Gives each key not held a slot (pending), evicting ready unpinned blocks that are not
        keys of this call, least recently used first. Returns None, changing nothing, when
        free slots plus evictable blocks (not keys of this call) are fewer than the new keys."""
        blocks = self._blocks
        new: list[bytes] = []
        seen: set[bytes] = set()
        protected: set[bytes] = set()
        for key in keys:
            block = blocks.get(key)
            if block is not None:
                if block[1] == _READY and block[2] == 0:
                    protected.add(key)
            elif key not in seen:
                seen.add(key)
                new.append(key)
        free = self._free
        victims: list[bytes] = []
        to_evict = len(new) - len(free)
        if to_evict > 0:
            if self._evictable - len(protected) < to_evict:
                return None
            for key, block in blocks.items():
                if block[1] == _READY and block[2] == 0 and key not in protected:
                    victims.append(key)
                    if len(victims) == to_evict:
                        break
            for key in victims:
                free.append(blocks.pop(key)[0])
            self._evictable -= len(victims)
        slots = [free.pop() for _ in new]
        for i in range(len(new) - 1, -1, -1):  # keys[0] ends the most recent
            blocks[new[i]] = [slots[i], _PENDING, 0]
        return PyPrepareStoreOutput(new, slots, victims)

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """Pending keys become ready (success) or are dropped, freeing their slots.

        Raises:
            ValueError: a key is not pending; nothing changes.
        """
        blocks = self._blocks
        done: list[bytes] = []
        seen: set[bytes] = set()
        for i, key in enumerate(keys):
            block = blocks.get(key)
            if block is None or block[1] != _PENDING:
                raise ValueError(f"complete_store: keys[{i}] is not pending")
            if key not in seen:
                seen.add(key)
                done.append(key)
        if success:
            for key in done:
                blocks[key][1] = _READY
            self._evictable += len(done)
        else:
            for key in done:
                self._free.append(blocks.pop(key)[0])


# ------------------------------------------------------------------------------ measurement


@dataclass(frozen=True)
class ManagerBenchParams:
    """Parameters of the manager benchmark (see the module docstring)."""

    pool_sizes: tuple[int, ...] = DEFAULT_POOL_SIZES
    eviction_policy: str = "lru"
    key_bytes: int = 9
    batch: int = 256
    batches_per_round: int = 1024
    repeat: int = 5
    seed: int = 0
    baseline: bool = True  # run the pure-Python baseline (LRU only)


def _timing(rounds: list[float], keys: int, calls: int) -> dict[str, float | int]:
    """The median round of ``rounds`` (seconds) as the C++ driver reports it."""
    ordered = sorted(rounds)
    seconds = max(ordered[len(ordered) // 2], 1e-12)
    return {
        "keys": keys,
        "calls": calls,
        "seconds": seconds,
        "best_seconds": ordered[0],
        "ns_per_key": seconds * 1e9 / keys if keys else 0.0,
        "keys_per_s": keys / seconds,
        "calls_per_s": calls / seconds,
    }


def _run_python_path(manager: Any, n: int, p: ManagerBenchParams) -> dict[str, Any]:
    """Runs the workload on ``manager`` (the binding's CPUOffloadingManager or PyLRUManager)
    from Python; the same numbers as ``kvoff._bench.bench_manager``."""
    batch, calls = p.batch, p.batches_per_round
    start = time.perf_counter()
    for first in range(0, n, batch):
        keys = workload_keys(np.arange(first, min(n, first + batch)), p.key_bytes, p.seed)
        if manager.prepare_store(keys) is None:
            raise RuntimeError(f"bench: filling the pool failed at key {first}")
        manager.complete_store(keys)
    order = shuffle_order(n, p.seed)
    for first in range(0, n, batch):
        manager.touch(workload_keys(order[first : first + batch], p.key_bytes, p.seed))
    setup_seconds = time.perf_counter() - start

    ids = lookup_ids(n, batch, calls, p.seed)
    flat = workload_keys(ids.reshape(-1), p.key_bytes, p.seed)
    lookups = [flat[b * batch : (b + 1) * batch] for b in range(calls)]
    del flat
    result: dict[str, Any] = {}
    rounds: list[float] = []
    hits_total = examined = 0
    lookup = manager.lookup
    clock = time.perf_counter
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(p.repeat):
            hits_total = examined = 0
            t0 = clock()
            for keys in lookups:
                hits = lookup(keys) or 0
                hits_total += hits
                examined += hits + 1 if hits < batch else hits
            rounds.append(clock() - t0)
        result["lookup"] = _timing(rounds, examined, calls)
        result["lookup_hits"] = hits_total

        prepare_rounds: list[float] = []
        complete_rounds: list[float] = []
        next_id = n
        prepare_store, complete_store = manager.prepare_store, manager.complete_store
        for r in range(p.repeat):
            flat = workload_keys(
                np.arange(next_id, next_id + calls * batch, dtype=np.uint64), p.key_bytes, p.seed
            )
            next_id += calls * batch
            stores = [flat[b * batch : (b + 1) * batch] for b in range(calls)]
            del flat
            prepare_s = complete_s = 0.0
            evicted = 0
            for keys in stores:
                t0 = clock()
                out = prepare_store(keys)
                if out is None:
                    raise RuntimeError("bench: prepare_store refused a store into a full pool")
                evicted += len(out.evicted_keys)
                del out
                t1 = clock()
                complete_store(keys)
                t2 = clock()
                prepare_s += t1 - t0
                complete_s += t2 - t1
            prepare_rounds.append(prepare_s)
            complete_rounds.append(complete_s)
            if r == 0:
                result["evicted"] = evicted
            del stores
        result["prepare_store"] = _timing(prepare_rounds, calls * batch, calls)
        result["complete_store"] = _timing(complete_rounds, calls * batch, calls)
    finally:
        if gc_was_enabled:
            gc.enable()
    result["setup_seconds"] = setup_seconds
    return result


_OPERATIONS = ("lookup", "prepare_store", "complete_store")


def _ratio(slow: dict[str, Any] | None, fast: dict[str, Any]) -> float | None:
    if slow is None or not fast["ns_per_key"]:
        return None
    return slow["ns_per_key"] / fast["ns_per_key"]


def run_manager_bench(
    params: ManagerBenchParams, log: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """Runs the three paths on every pool size; returns one entry per pool size:
    ``{"pool_size", "operations": {op: {"in_core", "binding", "python_baseline",
    "in_core_vs_baseline", "binding_vs_baseline"}}, "lookup_hits", "evicted",
    "setup_seconds": {path: s}}``, with ``op`` in lookup, prepare_store, complete_store and
    store (prepare + complete). Costs in ns per key; ratios are baseline ns / path ns (None
    without a baseline).

    Raises:
        ValueError: an unknown eviction policy (naming the choices), a parameter out of range, a
            pool size below ``batch``, or ``key_bytes`` too short for distinct keys.
        RuntimeError: the paths disagree on the workload totals (they must run the same one).
    """
    from kvoff import _bench, _scheduler

    policies = list(_scheduler.eviction_policies())
    if params.eviction_policy not in policies:
        raise ValueError(
            f"unknown eviction policy {params.eviction_policy!r}; choose one of {policies}"
        )
    small = [n for n in params.pool_sizes if n < params.batch]
    if small:
        raise ValueError(
            f"pool size {small[0]} is smaller than the batch ({params.batch} keys per call): a "
            "store batch must fit the pool; raise --pool-sizes or lower --batch"
        )
    if params.key_bytes < 2:
        raise ValueError(
            f"key_bytes must be >= 2 (hash bytes + 1 group byte), got {params.key_bytes}"
        )
    baseline = params.baseline and params.eviction_policy == "lru"
    entries = []
    for n in params.pool_sizes:
        if log:
            log(f"pool {n:,}: C++ in-core")
        try:
            core = dict(
                _bench.bench_manager(
                    n,
                    params.eviction_policy,
                    params.key_bytes,
                    params.batch,
                    params.batches_per_round,
                    params.repeat,
                    params.seed,
                )
            )
        except RuntimeError as exc:
            if "filling the pool failed" not in str(exc):
                raise
            # the random keys have (key_bytes - 1) hash bytes: too few repeat before the pool fills
            raise ValueError(
                f"--key-bytes {params.key_bytes} gives too few distinct keys for a pool of {n:,} "
                f"slots ({exc}); raise --key-bytes (default: 9)"
            ) from exc
        if log:
            log(f"pool {n:,}: C++ through the binding")
        binding = _run_python_path(
            _scheduler.CPUOffloadingManager(n, params.eviction_policy), n, params
        )
        py = None
        if baseline:
            if log:
                log(f"pool {n:,}: Python baseline")
            py = _run_python_path(PyLRUManager(n), n, params)
        for name, other in (("binding", binding), ("python_baseline", py)):
            if other is None:
                continue
            for total in ("lookup_hits", "evicted"):
                if other[total] != core[total]:
                    raise RuntimeError(
                        f"bench: the {name} path's {total} ({other[total]}) differs from the "
                        f"in-core path's ({core[total]}): the workloads are not the same"
                    )
        operations: dict[str, Any] = {}
        paths = {"in_core": core, "binding": binding, "python_baseline": py}
        for op in (*_OPERATIONS, "store"):
            row: dict[str, Any] = {}
            for path, res in paths.items():
                if res is None:
                    row[path] = None
                elif op == "store":
                    prep, comp = res["prepare_store"], res["complete_store"]
                    row[path] = _timing(
                        [prep["seconds"] + comp["seconds"]], prep["keys"], prep["calls"]
                    )
                else:
                    row[path] = {k: res[op][k] for k in res[op]}
            row["in_core_vs_baseline"] = _ratio(row["python_baseline"], row["in_core"])
            row["binding_vs_baseline"] = _ratio(row["python_baseline"], row["binding"])
            operations[op] = row
        entries.append(
            {
                "pool_size": n,
                "operations": operations,
                "lookup_hits": core["lookup_hits"],
                "evicted": core["evicted"],
                "setup_seconds": {
                    path: (res["setup_seconds"] if res is not None else None)
                    for path, res in paths.items()
                },
            }
        )
    return entries


def _fmt_ns(timing: dict[str, Any] | None) -> str:
    return "-" if timing is None else f"{timing['ns_per_key']:.1f}"


def _fmt_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.1f}x"


def format_manager_table(entries: list[dict[str, Any]], params: ManagerBenchParams) -> str:
    """The manager results as a plain-text table (ns per key, lower is better; ratios =
    baseline / path, higher is better)."""
    header = (
        f"{'pool':>11}  {'operation':<15}{'in-core':>10}{'binding':>10}{'python':>10}"
        f"{'in-core/py':>12}{'binding/py':>12}{'in-core Mkeys/s':>17}"
    )
    lines = [
        f"CPUOffloadingManager ({params.eviction_policy}): {params.batch} keys of "
        f"{params.key_bytes} bytes per call, {params.batches_per_round} calls x "
        f"{params.repeat} rounds (median); ns per key",
        header,
        "-" * len(header),
    ]
    for entry in entries:
        for op, row in entry["operations"].items():
            core = row["in_core"]
            lines.append(
                f"{entry['pool_size']:>11,}  {op:<15}{_fmt_ns(core):>10}"
                f"{_fmt_ns(row['binding']):>10}{_fmt_ns(row['python_baseline']):>10}"
                f"{_fmt_ratio(row['in_core_vs_baseline']):>12}"
                f"{_fmt_ratio(row['binding_vs_baseline']):>12}"
                f"{core['keys_per_s'] / 1e6:>17.1f}"
            )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- run metadata


def machine_info() -> dict[str, Any]:
    """The machine: CPU model (from /proc/cpuinfo where it exists), cores, platform."""
    cpu_model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": cpu_model,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
    }


def run_info(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Where and how a result was produced: command line, date (ISO, UTC), machine, versions."""
    import torch

    import kvoff

    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "command": " ".join(["kvoff", *args]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "kvoff_version": kvoff.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        # what the measured kvoff was compiled with (compiler, CUDA architectures, ...)
        "build": _build_summary(),
    }


def _build_summary() -> dict[str, Any]:
    info = kvoff_build_info()
    keep = ("built_torch", "built_torch_cuda", "with_cuda", "cuda_architectures", "cuda_compiler")
    return {k: v for k, v in info.as_dict().items() if k in keep} | {
        "cxx_compiler": info.cxx_compiler,
        "build_type": info.build_type,
        "runtime_matches": info.runtime_matches,
    }


DEFAULT_STEP_SHAPES: tuple[tuple[int, int], ...] = ((64, 1), (256, 2), (1024, 1), (1024, 4))


def format_steps_table(steps: list[dict[str, Any]]) -> str:
    """The per-step scheduler results as a text table (µs per decode step, facade and core;
    µs per admitted request, a miss and a whole-prompt hit with its load job)."""
    lines = [
        "",
        "scheduler steps (decode: 1 token per request per step; median step)",
        f"{'B':>6} {'G':>3} {'step us':>10} {'ns/req':>8} {'core us':>10} {'core ns/req':>12} "
        f"{'admit us/req':>13} {'hit us/req':>11} {'prefill ms':>11} {'blocks':>8}",
    ]
    for r in steps:
        lines.append(
            f"{r['num_requests']:>6} {r['num_groups']:>3} {r['decode_step_us']:>10.1f} "
            f"{r['decode_step_per_request_ns']:>8.0f} {r['decode_step_core_us']:>10.1f} "
            f"{r['decode_step_core_per_request_ns']:>12.0f} {r['admit_us_per_request']:>13.2f} "
            f"{r['admit_hit_us_per_request']:>11.2f} {r['prefill_step_ms']:>11.1f} "
            f"{r['prefill_blocks_stored']:>8}"
        )
    return "\n".join(lines)


def run_scheduler_bench(
    params: ManagerBenchParams,
    json_path: Path | None = None,
    argv: Sequence[str] | None = None,
    out: Callable[[str], None] = print,
    log: Callable[[str], None] | None = None,
    step_shapes: Sequence[tuple[int, int]] = DEFAULT_STEP_SHAPES,
    decode_steps: int = 64,
) -> dict[str, Any]:
    """``kvoff bench scheduler``: runs the manager benchmark and the per-step scheduler
    benchmark (:func:`kvoff.tools.bench_steps.bench_scheduler_steps` for each ``(B requests, G
    groups)`` of ``step_shapes``, under ``"scheduler_steps"``), prints the tables with ``out``,
    writes the JSON document to ``json_path`` (creating its folder) and returns it.

    Raises:
        ValueError / RuntimeError: as :func:`run_manager_bench`.
        OSError: the JSON file cannot be written.
    """
    entries = run_manager_bench(params, log=log)
    steps = []
    for b, g in step_shapes:
        if log is not None:
            log(f"scheduler steps: {b} requests x {g} groups")
        steps.append(bench_scheduler_steps(b, g, decode_steps=decode_steps, seed=params.seed))
    params_dict = asdict(params)
    params_dict["pool_sizes"] = list(params.pool_sizes)
    document: dict[str, Any] = {
        "benchmark": "kvoff bench scheduler",
        "run": run_info(argv),
        "parameters": params_dict,
        "units": "ns_per_key: nanoseconds per key (median round); keys_per_s, calls_per_s; "
        "*_vs_baseline: python_baseline ns_per_key / path ns_per_key",
        "target": {"min_speedup_vs_baseline": MIN_SPEEDUP},
        "manager": entries,
        "scheduler_steps": steps,
    }
    out(format_manager_table(entries, params))
    if steps:
        out(format_steps_table(steps))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(document, indent=2) + "\n")
        out(f"JSON written to {json_path}")
    return document
