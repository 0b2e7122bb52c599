"""User errors of the ``kvoff`` command: a clear message naming the value and the fix, exit
code 2, no traceback; and options that must not be silently ignored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoff.tools.cli import main
from kvoff.tools.traces import load_trace

REQUEST = '{"timestamp": 0, "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}'


@pytest.fixture(autouse=True)
def _no_tier_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVOFF_DISK_PATH", "KVOFF_DISK_BYTES", "KVOFF_REMOTE_URL"):
        monkeypatch.delenv(name, raising=False)


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Runs ``kvoff argv``; asserts exit code 2 and no traceback; returns stderr."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err
    return err


def test_sweep_refuses_tiers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # every point must start empty: a disk tier would keep the blocks of earlier points
    base = ["replay", "--sweep-capacity", "4,8", "--policies", "lru", "--limit", "3"]
    disk = ["--disk-path", str(tmp_path / "d"), "--disk-bytes", "64MiB", "--no-progress"]
    err = _fails(base + disk, capsys)
    assert "--disk-path" in err and "empty CPU pool" in err
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())
    err = _fails([*base, "--remote-url", "redis://127.0.0.1:1", "--no-progress"], capsys)
    assert "--remote-url" in err


def test_sweep_min_refuses_engines(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--sweep-capacity", "4", "--policies", "min", "--engines", "2"]
    err = _fails([*argv, "--limit", "3", "--no-progress"], capsys)
    assert "policy 'min' simulates one CPU pool offline; drop the tiers and --engines" in err


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ('"hash_ids": [1.5, 2]', r"hash_ids must hold JSON integers, got 1.5"),
        ('"hash_ids": "12"', r"hash_ids must be a JSON list"),
        ('"hash_ids": [1, true]', r"got True"),
        ('"hash_ids": [1, 18446744073709551616]', r"does not fit int64"),
        ('"hash_ids": [1, -9223372036854775809]', r"does not fit int64"),
    ],
)
def test_trace_loader_rejects_bad_hash_ids(tmp_path: Path, record: str, match: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(REQUEST + "\n" + REQUEST.replace('"hash_ids": [1, 2]', record) + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:2: .*" + match):
        load_trace(path)


@pytest.mark.parametrize(
    ("old", "new", "match"),
    [
        ('"input_length": 600', '"input_length": 600.9', "input_length must be a JSON integer"),
        ('"input_length": 600', '"input_length": "600"', "input_length must be a JSON integer"),
        ('"output_length": 7', '"output_length": 7.0', "output_length must be a JSON integer"),
        ('"output_length": 7', '"output_length": true', "output_length must be a JSON integer"),
        ('"output_length": 7', '"output_length": -7', "output_length=-7"),
        ('"timestamp": 0', '"timestamp": "0"', "timestamp must be a number"),
    ],
)
def test_trace_loader_rejects_bad_fields(tmp_path: Path, old: str, new: str, match: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(REQUEST.replace(old, new) + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:1: .*" + match):
        load_trace(path)


def test_trace_loader_keeps_good_records(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    big = 2**63 - 1
    path.write_text(REQUEST.replace("[1, 2]", f"[-1, {big}]") + "\n\n")
    (req,) = load_trace(path)
    assert req.hash_ids == (-1, big) and req.input_length == 600 and req.output_length == 7


def test_empty_or_binary_trace_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: the trace has no requests"):
        load_trace(empty)
    err = _fails(["replay", "--trace", str(empty), "--no-progress"], capsys)
    assert "empty.jsonl" in err and "no requests" in err
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(ValueError, match=r"binary\.jsonl: not a UTF-8 text file"):
        load_trace(binary)


def test_sweep_without_tiers_still_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    argv = ["replay", "--sweep-capacity", "4,8", "--policies", "lru,min", "--limit", "5"]
    assert main([*argv, "--no-progress", "--json", str(out)]) == 0
    sweep = json.loads(out.read_text())["sweep"]
    assert len(sweep["points"]) == 4
    capsys.readouterr()


def test_os_errors_are_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a folder given as a file
    argv = ["plan", "--gpu-memory", "8GiB", "--cpu-bytes", "8GiB"]
    err = _fails([*argv, "--specs", str(tmp_path)], capsys)
    assert str(tmp_path) in err and "check the path" in err
    # a file given as the disk tier's folder
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv = ["bench", "tiers", "--disk-path", str(afile), "--total-bytes", "1MiB", "--no-remote"]
    err = _fails([*argv, "--block-sizes", "64KiB"], capsys)
    assert str(afile) in err


def test_json_path_is_checked_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvoff.tools import replay as replay_mod

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the replay ran before --json was checked")

    monkeypatch.setattr(replay_mod, "run_replay", no_run)
    err = _fails(["replay", "--limit", "2", "--no-progress", "--json", str(tmp_path)], capsys)
    assert "--json" in err and "is a folder" in err
    afile = tmp_path / "afile"
    afile.write_text("x")
    bad = afile / "r.json"
    err = _fails(["replay", "--limit", "2", "--no-progress", "--json", str(bad)], capsys)
    assert "--json" in err and "not a folder" in err


def test_json_parent_folder_is_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new" / "deeper" / "r.json"
    assert main(["replay", "--limit", "2", "--no-progress", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["result"]["requests"] == 2
    capsys.readouterr()


def test_plot_without_matplotlib_fails_before_the_sweep(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import sys

    from kvoff.tools import policy_sweep

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sweep ran before matplotlib was checked")

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(policy_sweep, "run_policy_sweep", no_run)
    argv = ["replay", "--sweep-capacity", "4", "--policies", "lru", "--limit", "2"]
    err = _fails([*argv, "--no-progress", "--plot", str(tmp_path / "c.png")], capsys)
    assert "--plot needs matplotlib" in err


def test_plot_without_suffix_names_the_file_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    argv = ["replay", "--sweep-capacity", "4", "--policies", "lru", "--limit", "2"]
    assert main([*argv, "--no-progress", "--plot", str(tmp_path / "curves")]) == 0
    out = capsys.readouterr().out
    assert f"curves drawn in {tmp_path / 'curves.png'}" in out
    assert (tmp_path / "curves.png").is_file()


def test_empty_policies_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--sweep-capacity", "4", "--policies", "", "--limit", "2"]
    err = _fails([*argv, "--no-progress"], capsys)
    assert "--policies ''" in err


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--pool-sizes", "1"], "pool size 1 is smaller than the batch (8 keys"),
        (["--pool-sizes", "64", "--key-bytes", "2"], "--key-bytes 2 gives too few distinct keys"),
    ],
)
def test_bench_scheduler_parameters(
    flags: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "scheduler", *flags, "--batch", "8", "--calls", "2", "--repeat", "1"]
    err = _fails([*argv, "--no-baseline", "--steps", "2x1", "--decode-steps", "1"], capsys)
    assert match in err


@pytest.mark.parametrize(
    "flags",
    [
        ["--gpu-blocks", "64"],
        ["--runs", "kvoff"],
        ["--engine-model", "tiny"],
        ["--dtype", "bfloat16"],
        ["--concurrency", "2"],
    ],
)
def test_vllm_flags_under_the_sim_engine(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = _fails(["replay", "--limit", "2", "--no-progress", *flags], capsys)
    assert f"{flags[0]} applies to --engine vllm only" in err


@pytest.mark.parametrize("flags", [["--compute"], ["--device", "cuda"]])
def test_min_refuses_compute_and_device(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = _fails(["replay", "--policy", "min", "--limit", "2", "--no-progress", *flags], capsys)
    assert "policy 'min' simulates the pool offline" in err and "--compute" in err


@pytest.mark.parametrize(
    "flags", [["--eviction-policy", "arc"], ["--pool-sizes", "1024"], ["--steps", "2x1"]]
)
def test_vs_vllm_refuses_manager_flags(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = _fails(["bench", "scheduler", "--vs-vllm", *flags], capsys)
    assert f"{flags[0]} applies to the CPU manager benchmark only" in err


def test_bench_json_folder_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "tiers", "--no-remote", "--disk-path", str(tmp_path / "d")]
    err = _fails([*argv, "--total-bytes", "1MiB", "--json", str(tmp_path)], capsys)
    assert f"--json {tmp_path} is a folder" in err
    assert not (tmp_path / "d").exists()  # nothing ran
