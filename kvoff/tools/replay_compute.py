"""Timing of ``kvoff replay --compute``: the prefill's cost, and kvoff against the engine alone,
interleaved.

The prefill of ``T`` tokens costs ``2 × num_params × T`` FLOPs (Kaplan et al. 2020, "Scaling
laws for neural language models", the forward pass), run as GEMMs on the compute stream
(:class:`Prefill`). The requests are served in chunks of ``interleave_requests``, and after each
chunk served with kvoff (arm A) the same requests are served again (:class:`Interleaved`):

- **B**, the engine's own prefix cache alone: the same GPU block pool and prefix cache, no kvoff;
- **C**, the GEMMs alone for the tokens A computed (the tokens neither cache hit): the ideal;
- **D**, the GEMMs alone for every input token (recomputing everything).

A and B each keep their own state from chunk to chunk; interleaving them per chunk makes the
GPU's clock and temperature drift fall on both alike. An arm's chunk is timed on the compute
stream (CUDA events; ``perf_counter`` on the CPU) from its start to the end of its last request's
work; the stores A still has in flight then finish before B starts, in neither time. Per request,
the time to first token is from the moment the engine takes it up (the compute stream has done
the previous request) to the end of its last prefill GEMM, which includes waiting for its loads
and for the fences.

``saving_fraction`` = (T_without − T_with) / (T_without − T_ideal): the share of the time that
the hits could save which kvoff did save (1: all of it; 0: none; negative: kvoff cost time);
``None`` when kvoff hit nothing (then only ``time_with_s / time_without_s`` says anything).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvoff.models import ModelPreset
from kvoff.tools.request_loop import ReplayResult

__all__ = ["Interleaved", "Marks", "Prefill", "Timer", "saving_fraction"]


class Timer:
    """Marks on the compute stream (CUDA events) or host timestamps (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> object:
        """A point in time: a CUDA event recorded on the current stream, or ``perf_counter``."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, a: object, b: object) -> float:
        """Seconds from mark ``a`` to mark ``b`` (on a GPU: waits for ``b``)."""
        if self.cuda:
            b.synchronize()  # type: ignore[attr-defined]
            return a.elapsed_time(b) / 1e3  # type: ignore[attr-defined]
        return float(b) - float(a)  # type: ignore[arg-type]

    def drain(self) -> None:
        """Waits for everything queued on the device (nothing to do on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize()


class Prefill:
    """The prefill's cost: ``2 × num_params`` FLOPs per token as GEMMs on the current stream.

    A chunk of ``c`` tokens runs ``reps = round(num_params / (hidden × intermediate))`` GEMMs
    ``(c × hidden) @ (hidden × intermediate)`` (bf16 on a GPU, float32 on the CPU).

    Raises:
        ValueError: the model preset has no compute shape.
    """

    def __init__(self, preset: ModelPreset, device: torch.device, chunk_tokens: int) -> None:
        if not (preset.hidden_size and preset.intermediate_size and preset.num_params):
            raise ValueError(
                f"model {preset.name!r} has no compute shape (hidden_size, intermediate_size, "
                "num_params); use a preset that has one for --compute"
            )
        h, i = preset.hidden_size, preset.intermediate_size
        self.reps = max(1, round(preset.num_params / (h * i)))
        self.flops_per_token = 2.0 * h * i * self.reps
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        gen = torch.Generator(device=device).manual_seed(0)
        self.x = torch.randn(chunk_tokens, h, dtype=dtype, device=device, generator=gen)
        self.w = torch.randn(h, i, dtype=dtype, device=device, generator=gen) / h**0.5
        self.out = torch.empty(chunk_tokens, i, dtype=dtype, device=device)
        self.chunk = chunk_tokens

    def run(self, tokens: int) -> None:
        """Queues the GEMMs of a prefill of ``tokens`` tokens."""
        for start in range(0, tokens, self.chunk):
            c = min(self.chunk, tokens - start)
            for _ in range(self.reps):
                torch.matmul(self.x[:c], self.w, out=self.out[:c])


@dataclass
class Marks:
    """One request's marks: taken up, first and last GEMM, and its tokens."""

    start: object
    gemm_start: object
    gemm_end: object
    input_tokens: int
    computed_tokens: int


def saving_fraction(time_with: float, time_without: float, time_ideal: float) -> float | None:
    """The share of the possible saving that was saved: ``(time_without − time_with) /
    (time_without − time_ideal)`` (seconds in, a ratio out); ``None`` when nothing could be
    saved (``time_without`` not above ``time_ideal`` by more than rounding: 1e-9 of it)."""
    if time_without - time_ideal <= 1e-9 * abs(time_without):
        return None
    return (time_without - time_with) / (time_without - time_ideal)


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


class Interleaved:
    """Arms B, C and D of the module docstring, run after each chunk of arm A.

    Args:
        requests_per_chunk: requests per chunk (>= 1).
        total: requests in the replay.
        timer: the marks' clock.
        prefill: the GEMMs.
        with_marks: arm A's per-request marks (appended to by its pool as it serves).
        without: serves requests ``[lo, hi)`` through arm B and returns their marks.

    Raises:
        ValueError: ``requests_per_chunk`` < 1.
    """

    def __init__(
        self,
        requests_per_chunk: int,
        total: int,
        timer: Timer,
        prefill: Prefill,
        with_marks: list[Marks],
        without: Callable[[int, int], list[Marks]],
    ) -> None:
        if requests_per_chunk < 1:
            raise ValueError(
                f"interleave_requests must be >= 1, got {requests_per_chunk}; give the number of "
                "requests served with kvoff before the same ones are served without it"
            )
        self.n, self.total, self.timer, self.prefill = requests_per_chunk, total, timer, prefill
        self.with_marks, self.without = with_marks, without
        self.without_marks: list[Marks] = []
        self.chunks: list[tuple[object, object, object, object]] = []  # A and B start, end
        self.gemms: list[tuple[object, object, object]] = []  # D start, C start, C end
        self.lo = 0
        prefill.run(prefill.chunk)  # warm-up (kernel selection, thread pools): in neither arm
        timer.drain()
        self.a_start = timer.mark()

    def restart(self) -> None:
        """Starts the first chunk's clock again (after a warm-up that ran since construction)."""
        self.timer.drain()
        self.a_start = self.timer.mark()

    def after(self, done: int) -> None:
        """Called after arm A served request ``done − 1``: at a chunk's end, runs B, C and D on
        its requests and starts A's next chunk."""
        if done - self.lo < self.n and done < self.total:
            return
        a_end = self.timer.mark()
        self.timer.drain()  # A's stores in flight finish here, in neither arm's time
        b_start = self.timer.mark()
        self.without_marks += self.without(self.lo, done)
        b_end = self.timer.mark()
        self.chunks.append((self.a_start, a_end, b_start, b_end))
        for m in self.with_marks[self.lo : done]:
            d = self.timer.mark()
            self.prefill.run(m.input_tokens)
            c = self.timer.mark()
            self.prefill.run(m.computed_tokens)
            self.gemms.append((d, c, self.timer.mark()))
        self.timer.drain()
        self.lo = done
        self.a_start = self.timer.mark()

    def totals(self, res: ReplayResult, without: ReplayResult) -> None:
        """Fills ``res``'s compute fields (seconds) from the marks; ``without``: arm B's
        totals (its hit tokens: the engine's prefix cache alone)."""
        sec = self.timer.seconds
        ttft_with = [sec(m.start, m.gemm_end) for m in self.with_marks]
        ttft_without = [sec(m.start, m.gemm_end) for m in self.without_marks]
        res.time_with_s = sum(sec(a0, a1) for a0, a1, _, _ in self.chunks)
        res.time_without_s = sum(sec(b0, b1) for _, _, b0, b1 in self.chunks)
        res.time_recompute_s = sum(sec(d, c) for d, c, _ in self.gemms)
        res.time_ideal_s = res.gemm_alone_s = sum(sec(c, e) for _, c, e in self.gemms)
        res.time_kvoff_s = sum(ttft_with)
        res.gemm_s = sum(sec(m.gemm_start, m.gemm_end) for m in self.with_marks)
        res.gemm_lost_s = res.gemm_s - res.gemm_alone_s
        # with no kvoff hit the "possible saving" is only the engine's own overhead: no ratio
        res.saving_fraction = (
            saving_fraction(res.time_with_s, res.time_without_s, res.time_ideal_s)
            if res.cpu_hit_tokens
            else None
        )
        res.ttft_p50_with_s = _percentile(ttft_with, 50)
        res.ttft_p99_with_s = _percentile(ttft_with, 99)
        res.ttft_p50_without_s = _percentile(ttft_without, 50)
        res.ttft_p99_without_s = _percentile(ttft_without, 99)
        res.hit_tokens_without = without.hit_tokens
        res.interleave_requests = self.n
        res.interleaved_chunks = len(self.chunks)
        res.compute_flops_per_token = self.prefill.flops_per_token
        res.speedup = res.time_recompute_s / res.time_kvoff_s if res.time_kvoff_s else None
        res.ideal_speedup = 1.0 / (1.0 - res.hit_rate) if res.hit_rate < 1 else None
        if res.speedup is not None and res.ideal_speedup is not None:
            res.speedup_vs_ideal = res.speedup / res.ideal_speedup
