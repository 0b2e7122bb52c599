"""``kvoff bench manager-calls`` without vLLM: its options, the errors it gives before any engine
runs (exit code 2, a message naming the value and the fix), and the log reader. The replay and
the recording run with vLLM: tests/integrations/test_vllm_manager_calls.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoff.tools.bench_manager_calls import DEFAULT_MANAGERS, parse_managers, read_log
from kvoff.tools.cli import _build_parser, main


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err
    return err


def test_defaults_and_options_parse() -> None:
    args = _build_parser().parse_args(["bench", "manager-calls"])
    assert args.bench_command == "manager-calls"
    assert args.limit == 500 and args.cpu_blocks == 4096 and args.max_tokens == 16
    assert args.trace == "conversation" and args.block_size == 32
    assert args.managers == DEFAULT_MANAGERS and args.record_policy == "lru"
    assert args.record_only is None and args.from_log is None and args.json is None
    args = _build_parser().parse_args(
        ["bench", "manager-calls", "--limit", "600", "--cpu-blocks", "2048", "--managers",
         "vllm:lru,kvoff:probation", "--from-log", "x.jsonl", "--json", "o.json"]
    )  # fmt: skip
    assert args.limit == 600 and args.cpu_blocks == 2048
    assert args.managers == (("vllm", "lru"), ("kvoff", "probation"))
    assert args.from_log == Path("x.jsonl") and args.json == Path("o.json")


def test_parse_managers_refuses_unknown_kinds_and_policies() -> None:
    assert parse_managers("kvoff:arc, vllm:arc,kvoff:arc") == (("kvoff", "arc"), ("vllm", "arc"))
    for bad in ("vllm:probation", "kvoff:nope", "lmcache:lru", "lru"):
        with pytest.raises(ValueError, match="use vllm:"):
            parse_managers(bad)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--limit", "0"], "must be >= 1"),
        (["--managers", "vllm:probation"], "use vllm:"),
        (["--record-only", "a", "--from-log", "b"], "not allowed with argument"),
        (["--record-policy", "fifo"], "--record-policy 'fifo'"),
    ],
)
def test_bad_options_exit_2_with_the_reason(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in _fails(["bench", "manager-calls", *flags], capsys)


def test_a_missing_log_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(["bench", "manager-calls", "--from-log", str(tmp_path / "none.jsonl")], capsys)
    assert "none.jsonl: no such file" in err


def test_read_log_decodes_keys_and_refuses_bad_logs() -> None:
    key = (b"k" * 32 + bytes(4)).hex()
    lines = [
        json.dumps({"ev": "header", "cpu_blocks": 8, "tokens_per_chunk": 32}),
        json.dumps(
            {"ev": "prepare_store", "req": "a", "keys": [[key, 32]], "stored": [key], "evicted": []}
        ),
        json.dumps({"ev": "lookup", "req": "a", "key": [key, 32], "result": "MISS"}),
        json.dumps({"ev": "end", "wall_s": 1.5}),
    ]
    log = read_log(lines)
    assert log.header["cpu_blocks"] == 8 and log.end["wall_s"] == 1.5
    store, lookup = log.events
    assert store["keys"] == [(bytes.fromhex(key), 32)] and store["stored"] == [bytes.fromhex(key)]
    assert lookup["key"] == (bytes.fromhex(key), 32)
    with pytest.raises(ValueError, match="expected the header"):
        read_log(lines[1:])
    with pytest.raises(ValueError, match="unknown event 'bogus'"):
        read_log([lines[0], json.dumps({"ev": "bogus"})])
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_log([lines[0], "{"])
    with pytest.raises(ValueError, match="empty"):
        read_log([])
