"""KV cache specs: page sizes, blocks per request and validation (docs/design.md vocabulary)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvoff
from kvoff.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

BF16 = torch.bfloat16


def test_public_names() -> None:
    for name in (
        "FullAttentionSpec",
        "SlidingWindowSpec",
        "MLAAttentionSpec",
        "MambaSpec",
        "UniformTypeKVCacheSpecs",
        "KVCacheTensor",
        "KVCacheGroupSpec",
        "KVCacheConfig",
    ):
        assert name in kvoff.__all__
        assert getattr(kvoff, name) is getattr(kvoff.specs, name)


def test_attention_pages_by_hand() -> None:
    # full: 2 (K,V) × 16 tokens × 8 heads × 128 × 2 bytes = 65,536
    assert FullAttentionSpec(16, 8, 128, BF16).page_size_bytes == 65_536
    # sliding window: the same page
    assert SlidingWindowSpec(16, 8, 128, BF16, 4096).page_size_bytes == 65_536
    # MLA (DeepSeek-V3): 1 latent × 64 tokens × 1 × 576 × 2 bytes = 73,728
    mla = MLAAttentionSpec(64, 1, 576, "bf16")
    assert mla.page_size_bytes == 73_728
    assert mla.bytes_per_token == 1152
    # fp8 full attention: 2 × 16 × 8 × 128 × 1 = 32,768
    assert FullAttentionSpec(16, 8, 128, "fp8").page_size_bytes == 32_768


def test_full_and_mla_blocks_per_request() -> None:
    full = FullAttentionSpec(16, 8, 128, BF16)
    assert [full.max_num_blocks(n) for n in (1, 16, 17, 496, 16384)] == [1, 1, 2, 31, 1024]
    assert MLAAttentionSpec(64, 1, 576, BF16).max_num_blocks(65) == 2
    with pytest.raises(ValueError, match="max_model_len"):
        full.max_num_blocks(0)


def test_sliding_window_blocks_by_hand() -> None:
    spec = SlidingWindowSpec(16, 8, 128, BF16, 1024)
    # short requests: as many as full attention, cdiv(100, 16) = 7
    assert spec.max_num_blocks(100) == 7
    # long requests: cdiv(1023, 16) + 1 = 64 + 1 = 65, whatever the length
    assert spec.max_num_blocks(1025) == 65
    assert spec.max_num_blocks(1_000_000) == 65
    # window 17: 16 previous tokens straddle 2 blocks: cdiv(16, 16) + 1 = 2
    assert SlidingWindowSpec(16, 1, 1, BF16, 17).max_num_blocks(10_000) == 2
    assert SlidingWindowSpec(16, 1, 1, BF16, 1).max_num_blocks(10_000) == 1


@pytest.mark.parametrize(("block_size", "window"), [(16, 1), (16, 16), (16, 17), (4, 10), (8, 33)])
def test_sliding_window_bound_is_tight(block_size: int, window: int) -> None:
    """Brute force: at token position p the layer needs tokens max(0, p - W + 1) .. p; the most
    blocks that range ever spans equals the formula (so it is neither too small nor loose)."""
    spec = SlidingWindowSpec(block_size, 1, 1, BF16, window)
    for length in (1, 5, 40, 200):
        spans = [p // block_size - max(0, p - window + 1) // block_size + 1 for p in range(length)]
        assert spec.max_num_blocks(length) == max(spans), length


def test_mamba_pages() -> None:
    # Jamba-like: conv (8192, 3) + ssm (8192, 16) in bf16 = 49,152 + 262,144 = 311,296 bytes
    spec = MambaSpec(80, [[8192, 3], [8192, 16]], ["bf16", "bf16"])
    assert spec.shapes == ((8192, 3), (8192, 16))
    assert spec.dtypes == (BF16, BF16)
    assert spec.page_size_unpadded == spec.page_size_bytes == 311_296
    padded = MambaSpec(80, ((8192, 3), (8192, 16)), (BF16, torch.float32), 600_000)
    # ssm state in fp32: 49,152 + 524,288 = 573,440 unpadded
    assert padded.page_size_unpadded == 573_440
    assert padded.page_size_bytes == 600_000
    assert padded.max_num_blocks(1) == padded.max_num_blocks(10**6) == 1
    assert hash(padded) == hash(MambaSpec(80, [[8192, 3], [8192, 16]], [BF16, "fp32"], 600_000))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((16, ((4, 4),), (BF16,), 31), "page_size_padded=31 .* at least 32"),
        ((16, ((4, 4),), (BF16, BF16)), "1 shapes but 2 dtypes"),
        ((16, ((4, 0),), (BF16,)), "positive ints"),
        ((16, (), ()), "empty"),
        ((0, ((4, 4),), (BF16,)), "block_size"),
        ((16, ((4, 4),), ("float7",)), "float7"),
    ],
)
def test_mamba_validation(args: tuple, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        MambaSpec(*args)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: KVCacheTensor(5, None), "KVCacheTensor.shared_by must name at least one layer"),
        (
            lambda: KVCacheGroupSpec(None, FullAttentionSpec(16, 8, 128, BF16)),
            "KVCacheGroupSpec.layer_names must name at least one layer",
        ),
        (lambda: MambaSpec(16, ((4, 8),), None), "MambaSpec.dtypes must be one dtype per shape"),
    ],
)
def test_a_missing_collection_is_named(build, match) -> None:  # type: ignore[no-untyped-def]
    """None where a collection belongs: a ValueError naming the field, not a bare
    "'NoneType' object is not iterable"."""
    with pytest.raises(ValueError, match=match):
        build()


def test_uniform_type_specs() -> None:
    a = FullAttentionSpec(16, 8, 128, BF16)  # 65,536
    b = FullAttentionSpec(16, 2, 64, BF16)  # 2 × 16 × 2 × 64 × 2 = 8,192
    u = UniformTypeKVCacheSpecs(16, {"l0": a, "l1": b})
    assert u.page_size_bytes == 65_536 + 8_192
    assert u.max_num_blocks(33) == 3
    assert dict(u.kv_cache_specs) == {"l0": a, "l1": b}
    assert hash(u) == hash(UniformTypeKVCacheSpecs(16, {"l0": a, "l1": b}))
    # equal whatever the order of the layers, so the hash must be too
    swapped = UniformTypeKVCacheSpecs(16, {"l1": b, "l0": a})
    assert swapped == u and hash(swapped) == hash(u) and len({u, swapped}) == 1
    with pytest.raises(TypeError):
        u.kv_cache_specs["l2"] = a  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        u.block_size = 32  # type: ignore[misc]
    # sliding-window groups: max over layers
    w = UniformTypeKVCacheSpecs(
        16,
        {
            "s0": SlidingWindowSpec(16, 8, 128, BF16, 64),
            "s1": SlidingWindowSpec(16, 4, 128, BF16, 64),
        },
    )
    assert w.max_num_blocks(10_000) == 5  # cdiv(63, 16) + 1


@pytest.mark.parametrize(
    ("specs", "needle"),
    [
        ({}, "non-empty"),
        (
            {"a": FullAttentionSpec(16, 8, 128, BF16), "b": MLAAttentionSpec(16, 1, 576, BF16)},
            "mixes layer types",
        ),
        (
            {
                "a": SlidingWindowSpec(16, 8, 128, BF16, 64),
                "b": SlidingWindowSpec(16, 8, 128, BF16, 128),
            },
            "mixes layer types",
        ),
        ({"a": FullAttentionSpec(32, 8, 128, BF16)}, "block_size=32"),
        ({"a": "full"}, "str"),
    ],
)
def test_uniform_type_validation(specs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        UniformTypeKVCacheSpecs(16, specs)


@pytest.mark.parametrize(
    ("factory", "needle"),
    [
        (lambda: SlidingWindowSpec(16, 8, 128, BF16, 0), "sliding_window"),
        (lambda: MLAAttentionSpec(16, 0, 576, BF16), "num_kv_heads"),
        (lambda: MLAAttentionSpec(16, 1, 576, "bf17"), "bf17"),
        (lambda: KVCacheTensor(-1, ("a",)), "size"),
        (lambda: KVCacheTensor(8, ()), "at least one layer"),
        (lambda: KVCacheGroupSpec([], FullAttentionSpec(16, 8, 128, BF16)), "at least one"),
        (lambda: KVCacheGroupSpec(["a"], "spec"), "KV cache spec"),
        (
            lambda: KVCacheGroupSpec(
                ["a", "b"], UniformTypeKVCacheSpecs(16, {"a": FullAttentionSpec(16, 8, 128, BF16)})
            ),
            "differ",
        ),
    ],
)
def test_validation(factory, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        factory()


def test_kv_cache_config_containers() -> None:
    full = FullAttentionSpec(16, 8, 128, BF16)
    config = KVCacheConfig(
        10,
        [KVCacheTensor(655_360, ["a"]), KVCacheTensor(655_360, ["b"])],
        [KVCacheGroupSpec(["a", "b"], full)],
        max_model_len=144,
    )
    assert isinstance(config.kv_cache_tensors, tuple)
    assert config.kv_cache_tensors[0].shared_by == ("a",)
    assert config.kv_cache_groups[0].layer_names == ("a", "b")
    assert config.total_bytes == 1_310_720
    assert config.layer_to_group() == {"a": 0, "b": 0}
    hash(config)
    with pytest.raises(ValueError, match="groups 0 and 1"):
        KVCacheConfig(1, [], [KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["a"], full)])
    with pytest.raises(ValueError, match="'z', which is in no group"):
        KVCacheConfig(1, [KVCacheTensor(65536, ["z"])], [KVCacheGroupSpec(["a"], full)])
    with pytest.raises(ValueError, match="two KVCacheTensors"):
        KVCacheConfig(
            1,
            [KVCacheTensor(65536, ["a"]), KVCacheTensor(65536, ["a"])],
            [KVCacheGroupSpec(["a"], full)],
        )
    with pytest.raises(ValueError, match=r"size=655359 bytes, less than num_blocks \(10\) pages"):
        KVCacheConfig(10, [KVCacheTensor(655_359, ["a"])], [KVCacheGroupSpec(["a"], full)])
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheConfig(-1, [], [KVCacheGroupSpec(["a"], full)])
    with pytest.raises(ValueError, match="max_model_len"):
        KVCacheConfig(1, [], [KVCacheGroupSpec(["a"], full)], 0)


def test_kv_cache_config_refuses_a_group_layer_in_no_tensor() -> None:
    # bytes per GPU block = tensor bytes // num_blocks (invariant 3) would miss layer "b", and the
    # CPU pool would get twice the slots cpu_bytes_to_use pays for
    full = FullAttentionSpec(16, 8, 128, BF16)  # page 65,536 bytes
    with pytest.raises(
        ValueError, match=r"layer 'b' is in a KV cache group but in no KVCacheTensor"
    ):
        KVCacheConfig(
            100, [KVCacheTensor(100 * 65536, ["a"])], [KVCacheGroupSpec(["a", "b"], full)]
        )
    with pytest.raises(ValueError, match=r"layer 'a' .* no KVCacheTensor .*\['a', 'b'\]"):
        KVCacheConfig(100, [], [KVCacheGroupSpec(["a", "b"], full)])
    # no GPU blocks: nothing to size, no tensor needed
    assert KVCacheConfig(0, [], [KVCacheGroupSpec(["a"], full)]).total_bytes == 0


@pytest.mark.parametrize("field", ["num_blocks", "max_model_len"])
def test_kv_cache_config_refuses_values_past_int64(field: str) -> None:
    full = FullAttentionSpec(16, 8, 128, BF16)
    kwargs = {"num_blocks": 10, "max_model_len": 144, field: 2**63}
    with pytest.raises(
        ValueError, match=rf"KVCacheConfig\.{field}=9223372036854775808 is too large"
    ):
        KVCacheConfig(
            kwargs["num_blocks"],
            [KVCacheTensor(655_360, ["a"])],
            [KVCacheGroupSpec(["a"], full)],
            kwargs["max_model_len"],
        )
    with pytest.raises(ValueError, match=r"KVCacheTensor\.size=.* too large"):
        KVCacheTensor(2**63, ["a"])
