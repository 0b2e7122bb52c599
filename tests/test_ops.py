"""torch.ops.kvoff.copy_blocks against a pure-torch reference, its error paths, and opcheck.

The reference copies bytes with advanced indexing on uint8 views (``dst[ids] = src[ids]``), so
every dtype, NaN payloads included, is compared bit for bit. Every rejected call must leave
every destination byte-for-byte unchanged, so the error cases put the bad value last (last
pair, last id) where a kernel that validated lazily would already have copied the rest. The
CUDA paths are tested in test_ops_cuda.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from copy_ops_util import (
    DTYPES,
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
from torch._subclasses.fake_tensor import FakeTensorMode

import kvoff  # noqa: F401  (loads kvoff._C)
from kvoff.ops import MECHANISMS, batch_copy_supported, copy_blocks

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


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("seed", range(8))
def test_cpu_mechanisms_match_reference(mechanism: str, seed: int) -> None:
    src, dst, src_ids, dst_ids = random_mechanism_case(seed)
    expected = reference(src, dst, src_ids, dst_ids)
    src_before = snapshot(src)
    copy_blocks(src, dst, src_ids, dst_ids, mechanism=mechanism, kernel_blocks=seed % 3)
    assert_bytes_equal(dst, expected)
    assert_bytes_equal(src, src_before)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_cpu_mechanisms_through_the_op(mechanism: str) -> None:
    """The op itself (positional and keyword forms) takes every name."""
    src, dst, src_ids, dst_ids = random_mechanism_case(100)
    expected = reference(src, dst, src_ids, dst_ids)
    OP(src, dst, torch.tensor(src_ids), torch.tensor(dst_ids), mechanism, 0)
    assert_bytes_equal(dst, expected)
    src, dst, src_ids, dst_ids = random_mechanism_case(101)
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


def test_opcheck_cpu() -> None:
    for args in opcheck_samples("cpu"):
        torch.library.opcheck(OP, args)
    for mechanism in MECHANISMS:
        for args in opcheck_samples("cpu")[:1]:
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
