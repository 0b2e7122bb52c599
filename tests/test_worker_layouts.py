"""The worker's slot-major CPU pool, its GPU layouts and its staged transfers (issue 12), with
CPU tensors: the same registration, slot arithmetic and staging pipeline run on a GPU.

* A CPU block (slot) is one contiguous region: ``block_size_factor`` sub-blocks, each holding
  one GPU block of every registered tensor in registration order (checked against an
  independent reference of that layout).
* Views of one buffer that are adjacent inside a block are one copy region: such a cache is
  ``block_contiguous``; separate per-layer tensors are ``layer_major``.
* ``staged`` jobs (gather into a staging buffer laid out like the slot, then whole sub-blocks
  to the pool; loads in reverse, in pieces through a ring) give exactly the bytes of direct
  copies, for factor > 1, partial first offloaded blocks, several pieces and several groups.
* Bad input leaves the pool and the GPU cache unchanged, with either mechanism.
"""

from __future__ import annotations

import pytest
import torch

from kvoff import CPUBlockSpec, GPUBlockSpec, OffloadingWorker
from kvoff.staging import StagingRing


def _rand(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def _layers(num_blocks: int, rows: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Separate per-layer tensors (layer-major), layer i with rows[i] bytes per block."""
    return {f"l{i}": _rand((num_blocks, r), seed + i) for i, r in enumerate(rows)}


def _expected_slot(kv: dict[str, torch.Tensor], gpu_ids: list[int]) -> torch.Tensor:
    """Reference: a slot is its GPU blocks one after another, each the concatenation of every
    layer's row in registration order."""
    return torch.cat([torch.cat([t[i].reshape(-1) for t in kv.values()]) for i in gpu_ids])


# ------------------------------------------------------------------------------ the slot


@pytest.mark.parametrize("mechanism", ["auto", "staged"])
def test_a_slot_is_one_contiguous_object_in_registration_order(mechanism: str) -> None:
    kv = _layers(12, [64, 32, 96])
    w = OffloadingWorker(12, 5, block_size_factor=2, mechanism=mechanism, staging_bytes=4 * 192)
    w.register_kv_caches(kv)
    assert w.bytes_per_gpu_block == 192 and w.slot_bytes == 384
    assert w.cpu_pool.shape == (5, 384)
    assert w.cpu_pool_allocated_bytes == w.cpu_pool_bytes == 5 * 384  # exact: no padding
    assert w.gpu_layouts == ["layer_major"]
    assert w.transfer_async(1, GPUBlockSpec.single_group([7, 2, 9, 4]), CPUBlockSpec((3, 0)))
    (r,) = w.wait([1])
    assert r.success and r.num_bytes == 4 * 192
    assert torch.equal(w.cpu_slot(3), _expected_slot(kv, [7, 2]))
    assert torch.equal(w.cpu_slot(0), _expected_slot(kv, [9, 4]))
    assert w.cpu_slot(3).is_contiguous() and w.cpu_slot(3).shape == (384,)
    # a load writes every layer of the blocks back from the slot
    assert w.transfer_async(2, CPUBlockSpec((3, 0)), GPUBlockSpec.single_group([1, 5, 6, 11]))
    assert w.wait([2])[0].success
    for t in kv.values():
        assert torch.equal(t[[1, 5, 6, 11]], t[[7, 2, 9, 4]])


def test_cpu_slot_errors() -> None:
    w = OffloadingWorker(4, 2)
    with pytest.raises(ValueError, match="call register_kv_caches first"):
        w.cpu_slot(0)
    w.register_kv_caches(_layers(4, [16]))
    for bad in (-1, 2):
        with pytest.raises(IndexError, match=rf"cpu_block_id {bad} is out of range.*\[0, 2\)"):
            w.cpu_slot(bad)


# ------------------------------------------------------------------------------ layouts


def test_views_of_one_buffer_are_one_block_contiguous_region() -> None:
    """vLLM's cross-layer layout: every layer is a view into one (num_blocks, layers × page)
    buffer. One region per block: whole blocks move as single chunks."""
    buf = _rand((10, 4 * 48), 1)
    kv = {f"l{i}": buf[:, i * 48 : (i + 1) * 48] for i in range(4)}
    w = OffloadingWorker(10, 4, block_size_factor=2)
    w.register_kv_caches(kv)
    assert w.gpu_layouts == ["block_contiguous"]
    assert len(w.gpu_tensors()) == 4  # per-layer views are still reported per layer
    ((region,),) = [g.regions for g in w._groups]
    assert region.row_bytes == 4 * 48 and region.gpu_rows.data_ptr() == buf.data_ptr()
    # job of 4 blocks in 2 runs of adjacent ids: 2 chunks, not 2 × 4 layers
    gpu = GPUBlockSpec.single_group([2, 3, 6, 7])
    per_group = w._expand(gpu, CPUBlockSpec((1, 2)))
    assert w.job_chunks(per_group) == (2, 4 * 4 * 48)
    assert w.transfer_async(1, gpu, CPUBlockSpec((1, 2)))
    assert torch.equal(w.cpu_slot(1), _expected_slot(kv, [2, 3]))
    assert torch.equal(w.cpu_slot(2), _expected_slot(kv, [6, 7]))


def test_views_out_of_block_order_or_with_gaps_stay_separate_regions() -> None:
    buf = _rand((8, 3 * 32 + 16), 2)  # 16 bytes of padding at the end of each block
    views = [buf[:, i * 32 : (i + 1) * 32] for i in range(3)]
    swapped = {"a": views[1], "b": views[2], "c": views[0]}
    w = OffloadingWorker(8, 4)
    w.register_kv_caches(swapped)
    # slot order a, b, c; in the block c comes first: only a and b are adjacent on both sides
    assert w.gpu_layouts == ["layer_major"]
    assert [r.row_bytes for r in w._groups[0].regions] == [64, 32]
    assert w.transfer_async(1, GPUBlockSpec.single_group([5]), CPUBlockSpec((2,)))
    assert torch.equal(w.cpu_slot(2), _expected_slot(swapped, [5]))
    kv_first = torch.zeros((2, 8, 64), dtype=torch.uint8)  # K and V halves 512 bytes apart
    w2 = OffloadingWorker(8, 4)
    w2.register_kv_caches({"x": kv_first}, kv_layout="kv_first")
    assert w2.gpu_layouts == ["layer_major"] and w2.bytes_per_gpu_block == 128


# ------------------------------------------------------------------------------ staged = direct


def _hybrid(num_blocks: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Two groups whose layers share tensors (a hybrid model's allocation), plus a group-0-only
    tensor: group 0 uses t0, t1, t2; group 1 uses t0, t1 with other block ids."""
    t0, t1, t2 = (
        _rand((num_blocks, 64), seed),
        _rand((num_blocks, 32), seed + 1),
        _rand((num_blocks, 48), seed + 2),
    )
    kv = {"g0.a": t0, "g0.b": t1, "g0.c": t2, "g1.a": t0, "g1.b": t1}
    return kv, {"g0.a": 0, "g0.b": 0, "g0.c": 0, "g1.a": 1, "g1.b": 1}


_JOBS = {
    # name: (factor, gpu spec, cpu slots)
    "factor 1": (1, GPUBlockSpec.single_group([3, 4, 5, 9, 1]), (6, 7, 8, 2, 0)),
    "factor 2, partial first block": (
        2, GPUBlockSpec.single_group([3, 4, 5, 9, 1], block_index=3), (6, 7, 8)
    ),
    "factor 4, several pieces": (4, GPUBlockSpec.single_group(list(range(1, 13))), (5, 2, 7)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_JOBS))
def test_staged_jobs_move_the_same_bytes_as_direct_copies(name: str) -> None:
    factor, gpu, cpu = _JOBS[name]
    pools = {}
    for mechanism in ("memcpy", "staged"):
        kv = _layers(16, [64, 32, 96, 8])
        # staging holds 2 blocks per direction: pieces of one block, reused round robin
        w = OffloadingWorker(16, 9, block_size_factor=factor, mechanism=mechanism,
                             staging_bytes=4 * 200, staging_piece_bytes=200)  # fmt: skip
        w.register_kv_caches(kv)
        w.cpu_pool.copy_(_rand(tuple(w.cpu_pool.shape), 99))  # what is not written must stay
        assert w.transfer_async(1, gpu, CPUBlockSpec(cpu))
        (r,) = w.wait([1])
        assert r.success and r.mechanism == ("staged" if mechanism == "staged" else "cpu")
        pools[mechanism] = w.cpu_pool.clone()
        if mechanism == "staged":
            ring = w._rings["store"]
            assert (ring.num_slots, ring.piece_blocks) == (2, 1)
            # load the slots back into other blocks, staged as well
            dst = GPUBlockSpec(tuple(b + 0 for b in range(16 - len(gpu.block_ids), 16)),
                               gpu.group_sizes, gpu.block_indices)  # fmt: skip
            before = {k: v.clone() for k, v in kv.items()}
            assert w.transfer_async(2, CPUBlockSpec(cpu), dst)
            assert w.wait([2])[0].success
            for k, t in kv.items():
                assert torch.equal(t[list(dst.block_ids)], before[k][list(gpu.block_ids)]), k
    assert torch.equal(pools["memcpy"], pools["staged"])


def test_staged_multi_group_job_with_shared_tensors() -> None:
    results = {}
    for mechanism in ("memcpy", "staged"):
        kv, groups = _hybrid(20, 5)
        w = OffloadingWorker(20, 8, block_size_factor=2, mechanism=mechanism,
                             staging_bytes=2 * 144 * 3)  # fmt: skip
        w.register_kv_caches(kv, groups)
        w.cpu_pool.copy_(_rand(tuple(w.cpu_pool.shape), 98))
        assert w.bytes_per_gpu_block == 64 + 32 + 48  # shared tensors counted once
        assert w.gpu_layouts == ["layer_major", "layer_major"]
        # group 0: blocks at logical 1..4 (partial first slot), group 1: logical 0..3
        gpu = GPUBlockSpec((2, 3, 4, 5, 11, 12, 13, 14), (4, 4), (1, 0))
        assert w.transfer_async(1, gpu, CPUBlockSpec((0, 1, 2, 3, 4)))
        assert w.wait([1])[0].success
        dst = GPUBlockSpec((6, 7, 8, 9, 15, 16, 17, 18), (4, 4), (1, 0))
        assert w.transfer_async(2, CPUBlockSpec((0, 1, 2, 3, 4)), dst)
        assert w.wait([2])[0].success
        results[mechanism] = (w.cpu_pool.clone(), {k: v.clone() for k, v in kv.items()})
    assert torch.equal(results["memcpy"][0], results["staged"][0])
    for k in results["memcpy"][1]:
        assert torch.equal(results["memcpy"][1][k], results["staged"][1][k]), k
    _, kv = results["staged"]
    assert torch.equal(kv["g0.c"][[6, 7, 8, 9]], _hybrid(20, 5)[0]["g0.c"][[2, 3, 4, 5]])


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("mechanism", ["auto", "staged"])
def test_a_bad_job_changes_neither_the_pool_nor_the_gpu_cache(mechanism: str) -> None:
    kv, groups = _hybrid(12, 9)
    w = OffloadingWorker(12, 4, block_size_factor=2, mechanism=mechanism, staging_bytes=2 * 288)
    w.register_kv_caches(kv, groups)
    w.cpu_pool.copy_(_rand(tuple(w.cpu_pool.shape), 3))
    pool = w.cpu_pool.clone()
    gpu = {k: v.clone() for k, v in kv.items()}
    out_of_range = GPUBlockSpec((1, 2, 3, 12), (2, 2), (0, 0))  # group 1: GPU id 12 of 12
    repeated = GPUBlockSpec((1, 2, 5, 5), (2, 2), (0, 0))  # group 1 writes block 5 twice
    one_slot = GPUBlockSpec((1, 2), (2, 0), (0, 0))
    bad_jobs = [
        (out_of_range, CPUBlockSpec((0, 1)), "GPU id 12 is out of range"),  # store
        (CPUBlockSpec((0, 1)), out_of_range, "GPU id 12 is out of range"),  # load
        (CPUBlockSpec((0, 1)), repeated, "a destination id repeats"),  # load
        (one_slot, CPUBlockSpec((4,)), "CPU block id 4 is out of range"),  # store to slot 4 of 4
        (CPUBlockSpec((4,)), one_slot, "CPU block id 4 is out of range"),  # load from it
    ]
    for job_id, (src, dst, message) in enumerate(bad_jobs):
        assert not w.transfer_async(job_id, src, dst)
        (r,) = w.wait([job_id])
        assert not r.success and r.num_bytes == 0
        assert message in r.error and "The job was not run" in r.error, r.error
    assert torch.equal(w.cpu_pool, pool)
    for k in kv:
        assert torch.equal(kv[k], gpu[k]), k


def test_staging_that_cannot_hold_a_block_fails_the_job_cleanly() -> None:
    kv = _layers(8, [64, 64])
    w = OffloadingWorker(8, 4, mechanism="staged", staging_bytes=128)  # 64 per direction
    w.register_kv_caches(kv)
    pool = w.cpu_pool.clone()
    assert not w.transfer_async(1, GPUBlockSpec.single_group([1]), CPUBlockSpec((0,)))
    (r,) = w.wait([1])
    assert "staging_bytes=128 gives 64 bytes per direction" in r.error
    assert "at least 256" in r.error and "set it to 0 to disable staging" in r.error
    w0 = OffloadingWorker(8, 4, mechanism="staged", staging_bytes=0)
    w0.register_kv_caches(_layers(8, [64, 64]))
    assert not w0.transfer_async(1, GPUBlockSpec.single_group([1]), CPUBlockSpec((0,)))
    assert "needs a staging buffer, but staging_bytes=0" in w0.wait([1])[0].error
    assert torch.equal(w.cpu_pool, pool)
    with pytest.raises(ValueError, match=r"staging_bytes \(-1\) must be >= 0"):
        OffloadingWorker(8, 4, staging_bytes=-1)
    with pytest.raises(ValueError, match=r"compute_slowdown_budget=-0\.5 must be >= 0"):
        OffloadingWorker(8, 4, compute_slowdown_budget=-0.5)


def test_staging_ring_is_fixed_and_round_robin() -> None:
    ring = StagingRing(torch.device("cpu"), 1000, 100, 250)
    assert (ring.piece_blocks, ring.num_slots, ring.num_bytes) == (2, 5, 1000)
    assert [ring.acquire() for _ in range(7)] == [0, 1, 2, 3, 4, 0, 1]
    v = ring.view(4, 2)
    assert v.shape == (2, 100) and v.data_ptr() == ring.buffer.data_ptr() + 800
    with pytest.raises(ValueError, match="smaller than one GPU block of all layers"):
        StagingRing(torch.device("cpu"), 99, 100, 250)
    small = StagingRing(torch.device("cpu"), 150, 100, 1000)  # room for one block only
    assert (small.piece_blocks, small.num_slots) == (1, 1)
