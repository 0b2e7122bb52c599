"""torch.ops.kvoff.copy_blocks against a pure-torch reference, its error paths, and opcheck.

The reference copies bytes with advanced indexing on uint8 views (``dst[ids] = src[ids]``), so
every dtype, NaN payloads included, is compared bit for bit. Every rejected call must leave
every destination byte-for-byte unchanged, so the error cases put the bad value last (last
pair, last id) where a kernel that validated lazily would already have copied the rest.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kvoff  # noqa: F401  (loads kvoff._C)
from kvoff.ops import MECHANISMS, batch_copy_supported, copy_blocks

OP = torch.ops.kvoff.copy_blocks.default

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.int8, torch.int64]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


# CUDA tests carry the `cuda` marker; tests/conftest.py skips them, with the reason, on
# builds without CUDA kernels or machines without a GPU.
requires_cuda = pytest.mark.cuda


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def random_bytes(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of the given shape and dtype filled with random bytes (NaN patterns included)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = int(np.prod(shape)) if len(shape) else 1
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(tuple(shape))


def block_tensor(
    num_blocks: int,
    row_shape: Sequence[int],
    dtype: torch.dtype,
    gen: torch.Generator,
    *,
    pad: int = 0,
    device: str | torch.device = "cpu",
    pin: bool = False,
) -> torch.Tensor:
    """(num_blocks, *row_shape) with contiguous rows; row stride = row + pad elements."""
    row = int(np.prod(row_shape)) if len(row_shape) else 1
    base = random_bytes((num_blocks, row + pad), dtype, gen)
    if pin:
        base = base.pin_memory()
    base = base.to(device)
    return base[:, :row].view(num_blocks, *row_shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of t with one extra trailing dim of element bytes (rows stay rows)."""
    return t.unsqueeze(-1).view(torch.uint8)


def reference(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
) -> list[torch.Tensor]:
    """What dst must look like after the copy, computed with advanced indexing on bytes."""
    sids = torch.as_tensor(list(src_ids), dtype=torch.int64)
    dids = torch.as_tensor(list(dst_ids), dtype=torch.int64)
    out = []
    for s, d in zip(src, dst, strict=True):
        expected = as_bytes(d.cpu()).clone()
        if len(sids):
            rows = as_bytes(s.cpu())[sids].reshape(len(sids), -1)
            expected[dids] = rows.reshape(expected[dids].shape)
        out.append(expected)
    return out


def assert_bytes_equal(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
        a_bytes = as_bytes(a.cpu())
        assert a_bytes.shape == e.shape
        if not torch.equal(a_bytes, e):
            bad = (a_bytes != e).reshape(a_bytes.shape[0], -1).any(dim=1).nonzero().flatten()
            raise AssertionError(f"pair {k}: rows {bad.tolist()[:20]} differ from the reference")


def snapshot(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [as_bytes(t.cpu()).clone() for t in tensors]


def unique_ids(rng: random.Random, n: int, limit: int) -> list[int]:
    return rng.sample(range(limit), n)


# ---------------------------------------------------------------------------------------------
# Correctness on the CPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_matches_reference_for_dtype(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(1)
    # Three layers with different page sizes; one with a padded row stride, one a K/V half.
    kv = block_tensor(24, (2, 4, 16), dtype, gen)
    src = [
        block_tensor(20, (4, 8), dtype, gen),
        block_tensor(24, (3, 5), dtype, gen, pad=7),
        kv[:, 1],
    ]
    dst = [
        block_tensor(30, (32,), dtype, gen, pad=3),
        block_tensor(16, (15,), dtype, gen),
        block_tensor(18, (4, 16), dtype, gen),
    ]
    n = 12
    src_ids = [rng.randrange(16) for _ in range(n)]  # repeats allowed on the source side
    dst_ids = unique_ids(rng, n, 16)
    expected = reference(src, dst, src_ids, dst_ids)
    src_before = snapshot(src)
    copy_blocks(src, dst, src_ids, dst_ids)
    assert_bytes_equal(dst, expected)
    assert_bytes_equal(src, src_before)  # sources are read only


@pytest.mark.parametrize("seed", range(40))
def test_random_layouts(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_pairs = rng.randint(1, 5)
    src_blocks, dst_blocks = rng.randint(1, 64), rng.randint(1, 64)
    n = rng.randint(0, min(src_blocks, dst_blocks))
    src, dst = [], []
    for _ in range(num_pairs):
        dtype = rng.choice(DTYPES)
        row_shape = [rng.randint(1, 6) for _ in range(rng.randint(0, 3))]
        flat = [int(np.prod(row_shape))] if row_shape and rng.random() < 0.5 else row_shape
        src.append(block_tensor(src_blocks, row_shape, dtype, gen, pad=rng.choice([0, 0, 1, 9])))
        dst.append(block_tensor(dst_blocks, flat, dtype, gen, pad=rng.choice([0, 0, 2])))
    if rng.random() < 0.3:  # runs of adjacent blocks on both sides
        s0, d0 = rng.randint(0, src_blocks - n), rng.randint(0, dst_blocks - n)
        src_ids, dst_ids = list(range(s0, s0 + n)), list(range(d0, d0 + n))
    else:
        src_ids = [rng.randrange(src_blocks) for _ in range(n)]
        dst_ids = unique_ids(rng, n, dst_blocks)
    expected = reference(src, dst, src_ids, dst_ids)
    copy_blocks(src, dst, torch.tensor(src_ids, dtype=torch.int64), dst_ids)
    assert_bytes_equal(dst, expected)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_empty_ids_is_a_noop(as_tensor: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    src = [block_tensor(4, (8,), torch.float16, gen)]
    dst = [block_tensor(4, (8,), torch.float16, gen)]
    before = snapshot(dst)
    ids: torch.Tensor | list[int] = torch.empty(0, dtype=torch.int64) if as_tensor else []
    copy_blocks(src, dst, ids, ids)
    assert_bytes_equal(dst, before)


def test_empty_block_tensors_and_empty_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    # size(0) == 0 with no ids; rows of zero elements with ids.
    copy_blocks([torch.empty(0, 4)], [torch.empty(0, 4)], [], [])
    src, dst = [torch.empty(5, 0)], [torch.empty(7, 0)]
    copy_blocks(src, dst, [0, 4], [6, 1])
    one_d_src = [random_bytes((9,), torch.int8, gen)]
    one_d_dst = [torch.zeros(9, dtype=torch.int8)]
    expected = reference(one_d_src, one_d_dst, [8, 0, 3], [0, 8, 2])
    copy_blocks(one_d_src, one_d_dst, [8, 0, 3], [0, 8, 2])  # 1-D tensors: a row is one element
    assert_bytes_equal(one_d_dst, expected)


def test_size_one_dims_with_any_stride_are_contiguous_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    base = random_bytes((6, 8), torch.float32, gen)
    src = [base.unsqueeze(1).unsqueeze(-1).as_strided((6, 1, 8, 1), (8, 1000, 1, 77))]
    dst = [torch.zeros(6, 8)]
    expected = reference(src, dst, [5, 1], [0, 3])
    copy_blocks(src, dst, [5, 1], [0, 3])
    assert_bytes_equal(dst, expected)


def test_strided_id_tensors() -> None:
    gen = torch.Generator().manual_seed(0)
    src, dst = [block_tensor(10, (4,), torch.float32, gen)], [torch.zeros(10, 4)]
    sids = torch.tensor([3, -1, 7, -1, 2, -1])[::2]
    dids = torch.tensor([[0, 9], [5, 9], [1, 9]])[:, 0]
    assert not sids.is_contiguous() and not dids.is_contiguous()
    expected = reference(src, dst, sids.tolist(), dids.tolist())
    OP(src, dst, sids, dids)
    assert_bytes_equal(dst, expected)


def test_id_sequence_forms() -> None:
    gen = torch.Generator().manual_seed(0)
    src, dst = [block_tensor(10, (4,), torch.float32, gen)], [torch.zeros(10, 4)]
    expected = reference(src, dst, [1, 2, 3], [7, 8, 9])
    copy_blocks(src, dst, range(1, 4), np.array([7, 8, 9], dtype=np.int32))
    assert_bytes_equal(dst, expected)
    with pytest.raises(TypeError, match=r"src_block_ids must hold integers.*float64"):
        copy_blocks(src, dst, [1.0, 2.0], [1, 2])


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("pattern", ["runs", "scattered", "strided"])
def test_large_copies_use_the_parallel_path(pattern: str, threads: int) -> None:
    """Tens of MiB with several threads: the at::parallel_for path, runs cut at 1 MiB."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(3)
        rng = random.Random(3)
        num_blocks = 1024
        pad = 64 if pattern == "strided" else 0
        src = [
            block_tensor(num_blocks, (2, 8, 128), torch.bfloat16, gen, pad=pad),  # 8 KiB rows
            block_tensor(num_blocks, (1024,), torch.uint8, gen, pad=pad),  # 1 KiB rows
        ]
        dst = [block_tensor(num_blocks, tuple(s.shape[1:]), s.dtype, gen) for s in src]
        n = 1000
        if pattern == "scattered":
            src_ids = [rng.randrange(num_blocks) for _ in range(n)]
            dst_ids = unique_ids(rng, n, num_blocks)
        else:  # a few long runs, longer than the 1 MiB cap of a work item
            src_ids = list(range(10, 10 + n))
            dst_ids = list(range(20, 20 + 600)) + list(range(0, 20)) + list(range(630, 1010))
        expected = reference(src, dst, src_ids, dst_ids)
        copy_blocks(src, dst, src_ids, dst_ids)
        assert_bytes_equal(dst, expected)
    finally:
        torch.set_num_threads(old)


def test_src_and_dst_may_be_views_of_one_tensor() -> None:
    """A K/V-split layout: the K and V halves of one tensor are two pairs."""
    gen = torch.Generator().manual_seed(0)
    gpu_like = random_bytes((12, 2, 4, 8), torch.float16, gen)
    cpu_like = torch.zeros(6, 2, 4, 8, dtype=torch.float16)
    src = [gpu_like[:, 0], gpu_like[:, 1]]
    dst = [cpu_like[:, 0], cpu_like[:, 1]]
    expected_whole = as_bytes(cpu_like).clone()
    expected_whole[[5, 0, 2]] = as_bytes(gpu_like)[[11, 3, 4]]
    copy_blocks(src, dst, [11, 3, 4], [5, 0, 2])
    assert torch.equal(as_bytes(cpu_like), expected_whole)


# ---------------------------------------------------------------------------------------------
# Mechanisms on the CPU
# ---------------------------------------------------------------------------------------------


def test_mechanism_names() -> None:
    assert MECHANISMS == ("auto", "memcpy", "batch", "kernel", "per_block")


def _random_mechanism_case(
    seed: int, device: str = "cpu", *, pin_src: bool = False, pin_dst: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], list[int]]:
    """Random pairs: dtypes, row shapes, padded strides and K/V-split halves; random ids."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    src_blocks, dst_blocks = rng.randint(8, 48), rng.randint(8, 48)
    src: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    for _ in range(rng.randint(1, 4)):
        dtype = rng.choice(DTYPES)
        row_shape = (rng.randint(1, 4), rng.randint(1, 24))
        if rng.random() < 0.4:  # a K/V-split layout: the two halves of one tensor, two pairs
            kv = block_tensor(src_blocks, (2, *row_shape), dtype, gen, device=device, pin=pin_src)
            src += [kv[:, 0], kv[:, 1]]
            dst += [
                block_tensor(
                    dst_blocks,
                    row_shape,
                    dtype,
                    gen,
                    pad=rng.choice([0, 3]),
                    device=device,
                    pin=pin_dst,
                )
                for _ in range(2)
            ]
        else:
            src.append(
                block_tensor(
                    src_blocks,
                    row_shape,
                    dtype,
                    gen,
                    pad=rng.choice([0, 0, 5]),
                    device=device,
                    pin=pin_src,
                )
            )
            dst.append(
                block_tensor(
                    dst_blocks,
                    row_shape,
                    dtype,
                    gen,
                    pad=rng.choice([0, 2]),
                    device=device,
                    pin=pin_dst,
                )
            )
    n = rng.randint(1, min(src_blocks, dst_blocks))
    if rng.random() < 0.3:  # adjacent runs on both sides
        s0, d0 = rng.randint(0, src_blocks - n), rng.randint(0, dst_blocks - n)
        src_ids, dst_ids = list(range(s0, s0 + n)), list(range(d0, d0 + n))
    else:
        src_ids = [rng.randrange(src_blocks) for _ in range(n)]
        dst_ids = unique_ids(rng, n, dst_blocks)
    return src, dst, src_ids, dst_ids


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("seed", range(8))
def test_cpu_mechanisms_match_reference(mechanism: str, seed: int) -> None:
    src, dst, src_ids, dst_ids = _random_mechanism_case(seed)
    expected = reference(src, dst, src_ids, dst_ids)
    src_before = snapshot(src)
    copy_blocks(src, dst, src_ids, dst_ids, mechanism=mechanism, kernel_blocks=seed % 3)
    assert_bytes_equal(dst, expected)
    assert_bytes_equal(src, src_before)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_cpu_mechanisms_through_the_op(mechanism: str) -> None:
    """The op itself (positional and keyword forms) takes every name."""
    src, dst, src_ids, dst_ids = _random_mechanism_case(100)
    expected = reference(src, dst, src_ids, dst_ids)
    OP(src, dst, torch.tensor(src_ids), torch.tensor(dst_ids), mechanism, 0)
    assert_bytes_equal(dst, expected)
    src, dst, src_ids, dst_ids = _random_mechanism_case(101)
    expected = reference(src, dst, src_ids, dst_ids)
    OP(src, dst, torch.tensor(src_ids), torch.tensor(dst_ids), mechanism=mechanism, kernel_blocks=2)
    assert_bytes_equal(dst, expected)


def test_cpu_per_block_large_copy() -> None:
    gen = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    src = [block_tensor(512, (2, 8, 128), torch.bfloat16, gen, pad=64)]
    dst = [block_tensor(512, (2, 8, 128), torch.bfloat16, gen)]
    src_ids = [rng.randrange(512) for _ in range(400)]
    dst_ids = unique_ids(rng, 400, 512)
    expected = reference(src, dst, src_ids, dst_ids)
    copy_blocks(src, dst, src_ids, dst_ids, mechanism="per_block")
    assert_bytes_equal(dst, expected)


@pytest.mark.parametrize("call", ["wrapper", "op"])
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"mechanism": "fast"},
            ValueError,
            r"mechanism='fast' is not one of 'auto', 'memcpy', 'batch', 'kernel', 'per_block'",
        ),
        ({"mechanism": "MEMCPY"}, ValueError, r"mechanism='MEMCPY' is not one of"),
        ({"mechanism": ""}, ValueError, r"mechanism='' is not one of"),
        ({"kernel_blocks": -1}, ValueError, r"kernel_blocks=-1 is negative"),
        ({"mechanism": "kernel", "kernel_blocks": -7}, ValueError, r"kernel_blocks=-7 is negative"),
    ],
    ids=["unknown", "case", "empty", "negative-blocks", "negative-blocks-kernel"],
)
def test_bad_options_raise_and_copy_nothing(
    call: str, kwargs: dict, error: type[Exception], match: str
) -> None:
    args = _healthy_args()
    before = snapshot(args["dst"])
    with pytest.raises(error, match=r"^kvoff\.copy_blocks: " + match):
        if call == "wrapper":
            copy_blocks(args["src"], args["dst"], args["src_ids"], args["dst_ids"], **kwargs)
        else:
            OP(args["src"], args["dst"], args["src_ids"], args["dst_ids"], **kwargs)
    assert_bytes_equal(args["dst"], before)


def test_bad_options_raise_in_fake_mode() -> None:
    with FakeTensorMode():
        src = [torch.empty(8, 4, 8, dtype=torch.float16)]
        dst = [torch.empty(6, 32, dtype=torch.float16)]
        ids = torch.arange(3)
        assert OP(src, dst, ids, ids, "kernel", 4) is None
        with pytest.raises(ValueError, match=r"mechanism='nope' is not one of"):
            OP(src, dst, ids, ids, "nope")
        with pytest.raises(ValueError, match=r"kernel_blocks=-2 is negative"):
            OP(src, dst, ids, ids, "auto", -2)


def test_kernel_blocks_type_is_checked_by_the_wrapper() -> None:
    args = _healthy_args()
    with pytest.raises(TypeError, match=r"kernel_blocks=1.5 is not an int"):
        copy_blocks(args["src"], args["dst"], args["src_ids"], args["dst_ids"], kernel_blocks=1.5)  # type: ignore[arg-type]


def test_batch_copy_supported_is_false_without_cuda() -> None:
    import kvoff._build_info as info

    supported = batch_copy_supported()
    assert isinstance(supported, bool)
    assert supported == torch.ops.kvoff.batch_copy_supported()
    if not info.WITH_CUDA or not torch.cuda.is_available():
        assert supported is False


# ---------------------------------------------------------------------------------------------
# opcheck and fake tensors
# ---------------------------------------------------------------------------------------------


def _opcheck_samples(device: str) -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    samples = []
    for dtype, n in ((torch.float16, 3), (torch.float32, 0), (torch.uint8, 5)):
        src = [
            block_tensor(8, (4, 8), dtype, gen, device=device),
            block_tensor(8, (16,), dtype, gen, pad=4, device=device),
        ]
        dst = [
            block_tensor(6, (32,), dtype, gen, device=device),
            block_tensor(6, (2, 8), dtype, gen, device=device),
        ]
        samples.append((src, dst, torch.arange(n), torch.arange(n).flip(0)))
    return samples


def test_opcheck_cpu() -> None:
    for args in _opcheck_samples("cpu"):
        torch.library.opcheck(OP, args)
    for mechanism in MECHANISMS:
        for args in _opcheck_samples("cpu")[:1]:
            torch.library.opcheck(OP, args, {"mechanism": mechanism, "kernel_blocks": 1})


def test_fake_tensor_mode_checks_metadata() -> None:
    with FakeTensorMode():
        src = [torch.empty(8, 4, 8, dtype=torch.float16)]
        dst = [torch.empty(6, 32, dtype=torch.float16)]
        ids = torch.arange(3)
        assert OP(src, dst, ids, ids) is None
        bad = [torch.empty(6, 32, dtype=torch.bfloat16)]
        with pytest.raises(ValueError, match=r"pair 0: src\[0\] is torch.float16"):
            OP(src, bad, ids, ids)
        with pytest.raises(ValueError, match=r"a row of src\[0\] has 32 elements"):
            OP(src, [torch.empty(6, 31, dtype=torch.float16)], ids, ids)


def test_torch_compile_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    src = [block_tensor(8, (16,), torch.float32, gen)]
    dst = [torch.zeros(8, 16)]
    expected = reference(src, dst, [1, 2], [6, 0])

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(s: list[torch.Tensor], d: list[torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> None:
        OP(s, d, a, b)

    f(src, dst, torch.tensor([1, 2]), torch.tensor([6, 0]))
    assert_bytes_equal(dst, expected)


# ---------------------------------------------------------------------------------------------
# Error paths: type, message, and nothing copied
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    """Three healthy pairs and 6 healthy ids; `mutate` breaks one thing, the later the better."""

    name: str
    error: type[Exception]
    match: str
    mutate: Callable[[dict], None]
    fake: bool = False  # the fake kernel (metadata only) raises the same error


def _healthy_args() -> dict:
    gen = torch.Generator().manual_seed(7)
    return {
        "src": [
            block_tensor(40, (4, 8), torch.float16, gen),
            block_tensor(50, (16,), torch.float32, gen, pad=3),
            block_tensor(60, (2, 32), torch.bfloat16, gen),
        ],
        "dst": [
            block_tensor(30, (32,), torch.float16, gen),
            block_tensor(20, (4, 4), torch.float32, gen),
            block_tensor(25, (64,), torch.bfloat16, gen, pad=1),
        ],
        "src_ids": torch.tensor([0, 1, 2, 3, 4, 5]),
        "dst_ids": torch.tensor([10, 11, 12, 13, 14, 15]),
    }


def _set(key: str, index: int, value: object) -> Callable[[dict], None]:
    def mutate(a: dict) -> None:
        a[key][index] = value

    return mutate


def _set_id(key: str, index: int, value: int) -> Callable[[dict], None]:
    def mutate(a: dict) -> None:
        a[key] = a[key].clone()
        a[key][index] = value

    return mutate


def _replace(key: str, value: object) -> Callable[[dict], None]:
    def mutate(a: dict) -> None:
        a[key] = value

    return mutate


def _many_ids_with_duplicate(dst_blocks: int, n: int) -> Callable[[dict], None]:
    """Long id lists (bitmap or sort path of the duplicate check) whose last id repeats."""

    def mutate(a: dict) -> None:
        gen = torch.Generator().manual_seed(1)
        a["src"] = [block_tensor(n, (2,), torch.float32, gen)]
        a["dst"] = [block_tensor(dst_blocks, (2,), torch.float32, gen)]
        a["src_ids"] = torch.arange(n)
        dst_ids = torch.arange(n) * (dst_blocks // n)
        dst_ids[-1] = dst_ids[n // 2]
        a["dst_ids"] = dst_ids

    return mutate


def _overlapping_rows(a: dict) -> None:
    a["dst"][2] = torch.zeros(25 * 64, dtype=torch.bfloat16).as_strided((25, 64), (32, 1))


def _non_contiguous_rows(a: dict) -> None:
    a["dst"][2] = torch.zeros(25, 64, 2, dtype=torch.bfloat16)[:, :, 0]


def _transposed_rows(a: dict) -> None:
    a["src"][2] = torch.zeros(60, 32, 2, dtype=torch.bfloat16).transpose(1, 2)


def _meta_in_last_pair(a: dict) -> None:
    a["src"][2] = torch.empty(60, 2, 32, dtype=torch.bfloat16, device="meta")


def _meta_dst(a: dict) -> None:
    a["dst"] = [t.to("meta") for t in a["dst"]]


ERROR_CASES = [
    Case(
        "list lengths",
        ValueError,
        r"src has 3 tensors but dst has 2",
        lambda a: a["dst"].pop(),
        fake=True,
    ),
    Case(
        "empty lists",
        ValueError,
        r"src is an empty list",
        lambda a: a.update(src=[], dst=[]),
        fake=True,
    ),
    Case(
        "dtype in last pair",
        ValueError,
        r"pair 2: src\[2\] is torch.bfloat16 but dst\[2\] is torch.float16",
        _set("dst", 2, torch.zeros(25, 64, dtype=torch.float16)),
        fake=True,
    ),
    Case(
        "row size in last pair",
        ValueError,
        r"pair 2: a row of src\[2\] has 64 elements \(shape \[60, 2, 32\]\) "
        r"but a row of dst\[2\] has 63",
        _set("dst", 2, torch.zeros(25, 63, dtype=torch.bfloat16)),
        fake=True,
    ),
    Case(
        "0-d tensor",
        ValueError,
        r"dst\[2\] is a 0-d tensor",
        _set("dst", 2, torch.tensor(1.0)),
        fake=True,
    ),
    Case(
        "non-contiguous rows", ValueError, r"dst\[2\] rows are not contiguous", _non_contiguous_rows
    ),
    Case("transposed rows", ValueError, r"src\[2\] rows are not contiguous", _transposed_rows),
    Case(
        "overlapping rows", ValueError, r"dst\[2\] has stride\(0\) = 32 elements", _overlapping_rows
    ),
    Case(
        "negative src id",
        IndexError,
        r"src_block_ids\[5\] = -1 is negative",
        _set_id("src_ids", 5, -1),
    ),
    Case(
        "negative dst id",
        IndexError,
        r"dst_block_ids\[5\] = -3 is negative",
        _set_id("dst_ids", 5, -3),
    ),
    Case(
        "src id out of range",
        IndexError,
        r"src_block_ids\[5\] = 40 is out of range for src\[0\] with 40 blocks "
        r".*valid ids are 0..39",
        _set_id("src_ids", 5, 40),
    ),
    Case(
        "dst id out of range",
        IndexError,
        r"dst_block_ids\[5\] = 20 is out of range for dst\[1\] with 20 blocks "
        r".*valid ids are 0..19",
        _set_id("dst_ids", 5, 20),
    ),
    Case(
        "duplicate dst id",
        ValueError,
        r"dst_block_ids\[5\] = 11 repeats dst_block_ids\[1\] = 11",
        _set_id("dst_ids", 5, 11),
    ),
    Case(
        "duplicate dst id, bitmap",
        ValueError,
        r"dst_block_ids\[99\] = 150 repeats dst_block_ids\[50\] = 150",
        _many_ids_with_duplicate(300, 100),
    ),
    Case(
        "duplicate dst id, sort",
        ValueError,
        r"dst_block_ids\[99\] = 50000 repeats dst_block_ids\[50\] = 50000",
        _many_ids_with_duplicate(100_000, 100),
    ),
    Case(
        "id dtype",
        ValueError,
        r"dst_block_ids has dtype torch.int32; block ids must be torch.int64",
        _replace("dst_ids", torch.arange(10, 16, dtype=torch.int32)),
        fake=True,
    ),
    Case(
        "id rank",
        ValueError,
        r"src_block_ids has shape \[2, 3\]; block ids must be a 1-D tensor",
        _replace("src_ids", torch.arange(6).reshape(2, 3)),
        fake=True,
    ),
    Case(
        "id lengths",
        ValueError,
        r"src_block_ids has 6 ids but dst_block_ids has 5",
        _replace("dst_ids", torch.arange(5)),
        fake=True,
    ),
    # Tensors on another device than the rest of their list: with a CPU torch the meta device
    # is the other device, and the dispatcher sends the call to the fake kernel.
    Case(
        "mixed src devices",
        RuntimeError,
        r"src\[2\] is on meta but src\[0\] is on cpu; every src tensor must be on one device",
        _meta_in_last_pair,
        fake=True,
    ),
    Case(
        "ids not on the CPU",
        RuntimeError,
        r"dst_block_ids is on meta",
        _replace("dst_ids", torch.arange(6, device="meta")),
        fake=True,
    ),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=lambda c: c.name)
def test_error_paths_copy_nothing(case: Case) -> None:
    args = _healthy_args()
    case.mutate(args)
    real_dst = [t for t in args["dst"] if t.device.type != "meta"]
    before = snapshot(real_dst)
    with pytest.raises(case.error, match=case.match):
        OP(args["src"], args["dst"], args["src_ids"], args["dst_ids"])
    assert_bytes_equal(real_dst, before)


@pytest.mark.parametrize("case", [c for c in ERROR_CASES if c.fake], ids=lambda c: c.name)
def test_fake_kernel_raises_the_same_errors(case: Case) -> None:
    args = _healthy_args()
    case.mutate(args)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = {k: pytree_to_fake(mode, v) for k, v in args.items()}
    with mode, pytest.raises(case.error, match=case.match):
        OP(fake["src"], fake["dst"], fake["src_ids"], fake["dst_ids"])


def pytree_to_fake(mode: FakeTensorMode, value: object) -> object:
    if isinstance(value, torch.Tensor):
        return mode.from_tensor(value)
    if isinstance(value, list):
        return [pytree_to_fake(mode, v) for v in value]
    return value


def test_healthy_args_copy() -> None:
    """The error cases start from arguments that do copy."""
    args = _healthy_args()
    expected = reference(
        args["src"], args["dst"], args["src_ids"].tolist(), args["dst_ids"].tolist()
    )
    OP(args["src"], args["dst"], args["src_ids"], args["dst_ids"])
    assert_bytes_equal(args["dst"], expected)


def test_error_messages_have_the_op_name() -> None:
    args = _healthy_args()
    with pytest.raises(IndexError, match=r"^kvoff\.copy_blocks: "):
        copy_blocks(args["src"], args["dst"], [0, 100], [1, 2])


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a CUDA build of kvoff and a GPU)
# ---------------------------------------------------------------------------------------------


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
    for args in _opcheck_samples("cuda"):
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
    src, dst, src_ids, dst_ids = _random_mechanism_case(seed, "cuda", pin_dst=True)
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
    src, dst, src_ids, dst_ids = _random_mechanism_case(7, "cuda", pin_dst=True)
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
    src, dst, src_ids, dst_ids = _random_mechanism_case(3, "cuda", pin_dst=True)
    _run_on_side_stream(lambda: copy_blocks(src, dst, src_ids, dst_ids, mechanism="batch"))
    assert isinstance(batch_copy_supported(), bool)


@requires_cuda
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_cuda_bad_options_copy_nothing(mechanism: str) -> None:
    src, dst, src_ids, dst_ids = _random_mechanism_case(11, "cuda", pin_dst=True)
    before = snapshot(dst)
    with pytest.raises(ValueError, match=r"kernel_blocks=-1 is negative"):
        OP(src, dst, torch.tensor(src_ids), torch.tensor(dst_ids), mechanism, -1)
    with pytest.raises(ValueError, match=r"mechanism='gpu' is not one of"):
        OP(src, dst, torch.tensor(src_ids), torch.tensor(dst_ids), "gpu", 0)
    torch.cuda.synchronize()
    assert_bytes_equal(dst, before)
