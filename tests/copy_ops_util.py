"""Helpers shared by the copy op's tests (tests/test_ops.py on the CPU, test_ops_cuda.py on a
GPU): random block tensors with padded row strides, a byte-exact reference copy computed with
advanced indexing on uint8 views, and random mechanism cases."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import torch

import kvoff  # noqa: F401  (loads kvoff._C)

OP = torch.ops.kvoff.copy_blocks.default

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.int8, torch.int64]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


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


def random_mechanism_case(
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


def opcheck_samples(device: str) -> list[tuple]:
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
