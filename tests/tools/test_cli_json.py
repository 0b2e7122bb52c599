"""``--json FILE`` means the same for every ``kvoff`` command: a JSON object whose ``run`` says
where and how it was produced (command, date, machine, versions), beside the command's results;
``--json -`` prints that document to stdout (and the command's text to stderr). ``kvoff info``
and ``kvoff plan`` print JSON instead of text with ``--format json``."""

from __future__ import annotations

import argparse
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoff.tools.cli import build_parser, main

# one light run of every command that takes --json (the heavier ones: smallest sizes)
RUNS: dict[str, list[str]] = {
    "replay": ["replay", "--limit", "2", "--no-progress"],
    "plan": ["plan", "--model", "llama-3-8b", "--gpu-memory", "16GiB", "--cpu-bytes", "64GiB"],
    "info": ["info"],
    "bench scheduler": [
        "bench", "scheduler", "--pool-sizes", "64", "--batch", "8", "--calls", "2",
        "--repeat", "1", "--no-baseline", "--steps", "2x1", "--decode-steps", "1",
    ],
    "bench transfer": [
        "bench", "transfer", "--presets", "qwen2.5-0.5b", "--blocks", "4", "--repeat", "1",
        "--warmup", "0", "--job-sizes", "--step-jobs", "0", "--layouts", "layer_major",
        "--no-gemm",
    ],
    "bench tiers": [
        "bench", "tiers", "--no-remote", "--block-sizes", "64KiB", "--total-bytes", "1MiB",
        "--disk-repeat", "1", "--promotion-bytes", "1MiB",
    ],
    "bench manager-calls": ["bench", "manager-calls", "--managers", "kvoff:lru"],
    "pool status": ["pool", "status"],  # --socket: a pool served for the test
    "bench node-pool": ["bench", "node-pool", "--blocks", "4", "--keys", "2", "--rounds", "1",
                        "--model", "tiny"],
}  # fmt: skip

_LOG = [
    {"ev": "header", "version": 1, "cpu_blocks": 4, "tokens_per_chunk": 32, "policy": "lru"},
    {"ev": "end", "requests": 0, "wall_s": 0.0},
]


def _commands_with_json() -> set[str]:
    """Every command and subcommand of the parser that has a --json option."""
    found: set[str] = set()

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    walk(p, f"{name} {sub}".strip())
            elif "--json" in action.option_strings:
                found.add(name)

    walk(build_parser(), "")
    return found


def test_every_command_with_json_is_checked() -> None:
    assert _commands_with_json() == set(RUNS)


def _argv(name: str, tmp_path: Path) -> list[str]:
    argv = list(RUNS[name])
    if name == "bench tiers":
        argv += ["--disk-path", str(tmp_path / "disk")]
    if name == "bench manager-calls":
        log = tmp_path / "calls.jsonl"
        log.write_text("".join(json.dumps(e) + "\n" for e in _LOG))
        argv += ["--from-log", str(log)]
    return argv


def _check_shape(doc: object, name: str) -> None:
    assert isinstance(doc, dict), name
    run = doc["run"]
    assert isinstance(run, dict) and run["command"].startswith("kvoff ") and run["date"], name
    assert {"machine", "kvoff_version", "torch_version"} <= set(run), name
    assert len(doc) >= 2, name  # the results beside the run record


# bench tiers takes about 10 s a run: its file is checked in tests/tiers/test_bench_tiers.py
STDOUT_ONLY = {"bench tiers"}


@pytest.fixture
def pool_socket(tmp_path: Path) -> Iterator[str]:
    """A node pool served in a thread of this process (``kvoff pool status`` asks it)."""
    from kvoff.node_pool import NodePoolServer

    region = f"kvoff-test-cli-json-{os.getpid()}"
    server = NodePoolServer(str(tmp_path / "pool.sock"), 4, 4096, region=region)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_s": 0.02}, daemon=True)
    thread.start()
    yield server.socket_path
    server.stop()
    thread.join(10)


@pytest.mark.parametrize("name", list(RUNS))
def test_json_file_and_stdout(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    argv = _argv(name, tmp_path)
    if name == "pool status":
        argv += ["--socket", request.getfixturevalue("pool_socket")]
    doc = None
    if name not in STDOUT_ONLY:
        path = tmp_path / "out" / "doc.json"
        assert main([*argv, "--json", str(path)]) in (0, 1)  # info: 1 when the runtime differs
        written = capsys.readouterr()
        doc = json.loads(path.read_text())
        _check_shape(doc, name)
        assert str(path) in written.out  # the text says where the file went
    assert main([*argv, "--json", "-"]) in (0, 1)
    printed = capsys.readouterr()
    doc_out = json.loads(printed.out)  # stdout holds the document alone
    _check_shape(doc_out, name)
    assert doc is None or set(doc_out) == set(doc)
    assert printed.err.strip()  # the text went to stderr


@pytest.mark.parametrize("name", ["info", "plan"])
def test_format_json_prints_the_bare_object(
    name: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = RUNS[name]
    assert main([*argv, "--format", "json"]) in (0, 1)
    bare = json.loads(capsys.readouterr().out)
    assert "run" not in bare
    path = tmp_path / "doc.json"
    assert main([*argv, "--format", "json", "--json", str(path)]) in (0, 1)
    out = capsys.readouterr().out
    assert json.loads(out.split("  JSON written to")[0]) == bare or name == "info"
    assert json.loads(path.read_text())[name] == json.loads(out.split("  JSON written to")[0])
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--format", "json", "--json", "-"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--format json and --json - both print" in err


def test_vs_vllm_json_to_stdout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvoff bench scheduler --vs-vllm --json -``, the run itself replaced (it needs vLLM and
    minutes): the document the benchmark returns is what stdout holds."""
    from kvoff.tools import bench_vllm
    from kvoff.tools.bench import run_info

    def fake(params: object, json_path: Path | None = None, argv=None, log=None) -> dict:
        assert json_path is None  # the CLI prints it
        print("the tables")
        return {"benchmark": "kvoff bench scheduler --vs-vllm", "run": run_info(argv)}

    monkeypatch.setattr(bench_vllm, "run_vs_vllm", fake)
    assert main(["bench", "scheduler", "--vs-vllm", "--json", "-"]) == 0
    printed = capsys.readouterr()
    _check_shape(json.loads(printed.out), "vs-vllm")
    assert "the tables" in printed.err
