"""``kvoff plan``: presets checked by hand, the specs file format and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoff.kv_cache_config import pool_bytes_per_block
from kvoff.tools.cli import main
from kvoff.tools.plan import PLAN_PRESETS, compute_plan, specs_from_json

GIB = 2**30
_MLA = {"block_size": 16, "num_kv_heads": 1, "head_size": 8}
_MAMBA = {"block_size": 16, "shapes": [[4]], "dtypes": ["bf16"]}


def _plan(name: str, world_size: int = 1):
    return compute_plan(
        PLAN_PRESETS[name].layer_specs(), 16 * GIB, 64 * GIB, world_size=world_size, source=name
    )


def test_llama_3_8b_by_hand() -> None:
    # page 2 × 16 × 8 × 128 × 2 = 65,536; 32 layers, one group → 2,097,152 bytes per block.
    # 16 GiB / 2 MiB = 8,192 GPU blocks; 8,191 usable × 16 = 131,056 tokens.
    # CPU: 64 GiB / 2 MiB = 32,768 blocks × 16 tokens; with 2 ranks 16,384.
    plan = _plan("llama-3-8b")
    (group,) = plan.kv_cache_config.kv_cache_groups
    assert len(group.layer_names) == 32
    assert group.kv_cache_spec.page_size_bytes == 65_536
    assert pool_bytes_per_block(plan.kv_cache_config.kv_cache_groups) == 2_097_152
    assert plan.kv_cache_config.num_blocks == 8192
    assert plan.kv_cache_config.max_model_len == 131_056
    assert plan.cpu.num_blocks == 32_768
    assert _plan("llama-3-8b", world_size=2).cpu.num_blocks == 16_384
    # with tiers and workers in processes of their own, each rank's pool (16,384 × 2 MiB =
    # 32 GiB with 2 ranks) plus a 4 KiB header page lives in /dev/shm
    two = _plan("llama-3-8b", world_size=2)
    assert two.to_dict()["cpu"]["shared_memory_bytes"] == 2 * (32 * GIB + 4096)
    text = two.format()
    assert "/dev/shm with tiers (workers in processes of their own, or the spec path): " in text
    assert "64.00 GiB" in text.split("/dev/shm with tiers")[1].splitlines()[0]


def test_qwen3_32b_by_hand() -> None:
    # page 65,536; 64 layers → 4 MiB per block; 16 GiB → 4,096 blocks; 4,095 × 16 = 65,520.
    # CPU 64 GiB / 4 MiB = 16,384 blocks.
    plan = _plan("qwen3-32b")
    assert len(plan.kv_cache_config.kv_cache_groups[0].layer_names) == 64
    assert plan.kv_cache_config.num_blocks == 4096
    assert plan.kv_cache_config.max_model_len == 65_520
    assert plan.cpu.num_blocks == 16_384


def test_gemma_3_27b_by_hand() -> None:
    # page 2 × 16 × 16 × 128 × 2 = 131,072 for both kinds. Layers 5, 11, ..., 59 are full
    # (10), 52 sliding-window. group_size = min(52, 10) = 10: sliding window in 6 groups
    # (5 × 10 + 1 × 2), full in 1 group of 10 → 7 groups, 10 shared tensors.
    # Pool: 10 × 131,072 = 1,310,720 bytes per block; 16 GiB → 13,107 blocks, 13,106 usable.
    # Each sliding group needs ≤ cdiv(1023, 16) + 1 = 65 blocks: 6 × 65 = 390;
    # full: cdiv(L, 16) ≤ 13,106 - 390 = 12,716 → L = 203,456 tokens.
    # CPU: 64 GiB / 1,310,720 = 52,428.8 → 52,428 blocks.
    plan = _plan("gemma-3-27b")
    config = plan.kv_cache_config
    sizes = [len(g.layer_names) for g in config.kv_cache_groups]
    assert sizes == [10, 10, 10, 10, 10, 2, 10]
    assert {g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups} == {131_072}
    assert config.kv_cache_groups[-1].layer_names == tuple(f"layers.{i}" for i in range(5, 62, 6))
    assert len(config.kv_cache_tensors) == 10
    assert config.num_blocks == 13_107
    assert config.max_model_len == 203_456
    assert plan.cpu.kv_bytes_per_block == 1_310_720
    assert plan.cpu.num_blocks == 52_428


def test_deepseek_v3_by_hand() -> None:
    # MLA page 64 × 576 × 2 = 73,728; 61 layers → 4,497,408 bytes per block.
    # 16 GiB = 17,179,869,184 / 4,497,408 = 3,819.9 → 3,819 blocks; 3,818 × 64 = 244,352.
    # CPU 68,719,476,736 / 4,497,408 = 15,279.7 → 15,279 blocks.
    plan = _plan("deepseek-v3")
    assert plan.kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes == 73_728
    assert plan.kv_cache_config.num_blocks == 3819
    assert plan.kv_cache_config.max_model_len == 244_352
    assert plan.cpu.num_blocks == 15_279


def test_jamba_by_hand() -> None:
    # attention page 2 × 80 × 8 × 128 × 2 = 327,680; Mamba state 311,296 padded to 327,680.
    # 4 attention (layers 4, 12, 20, 28) + 28 Mamba → group_size 4: 7 Mamba groups + 1
    # attention group, 4 shared tensors; pool 4 × 327,680 = 1,310,720 per block → 13,107 blocks.
    # need(L) = 7 (one state per Mamba group) + cdiv(L, 80) ≤ 13,106 → 13,099 × 80 = 1,047,920.
    # CPU: 64 GiB / 1,310,720 → 52,428 blocks.
    plan = _plan("jamba-v0.1")
    config = plan.kv_cache_config
    assert [len(g.layer_names) for g in config.kv_cache_groups] == [4] * 8
    assert config.kv_cache_groups[-1].layer_names == (
        "layers.4",
        "layers.12",
        "layers.20",
        "layers.28",
    )
    assert config.kv_cache_groups[0].kv_cache_spec.page_size_unpadded == 311_296
    assert len(config.kv_cache_tensors) == 4
    assert config.num_blocks == 13_107
    assert config.max_model_len == 1_047_920
    assert plan.cpu.num_blocks == 52_428


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama-3-8b", "--gpu-memory", "16GiB", "--cpu-bytes", "64GiB"]
    assert main([*argv, "--format", "json", "--block-size", "64", "--world-size", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu"]["num_blocks"] == 8192
    assert data["gpu"]["tokens"] == 8192 * 16
    # 64 GiB / (2 MiB × 4 × 2 ranks) = 4,096 offloaded blocks of 64 tokens
    assert data["cpu"]["num_blocks"] == 4096
    assert data["cpu"]["tokens"] == 4096 * 64
    assert data["max_model_len"] == 131_056
    assert data["groups"][0]["kind"] == "full_attention"
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "8,192 blocks" in text
    assert "max model length: 131,056 tokens" in text


def test_cli_specs_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "specs.json"
    layer = {"block_size": 16, "num_kv_heads": 8, "head_size": 128, "dtype": "bf16"}
    path.write_text(
        json.dumps(
            {
                "layers": [
                    {"type": "full_attention", "count": 2, **layer},
                    {"type": "sliding_window", "name": "swa", "sliding_window": 128, **layer},
                ]
            }
        )
    )
    argv = ["plan", "--specs", str(path), "--gpu-memory", "2MiB", "--cpu-bytes", "1MiB"]
    assert main([*argv, "--num-gpu-blocks-override", "32", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # hybrid: 2 full + 1 SW, group_size 1 → 3 groups, 1 tensor; 32 blocks (override);
    # need = 2 × cdiv(L,16) + min(cdiv(L,16), 9) ≤ 31 → cdiv ≤ 11 → 176 tokens.
    assert [g["layers"] for g in data["groups"]] == [["layers.0"], ["layers.1"], ["swa"]]
    assert data["gpu"]["num_blocks"] == 32
    assert data["max_model_len"] == 176
    # CPU: 1 MiB / 65,536 = 16 blocks
    assert data["cpu"]["num_blocks"] == 16


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--model", "llama-3-8b", "--max-model-len", "200000"], "max_model_len=200000"),
        (["--model", "llama-3-8b", "--block-size", "24"], "multiple"),
        (["--specs", "/nonexistent/specs.json"], "nonexistent"),
    ],
)
def test_cli_errors(extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", *extra, "--gpu-memory", "16GiB", "--cpu-bytes", "64GiB"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "kvoff plan: error:" in err
    assert needle in err


def test_cli_bad_bytes_and_missing_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "llama-3-8b", "--gpu-memory", "lots", "--cpu-bytes", "1GiB"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["plan", "--gpu-memory", "1GiB", "--cpu-bytes", "1GiB"])
    capsys.readouterr()


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"layers": []}, "at least one layer"),
        ([{"type": "linear"}], "unknown type 'linear'"),
        ([{"type": "mla", "block_size": 16}], "missing"),
        (
            [{"type": "mla", "block_size": 16, "num_kv_heads": 1, "head_size": 8, "dtype": "x"}],
            "'x'",
        ),
        ([{"type": "full_attention", "count": 0}], "count"),
        (
            [
                {
                    "type": "mamba",
                    "name": "m",
                    "block_size": 16,
                    "shapes": [[4]],
                    "dtypes": ["bf16"],
                },
                {
                    "type": "mamba",
                    "name": "m",
                    "block_size": 16,
                    "shapes": [[4]],
                    "dtypes": ["bf16"],
                },
            ],
            "used twice",
        ),
    ],
)
def test_specs_file_errors(data: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        specs_from_json(data)


def test_replay_subcommand_still_parses() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--help"])
    assert exc.value.code == 0
