"""The CPU plan: offloaded block size, bytes per GPU block and CPU slots (docs/design.md
invariant 3), and its errors."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch

import kvoff
from kvoff import offloading_spec
from kvoff.config import EVICTION_POLICIES
from kvoff.kv_cache_config import pool_bytes_per_block
from kvoff.offloading_spec import CPUOffloadingSpec
from kvoff.sizing import bytes_per_gpu_block
from kvoff.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from kvoff.tools.bench_transfer import TRANSFER_PRESETS
from kvoff.tools.manager_calls_record import _kv_bytes_per_block

BF16 = torch.bfloat16
FULL = FullAttentionSpec(16, 8, 128, BF16)  # page 65,536 bytes


def _llama_like(num_blocks: int = 100, layers: int = 2) -> KVCacheConfig:
    specs = {f"l{i}": FULL for i in range(layers)}
    return kvoff.get_kv_cache_config(specs, 1, num_gpu_blocks_override=num_blocks)


def test_public_name() -> None:
    assert kvoff.CPUOffloadingSpec is CPUOffloadingSpec


def test_derived_values_by_hand() -> None:
    config = _llama_like()
    spec = CPUOffloadingSpec(config, cpu_bytes_to_use=2**30, block_size=64, world_size=2)
    assert spec.gpu_block_size == (16,)
    assert spec.block_size_factor == 4
    assert spec.offloaded_block_size == 64
    # 2 layers × 65,536 = 131,072 bytes per GPU block
    assert spec.kv_bytes_per_block == 131_072
    # 2^30 // (131,072 × 2 ranks × 4) = 1,024 slots
    assert spec.num_blocks == 1024
    assert spec.num_tokens == 1024 * 64
    assert spec.bytes_per_offloaded_block == 524_288
    default = CPUOffloadingSpec(config, cpu_bytes_to_use=2**30)
    assert default.offloaded_block_size == 16
    assert default.block_size_factor == 1
    assert default.num_blocks == 2**30 // 131_072 == 8192
    hash(default)


def test_per_layer_pages_cpu_count_by_hand() -> None:
    """Invariant 3 with a UniformTypeKVCacheSpecs group: bytes per GPU block is the sum of the
    layers' pages (65,536 + 16,384 = 81,920), not its page × number of tensors (which would
    count the group page twice, giving half the slots)."""
    small = FullAttentionSpec(16, 2, 128, BF16)  # 16,384 bytes
    config = kvoff.get_kv_cache_config({"a": FULL, "b": small}, 1, num_gpu_blocks_override=50)
    assert isinstance(config.kv_cache_groups[0].kv_cache_spec, kvoff.UniformTypeKVCacheSpecs)
    assert config.kv_cache_groups[0].kv_cache_spec.page_size_bytes == 81_920
    spec = CPUOffloadingSpec(config, cpu_bytes_to_use=81_920 * 10)
    assert spec.kv_bytes_per_block == 81_920
    assert spec.num_blocks == 10  # 819,200 // 81,920; page × 2 tensors would give 5


def test_hybrid_bytes_per_block_is_shared_tensor_bytes() -> None:
    swa = SlidingWindowSpec(16, 8, 128, BF16, 256)
    specs = {"s0": swa, "s1": swa, "s2": swa, "f0": FULL}
    config = kvoff.get_kv_cache_config(specs, 1, num_gpu_blocks_override=100)
    # group_size 1 → one tensor shared by all four layers: 65,536 bytes per block
    assert len(config.kv_cache_tensors) == 1
    spec = CPUOffloadingSpec(config, cpu_bytes_to_use=65_536 * 33)
    assert spec.kv_bytes_per_block == 65_536
    assert spec.gpu_block_size == (16, 16, 16, 16)
    assert spec.num_blocks == 33


def test_zero_gpu_blocks_gives_zero_cpu_blocks() -> None:
    config = KVCacheConfig(0, [KVCacheTensor(0, ["a"])], [KVCacheGroupSpec(["a"], FULL)])
    spec = CPUOffloadingSpec(config, cpu_bytes_to_use=2**30)
    assert spec.kv_bytes_per_block == 0
    assert spec.num_blocks == 0


def test_count_comes_from_the_one_sizing_function(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def spy(*args: int) -> int:
        calls.append(args)
        return 7

    monkeypatch.setattr(offloading_spec, "compute_num_cpu_blocks", spy)
    spec = CPUOffloadingSpec(_llama_like(), cpu_bytes_to_use=10**9, block_size=32, world_size=3)
    assert spec.num_blocks == 7
    assert calls == [(10**9, 131_072, 2, 3)]


def test_bytes_per_block_comes_from_the_one_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """invariant 3: the plan's bytes per GPU block is sizing.bytes_per_gpu_block of its tensors."""
    calls = []

    def spy(tensor_bytes: Iterable[int], num_blocks: int) -> int:
        calls.append((list(tensor_bytes), num_blocks))
        return 4096

    monkeypatch.setattr(offloading_spec, "bytes_per_gpu_block", spy)
    config = _llama_like()
    spec = CPUOffloadingSpec(config, cpu_bytes_to_use=4096 * 5)
    assert spec.kv_bytes_per_block == 4096 and spec.num_blocks == 5
    assert calls == [([t.size for t in config.kv_cache_tensors], 100)]


def test_bytes_per_gpu_block() -> None:
    assert bytes_per_gpu_block([1000, 600], 4) == 400  # total bytes // num_blocks
    assert bytes_per_gpu_block([1001], 2) == 500
    assert bytes_per_gpu_block([65_536] * 3, 1) == 196_608  # one block of each tensor
    assert bytes_per_gpu_block([np.int64(4096)], np.int64(2)) == 2048
    assert bytes_per_gpu_block([123], 0) == 0  # no GPU blocks: nothing to offload
    assert bytes_per_gpu_block([], 0) == 0


@pytest.mark.parametrize(
    ("tensor_bytes", "num_blocks", "error", "needle"),
    [
        ([100], -1, ValueError, "num_blocks=-1"),
        ([100, -5], 1, ValueError, r"sizes \[100, -5\]"),
        ([100], 1.5, TypeError, "num_blocks must be an int, got 1.5"),
        ([True], 1, TypeError, "tensor_bytes must be an int, got True"),
        (["64"], 1, TypeError, "tensor_bytes must be an int"),
    ],
)
def test_bytes_per_gpu_block_errors(
    tensor_bytes: list, num_blocks: object, error: type[Exception], needle: str
) -> None:
    with pytest.raises(error, match=needle):
        bytes_per_gpu_block(tensor_bytes, num_blocks)  # type: ignore[arg-type]


def test_every_bytes_per_block_figure_is_the_one_function(tmp_path: Path) -> None:
    """The plan, the pool sizing of get_kv_cache_config, the transfer benchmark's presets and the
    recorded engine's pool all give the figure of one formula (invariant 3)."""
    config = _llama_like(num_blocks=100, layers=3)
    sizes = [t.size for t in config.kv_cache_tensors]
    expected = bytes_per_gpu_block(sizes, config.num_blocks)
    assert expected == 3 * 65_536
    assert CPUOffloadingSpec(config, cpu_bytes_to_use=2**30).kv_bytes_per_block == expected
    assert pool_bytes_per_block(config.kv_cache_groups) == expected
    llama = TRANSFER_PRESETS["llama-3-8b"]
    assert llama.bytes_per_block == 32 * 2 * 32_768 == 2 * 2**20
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 3, "num_attention_heads": 16, "num_key_value_heads": 8, '
        '"hidden_size": 2048, "head_dim": 128}'
    )
    # K and V of 3 layers, 16 tokens × 8 heads × 128 × 2 bytes each: the same 3 × 65,536
    assert _kv_bytes_per_block(tmp_path, "bfloat16", 16) == expected


def _mixed_block_sizes() -> KVCacheConfig:
    a = FullAttentionSpec(16, 8, 128, BF16)
    b = SlidingWindowSpec(32, 4, 128, BF16, 512)  # same page: 2 × 32 × 4 × 128 × 2 = 65,536
    return kvoff.get_kv_cache_config({"a": a, "b": b}, 1, num_gpu_blocks_override=10)


@pytest.mark.parametrize(
    ("config", "kwargs", "needle"),
    [
        (_llama_like, {}, "cpu_bytes_to_use is missing"),
        (_llama_like, {"cpu_bytes_to_use": 0}, "positive number of bytes, got 0"),
        (_llama_like, {"cpu_bytes_to_use": -1}, "got -1"),
        (
            _llama_like,
            {"cpu_bytes_to_use": 1000, "block_size": 32, "world_size": 2},
            "cannot hold one offloaded block: one needs 524288 bytes",
        ),
        (_llama_like, {"cpu_bytes_to_use": 2**30, "block_size": 40}, "40 .* multiple .* 32 or 48"),
        (_llama_like, {"cpu_bytes_to_use": 2**30, "block_size": 0}, "positive"),
        (_mixed_block_sizes, {"cpu_bytes_to_use": 2**30, "block_size": 64}, r"\[16, 32\]"),
        (_mixed_block_sizes, {"cpu_bytes_to_use": 2**30}, "must use one block size"),
        (
            _llama_like,
            {"cpu_bytes_to_use": 2**30, "hash_block_size": 12},
            "hash_block_size=12.*aligned to the prefix-cache hash size",
        ),
        (_llama_like, {"cpu_bytes_to_use": 2**30, "eviction_policy": "fifo"}, "'fifo'.*lru"),
        (_llama_like, {"cpu_bytes_to_use": 2**30, "world_size": 0}, "world_size"),
    ],
)
def test_errors(config, kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        CPUOffloadingSpec(config(), **kwargs)


def test_hash_block_size_and_policy_accepted() -> None:
    spec = CPUOffloadingSpec(
        _llama_like(), cpu_bytes_to_use=2**30, hash_block_size=8, eviction_policy=" LRU "
    )
    assert spec.eviction_policy == "lru" == EVICTION_POLICIES[0]


def test_from_dict() -> None:
    config = _llama_like()
    spec = CPUOffloadingSpec.from_dict(
        config,
        {"cpu_bytes_to_use": 2**30, "block_size": 64, "hash_block_size": 16},
        world_size=2,
    )
    assert spec == CPUOffloadingSpec(
        config, cpu_bytes_to_use=2**30, block_size=64, hash_block_size=16, world_size=2
    )
    with pytest.raises(ValueError, match=r"'cpu_byte_to_use'.*did you mean 'cpu_bytes_to_use'"):
        CPUOffloadingSpec.from_dict(config, {"cpu_byte_to_use": 2**30})
    with pytest.raises(ValueError, match=r"'blocksize'.*did you mean 'block_size'"):
        CPUOffloadingSpec.from_dict(config, {"cpu_bytes_to_use": 2**30, "blocksize": 64})
    with pytest.raises(ValueError, match="cpu_bytes_to_use is missing"):
        CPUOffloadingSpec.from_dict(config, {})


def test_from_config_uses_the_one_configuration_object(tmp_path, monkeypatch) -> None:
    """The plan reads the library's configuration object, file and environment included."""
    from kvoff import OffloadingConfig
    from kvoff.kv_cache_config import get_kv_cache_config

    layer = FullAttentionSpec(16, 8, 128, torch.bfloat16)  # 65,536-byte page
    kv = get_kv_cache_config({f"l{i}": layer for i in range(4)}, 2**30)
    path = tmp_path / "kvoff.yaml"
    path.write_text("cpu_bytes_to_use: 1GiB\noffloaded_block_size: 64\n")
    monkeypatch.setenv("KVOFF_WORLD_SIZE", "2")
    spec = CPUOffloadingSpec.from_config(kv, OffloadingConfig.load(path))
    # 2^30 // (4 layers × 65,536 bytes × factor 4 × world size 2) = 512 slots
    assert (spec.block_size_factor, spec.num_blocks) == (4, 512)
    with pytest.raises(ValueError, match=r"num_cpu_blocks=7.*set cpu_bytes_to_use"):
        CPUOffloadingSpec.from_config(kv, OffloadingConfig(num_cpu_blocks=7))
