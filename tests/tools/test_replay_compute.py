"""``kvoff replay --compute``'s arms and accounting, and the options that pick what a short GPU
run replays (``--start``, ``--warmup``, ``--best-reuse-window``, the ``unique`` trace).

The times are checked exactly with a clock only the GEMMs advance; CPU wall times are too noisy
on a shared machine to compare."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvoff.tools import replay as replay_mod
from kvoff.tools.policy_sim import run_manager_replay
from kvoff.tools.replay import ReplayConfig, run_replay
from kvoff.tools.replay_compute import saving_fraction
from kvoff.tools.trace_windows import best_hit_window
from kvoff.tools.traces import load_trace


class _VirtualClock:
    """A clock only the GEMMs advance (1 µs per token): every compute figure has an exact
    value from the token counts."""

    now = 0.0

    def __init__(self, device: object = None) -> None:
        self.cuda = False

    def mark(self) -> float:
        return _VirtualClock.now

    def seconds(self, a: float, b: float) -> float:
        return b - a

    def drain(self) -> None:
        pass


class _VirtualPrefill:
    flops_per_token = 1.0
    chunk = 0  # the warm-up runs no tokens: the clock starts at the first request

    def __init__(self, *args: object) -> None:
        pass

    def run(self, tokens: int) -> None:
        _VirtualClock.now += tokens * 1e-6


def test_interleaved_arms_account_for_every_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arm A (kvoff), B (the engine's prefix cache alone), C (the ideal) and D (recompute) each
    get exactly their own tokens: with a clock only GEMMs advance, A's time is the ideal, B's
    the tokens its prefix cache missed, and kvoff captures the whole saving."""
    monkeypatch.setattr(replay_mod, "Timer", _VirtualClock)
    monkeypatch.setattr(replay_mod, "Prefill", _VirtualPrefill)
    cfg = ReplayConfig(cpu_blocks=2000, limit=60, compute=True, gpu_prefix_blocks=8,
                       interleave_requests=7)  # fmt: skip
    res = run_replay(cfg)
    us = 1e-6
    assert res.cpu_hit_tokens > 0 and res.gpu_hit_tokens > 0
    assert res.hit_tokens_without == res.gpu_hit_tokens  # the same prefix cache, without kvoff
    assert res.time_ideal_s == pytest.approx(res.computed_tokens * us)
    assert res.time_with_s == pytest.approx(res.computed_tokens * us)
    assert res.time_without_s == pytest.approx((res.input_tokens - res.gpu_hit_tokens) * us)
    assert res.time_recompute_s == pytest.approx(res.input_tokens * us)
    assert res.saving_fraction == pytest.approx(1.0)
    assert res.interleaved_chunks == 9  # 8 × 7 + 4
    computed = [
        n - g - c
        for n, g, c in zip(
            [r.input_length for r in load_trace("conversation", limit=60)],
            res.per_request_gpu_hit_tokens,
            res.per_request_cpu_hit_tokens,
            strict=True,
        )
    ]
    assert res.ttft_p50_with_s == pytest.approx(float(np.percentile(computed, 50)) * us)
    assert res.ttft_p99_with_s == pytest.approx(float(np.percentile(computed, 99)) * us)
    assert res.ttft_p50_with_s < res.ttft_p50_without_s


def test_saving_fraction_is_the_share_of_the_possible_saving() -> None:
    assert saving_fraction(8.0, 10.0, 6.0) == pytest.approx(0.5)
    assert saving_fraction(6.0, 10.0, 6.0) == pytest.approx(1.0)
    assert saving_fraction(11.0, 10.0, 6.0) == pytest.approx(-0.25)  # kvoff cost time
    assert saving_fraction(10.0, 10.0, 10.0) is None  # nothing could be saved


def test_zero_reuse_trace_has_nothing_to_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``unique`` trace: no hit anywhere, so kvoff's time is the engine's and the ideal."""
    monkeypatch.setattr(replay_mod, "Timer", _VirtualClock)
    monkeypatch.setattr(replay_mod, "Prefill", _VirtualPrefill)
    res = run_replay(ReplayConfig(trace="unique", limit=30, compute=True, interleave_requests=8))
    assert res.hit_tokens == 0 and res.hit_tokens_without == 0 and res.blocks_stored > 0
    assert res.time_with_s == pytest.approx(res.time_without_s)
    assert res.time_without_s == pytest.approx(res.input_tokens * 1e-6)
    assert res.saving_fraction is None  # nothing could be saved
    assert res.ttft_p99_with_s == pytest.approx(res.ttft_p99_without_s)


def test_start_and_warmup_pick_the_requests_replayed() -> None:
    trace = load_trace("conversation", limit=80)
    cold = run_replay(ReplayConfig(start=60, limit=20, cpu_blocks=3000))
    assert cold.requests == 20 and cold.warmup_requests == 0
    assert cold.input_tokens == sum(r.input_length for r in trace[60:80])
    # the 60 requests before are served first: same requests counted, warmer caches
    warm = run_replay(ReplayConfig(limit=80, warmup_requests=60, cpu_blocks=3000))
    assert warm.requests == 20 and warm.warmup_requests == 60
    assert warm.input_tokens == cold.input_tokens
    assert warm.hit_tokens > cold.hit_tokens and warm.corrupted_blocks == 0
    assert len(warm.per_request_cpu_hit_tokens) == 20
    with pytest.raises(ValueError, match="warmup_requests=20 leaves none of the 20 requests"):
        run_replay(ReplayConfig(limit=20, warmup_requests=20))
    with pytest.raises(ValueError, match="start must be >= 0"):
        run_replay(ReplayConfig(start=-1, limit=5))


def test_warmup_is_served_but_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replay_mod, "Timer", _VirtualClock)
    monkeypatch.setattr(replay_mod, "Prefill", _VirtualPrefill)
    res = run_replay(ReplayConfig(limit=50, warmup_requests=30, compute=True, cpu_blocks=3000))
    assert res.requests == 20 and res.interleaved_chunks == 2  # 16 + 4
    assert res.time_with_s == pytest.approx(res.computed_tokens * 1e-6)
    assert res.time_recompute_s == pytest.approx(res.input_tokens * 1e-6)


def test_best_hit_window() -> None:
    assert best_hit_window([10, 10, 10, 10], [0, 5, 8, 1], 2) == (1, pytest.approx(0.65))
    assert best_hit_window([10, 10], [3, 3], 2) == (0, pytest.approx(0.3))
    assert best_hit_window([4, 8, 8], [4, 0, 8], 1) == (0, pytest.approx(1.0))  # earliest tie
    with pytest.raises(ValueError, match="input_tokens has 2 requests but hit_tokens 1"):
        best_hit_window([1, 2], [1], 1)
    with pytest.raises(ValueError, match="window=3 requests is longer than the trace"):
        best_hit_window([1, 2], [1, 1], 3)
    with pytest.raises(ValueError, match="window must be an integer >= 1, got 0"):
        best_hit_window([1, 2], [1, 1], 0)


def _kvoff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvoff", *args], capture_output=True, text=True, check=False
    )


def test_cli_best_reuse_window_replays_the_stretch_with_the_most_hits(tmp_path: Path) -> None:
    out = tmp_path / "w.json"
    proc = _kvoff("replay", "--best-reuse-window", "30", "--warmup", "50", "--cpu-blocks",
                  "3000", "--no-progress", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    whole = load_trace("conversation")
    sim = run_manager_replay(ReplayConfig(cpu_blocks=3000), requests=whole)
    start, fraction = best_hit_window(
        [r.input_length for r in whole], sim.per_request_cpu_hit_tokens, 30
    )
    assert doc["window"] == {"start": start, "requests": 30, "simulated_hit_rate": fraction,
                             "simulated_cpu_blocks": 3000}  # fmt: skip
    assert fraction > sim.hit_rate  # the stretch reuses more than the trace does on average
    res = doc["result"]
    assert res["requests"] == 30 and res["warmup_requests"] == 50
    assert res["input_tokens"] == sum(r.input_length for r in whole[start : start + 30])
    assert f"best-reuse window: requests {start}..{start + 29}" in proc.stderr
    bad = _kvoff("replay", "--best-reuse-window", "30", "--limit", "5")
    assert bad.returncode == 2 and "drop --start and --limit" in bad.stderr
