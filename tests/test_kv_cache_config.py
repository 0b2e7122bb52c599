"""The GPU plan: grouping, tensors, num_blocks, the override and max_model_len fitting
(docs/design.md invariants 2 and 5)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvoff
from kvoff.kv_cache_config import fit_max_model_len, get_kv_cache_config, pool_bytes_per_block
from kvoff.sizing import compute_num_cpu_blocks
from kvoff.specs import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

BF16 = torch.bfloat16
FULL = FullAttentionSpec(16, 8, 128, BF16)  # page 65,536 bytes
SWA = SlidingWindowSpec(16, 8, 128, BF16, 128)  # page 65,536 bytes; ≤ cdiv(127,16)+1 = 9 blocks


def _check_plan(config: kvoff.KVCacheConfig) -> None:
    """Properties every plan has: pool bytes match the tensors, each layer in one group and one
    tensor."""
    per_block = pool_bytes_per_block(config.kv_cache_groups)
    assert config.total_bytes == config.num_blocks * per_block
    assert config.total_bytes // config.num_blocks == per_block
    group_layers = [n for g in config.kv_cache_groups for n in g.layer_names]
    tensor_layers = [n for t in config.kv_cache_tensors for n in t.shared_by]
    assert len(group_layers) == len(set(group_layers))
    assert sorted(group_layers) == sorted(tensor_layers)


def test_public_names() -> None:
    assert kvoff.get_kv_cache_config is get_kv_cache_config
    assert kvoff.pool_bytes_per_block is pool_bytes_per_block


def test_override_32_blocks_auto_fits_and_rejects_16384() -> None:
    specs = {"l0": FULL, "l1": FULL}
    config = get_kv_cache_config(specs, 1, num_gpu_blocks_override=32)
    # 32 blocks, block 0 is the null block: 31 usable × 16 tokens = 496 tokens (≤ 512)
    assert config.num_blocks == 32
    assert config.max_model_len == 31 * 16 == 496
    # 496 tokens → cdiv(496, 16) = 31 blocks fits; 497 → 32 does not
    assert get_kv_cache_config(specs, 1, num_gpu_blocks_override=32, max_model_len=496)
    with pytest.raises(ValueError, match="497"):
        get_kv_cache_config(specs, 1, num_gpu_blocks_override=32, max_model_len=497)
    # 16384 tokens need cdiv(16384, 16) = 1024 blocks; 32 exist (31 usable)
    with pytest.raises(ValueError) as err:
        get_kv_cache_config(specs, 1, num_gpu_blocks_override=32, max_model_len=16384)
    msg = str(err.value)
    for needle in ("16384", "1024", "32", "31", "496", "num_gpu_blocks_override"):
        assert needle in msg, needle


def test_override_sets_capacity_before_fitting() -> None:
    """Invariant 5: with an override, memory plays no part — neither a tiny budget (which alone
    gives 0 blocks and would refuse every length) nor a huge one (which would fit far more)."""
    specs = {"l0": FULL, "l1": SWA}  # hybrid: 2 groups of 1 layer, 1 shared tensor
    tiny = get_kv_cache_config(specs, 1, num_gpu_blocks_override=32)
    huge = get_kv_cache_config(specs, 2**40, num_gpu_blocks_override=32)
    assert tiny == huge
    assert tiny.num_blocks == 32
    # capacity = override × pool bytes per block = 32 × (65,536 × group_size 1)
    assert tiny.total_bytes == 32 * 65_536
    # need(L) = cdiv(L,16) + min(cdiv(L,16), 9) ≤ 31 → cdiv(L,16) ≤ 22 → 352 tokens
    assert tiny.max_model_len == 352
    without = get_kv_cache_config(specs, 2**30)
    assert without.num_blocks == 2**30 // 65_536
    with pytest.raises(ValueError, match="not even one token"):
        get_kv_cache_config(specs, 1)


def test_single_type_one_group_one_tensor_per_layer() -> None:
    specs = {f"layers.{i}": FULL for i in range(4)}
    # pool: 4 × 65,536 = 262,144 bytes per block; 10 MiB → 40 blocks; 39 × 16 = 624 tokens
    config = get_kv_cache_config(specs, 10 * 2**20)
    assert len(config.kv_cache_groups) == 1
    assert config.kv_cache_groups[0].kv_cache_spec == FULL
    assert [t.shared_by for t in config.kv_cache_tensors] == [(n,) for n in specs]
    assert config.num_blocks == 40
    assert all(t.size == 40 * 65_536 for t in config.kv_cache_tensors)
    assert pool_bytes_per_block(config.kv_cache_groups) == 262_144
    assert config.max_model_len == 624
    _check_plan(config)


def test_per_layer_pages_form_one_uniform_group() -> None:
    small = FullAttentionSpec(16, 2, 128, BF16)  # 16,384 bytes
    specs = {"a": FULL, "b": small, "c": FULL}
    config = get_kv_cache_config(specs, 1_474_560)
    (group,) = config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert group.layer_names == ("a", "b", "c")
    # pool: 65,536 + 16,384 + 65,536 = 147,456 bytes per block → 1,474,560 // 147,456 = 10
    assert config.num_blocks == 10
    assert [t.size for t in config.kv_cache_tensors] == [655_360, 163_840, 655_360]
    _check_plan(config)


def test_hybrid_groups_share_tensors_position_by_position() -> None:
    # 5 sliding-window + 2 full layers → group_size 2: SW groups (s0,s1) (s2,s3) (s4), full (f0,f1)
    specs = {"s0": SWA, "s1": SWA, "f0": FULL, "s2": SWA, "s3": SWA, "f1": FULL, "s4": SWA}
    config = get_kv_cache_config(specs, 100 * 131_072)
    assert [g.layer_names for g in config.kv_cache_groups] == [
        ("s0", "s1"),
        ("s2", "s3"),
        ("s4",),
        ("f0", "f1"),
    ]
    assert [t.shared_by for t in config.kv_cache_tensors] == [
        ("s0", "s2", "s4", "f0"),
        ("s1", "s3", "f1"),
    ]
    # pool: 65,536 × 2 tensors = 131,072 per block → 100 blocks
    assert pool_bytes_per_block(config.kv_cache_groups) == 131_072
    assert config.num_blocks == 100
    _check_plan(config)


def test_hybrid_mamba_with_padding_and_mismatch() -> None:
    attn = FullAttentionSpec(80, 8, 128, BF16)  # 2 × 80 × 8 × 128 × 2 = 327,680
    shapes = ((8192, 3), (8192, 16))  # 311,296 bytes unpadded
    unpadded = MambaSpec(80, shapes, (BF16, BF16))
    with pytest.raises(ValueError) as err:
        get_kv_cache_config({"m0": unpadded, "a0": attn}, 2**30)
    msg = str(err.value)
    assert "311296" in msg
    assert "327680" in msg
    assert "page_size_padded" in msg
    padded = MambaSpec(80, shapes, (BF16, BF16), 327_680)
    config = get_kv_cache_config({"m0": padded, "m1": padded, "a0": attn}, 10 * 327_680)
    # group_size 1: groups (m0) (m1) (a0); pool 327,680 per block → 10 blocks; 9 usable:
    # need(L) = 1 + 1 + cdiv(L, 80) ≤ 9 → 7 × 80 = 560 tokens
    assert config.num_blocks == 10
    assert config.max_model_len == 560
    _check_plan(config)


def test_sliding_window_fits_longer_than_full_for_same_memory() -> None:
    """5 sliding-window + 1 full layer against 6 full layers, same memory (600 pages)."""
    memory = 600 * 65_536
    hybrid = get_kv_cache_config({**{f"s{i}": SWA for i in range(5)}, "f": FULL}, memory)
    full = get_kv_cache_config({f"f{i}": FULL for i in range(6)}, memory)
    # full: 6 pages per block → 100 blocks, 99 usable → 99 × 16 = 1,584 tokens
    assert full.max_model_len == 1_584
    # hybrid: group_size 1, 1 page per block → 600 blocks, 599 usable; the 5 SW groups need at
    # most 9 blocks each: cdiv(L,16) ≤ 599 - 45 = 554 → 8,864 tokens. Counting sliding-window
    # layers like full attention would give 6 × cdiv(L,16) ≤ 599 → 1,584 again.
    assert hybrid.num_blocks == 600
    assert hybrid.max_model_len == 8_864 > full.max_model_len


def test_window_only_model_is_capped() -> None:
    config = get_kv_cache_config({"s": SWA}, 1, num_gpu_blocks_override=20)
    # only 9 blocks are ever needed, so the cap applies: 19 usable × 16 = 304 tokens
    assert config.max_model_len == 304
    assert fit_max_model_len(config.kv_cache_groups, 1) == 0


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        (({}, 2**30), {}, "non-empty"),
        (({"a": FULL}, 0), {}, "available_memory"),
        (({"a": FULL}, -5), {}, "available_memory"),
        (({"a": FULL}, 2**30), {"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
        (({"a": FULL}, 2**30), {"max_model_len": 0}, "max_model_len"),
        (({"a": "full"}, 2**30), {}, "not a layer spec"),
        (({"a": FULL}, 65_536), {}, "not even one token.*at least 2 blocks"),
        (
            ({"a": FULL}, 10 * 65_536),
            {"max_model_len": 1000},
            "max_model_len=1000 .* 63 blocks.* 9 are usable .*more GPU memory.*<= 144",
        ),
    ],
)
def test_errors(args: tuple, kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        get_kv_cache_config(*args, **kwargs)


def test_pool_bytes_per_block_errors() -> None:
    with pytest.raises(ValueError, match="at least one"):
        pool_bytes_per_block([])
    groups = [
        kvoff.KVCacheGroupSpec(["a"], FULL),
        kvoff.KVCacheGroupSpec(["b"], MLAAttentionSpec(16, 1, 576, BF16)),
    ]
    with pytest.raises(ValueError, match="page sizes"):
        pool_bytes_per_block(groups)


@st.composite
def _layouts(draw: st.DrawFn) -> dict[str, kvoff.specs.KVCacheSpec]:
    block = draw(st.sampled_from([16, 32]))
    heads = draw(st.integers(1, 4))
    head = draw(st.sampled_from([32, 64]))
    n = draw(st.integers(1, 16))
    if draw(st.booleans()):  # one type, per-layer pages
        return {
            f"l{i}": FullAttentionSpec(block, draw(st.integers(1, 4)), head, BF16) for i in range(n)
        }
    page = 2 * block * heads * head * 2
    kinds = [
        FullAttentionSpec(block, heads, head, BF16),
        SlidingWindowSpec(block, heads, head, BF16, draw(st.integers(1, 300))),
        MLAAttentionSpec(block, 2 * heads, head, BF16),  # 1 × block × 2h × head × 2 = page
        MambaSpec(block, ((4, 8),), (BF16,), page),
    ]
    return {f"l{i}": draw(st.sampled_from(kinds)) for i in range(n)}


@settings(max_examples=60, deadline=None)
@given(
    specs=_layouts(),
    blocks=st.integers(17, 5000),
    extra=st.integers(0, 10**6),
    world_size=st.integers(1, 8),
    cpu_bytes=st.integers(1, 2**36),
    override=st.booleans(),
)
def test_property_plans(
    specs: dict, blocks: int, extra: int, world_size: int, cpu_bytes: int, override: bool
) -> None:
    largest = max(s.page_size_bytes for s in specs.values())
    memory = blocks * largest * len(specs) + extra  # ≥ 17 blocks: every layout fits a token
    config = get_kv_cache_config(
        specs, memory, num_gpu_blocks_override=blocks if override else None
    )
    _check_plan(config)
    per_block = pool_bytes_per_block(config.kv_cache_groups)
    assert config.num_blocks == (blocks if override else memory // per_block)
    assert sorted(n for g in config.kv_cache_groups for n in g.layer_names) == sorted(specs)
    need = sum(g.kv_cache_spec.max_num_blocks(config.max_model_len) for g in config.kv_cache_groups)
    assert need <= config.num_blocks - 1
    # CPU side (invariant 3): bytes per GPU block = total tensor bytes // num_blocks
    gpu_bs = config.kv_cache_groups[0].kv_cache_spec.block_size
    factor = 4
    try:
        cpu = kvoff.CPUOffloadingSpec(
            config, cpu_bytes_to_use=cpu_bytes, block_size=factor * gpu_bs, world_size=world_size
        )
    except ValueError as exc:
        assert per_block * factor * world_size > cpu_bytes, exc
        return
    assert cpu.kv_bytes_per_block == per_block
    assert cpu.num_blocks == cpu_bytes // (config.total_bytes // config.num_blocks * world_size * 4)
    assert cpu.num_blocks == compute_num_cpu_blocks(cpu_bytes, per_block, factor, world_size)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (
            {"num_gpu_blocks_override": 2**64},
            r"num_gpu_blocks_override=18446744073709551616 is too",
        ),
        ({"num_gpu_blocks_override": 2**62}, r"num_gpu_blocks_override=4611686018427387904 blocks"),
        ({"max_model_len": 2**63}, r"max_model_len=9223372036854775808 is too large"),
    ],
)
def test_plan_refuses_values_past_int64(kwargs: dict, needle: str) -> None:
    # they used to be accepted and crash later in the C++ binding with a raw TypeError
    full = FullAttentionSpec(16, 8, 128, torch.bfloat16)
    kwargs.setdefault("num_gpu_blocks_override", 100)
    with pytest.raises(ValueError, match=needle):
        get_kv_cache_config({"a": full}, 1, **kwargs)


def test_fit_max_model_len_checks_its_arguments() -> None:
    group = KVCacheGroupSpec(["a"], FullAttentionSpec(16, 8, 128, torch.bfloat16))
    with pytest.raises(ValueError, match="kv_cache_groups must hold at least one KVCacheGroupSpec"):
        fit_max_model_len([], 10)
    for bad in (10.5, "10", True, -1):
        with pytest.raises(ValueError, match=r"num_blocks must be an int >= 0"):
            fit_max_model_len([group], bad)  # type: ignore[arg-type]
    assert fit_max_model_len([group], 10) == 144
    assert fit_max_model_len([group], 2**62) == 2**63 - 1  # capped at int64
