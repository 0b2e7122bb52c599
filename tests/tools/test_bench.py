"""``kvoff bench scheduler``: the CLI writes the documented JSON, the three paths run the same
workload, and the pure-Python baseline has exactly the C++ manager's semantics. No timing
assertions."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kvoff import _bench, _scheduler
from kvoff.tools.bench import PyLRUManager, lookup_ids, shuffle_order, workload_keys
from kvoff.tools.cli import main

_TIMING_FIELDS = {"keys", "calls", "seconds", "best_seconds", "ns_per_key", "keys_per_s"}


def test_cli_writes_json_with_every_field(tmp_path, capsys):
    path = tmp_path / "out" / "bench.json"
    argv = ["bench", "scheduler", "--pool-sizes", "4096", "--calls", "8", "--repeat", "2"]
    argv += ["--steps", "8x1", "16x3", "--decode-steps", "20"]
    assert main([*argv, "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "lookup" in printed and "prepare_store" in printed and str(path) in printed

    doc = json.loads(path.read_text())
    run = doc["run"]
    assert run["command"] == "kvoff " + " ".join([*argv, "--json", str(path)])
    assert run["date"] and run["kvoff_version"] and run["torch_version"]
    assert run["build"]["cxx_compiler"] and run["build"]["runtime_matches"] is True
    assert run["build"]["built_torch"] == run["torch_version"]
    assert set(run["machine"]) >= {"cpu_model", "cores", "platform"}
    params = doc["parameters"]
    assert params["pool_sizes"] == [4096]
    assert params["batch"] == 256 and params["repeat"] == 2 and params["batches_per_round"] == 8
    assert params["eviction_policy"] == "lru"
    steps = doc["scheduler_steps"]
    assert [(r["num_requests"], r["num_groups"]) for r in steps] == [(8, 1), (16, 3)]
    for r in steps:
        # every prompt block of every group is stored at prefill (1024-token prompts, 16-token
        # blocks); 20 decode steps complete one more block per request (at token 1040)
        assert r["prefill_blocks_stored"] == r["num_requests"] * r["num_groups"] * 64
        assert r["decode_store_jobs"] == r["num_requests"]
        assert r["decode_step_us"] > 0 and r["decode_step_core_us"] > 0
        assert r["admit_us_per_request"] > 0 and r["complete_us_per_job"] > 0
        # every request admitted again hits its whole prompt (a load job of all 64 blocks)
        assert r["admit_hit_requests"] == r["num_requests"]
        assert r["admit_hit_tokens_per_request"] == 1024
        assert r["admit_hit_us_per_request"] > 0

    (entry,) = doc["manager"]
    assert entry["pool_size"] == 4096
    assert entry["evicted"] == 8 * 256  # every store call into the full pool evicts a batch
    assert 0 < entry["lookup_hits"] <= 8 * 256
    assert set(entry["operations"]) == {"lookup", "prepare_store", "complete_store", "store"}
    for op, row in entry["operations"].items():
        for path_name in ("in_core", "binding", "python_baseline"):
            timing = row[path_name]
            assert set(timing) >= _TIMING_FIELDS, (op, path_name)
            assert timing["ns_per_key"] > 0 and timing["keys_per_s"] > 0
        assert row["in_core_vs_baseline"] > 0 and row["binding_vs_baseline"] > 0
    assert entry["operations"]["prepare_store"]["in_core"]["keys"] == 8 * 256


def test_other_policies_run_without_baseline(tmp_path):
    policies = list(_scheduler.eviction_policies())
    other = next((p for p in policies if p != "lru"), None)
    if other is None:
        pytest.skip("only the lru policy is registered")
    path = tmp_path / "bench.json"
    argv = ["bench", "scheduler", "--pool-sizes", "4096", "--calls", "4", "--repeat", "1"]
    argv += ["--steps", "4x2", "--decode-steps", "2"]
    assert main([*argv, "--eviction-policy", other, "--json", str(path)]) == 0
    (entry,) = json.loads(path.read_text())["manager"]
    row = entry["operations"]["lookup"]
    assert row["python_baseline"] is None and row["in_core_vs_baseline"] is None
    assert row["binding"]["ns_per_key"] > 0


def test_unknown_policy_is_rejected_by_the_cli(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "scheduler", "--eviction-policy", "nope"])
    assert exc.value.code == 2
    assert "nope" in capsys.readouterr().err


def test_bench_driver_rejects_bad_parameters():
    with pytest.raises(ValueError, match="key_bytes"):
        _bench.bench_manager(64, key_bytes=1)
    with pytest.raises(ValueError, match="batch"):
        _bench.bench_manager(64, batch=0)
    with pytest.raises(ValueError, match="eviction_policy"):
        _bench.bench_manager(64, eviction_policy="nope")


def test_bench_driver_is_not_in_the_production_module():
    # benchmark code lives in kvoff._bench (cpp/bench/), not in kvoff._scheduler or kvoff_core
    assert not hasattr(_scheduler, "_bench_manager")


def test_python_workload_matches_the_cpp_driver():
    # The C++ driver's lookup_hits for one round is reproduced from the Python workload rules:
    # all keys 0..n-1 are held, so a call's hits are its batch up to its first missing key.
    n, batch, calls = 300, 16, 40
    ids = lookup_ids(n, batch, calls, seed=7)
    expected = 0
    for row in ids:
        missing = np.nonzero(row >= np.uint64(1 << 40))[0]
        expected += int(missing[0]) if len(missing) else batch
    res = _bench.bench_manager(
        n, key_bytes=33, batch=batch, batches_per_round=calls, repeat=1, seed=7
    )
    assert res["lookup_hits"] == expected
    assert expected < calls * batch  # some calls do miss
    keys = workload_keys(np.arange(n), 33, seed=7)
    assert len(set(keys)) == n and all(len(k) == 33 and k[-1] == 0 for k in keys)
    assert sorted(shuffle_order(n, 7).tolist()) == list(range(n))


def _same(cpp, py, op, *args):
    """Runs op on both managers; both raise ValueError or both return the same thing."""
    try:
        expected = getattr(cpp, op)(*args)
    except ValueError:
        with pytest.raises(ValueError):
            getattr(py, op)(*args)
        return None
    got = getattr(py, op)(*args)
    if op == "prepare_store" and expected is not None:
        assert got is not None, args
        assert got.keys_to_store == expected.keys_to_store, args
        assert got.block_ids == expected.block_ids, args
        assert got.evicted_keys == expected.evicted_keys, args  # same victims, same order
    else:
        assert got == expected, (op, args)
    return expected


@pytest.mark.parametrize("seed", range(6))
def test_python_baseline_has_the_cpp_manager_semantics(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([1, 4, 16, 40])
    cpp = _scheduler.CPUOffloadingManager(num_blocks)
    py = PyLRUManager(num_blocks)
    universe = [bytes([i]) * rng.choice([1, 9, 33]) for i in range(3 * num_blocks + 5)]
    pending: list[list[bytes]] = []
    loading: list[list[bytes]] = []
    for _ in range(400):
        keys = [rng.choice(universe) for _ in range(rng.randint(1, min(12, num_blocks + 2)))]
        op = rng.random()
        if op < 0.3:
            _same(cpp, py, "lookup", keys)
        elif op < 0.55:
            out = _same(cpp, py, "prepare_store", keys)
            if out is not None and out.keys_to_store:
                pending.append(list(out.keys_to_store))
        elif op < 0.7 and pending:
            batch = pending.pop(rng.randrange(len(pending)))
            _same(cpp, py, "complete_store", batch, rng.random() < 0.8)
        elif op < 0.8:
            _same(cpp, py, "touch", keys)
        elif op < 0.9:
            if _same(cpp, py, "prepare_load", keys) is not None:
                loading.append(keys)
        elif loading:
            _same(cpp, py, "complete_load", loading.pop(rng.randrange(len(loading))))
        else:
            _same(cpp, py, "complete_store", keys)  # usually an error on both sides
        assert len(py) == len(cpp)
        assert [py.lookup([k]) for k in universe] == [cpp.lookup([k]) for k in universe]
