"""Windows of a trace ranked by prefix reuse: which stretch of consecutive requests is worth a
short replay.

The reuse of a window is what ``kvoff replay`` reports as ``max_hit_rate`` (the full-block
maximum of :func:`kvoff.tools.request_loop.run_request_loop`) when the window's requests are
replayed alone, from a cold cache, with an infinite pool: per request, the leading run of its
full offloaded blocks whose identity some earlier request **of the window** already had, times
``block_size`` tokens. A block's identity is ``(hash id of the trace block holding its last
token, position)``, as in :func:`kvoff.tools.request_loop.request_blocks`; only full offloaded
blocks count (``input_length // block_size`` of them), so a request's partial last block is
never a hit. The reuse fraction is those tokens over the window's input tokens.

All windows are scored at once in ``O(blocks + windows)`` after one sort: for each block, the
latest earlier request holding its identity (and, the run being leading, the minimum of that
over the block and the blocks before it) says exactly which window starts still see it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvoff.tools.traces import MOONCAKE_BLOCK_SIZE, TraceRequest

__all__ = ["ReuseWindow", "best_hit_window", "best_reuse_window", "reuse_windows"]


@dataclass(frozen=True)
class ReuseWindow:
    """One window of consecutive requests and its reuse.

    Attributes:
        start: index of the window's first request in the trace.
        stop: one past its last request (``start + window``).
        input_tokens: prompt tokens of its requests.
        reuse_tokens: tokens of its requests a cold replay of the window alone with an infinite
            pool could hit (module docstring); a multiple of ``block_size``.
    """

    start: int
    stop: int
    input_tokens: int
    reuse_tokens: int

    @property
    def reuse_fraction(self) -> float:
        """``reuse_tokens / input_tokens`` (0.0 for a window without input tokens): the
        ``max_hit_rate`` a replay of the window alone reports."""
        return self.reuse_tokens / self.input_tokens if self.input_tokens else 0.0


def _check_positive(name: str, value: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}; {fix}")


def reuse_windows(
    requests: Sequence[TraceRequest],
    window: int,
    stride: int = 1,
    *,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    trace_block_size: int = MOONCAKE_BLOCK_SIZE,
) -> list[ReuseWindow]:
    """The reuse of every window of ``window`` consecutive requests starting at a multiple of
    ``stride`` (``0, stride, 2 * stride, ...`` while ``start + window <= len(requests)``).

    Args:
        requests: the trace, in order.
        window: requests per window.
        stride: requests between consecutive window starts (1: every start).
        block_size: tokens per offloaded block (``kvoff replay --offloaded-block-size``; a
            replay's ``max_hit_rate`` counts whole offloaded blocks).
        trace_block_size: tokens per trace hash id (512 for Mooncake).

    Returns:
        One :class:`ReuseWindow` per start, in start order (see the module docstring for the
        definition of reuse).

    Raises:
        ValueError: ``window``, ``stride``, ``block_size`` or ``trace_block_size`` below 1;
            ``window`` above ``len(requests)``; a request with fewer hash ids than its
            ``input_length`` needs at ``trace_block_size`` tokens per id.
    """
    _check_positive("window", window, "give the number of consecutive requests per window")
    _check_positive("stride", stride, "give the requests between window starts (1: every start)")
    _check_positive("block_size", block_size, "give the offloaded block size in tokens")
    _check_positive("trace_block_size", trace_block_size, "give the tokens per trace hash id")
    num_req = len(requests)
    if window > num_req:
        raise ValueError(
            f"window={window} requests is longer than the trace ({num_req} requests); give a "
            f"window of at most {num_req}"
        )
    window, stride = int(window), int(stride)
    num_win = (num_req - window) // stride + 1

    lengths = np.fromiter((r.input_length for r in requests), dtype=np.int64, count=num_req)
    num_ids = np.fromiter((len(r.hash_ids) for r in requests), dtype=np.int64, count=num_req)
    num_full = lengths // block_size  # full offloaded blocks per request
    # trace block of the last token of a request's last full offloaded block
    need = np.where(num_full > 0, (num_full * block_size - 1) // trace_block_size + 1, 0)
    short = np.flatnonzero(need > num_ids)
    if short.size:
        i = int(short[0])
        raise ValueError(
            f"request {i}: input_length={int(lengths[i])} needs {int(need[i])} hash ids at "
            f"trace_block_size={trace_block_size}, got {int(num_ids[i])}; is trace_block_size "
            "right?"
        )

    starts = np.arange(num_win, dtype=np.int64) * stride
    cum_len = np.concatenate(([0], np.cumsum(lengths)))
    input_tokens = cum_len[starts + window] - cum_len[starts]

    total = int(num_full.sum())
    counts = np.zeros(num_win + 1, dtype=np.int64)
    if total:
        flat_ids = np.fromiter(
            (h for r in requests for h in r.hash_ids), dtype=np.int64, count=int(num_ids.sum())
        )
        id_offset = np.concatenate(([0], np.cumsum(num_ids)[:-1]))
        req = np.repeat(np.arange(num_req, dtype=np.int64), num_full)
        first = np.concatenate(([0], np.cumsum(num_full)[:-1]))
        pos = np.arange(total, dtype=np.int64) - np.repeat(first, num_full)
        hid = flat_ids[id_offset[req] + ((pos + 1) * block_size - 1) // trace_block_size]

        # latest earlier request holding each block's identity (hid, pos), else -1; a request
        # holds an identity once (positions differ), so the previous one in the sort is earlier
        order = np.lexsort((req, pos, hid))
        s_hid, s_pos, s_req = hid[order], pos[order], req[order]
        same = (s_hid[1:] == s_hid[:-1]) & (s_pos[1:] == s_pos[:-1])
        prev = np.empty(total, dtype=np.int64)
        prev[order] = np.concatenate(([-1], np.where(same, s_req[:-1], -1)))

        # the run is leading: a block hits in the window from s on iff every block up to it has
        # an earlier holder at index >= s, i.e. the prefix minimum of ``prev`` within the
        # request is >= s. Segmented prefix minimum: lift each request above all later ones.
        lift = (num_req + 1) * (num_req - req)
        prefix_min = np.minimum.accumulate(prev + 1 + lift) - lift - 1

        # block (request i, prefix minimum p >= 0) hits in the windows with i - window < s <= p
        hit = prefix_min >= 0
        i, p = req[hit], prefix_min[hit]
        k_lo = np.maximum(0, -((window - 1 - i) // stride))  # ceil((i - window + 1) / stride)
        k_hi = np.minimum(num_win - 1, p // stride)
        ok = k_lo <= k_hi
        counts += np.bincount(k_lo[ok], minlength=num_win + 1)
        counts -= np.bincount(k_hi[ok] + 1, minlength=num_win + 1)
    reuse_tokens = np.cumsum(counts[:num_win]) * block_size

    return [
        ReuseWindow(int(s), int(s) + window, int(t), int(u))
        for s, t, u in zip(starts, input_tokens, reuse_tokens, strict=True)
    ]


def best_reuse_window(
    requests: Sequence[TraceRequest],
    window: int,
    *,
    stride: int | None = None,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    trace_block_size: int = MOONCAKE_BLOCK_SIZE,
) -> tuple[int, float]:
    """The window of ``window`` consecutive requests with the highest reuse fraction (module
    docstring): what to replay when only ``window`` requests fit the budget.

    Args:
        requests: the trace, in order.
        window: requests per window.
        stride: requests between the window starts tried (``None`` or 1: every start).
        block_size: tokens per offloaded block.
        trace_block_size: tokens per trace hash id (512 for Mooncake).

    Returns:
        ``(start, reuse_fraction)``: the index of the window's first request (replay
        ``requests[start : start + window]``) and its reuse tokens over its input tokens (the
        ``max_hit_rate`` that replay reports). Ties go to the earliest start.

    Raises:
        ValueError: as :func:`reuse_windows`.
    """
    wins = reuse_windows(
        requests,
        window,
        1 if stride is None else stride,
        block_size=block_size,
        trace_block_size=trace_block_size,
    )
    best = max(wins, key=lambda w: w.reuse_fraction)  # max keeps the first of equal keys
    return best.start, best.reuse_fraction


def best_hit_window(
    input_tokens: Sequence[int], hit_tokens: Sequence[int], window: int
) -> tuple[int, float]:
    """The ``window`` consecutive requests with the highest hit fraction in a replay that
    already ran (e.g. :func:`kvoff.tools.policy_sim.run_manager_replay` of the whole trace with
    the pool that will be measured): ``(start, sum(hit_tokens) / sum(input_tokens))`` over
    ``[start, start + window)``; ties go to the earliest start.

    Args:
        input_tokens: per request, its input tokens.
        hit_tokens: per request, its hit tokens in that replay.
        window: requests per window.

    Raises:
        ValueError: lists of different lengths, ``window`` < 1 or longer than the lists.
    """
    inp = np.asarray(input_tokens, dtype=np.int64)
    hit = np.asarray(hit_tokens, dtype=np.int64)
    if inp.shape != hit.shape:
        raise ValueError(
            f"input_tokens has {inp.size} requests but hit_tokens {hit.size}; give both for "
            "the same replay"
        )
    _check_positive("window", window, "give the requests per window")
    if window > inp.size:
        raise ValueError(
            f"window={window} requests is longer than the trace ({inp.size} requests); give a "
            f"window of at most {inp.size}"
        )
    ci = np.concatenate([[0], np.cumsum(inp)])
    ch = np.concatenate([[0], np.cumsum(hit)])
    total = ci[window:] - ci[:-window]
    frac = (ch[window:] - ch[:-window]) / np.maximum(total, 1)
    start = int(np.argmax(frac))
    return start, float(frac[start])
