"""The manager-only sweep (kvoff.tools.policy_sim) counts what the real replay counts, the trace
generator (kvoff.tools.trace_mix) writes valid Mooncake traces, and the side-by-side policy
bench (kvoff.tools.bench_policies) reports every policy and operation. No timing is asserted."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvoff.tools.bench import ManagerBenchParams
from kvoff.tools.bench_policies import OPERATIONS, bench_policies
from kvoff.tools.policy_sim import run_manager_replay, run_manager_sweep
from kvoff.tools.replay import ReplayConfig, run_replay
from kvoff.tools.trace_mix import KINDS, make_trace, write_trace
from kvoff.tools.traces import load_trace


@pytest.mark.parametrize(
    ("trace", "policy"),
    [("conversation", "lru"), ("conversation", "probation"), ("synthetic", "probation")],
)
def test_manager_replay_counts_equal_the_replay(trace: str, policy: str) -> None:
    config = ReplayConfig(trace=trace, cpu_blocks=40, policy=policy, limit=50)
    real = run_replay(config)
    sim = run_manager_replay(config)
    assert real.evictions > 0  # the pool is under pressure: the policy decides hits
    for field in ("requests", "input_tokens", "hit_tokens", "cpu_hit_tokens", "evictions"):
        assert getattr(sim, field) == getattr(real, field), field
    assert sim.stores_skipped == real.stores_skipped
    assert sim.max_hit_rate == pytest.approx(real.max_hit_rate)


def test_manager_sweep_includes_min_and_rejects_a_gpu_cache() -> None:
    sweep = run_manager_sweep(ReplayConfig(limit=60), [16, 64], ["lru", "probation", "min"])
    for c in (16, 64):
        assert sweep.point("min", c).hit_rate >= sweep.point("lru", c).hit_rate
    with pytest.raises(ValueError, match="gpu_prefix_blocks"):
        run_manager_replay(
            dataclasses.replace(ReplayConfig(limit=5, cpu_blocks=8), gpu_prefix_blocks=4)
        )


GENERATED = [k for k in KINDS if k not in ("interleave", "shuffle")]


@pytest.mark.parametrize("kind", GENERATED)
def test_generated_traces_are_valid_prefix_traces(kind: str, tmp_path) -> None:
    path = tmp_path / f"{kind}.jsonl"
    write_trace(make_trace(kind, requests=300, seed=1), path)
    reqs = load_trace(path)  # checks len(hash_ids) == ceil(input_length / 512)
    assert len(reqs) == 300
    parent: dict[int, int | None] = {}  # an id names its whole prefix: one parent per id
    for r in reqs:
        for i, h in enumerate(r.hash_ids):
            p = r.hash_ids[i - 1] if i else None
            assert parent.setdefault(h, p) == p, (kind, h)
    reused = sum(1 for r in reqs for h in r.hash_ids) - len(parent)
    assert reused > 0  # some prefix comes back
    assert make_trace(kind, requests=300, seed=1) == make_trace(kind, requests=300, seed=1)


def test_bundled_mixes_keep_every_request() -> None:
    conv, syn = load_trace("conversation"), load_trace("synthetic")
    mixed = make_trace("interleave")
    assert len(mixed) == len(conv) + len(syn)
    assert [r.timestamp_ms for r in mixed] == sorted(r.timestamp_ms for r in mixed)
    ids_conv = {h for r in conv for h in r.hash_ids}
    assert sum(1 for r in mixed if set(r.hash_ids) <= ids_conv) >= len(conv)
    shuffled = make_trace("shuffle")

    def order(r):
        return (r.hash_ids, r.timestamp_ms, r.input_length, r.output_length)

    assert sorted(shuffled, key=order) == sorted(conv, key=order)
    with pytest.raises(ValueError, match="unknown trace kind"):
        make_trace("nope")


def test_bench_policies_reports_each_policy_and_operation() -> None:
    params = ManagerBenchParams(pool_sizes=(2048,), batches_per_round=4, repeat=1, baseline=False)
    (entry,) = bench_policies(["lru", "probation"], params, rounds=2)
    assert entry["pool_size"] == 2048
    for p in ("lru", "probation"):
        assert set(entry["ns_per_key"][p]) == set(OPERATIONS)
        assert all(len(v) == 2 for v in entry["samples"][p].values())
    assert entry["ratio_to_lru"]["lru"] == {op: 1.0 for op in OPERATIONS}
    with pytest.raises(ValueError, match="unknown eviction policy"):
        bench_policies(["lru", "nope"], params, rounds=1)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--trace", "nope", "--sweep-capacity", "4"], "trace 'nope' is not a bundled trace"),
        (["--sweep-capacity", "0"], "'0' must be at least 1"),
        (["--sweep-capacity", "4", "--policies", "foo"], "unknown policy 'foo'"),
        (["--sweep-capacity", "4", "--limit", "0"], "'0' is not a positive request count"),
        (["--sweep-capacity", "4", "--limit", "-1"], "'-1' is not a positive request count"),
    ],
)
def test_main_reports_bad_arguments_without_a_traceback(
    flags: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvoff.tools.policy_sim import main

    with pytest.raises(SystemExit) as info:
        main(flags)
    err = capsys.readouterr().err
    assert info.value.code == 2 and match in err and "Traceback" not in err


def test_json_dash_prints_only_the_document_on_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--json -`` means stdout here as in every kvoff command (docs/benchmarks.md): the JSON
    document alone on stdout, the table on stderr. It wrote a file named ``-`` instead."""
    import json

    from kvoff.tools.bench_policies import main as bench_main
    from kvoff.tools.policy_sim import main as sim_main

    monkeypatch.chdir(tmp_path)  # a file named "-" would land here
    sim = ["--sweep-capacity", "64", "--policies", "lru", "--limit", "20"]
    assert sim_main([*sim, "--json", "-"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["sweep"] and doc["run"]["command"].startswith("python -m kvoff.tools.policy_sim")
    assert "lru" in err
    flags = ["--policies", "lru", "--pool-sizes", "2048", "--rounds", "1", "--repeat", "1"]
    assert bench_main([*flags, "--calls", "4", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["manager"][0]["pool_size"] == 2048 and "ns per key" in err
    assert not (tmp_path / "-").exists()
    assert sim_main([*sim, "--json", str(tmp_path / "sim.json")]) == 0
    assert json.loads((tmp_path / "sim.json").read_text())["sweep"]
