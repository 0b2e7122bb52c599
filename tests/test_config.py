"""Specs, the offloading configuration and CPU pool sizing (docs/design.md invariant 3)."""

from __future__ import annotations

import decimal

import numpy as np
import pydantic
import pytest
import torch

import kvoff
from kvoff.config import EVICTION_POLICIES, OffloadingConfig, parse_byte_size
from kvoff.sizing import compute_num_cpu_blocks
from kvoff.specs import FullAttentionSpec


def test_full_attention_page_size_by_hand() -> None:
    # Llama-3-8B layer, 16-token blocks: 2 (K,V) × 16 × 8 heads × 128 × 2 bytes = 65,536
    spec = kvoff.FullAttentionSpec(16, 8, 128, torch.bfloat16)
    assert spec.page_size_bytes == 65_536
    assert spec.bytes_per_token == 4096
    # dtype names are accepted and normalised; the spec is frozen
    assert FullAttentionSpec(16, 8, 128, "bf16") == spec
    with pytest.raises(AttributeError):
        spec.block_size = 32  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"block_size": 0}, "block_size"),
        ({"num_kv_heads": -1}, "num_kv_heads"),
        ({"head_size": 1.5}, "head_size"),
        ({"dtype": "float13"}, "float13"),
    ],
)
def test_full_attention_rejects_bad_values(kwargs: dict, needle: str) -> None:
    args = {"block_size": 16, "num_kv_heads": 8, "head_size": 128, "dtype": torch.float16}
    args.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        FullAttentionSpec(**args)


def test_num_cpu_blocks_formula() -> None:
    # invariant 3: cpu_bytes // (bytes per GPU block of one rank × world_size × factor)
    per_block = 32 * 65_536  # 32 Llama layers
    assert compute_num_cpu_blocks(10 * 2**30, per_block, 4, 2) == (10 * 2**30) // (
        per_block * 2 * 4
    )
    # not page size × number of tensors: the caller passes the total bytes per GPU block, and
    # world size and factor both divide
    assert compute_num_cpu_blocks(1000, 10, 1, 1) == 100
    assert compute_num_cpu_blocks(1000, 10, 2, 1) == 50
    assert compute_num_cpu_blocks(1000, 10, 2, 5) == 10
    # zero GPU blocks gives zero CPU blocks, not a division error
    assert compute_num_cpu_blocks(1000, 0, 4, 2) == 0
    with pytest.raises(ValueError, match="world_size"):
        compute_num_cpu_blocks(1000, 10, 1, 0)


def test_config_resolves_blocks_from_bytes() -> None:
    cfg = OffloadingConfig(cpu_bytes_to_use=2**30, offloaded_block_size=64)
    assert cfg.block_size_factor(16) == 4
    assert cfg.resolve_num_cpu_blocks(bytes_per_gpu_block=4096, block_size=16) == 2**30 // (
        4096 * 4
    )
    assert cfg.resolve_num_cpu_blocks(4096, 16, world_size=4) == 2**30 // (4096 * 4 * 4)
    assert OffloadingConfig(num_cpu_blocks=7).resolve_num_cpu_blocks(4096, 16) == 7


def test_config_errors_name_value_and_fix() -> None:
    with pytest.raises(pydantic.ValidationError, match="exactly one"):
        OffloadingConfig()
    with pytest.raises(pydantic.ValidationError, match="exactly one"):
        OffloadingConfig(cpu_bytes_to_use=10, num_cpu_blocks=1)
    with pytest.raises(pydantic.ValidationError, match="greater than 0"):
        OffloadingConfig(cpu_bytes_to_use=0)
    with pytest.raises(pydantic.ValidationError, match=r"'fifo'.*lru"):
        OffloadingConfig(cpu_bytes_to_use=10, eviction_policy="fifo")
    with pytest.raises(pydantic.ValidationError, match="cpu_byte_to_use"):
        OffloadingConfig(cpu_byte_to_use=10)  # type: ignore[call-arg]
    cfg = OffloadingConfig(cpu_bytes_to_use=100, offloaded_block_size=40)
    with pytest.raises(ValueError, match=r"offloaded_block_size=40.*block_size=16"):
        cfg.block_size_factor(16)
    with pytest.raises(ValueError, match=r"cannot hold one offloaded block \(4096 bytes"):
        OffloadingConfig(cpu_bytes_to_use=100).resolve_num_cpu_blocks(4096, 16)


def test_policy_list_comes_from_the_core() -> None:
    assert "lru" in EVICTION_POLICIES
    for name in EVICTION_POLICIES:
        kvoff.CPUOffloadingManager(4, eviction_policy=name)
        assert (
            OffloadingConfig(num_cpu_blocks=4, eviction_policy=name.upper()).eviction_policy == name
        )


def test_transfer_options_reach_the_worker(tmp_path) -> None:
    import json

    from kvoff.ops import MECHANISMS
    from kvoff.transfer import ALL_MECHANISMS, load_thresholds

    # config validates without loading the extension: the op's names plus the worker's staged
    assert (*MECHANISMS, "staged") == ALL_MECHANISMS
    path = tmp_path / "t.json"
    path.write_text(json.dumps(load_thresholds().to_json()))
    cfg = OffloadingConfig.from_dict(
        {
            "num_cpu_blocks": 8,
            "transfer_mechanism": "Kernel",
            "transfer_thresholds": str(path),
            "pin_memory": False,
            "compute_slowdown_budget": 0.05,
            "staging_bytes": "32MiB",
        }
    )
    opts = cfg.worker_options()
    assert opts["mechanism"] == "kernel" and "pin_chunk_bytes" not in opts
    assert opts["thresholds"] == load_thresholds(path) and opts["pin_memory"] is False
    assert opts["compute_slowdown_budget"] == 0.05 and opts["staging_bytes"] == 32 << 20
    worker = kvoff.OffloadingWorker(4, 2, **opts)
    assert worker.compute_slowdown_budget == 0.05 and worker.staging_bytes == 32 << 20
    assert OffloadingConfig(num_cpu_blocks=8, staging_bytes=0).staging_bytes == 0  # off
    assert OffloadingConfig(num_cpu_blocks=8, transfer_mechanism="STAGED").transfer_mechanism == (
        "staged"
    )
    with pytest.raises(ValueError, match="compute_slowdown_budget"):
        OffloadingConfig(num_cpu_blocks=8, compute_slowdown_budget=-0.01)
    with pytest.raises(ValueError, match="unknown transfer_mechanism 'dma'"):
        OffloadingConfig(num_cpu_blocks=8, transfer_mechanism="dma")
    bad = OffloadingConfig(num_cpu_blocks=8, transfer_thresholds=tmp_path / "missing.json")
    with pytest.raises(ValueError, match="cannot read transfer thresholds"):
        bad.worker_options()


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("9007199254740993", 9_007_199_254_740_993),  # float arithmetic gave ...992
        ("123456789012345678", 123_456_789_012_345_678),
        ("9223372036854775807", 2**63 - 1),  # the documented maximum was refused
        ("1.5KiB", 1536),
        ("1.5GB", 1_500_000_000),
        ("1e+9", 10**9),
    ],
)
def test_byte_counts_are_parsed_exactly(text: str, value: int) -> None:
    from kvoff.config import parse_byte_size

    assert parse_byte_size(text) == value


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("1.5", "not a whole number of bytes"),  # was truncated to 1 byte
        ("9223372036854775808", "too large"),
        ("1e999", "too large"),
        ("0", "must be positive"),
    ],
)
def test_byte_counts_that_are_not_whole_positive_int64_are_refused(text: str, needle: str) -> None:
    from kvoff.config import parse_byte_size

    with pytest.raises(ValueError, match=needle):
        parse_byte_size(text)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"cpu_bytes_to_use": True}, "cpu_bytes_to_use"),  # lax pydantic read True as 1 byte
        ({"num_cpu_blocks": 4, "world_size": True}, "world_size"),
        ({"num_cpu_blocks": True}, "num_cpu_blocks"),
        ({"cpu_bytes_to_use": 2**64 + 2**80}, "cpu_bytes_to_use"),  # past int64: a pybind dump
        ({"num_cpu_blocks": 2**63}, "num_cpu_blocks"),
    ],
)
def test_counts_refuse_bools_and_values_past_int64(kwargs: dict, field: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=field):
        OffloadingConfig(**kwargs)


def test_an_empty_path_variable_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVOFF_DISK_PATH="" became Path("."): a disk tier file in the working directory."""
    monkeypatch.setenv("KVOFF_DISK_PATH", "")
    monkeypatch.setenv("KVOFF_TRANSFER_THRESHOLDS", " ")
    monkeypatch.setenv("KVOFF_NUM_CPU_BLOCKS", "4")
    c = OffloadingConfig.load()
    assert c.disk_path is None and c.transfer_thresholds is None and not c.has_tiers


@pytest.mark.parametrize("text", ["1e9999999", "1e999999999", "1e999999999999999999999"])
def test_huge_exponents_are_a_value_error_naming_the_key(text: str) -> None:
    # decimal.Overflow used to escape pydantic instead of the error naming the key
    with pytest.raises(ValueError, match="too large a byte count"):
        parse_byte_size(text)
    with pytest.raises(pydantic.ValidationError, match=r"cpu_bytes_to_use[\s\S]*too large"):
        OffloadingConfig(cpu_bytes_to_use=text)


def test_byte_parsing_is_exact_whatever_the_decimal_context() -> None:
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        parse_byte_size("0.99999999999999999999999999999KiB")
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        parse_byte_size("1.00000000000000000000000000001")
    with decimal.localcontext() as ctx:
        ctx.prec = 6  # as some other library in the process might set it
        assert parse_byte_size("123456789") == 123_456_789
        assert parse_byte_size("1.0000001GB") == 1_000_000_100
        assert parse_byte_size("9223372036854775807") == 2**63 - 1


def test_zero_staging_bytes_in_any_unit_and_finite_non_bool_floats() -> None:
    for zero in (0, "0", "0MiB", "0.0GiB"):
        assert OffloadingConfig(num_cpu_blocks=4, staging_bytes=zero).staging_bytes == 0
    with pytest.raises(ValueError, match="must be positive"):
        OffloadingConfig(num_cpu_blocks=4, cpu_bytes_to_use=None, disk_path="/x", disk_bytes="0MiB")
    for key in ("compute_slowdown_budget", "remote_ttl_s", "remote_timeout_s"):
        with pytest.raises(pydantic.ValidationError, match=rf"{key}[\s\S]*got True"):
            OffloadingConfig(num_cpu_blocks=4, **{key: True})
    for inf in (float("inf"), "inf"):
        with pytest.raises(pydantic.ValidationError, match=r"compute_slowdown_budget[\s\S]*finite"):
            OffloadingConfig(num_cpu_blocks=4, compute_slowdown_budget=inf)
    assert (
        OffloadingConfig(num_cpu_blocks=4, compute_slowdown_budget=0).compute_slowdown_budget == 0
    )


def test_resolve_num_cpu_blocks_checks_arguments_up_front() -> None:
    config = OffloadingConfig(cpu_bytes_to_use="1GiB")
    assert config.resolve_num_cpu_blocks(131072, np.int64(16)) == 8192
    assert config.resolve_num_cpu_blocks(np.int64(131072), 16) == 8192
    for args, name in (
        ((131072, 16.0), "block_size"),
        ((131072.0, 16), "bytes_per_gpu_block"),
        ((131072, 16, 2.0), "world_size"),
        ((131072, True), "block_size"),
    ):
        with pytest.raises(TypeError, match=rf"{name} must be an int"):
            config.resolve_num_cpu_blocks(*args)
    blocks = OffloadingConfig(num_cpu_blocks=4)  # checked even when the count is given
    with pytest.raises(TypeError, match="bytes_per_gpu_block must be an int"):
        blocks.resolve_num_cpu_blocks(1.5, 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        blocks.resolve_num_cpu_blocks(131072, 16, 0)
