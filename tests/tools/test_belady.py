"""Belady's MIN (``kvoff replay --policy min``): block misses against an exhaustive search on
small reference streams, and the replay's hit tokens against an independent model that shares no
code with kvoff (it reads the trace itself, finds each victim by scanning the future)."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from collections import OrderedDict
from functools import cache
from itertools import combinations, islice
from pathlib import Path

import pytest

import kvoff
from kvoff.tools.belady import NEVER, BeladyPool, min_block_misses, run_min_replay
from kvoff.tools.replay import ReplayConfig, run_replay

TRACES = Path(kvoff.__file__).parent / "data" / "traces"
N = 300


# ------------------------------------------------------------------ exhaustive search


def brute_force_misses(requests: list[tuple], capacity: int) -> int:
    """The fewest block misses any eviction order gives, under the store rule of
    :func:`min_block_misses` (leading hits; the keys after them stored all or nothing, the keys
    of the call not evicted for each other): every choice of victims is tried."""

    @cache
    def best(i: int, pool: frozenset) -> int:
        if i == len(requests):
            return 0
        keys = requests[i]
        misses = sum(1 for k in keys if k not in pool)
        h = 0
        while h < len(keys) and keys[h] in pool:
            h += 1
        call = keys[h:]
        new = [k for k in call if k not in pool]
        need = len(new) - (capacity - len(pool))
        evictable = sorted(pool - set(call))
        if need > len(evictable):  # refused: nothing changes
            return misses + best(i + 1, pool)
        if need <= 0:
            return misses + best(i + 1, pool | set(new))
        return misses + min(
            best(i + 1, (pool - set(victims)) | set(new))
            for victims in combinations(evictable, need)
        )

    return best(0, frozenset())


def _prefix_stream(rng: random.Random, n: int) -> list[tuple]:
    """Requests that are prefixes of a few conversations (keys (conversation, depth))."""
    out = []
    for _ in range(n):
        conv = rng.randrange(3)
        out.append(tuple((conv, d) for d in range(rng.randint(1, 3))))
    return out


def _free_stream(rng: random.Random, n: int) -> list[tuple]:
    """Requests of 1..3 distinct keys drawn from six, in any order (no prefix structure)."""
    return [tuple(rng.sample(range(6), rng.randint(1, 3))) for _ in range(n)]


@pytest.mark.parametrize("kind", ["prefix", "free"])
@pytest.mark.parametrize("seed", range(40))
def test_min_block_misses_equal_the_exhaustive_minimum(kind: str, seed: int) -> None:
    rng = random.Random(seed)
    stream = (_prefix_stream if kind == "prefix" else _free_stream)(rng, rng.randint(4, 9))
    capacity = rng.randint(3, 5)  # >= every request: no store is refused
    got = min_block_misses(stream, capacity)
    assert got == brute_force_misses(stream, capacity), (stream, capacity)


def test_the_exhaustive_minimum_beats_other_orders() -> None:
    # The check above is not vacuous: evicting the wrong block costs misses here, and LRU's
    # order does (a is reused, b never; LRU evicts a).
    stream = [("a",), ("b",), ("c",), ("a",)]
    assert brute_force_misses(stream, 2) == min_block_misses(stream, 2) == 3
    lru: OrderedDict = OrderedDict()
    misses = 0
    for keys in stream:
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
            else:
                misses += 1
                if len(lru) == 2:
                    lru.popitem(last=False)
                lru[k] = None
    assert misses == 4


def test_ties_evict_the_deeper_block_first() -> None:
    # a0 and its child a1 have the same next use (request 3); the pool must drop one of them
    # for c: MIN drops the deeper a1, so request 3 still hits a0 (a prefix keeps its head).
    pool = BeladyPool(2)
    assert pool.store(["a0", "a1"], [3, 3], [0, 1]) == (["a0", "a1"], [])
    stored, evicted = pool.store(["c"], [NEVER], [0])
    assert (stored, evicted) == (["c"], ["a1"])
    assert pool.leading_hits(["a0", "a1"]) == 1
    # the farthest next use goes first, whatever the depth
    pool = BeladyPool(2)
    pool.store(["a"], [9], [0])
    pool.store(["b"], [2], [5])
    assert pool.store(["c"], [4], [0]) == (["c"], ["a"])
    pool.reference("b", 7, 5)  # b's next use moves past c's
    assert pool.store(["d"], [NEVER], [0]) == (["d"], ["b"])


def test_store_is_all_or_nothing_and_protects_the_call() -> None:
    pool = BeladyPool(2)
    pool.store(["a", "b"], [NEVER, NEVER], [0, 1])
    assert pool.store(["a", "b", "c"], [1, 1, 1], [0, 1, 2]) is None  # 3 keys, 2 slots
    assert len(pool) == 2 and "a" in pool and "b" in pool and "c" not in pool
    stored, evicted = pool.store(["a", "c"], [NEVER, NEVER], [0, 1])
    assert (stored, evicted) == (["c"], ["b"])  # a is a key of the call


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="capacity of at least 1 block, got 0"):
        BeladyPool(0)
    with pytest.raises(ValueError, match="request 1 repeats a key"):
        min_block_misses([("a",), ("b", "b")], 2)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        run_min_replay(ReplayConfig(cpu_blocks=0, limit=3))
    with pytest.raises(ValueError, match="gpu_prefix_blocks must be >= 0"):
        run_min_replay(ReplayConfig(gpu_prefix_blocks=-1, limit=3))
    with pytest.raises(ValueError, match="offloaded_block_size=500"):
        run_min_replay(ReplayConfig(offloaded_block_size=500, cpu_blocks=10, limit=3))


# ------------------------------------------------------------ the replay against a model


def _read(name: str, n: int) -> list[dict]:
    with (TRACES / f"{name}_trace.jsonl").open() as fh:
        return [json.loads(line) for line in islice(fh, n)]


def model_min_replay(reqs: list[dict], bs: int, obs: int, gpu_cap: int, cpu_cap: int):
    """Per request (GPU hit tokens, kvoff hit tokens) with MIN under the replay's definition:
    each victim is found by scanning the later requests for every candidate's next use."""
    f = obs // bs
    requests = []
    for r in reqs:
        length, hids = r["input_length"], r["hash_ids"]

        def ident(p, length=length, hids=hids):
            return (hids[(min((p + 1) * bs, length) - 1) // 512], p)

        gkeys = [ident(p) for p in range(length // bs)]
        okeys = [ident((j + 1) * f - 1) for j in range(length // obs)]
        requests.append((gkeys, okeys))
    used = [frozenset(okeys) for _, okeys in requests]  # (a set per request: the scan's test)

    def next_use(key, after):
        for i in range(after + 1, len(requests)):
            if key in used[i]:
                return i
        return len(requests) + 1

    pool: dict = {}  # key -> depth
    gpu: OrderedDict = OrderedDict()
    out = []
    for i, (gkeys, okeys) in enumerate(requests):
        g = 0
        if gpu_cap:
            while g < len(gkeys) and gkeys[g] in gpu:
                g += 1
        h = 0
        while g // f + h < len(okeys) and okeys[g // f + h] in pool:
            h += 1
        hit_end = max(g, (g // f + h) * f)
        first_new = hit_end // f
        if first_new < len(okeys):
            call = okeys[first_new:]
            new = [k for k in call if k not in pool]
            need = len(new) - (cpu_cap - len(pool))
            candidates = [k for k in pool if k not in call]
            if need <= len(candidates):
                candidates.sort(key=lambda k: (next_use(k, i), pool[k]), reverse=True)
                for k in candidates[: max(0, need)]:
                    del pool[k]
                for k in new:
                    pool[k] = k[1]
        if gpu_cap:
            for k in reversed(gkeys):
                gpu[k] = True
                gpu.move_to_end(k)
            while len(gpu) > gpu_cap:
                gpu.popitem(last=False)
        out.append((g * bs, (hit_end - g) * bs))
    return out


@pytest.mark.parametrize(
    ("trace", "bs", "obs", "gpu_cap", "cpu_cap"),
    [
        ("conversation", 16, 512, 0, 150),
        ("synthetic", 16, 512, 0, 150),
        # partial first offloaded blocks after GPU hits
        pytest.param("conversation", 16, 512, 20, 300, marks=pytest.mark.slow),
        pytest.param("conversation", 64, 256, 3, 400, marks=pytest.mark.slow),  # factor 4
        pytest.param("synthetic", 32, 128, 0, 1500, marks=pytest.mark.slow),
    ],
)
def test_min_replay_matches_independent_model(trace, bs, obs, gpu_cap, cpu_cap) -> None:
    reqs = _read(trace, N)
    config = ReplayConfig(
        trace=trace,
        block_size=bs,
        offloaded_block_size=obs,
        gpu_prefix_blocks=gpu_cap,
        cpu_blocks=cpu_cap,
        limit=N,
        policy="min",
    )
    res = run_replay(config)  # dispatches to run_min_replay
    assert res.policy == "min" and res.device == "offline"
    want = model_min_replay(reqs, bs, obs, gpu_cap, cpu_cap)
    got = list(zip(res.per_request_gpu_hit_tokens, res.per_request_cpu_hit_tokens, strict=True))
    assert got == want
    assert res.cpu_hit_tokens > 0 and res.evictions > 0
    assert res.hit_tokens == sum(g + c for g, c in want)
    assert res.input_tokens == sum(r["input_length"] for r in reqs)
    # MIN is the optimum of the same loop: no engine policy hits more here
    for policy in ("lru", "probation"):
        other = run_replay(dataclasses.replace(config, policy=policy))
        assert other.hit_tokens <= res.hit_tokens, policy
        assert other.max_hit_rate == res.max_hit_rate
        assert other.cpu_blocks == res.cpu_blocks


def test_min_replay_with_an_unbounded_pool_reaches_the_full_block_maximum() -> None:
    res = run_min_replay(ReplayConfig(trace="synthetic", cpu_blocks=200_000, limit=N))
    assert res.hit_rate == pytest.approx(res.max_hit_rate) and res.evictions == 0
    assert res.stores_skipped == 0 and res.corrupted_blocks == 0


def test_cli_policy_min(tmp_path: Path) -> None:
    out = tmp_path / "min.json"
    argv = ["--trace", "synthetic", "--limit", "200", "--cpu-blocks", "300", "--policy", "min"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvoff", "replay", *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "Belady's MIN" in proc.stdout and "no bytes moved" in proc.stdout
    record = json.loads(out.read_text())
    assert record["run"]["command"].startswith("kvoff replay")
    result = record["result"]
    assert result["policy"] == "min" and result["cpu_blocks"] == 300
    expected = run_min_replay(ReplayConfig(trace="synthetic", cpu_blocks=300, limit=200))
    assert result["hit_tokens"] == expected.hit_tokens > 0
