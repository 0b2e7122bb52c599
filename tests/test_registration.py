"""Layout-agnostic registration (docs/design.md invariant 2): every layout becomes num_blocks rows
from KVCacheConfig.num_blocks, and a store/load round trip moves exactly the right bytes."""

from __future__ import annotations

import pytest
import torch

import kvoff
from kvoff import CPUBlockSpec, GPUBlockSpec, OffloadingWorker
from kvoff.registration import block_row_views
from kvoff.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

N = 6  # GPU blocks


def _rand(shape, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _config(groups, tensors=None, num_blocks=N):
    if tensors is None:
        tensors = [
            KVCacheTensor(num_blocks * _page(grp, name), (name,))
            for grp in groups
            for name in grp.layer_names
        ]
    return KVCacheConfig(num_blocks, tensors, groups, max_model_len=64)


def _page(group, name):
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)
    return (dict(per_layer)[name] if per_layer is not None else spec).page_size_bytes


def _round_trip(worker, src_blocks, dst_blocks, groups=1):
    """Store src_blocks (group 0, or the same ids in every group) and load them into dst."""
    n = len(src_blocks)
    gpu_src = GPUBlockSpec(tuple(src_blocks) * groups, (n,) * groups, (0,) * groups)
    cpu = CPUBlockSpec(tuple(range(n * groups)))
    assert worker.transfer_async(1, gpu_src, cpu)
    gpu_dst = GPUBlockSpec(tuple(dst_blocks) * groups, (n,) * groups, (0,) * groups)
    assert worker.transfer_async(2, cpu, gpu_dst)
    assert all(r.success for r in worker.wait([1, 2]))


def test_blocks_first_and_kernel_blocks() -> None:
    spec = FullAttentionSpec(8, 2, 16, torch.float16)
    group = KVCacheGroupSpec(("a", "b"), spec)
    kv_a = _rand((N, 2, 8, 2, 16), seed=1)
    kv_b = _rand((4 * N, 2, 2, 2, 16), seed=2)  # each block split into 4 kernel blocks of 2
    w = OffloadingWorker(N, 4, kv_cache_config=_config([group]))
    w.register_kv_caches({"a": kv_a, "b": kv_b})
    assert [r.shape for r in w.gpu_tensors()] == [(N, spec.page_size_bytes)] * 2
    _round_trip(w, [1, 2], [4, 5])
    assert torch.equal(kv_a[4], kv_a[1]) and torch.equal(kv_a[5], kv_a[2])
    assert torch.equal(kv_b[16:24], kv_b[4:12])  # blocks 4,5 = kernel blocks 16..23
    assert not torch.equal(kv_b[0:4], kv_b[4:8])


def test_kv_first_layout_gives_two_half_page_rows() -> None:
    spec = FullAttentionSpec(4, 2, 8, torch.bfloat16)
    kv = _rand((2, N, 4, 2, 8), torch.bfloat16, seed=3)
    rows = block_row_views("l", kv, N, spec)
    assert [r.shape for r in rows] == [(N, spec.page_size_bytes // 2)] * 2
    w = OffloadingWorker(N, 3, kv_cache_config=_config([KVCacheGroupSpec(("l",), spec)]))
    w.register_kv_caches({"l": kv})
    _round_trip(w, [0, 3], [5, 1])
    assert torch.equal(kv[:, 5], kv[:, 0]) and torch.equal(kv[:, 1], kv[:, 3])
    assert not torch.equal(kv[:, 2], kv[:, 0])
    # K/V first with kernel blocks: (2, 2N, 2, ...)
    kv2 = _rand((2, 2 * N, 2, 2, 8), torch.bfloat16, seed=4)
    rows = block_row_views("l", kv2, N, spec)
    assert [r.shape for r in rows] == [(N, spec.page_size_bytes // 2)] * 2
    assert rows[1].data_ptr() == kv2[1].data_ptr()


def test_layers_of_two_groups_share_one_tensor() -> None:
    full = FullAttentionSpec(4, 1, 8, torch.float16)
    swa = SlidingWindowSpec(4, 1, 8, torch.float16, sliding_window=8)
    groups = [KVCacheGroupSpec(("full",), full), KVCacheGroupSpec(("swa",), swa)]
    raw = _rand((N, full.page_size_bytes // 2), seed=5)  # one allocation, viewed by both layers
    tensors = [KVCacheTensor(N * full.page_size_bytes, ("full", "swa"))]
    w = OffloadingWorker(N, 4, kv_cache_config=_config(groups, tensors))
    w.register_kv_caches({"full": raw.view(N, 2, 4, 1, 8), "swa": raw.view(N, 2, 4, 1, 8)})
    assert w.num_groups == 2
    before = raw.clone()
    # group 0 stores GPU block 1, group 1 stores GPU block 2 (same tensor, different ids)
    assert w.transfer_async(1, GPUBlockSpec((1, 2), (1, 1), (0, 0)), CPUBlockSpec((0, 1)))
    raw.zero_()
    assert w.transfer_async(2, CPUBlockSpec((0, 1)), GPUBlockSpec((4, 5), (1, 1), (0, 0)))
    assert torch.equal(raw[4], before[1]) and torch.equal(raw[5], before[2])
    assert raw[1].abs().sum() == 0


def test_per_layer_page_sizes() -> None:
    specs = {
        "a": FullAttentionSpec(4, 1, 8, torch.float16),
        "b": FullAttentionSpec(4, 4, 8, torch.float16),
    }
    uniform = UniformTypeKVCacheSpecs(4, specs)
    assert uniform.page_size_bytes == specs["a"].page_size_bytes + specs["b"].page_size_bytes
    group = KVCacheGroupSpec(("a", "b"), uniform)
    kv = {"a": _rand((N, 2, 4, 1, 8), seed=6), "b": _rand((N, 2, 4, 4, 8), seed=7)}
    w = OffloadingWorker(N, 2, kv_cache_config=_config([group]))
    w.register_kv_caches(kv)
    assert w.bytes_per_gpu_block == uniform.page_size_bytes
    _round_trip(w, [3], [0])
    assert torch.equal(kv["a"][0], kv["a"][3]) and torch.equal(kv["b"][0], kv["b"][3])
    with pytest.raises(ValueError, match="page_size_bytes is"):
        OffloadingWorker(N, 2, kv_cache_config=_config([group])).register_kv_caches(
            {"a": kv["b"], "b": kv["a"]}
        )


def test_padded_mamba_copies_only_unpadded_bytes() -> None:
    conv, ssm = (3, 4), (2, 5)  # float32 states: 48 + 40 = 88 bytes, padded to 128
    spec = MambaSpec(4, (conv, ssm), (torch.float32, torch.float32), page_size_padded=128)
    assert spec.page_size_unpadded == 88 and spec.page_size_bytes == 128
    raw = torch.full((N, 128), 0xAB, dtype=torch.uint8)
    states = [
        raw[:, :48].view(torch.float32).view(N, *conv),
        raw[:, 48:88].view(torch.float32).view(N, *ssm),
    ]
    for i, s in enumerate(states):
        s.copy_(_rand(s.shape, torch.float32, seed=10 + i))
    group = KVCacheGroupSpec(("m",), spec)
    for kv in (states, raw):  # a list of state views, or the raw padded tensor
        w = OffloadingWorker(N, 2, kv_cache_config=_config([group]))
        w.register_kv_caches({"m": kv})
        assert sum(r.shape[1] for r in w.gpu_tensors()) == 88
        raw[5, 88:] = 0x11  # padding of the destination block must not be written
        _round_trip(w, [2], [5])
        assert torch.equal(raw[5, :88], raw[2, :88])
        assert bool((raw[5, 88:] == 0x11).all())


def test_registration_errors_name_the_layer() -> None:
    spec = FullAttentionSpec(4, 1, 8, torch.float16)
    group = KVCacheGroupSpec(("l",), spec)
    w = OffloadingWorker(N, 2, kv_cache_config=_config([group]))
    with pytest.raises(ValueError, match=r"missing \['l'\]"):
        w.register_kv_caches({"x": _rand((N, 2, 4, 1, 8))})
    with pytest.raises(ValueError, match=r"layer .l.*not a multiple of num_blocks=6"):
        w.register_kv_caches({"l": _rand((7, 2, 4, 1, 8))})
    with pytest.raises(ValueError, match=r"kv_cache_config\.num_blocks=6"):
        OffloadingWorker(5, 2, kv_cache_config=_config([group]))
    with pytest.raises(ValueError, match="kv_layout"):
        block_row_views("l", _rand((N, 2, 4, 1, 8)), N, spec, kv_layout="nhd")  # type: ignore[arg-type]
    assert kvoff.OffloadingWorker is OffloadingWorker
