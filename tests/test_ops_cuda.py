"""torch.ops.kvoff.copy_blocks on a GPU: every direction against the byte-exact reference, each
mechanism round trip (on a side stream and on the default stream), the kernel's grid caps and
unaligned rows, rejected calls that copy nothing, and opcheck.

Every test carries the `cuda` marker; tests/conftest.py skips them, with the reason, on builds
without CUDA kernels or machines without a GPU.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
import torch
from copy_ops_util import (
    OP,
    as_bytes,
    assert_bytes_equal,
    block_tensor,
    opcheck_samples,
    random_bytes,
    random_mechanism_case,
    reference,
    snapshot,
    unique_ids,
)

from kvoff.ops import MECHANISMS, batch_copy_supported, copy_blocks

requires_cuda = pytest.mark.cuda


def _cuda_layers(
    gen: torch.Generator,
    *,
    src_side: str,
    dst_side: str,
    row_shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    num_blocks: int,
    pad: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    def make(side: str, p: int) -> list[torch.Tensor]:
        dev = "cuda" if side == "gpu" else "cpu"
        return [
            block_tensor(num_blocks, rs, dtype, gen, pad=p, device=dev, pin=side == "pinned")
            for rs in row_shapes
        ]

    return make(src_side, pad), make(dst_side, 0)


DIRECTIONS = [("pinned", "gpu"), ("gpu", "pinned"), ("gpu", "gpu")]


@requires_cuda
@pytest.mark.parametrize(("src_side", "dst_side"), DIRECTIONS, ids=lambda s: s)
@pytest.mark.parametrize(
    ("pattern", "layout"),
    [
        ("runs", ([(2, 16, 8, 128), (16, 8, 128)], torch.bfloat16, 0)),  # copy calls (1-D)
        ("runs", ([(2, 16, 8, 128)], torch.float16, 256)),  # copy calls (2-D, strided rows)
        ("scattered", ([(2, 16, 4, 64), (512,)], torch.float16, 0)),  # kernel, 16-byte vectors
        ("scattered", ([(3, 7), (5,)], torch.uint8, 1)),  # kernel, byte accesses
        ("scattered", ([(6,)], torch.float32, 2)),  # kernel, 8-byte vectors
    ],
    ids=["runs-dense", "runs-strided", "kernel-vec16", "kernel-bytes", "kernel-vec8"],
)
def test_cuda_matches_reference(
    src_side: str,
    dst_side: str,
    pattern: str,
    layout: tuple[list[tuple[int, ...]], torch.dtype, int],
) -> None:
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    num_blocks = 96
    row_shapes, dtype, pad = layout
    src, dst = _cuda_layers(
        gen,
        src_side=src_side,
        dst_side=dst_side,
        row_shapes=row_shapes,
        dtype=dtype,
        num_blocks=num_blocks,
        pad=pad,
    )
    n = 64
    if pattern == "runs":
        src_ids, dst_ids = list(range(4, 4 + n)), list(range(30, 30 + n))
    else:
        src_ids = [rng.randrange(num_blocks) for _ in range(n)]
        dst_ids = unique_ids(rng, n, num_blocks)
    expected = reference(src, dst, src_ids, dst_ids)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the copy runs on the current stream
        copy_blocks(src, dst, src_ids, dst_ids)
    stream.synchronize()
    assert_bytes_equal(dst, expected)


@requires_cuda
def test_cuda_unpinned_cpu_is_rejected_and_nothing_copied() -> None:
    gen = torch.Generator().manual_seed(0)
    src = [block_tensor(8, (64,), torch.float16, gen, device="cuda") for _ in range(2)]
    dst = [
        block_tensor(8, (64,), torch.float16, gen, pin=True),
        block_tensor(8, (64,), torch.float16, gen),  # last pair not pinned
    ]
    before = snapshot(dst)
    with pytest.raises(RuntimeError, match=r"dst\[1\] is a CPU tensor that is not pinned"):
        copy_blocks(src, dst, [0, 1], [2, 3])
    torch.cuda.synchronize()
    assert_bytes_equal(dst, before)


@requires_cuda
def test_cuda_mixed_devices_in_one_list_are_rejected() -> None:
    gen = torch.Generator().manual_seed(0)
    src = [block_tensor(8, (64,), torch.float16, gen, device="cuda") for _ in range(2)]
    dst = [
        block_tensor(8, (64,), torch.float16, gen, device="cuda"),
        block_tensor(8, (64,), torch.float16, gen, pin=True),
    ]
    before = snapshot(dst)
    with pytest.raises(RuntimeError, match=r"dst\[1\] is on cpu but dst\[0\] is on cuda:0"):
        copy_blocks(src, dst, [0, 1], [2, 3])
    with pytest.raises(RuntimeError, match=r"src_block_ids is on cuda:0"):
        copy_blocks(src, dst[:1] * 2, torch.tensor([0], device="cuda"), [2])
    torch.cuda.synchronize()
    assert_bytes_equal(dst, before)


@requires_cuda
def test_cuda_errors_copy_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    src = [block_tensor(8, (64,), torch.float16, gen, device="cuda") for _ in range(2)]
    dst = [block_tensor(8, (64,), torch.float16, gen, pin=True) for _ in range(2)]
    before = snapshot(dst)
    with pytest.raises(IndexError, match=r"src_block_ids\[2\] = 8 is out of range"):
        copy_blocks(src, dst, [0, 1, 8], [2, 3, 4])
    with pytest.raises(ValueError, match=r"dst_block_ids\[2\] = 2 repeats dst_block_ids\[0\]"):
        copy_blocks(src, dst, [0, 1, 5], [2, 3, 2])
    torch.cuda.synchronize()
    assert_bytes_equal(dst, before)


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_gpu_to_other_gpu_is_rejected() -> None:
    src = [torch.zeros(4, 8, device="cuda:0")]
    dst = [torch.zeros(4, 8, device="cuda:1")]
    with pytest.raises(RuntimeError, match=r"GPU-to-GPU copies must stay on one device"):
        copy_blocks(src, dst, [0], [1])


@requires_cuda
def test_opcheck_cuda() -> None:
    """GPU to GPU: opcheck clones its inputs, and clones of pinned tensors are not pinned."""
    for args in opcheck_samples("cuda"):
        torch.library.opcheck(OP, args)


def _run_on_side_stream(fn: Callable[[], None]) -> None:
    """Runs fn with a fresh side stream current (the batch API refuses the legacy stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    stream.synchronize()


@requires_cuda
@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("seed", range(6))
def test_cuda_mechanisms_round_trip(mechanism: str, seed: int) -> None:
    """GPU -> pinned CPU -> GPU, byte-exact, for every mechanism; random dtypes, layouts, ids."""
    src, dst, src_ids, dst_ids = random_mechanism_case(seed, "cuda", pin_dst=True)
    expected = reference(src, dst, src_ids, dst_ids)
    _run_on_side_stream(lambda: copy_blocks(src, dst, src_ids, dst_ids, mechanism=mechanism))
    assert_bytes_equal(dst, expected)
    # Back: pinned CPU -> fresh GPU tensors of the source layout, at other rows.
    gen = torch.Generator().manual_seed(seed + 1000)
    back = [block_tensor(s.shape[0], tuple(s.shape[1:]), s.dtype, gen, device="cuda") for s in src]
    back_ids = list(reversed(range(len(dst_ids))))
    expected_back = reference(dst, back, dst_ids, back_ids)
    _run_on_side_stream(lambda: copy_blocks(dst, back, dst_ids, back_ids, mechanism=mechanism))
    assert_bytes_equal(back, expected_back)
    # The rows that went out and came back equal the original source rows.
    for s, b in zip(src, back, strict=True):
        assert torch.equal(as_bytes(b.cpu())[back_ids], as_bytes(s.cpu())[src_ids])


@requires_cuda
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_cuda_runs_over_a_whole_host_pool(mechanism: str) -> None:
    """Every CPU block of a kvoff.pinned.HostPool in one dense run, whatever the mechanism:
    the pool is one registration (a pool pinned in pieces failed any block or run that crossed
    a cut: kvoff/pinned.py). Rows of 1.5 pages, so rows and pages do not line up. Byte-exact
    both ways."""
    from kvoff.pinned import HostPool

    rows, row_bytes = 48, 6144
    pool = HostPool([(rows, row_bytes)], pin=True)
    cpu = pool.tensors[0]
    assert cpu.is_pinned()
    gen = torch.Generator().manual_seed(5)
    gpu = torch.randint(0, 256, (rows + 8, row_bytes), generator=gen, dtype=torch.uint8)
    gpu = gpu.cuda()
    cpu.fill_(0)
    ids = list(range(rows))
    _run_on_side_stream(lambda: copy_blocks([gpu], [cpu], [i + 8 for i in ids], ids,
                                            mechanism=mechanism))  # fmt: skip
    assert torch.equal(cpu, gpu[8:].cpu())
    back = torch.zeros_like(gpu)
    _run_on_side_stream(lambda: copy_blocks([cpu], [back], ids, ids, mechanism=mechanism))
    assert torch.equal(back[:rows].cpu(), cpu)
    pool.close()


@requires_cuda
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_cuda_mechanisms_on_the_default_stream(mechanism: str) -> None:
    """On the (legacy) default stream too: "batch" falls back there instead of failing."""
    src, dst, src_ids, dst_ids = random_mechanism_case(7, "cuda", pin_dst=True)
    expected = reference(src, dst, src_ids, dst_ids)
    copy_blocks(src, dst, src_ids, dst_ids, mechanism=mechanism)
    torch.cuda.synchronize()
    assert_bytes_equal(dst, expected)


@requires_cuda
@pytest.mark.parametrize("kernel_blocks", [0, 1, 3, 10_000])
@pytest.mark.parametrize(("src_side", "dst_side"), DIRECTIONS, ids=lambda s: s)
def test_cuda_kernel_grid_caps(kernel_blocks: int, src_side: str, dst_side: str) -> None:
    """kernel_blocks=1 (one block grid-strides over every row), the default, and a huge cap."""
    gen = torch.Generator().manual_seed(kernel_blocks)
    rng = random.Random(kernel_blocks)
    num_blocks = 200
    src, dst = _cuda_layers(
        gen,
        src_side=src_side,
        dst_side=dst_side,
        row_shapes=[(2, 16, 8, 128), (4, 64), (3, 5)],
        dtype=torch.bfloat16,
        num_blocks=num_blocks,
        pad=8,
    )
    n = 150
    src_ids = [rng.randrange(num_blocks) for _ in range(n)]
    dst_ids = unique_ids(rng, n, num_blocks)
    expected = reference(src, dst, src_ids, dst_ids)
    _run_on_side_stream(
        lambda: copy_blocks(
            src, dst, src_ids, dst_ids, mechanism="kernel", kernel_blocks=kernel_blocks
        )
    )
    assert_bytes_equal(dst, expected)


@requires_cuda
@pytest.mark.parametrize("row_bytes", [1, 3, 17, 255, 1001, 4099, 65537])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_cuda_kernel_unaligned_rows(row_bytes: int, offset: int) -> None:
    """Odd row sizes and base pointers off by a few bytes: the byte-access path of the kernel."""
    gen = torch.Generator().manual_seed(row_bytes + offset)
    rng = random.Random(row_bytes)
    num_blocks = 24
    stride = row_bytes + 5
    base_src = random_bytes((num_blocks * stride + offset,), torch.uint8, gen).cuda()
    base_dst = random_bytes((num_blocks * row_bytes + offset,), torch.uint8, gen).pin_memory()
    src = [base_src[offset:].as_strided((num_blocks, row_bytes), (stride, 1))]
    dst = [base_dst[offset:].view(num_blocks, row_bytes)]
    src_ids = [rng.randrange(num_blocks) for _ in range(16)]
    dst_ids = unique_ids(rng, 16, num_blocks)
    for kernel_blocks in (1, 0):
        expected = reference(src, dst, src_ids, dst_ids)
        sids = list(src_ids)
        _run_on_side_stream(
            lambda kb=kernel_blocks, sids=sids: copy_blocks(
                src, dst, sids, dst_ids, mechanism="kernel", kernel_blocks=kb
            )
        )
        assert_bytes_equal(dst, expected)
        src_ids = src_ids[::-1]


@requires_cuda
def test_cuda_batch_copy_supported_is_a_bool() -> None:
    assert isinstance(batch_copy_supported(), bool)
    # A batch call never turns a supported verdict into an error; it may only turn it False.
    src, dst, src_ids, dst_ids = random_mechanism_case(3, "cuda", pin_dst=True)
    _run_on_side_stream(lambda: copy_blocks(src, dst, src_ids, dst_ids, mechanism="batch"))
    assert isinstance(batch_copy_supported(), bool)


@requires_cuda
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_cuda_bad_options_copy_nothing(mechanism: str) -> None:
    src, dst, src_ids, dst_ids = random_mechanism_case(11, "cuda", pin_dst=True)
    before = snapshot(dst)
    with pytest.raises(ValueError, match=r"kernel_blocks=-1 is negative"):
        OP(src, dst, torch.tensor(src_ids), torch.tensor(dst_ids), mechanism, -1)
    with pytest.raises(ValueError, match=r"mechanism='gpu' is not one of"):
        OP(src, dst, torch.tensor(src_ids), torch.tensor(dst_ids), "gpu", 0)
    torch.cuda.synchronize()
    assert_bytes_equal(dst, before)
