"""The worker: registration (DESIGN.md invariant 2), store/load round trips, job bookkeeping."""

from __future__ import annotations

import pytest
import torch

from kvoff import CPUBlockSpec, GPUBlockSpec, OffloadingWorker


def _kv(num_blocks: int, block_size: int = 4, heads: int = 2, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, 2, block_size, heads, dim), generator=g).to(torch.bfloat16)


def test_round_trip_factor_one_all_layers() -> None:
    caches = {f"l{i}": _kv(10, seed=i) for i in range(3)}
    original = {k: v.clone() for k, v in caches.items()}
    w = OffloadingWorker(num_gpu_blocks=10, num_cpu_blocks=6)
    w.register_kv_caches(caches)
    assert w.transfer_async(1, GPUBlockSpec.single_group([7, 2, 5]), CPUBlockSpec((0, 4, 1)))
    (r,) = w.wait([1])
    assert r.success and r.direction == "store"
    assert r.num_bytes == 3 * 3 * caches["l0"][0].numel() * 2
    for v in caches.values():
        v.zero_()
    assert w.transfer_async(2, CPUBlockSpec((4, 1, 0)), GPUBlockSpec.single_group([3, 9, 8]))
    assert [x.job_id for x in w.get_finished()] == [2]
    for k, v in caches.items():
        torch.testing.assert_close(v[3], original[k][2], rtol=0, atol=0)
        torch.testing.assert_close(v[9], original[k][5], rtol=0, atol=0)
        torch.testing.assert_close(v[8], original[k][7], rtol=0, atol=0)
        assert v[0].abs().sum() == 0  # untouched blocks stay untouched


def test_factor_and_partial_first_offloaded_block() -> None:
    """block_size_factor 4: GPU blocks at logical positions 6..9 span offloaded blocks 1 (its
    sub-blocks 2, 3) and 2 (sub-blocks 0, 1); block_indices gives the offset."""
    kv = _kv(16)
    w = OffloadingWorker(num_gpu_blocks=16, num_cpu_blocks=3, block_size_factor=4)
    w.register_kv_caches({"l": kv})
    # store offloaded blocks made of GPU blocks [1..4] -> slot 2 and [5..8] -> slot 0
    assert w.transfer_async(
        1, GPUBlockSpec.single_group([1, 2, 3, 4, 5, 6, 7, 8], 0), CPUBlockSpec((2, 0))
    )
    # load logical positions 6..9 = slot 2 sub-blocks 2,3 then slot 0 sub-blocks 0,1
    assert w.transfer_async(
        2, CPUBlockSpec((2, 0)), GPUBlockSpec.single_group([10, 11, 12, 13], block_index=6)
    )
    for dst, src in zip([10, 11, 12, 13], [3, 4, 5, 6], strict=True):
        assert torch.equal(kv[dst], kv[src]), (dst, src)


def test_multi_group_job() -> None:
    kv_a, kv_b = _kv(8, seed=1), _kv(8, seed=2)
    w = OffloadingWorker(num_gpu_blocks=8, num_cpu_blocks=4, block_size_factor=2)
    w.register_kv_caches({"a": kv_a, "b": kv_b}, layer_to_group={"a": 0, "b": 1})
    assert w.num_groups == 2
    # group 0: blocks 1,2 (logical 0,1) -> slot 3; group 1: block 5 at logical 3 -> slot 1 (sub 1)
    spec = GPUBlockSpec((1, 2, 5), group_sizes=(2, 1), block_indices=(0, 3))
    assert w.transfer_async(1, spec, CPUBlockSpec((3, 1)))
    assert w.transfer_async(2, CPUBlockSpec((3, 1)), GPUBlockSpec((6, 7, 4), (2, 1), (0, 3)))
    assert torch.equal(kv_a[6], kv_a[1]) and torch.equal(kv_a[7], kv_a[2])
    assert torch.equal(kv_b[4], kv_b[5])
    assert not torch.equal(kv_b[6], kv_b[1])  # group 1 never copied its block 1
    # a group with no blocks in this job
    assert w.transfer_async(3, GPUBlockSpec((2,), (1, 0), (0, 0)), CPUBlockSpec((0,)))


def test_registration_uses_num_gpu_blocks_not_the_shape() -> None:
    """Invariant 2: a tensor whose leading dimension is 4 × num_blocks (kernel blocks of a
    quarter of the size) is still registered as num_blocks rows of 4 kernel blocks each."""
    kernel_blocks = _kv(4 * 6, block_size=2)
    w = OffloadingWorker(num_gpu_blocks=6, num_cpu_blocks=2)
    w.register_kv_caches({"l": kernel_blocks})
    (rows,) = w.gpu_tensors()
    assert rows.shape == (6, 4 * kernel_blocks[0].numel() * 2)
    assert w.transfer_async(1, GPUBlockSpec.single_group([1]), CPUBlockSpec((1,)))
    assert w.transfer_async(2, CPUBlockSpec((1,)), GPUBlockSpec.single_group([5]))
    # GPU block 5 = kernel blocks 20..23, GPU block 1 = kernel blocks 4..7
    assert torch.equal(kernel_blocks[20:24], kernel_blocks[4:8])
    with pytest.raises(ValueError, match="not a multiple of num_blocks=7"):
        OffloadingWorker(num_gpu_blocks=7, num_cpu_blocks=2).register_kv_caches(
            {"l": kernel_blocks}
        )


def test_bad_ids_fail_the_job_cleanly() -> None:
    kv = _kv(8)
    before = kv.clone()
    w = OffloadingWorker(num_gpu_blocks=8, num_cpu_blocks=2)
    w.register_kv_caches({"l": kv})
    assert w.transfer_async(1, GPUBlockSpec.single_group([1, 2]), CPUBlockSpec((0, 1)))
    # CPU id 2 is out of range: the whole job fails, reported, and GPU block 3 is not written
    assert not w.transfer_async(2, CPUBlockSpec((0, 2)), GPUBlockSpec.single_group([3, 4]))
    (r,) = w.wait([2])
    assert not r.success and r.num_bytes == 0 and "2" in (r.error or "")
    assert torch.equal(kv, before)
    # GPU id out of range
    assert not w.transfer_async(3, GPUBlockSpec.single_group([8]), CPUBlockSpec((0,)))
    # the earlier store is intact
    assert w.transfer_async(4, CPUBlockSpec((0, 1)), GPUBlockSpec.single_group([5, 6]))
    assert torch.equal(kv[5], before[1]) and torch.equal(kv[6], before[2])


def test_structural_errors_raise() -> None:
    w = OffloadingWorker(num_gpu_blocks=8, num_cpu_blocks=2, block_size_factor=2)
    with pytest.raises(ValueError, match="register_kv_caches first"):
        w.transfer_async(1, GPUBlockSpec.single_group([1]), CPUBlockSpec((0,)))
    w.register_kv_caches({"l": _kv(8)})
    with pytest.raises(ValueError, match=r"sum\(group_sizes\)=3 != len\(block_ids\)=2"):
        GPUBlockSpec((1, 2), (3,), (0,))
    with pytest.raises(ValueError, match="one entry per KV cache group"):
        GPUBlockSpec((1, 2), (2,), (0, 0))
    with pytest.raises(ValueError, match="2 group_sizes entries but 1"):
        w.transfer_async(1, GPUBlockSpec((1, 2), (1, 1), (0, 0)), CPUBlockSpec((0, 1)))
    with pytest.raises(ValueError, match="covers 1 offloaded blocks"):
        w.transfer_async(1, GPUBlockSpec.single_group([1, 2]), CPUBlockSpec((0, 1)))
    with pytest.raises(ValueError, match="needs at least 2"):
        w.transfer_async(1, GPUBlockSpec.single_group([1, 2], 1), CPUBlockSpec((0,)))
    with pytest.raises(ValueError, match="GPUBlockSpec→CPUBlockSpec"):
        w.transfer_async(1, CPUBlockSpec((0,)), CPUBlockSpec((1,)))
    with pytest.raises(KeyError, match="unknown job ids"):
        w.wait([99])
    with pytest.raises(ValueError, match="already called"):
        w.register_kv_caches({"l": _kv(8)})


def test_registration_errors() -> None:
    w = OffloadingWorker(num_gpu_blocks=4, num_cpu_blocks=1)
    with pytest.raises(ValueError, match="empty"):
        w.register_kv_caches({})
    with pytest.raises(ValueError, match="not contiguous"):
        w.register_kv_caches({"l": _kv(4)[..., ::2]})
    with pytest.raises(ValueError, match="without gaps"):
        w.register_kv_caches({"a": _kv(4), "b": _kv(4)}, {"a": 0, "b": 2})
    with pytest.raises(ValueError, match="num_gpu_blocks must be >= 1"):
        OffloadingWorker(num_gpu_blocks=0, num_cpu_blocks=1)
