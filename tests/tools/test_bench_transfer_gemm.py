"""The GEMM-slowdown measurement of ``kvoff bench transfer`` (issue 55, item 4): interleaved
"alone" / "with transfers" rounds and their statistics (:mod:`kvoff.tools.slowdown_rounds`:
median, interquartile range, the median's distribution-free 95 % interval, rounds needed),
checked with CPU fakes of known answer;
and the wiring of the rounds into the per-mechanism rows, the parameters and the command line.
The GEMM itself runs only on CUDA."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from kvoff.jobs import TransferResult
from kvoff.tools import bench_transfer as bt
from kvoff.tools.bench_transfer import TRANSFER_PRESETS, TransferBenchParams, run_transfer_bench
from kvoff.tools.cli import build_parser, main
from kvoff.tools.slowdown_rounds import (
    GEMM_ROUNDS,
    SLOWDOWN_HALF_WIDTH_TARGET,
    interleaved_slowdowns,
    median_half_width,
    rounds_needed,
    summarize_slowdowns,
)

# ------------------------------------------------------------------------- interleaving


class _Clock:
    """Fake timings: ``alone`` and ``with_transfers`` return seconds from a formula of the call
    number (0, 1, 2, ... over both), and every call is logged."""

    def __init__(self, alone_s: Any, with_s: Any) -> None:
        self.calls: list[str] = []
        self._alone_s, self._with_s = alone_s, with_s

    def alone(self) -> float:
        self.calls.append("alone")
        return self._alone_s(len(self.calls) - 1)

    def with_transfers(self) -> float:
        self.calls.append("with")
        return self._with_s(len(self.calls) - 1)


def test_rounds_alternate_order_and_give_with_over_alone_minus_one() -> None:
    # call k takes k + 1 seconds, so each round's value says which timing came first
    clock = _Clock(lambda k: k + 1.0, lambda k: k + 1.0)
    got = interleaved_slowdowns(clock.alone, clock.with_transfers, 4)
    assert clock.calls == ["alone", "with", "with", "alone", "alone", "with", "with", "alone"]
    # round 0: alone 1 s, with 2 s; round 1: with 3 s, alone 4 s; round 2: 5, 6; round 3: 7, 8
    assert got == [2 / 1 - 1, 3 / 4 - 1, 6 / 5 - 1, 7 / 8 - 1]


def test_constant_5_percent_with_noise_gives_a_median_near_5_percent() -> None:
    rng = random.Random(55)
    noise = [rng.uniform(-0.02, 0.02) for _ in range(200)]
    clock = _Clock(lambda k: 0.030 * (1 + noise[k]), lambda k: 0.030 * 1.05 * (1 + noise[k]))
    s = summarize_slowdowns(interleaved_slowdowns(clock.alone, clock.with_transfers, 41))
    assert len(s.rounds) == 41
    assert s.median == pytest.approx(0.05, abs=0.01)
    # each round's value lies within the noise band: 1.05 * (1 ± 0.02) / (1 ∓ 0.02) - 1
    assert all(1.05 * 0.98 / 1.02 - 1 <= r <= 1.05 * 1.02 / 0.98 - 1 for r in s.rounds)
    assert 0 < s.spread < 0.05
    assert s.half_width is not None and s.half_width < SLOWDOWN_HALF_WIDTH_TARGET
    assert s.rounds_needed is not None and 6 <= s.rounds_needed <= 41


def test_alternating_order_cancels_a_slow_drift() -> None:
    # the machine gets 0.5 % slower every call; the true slowdown is 3 %
    g = 0.005
    clock = _Clock(lambda k: 1.0 * (1 + g) ** k, lambda k: 1.03 * (1 + g) ** k)
    got = interleaved_slowdowns(clock.alone, clock.with_transfers, 10)
    # the same order every round would bias every value the same way: 1.03 * (1 + g) - 1 ...
    assert got[0::2] == pytest.approx([1.03 * (1 + g) - 1] * 5)
    assert got[1::2] == pytest.approx([1.03 / (1 + g) - 1] * 5)
    # ... alternating puts half on each side, and the median lands on the truth (to g^2)
    assert summarize_slowdowns(got).median == pytest.approx(0.03, abs=1e-4)


@pytest.mark.parametrize("rounds", [0, -3, 2.5, True, "9"])
def test_rounds_below_one_or_not_an_integer_raise_naming_the_value_and_the_fix(
    rounds: Any,
) -> None:
    clock = _Clock(lambda k: 1.0, lambda k: 1.0)
    with pytest.raises(ValueError, match=rf"rounds={rounds!r}.*integer >= 1.*--gemm-rounds"):
        interleaved_slowdowns(clock.alone, clock.with_transfers, rounds)
    assert clock.calls == []  # refused before timing anything


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_timing_that_is_not_positive_seconds_raises(bad: float) -> None:
    clock = _Clock(lambda k: 1.0, lambda k: bad)
    with pytest.raises(
        ValueError, match=r"round 0: with_transfers\(\) returned .*finite number > 0"
    ):
        interleaved_slowdowns(clock.alone, clock.with_transfers, 3)


# ------------------------------------------------------------------------- statistics


@pytest.mark.parametrize(
    ("n", "low", "high"),
    # the 95 % order-statistic interval (x_(j), x_(n+1-j)) of the median (Conover 1999, §3.2;
    # the usual tables): coverage 1 - 2 * P(Binomial(n, 1/2) <= j - 1) >= 0.95
    [(6, 1, 6), (9, 2, 8), (10, 2, 9), (20, 6, 15)],
)
def test_median_half_width_uses_the_textbook_order_statistics(n: int, low: int, high: int) -> None:
    values = [float(k) for k in range(1, n + 1)]  # x_(k) = k
    random.Random(n).shuffle(values)  # order of the rounds does not matter
    assert median_half_width(values) == (high - low) / 2
    j = low
    cover = 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n
    wider = 1 - 2 * sum(math.comb(n, i) for i in range(j + 1)) / 2**n
    assert cover >= 0.95 > wider  # the narrowest such interval


def test_median_half_width_needs_six_rounds_at_95_percent() -> None:
    # [x_(1), x_(5)] covers the median of 5 with 1 - 2/32 = 93.75 % < 95 %
    assert median_half_width([0.01, 0.02, 0.03, 0.04, 0.05]) is None
    assert median_half_width([0.05]) is None
    assert median_half_width([0.01, 0.02, 0.03, 0.04, 0.05], confidence=0.9) == 0.02
    with pytest.raises(ValueError, match=r"confidence=1\.5.*between 0 and 1"):
        median_half_width([0.0] * 9, confidence=1.5)


def test_rounds_needed_is_the_first_prefix_whose_half_width_is_below_the_target() -> None:
    values = [0.00, 0.10, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05]
    # n = 6, 7, 8: interval [x_(1), x_(n)] = [0, 0.10], half-width 0.05; n = 9: [x_(2), x_(8)]
    # = [0.05, 0.05], half-width 0
    assert [median_half_width(values[:n]) for n in (6, 7, 8, 9)] == [0.05, 0.05, 0.05, 0.0]
    assert rounds_needed(values) == 9
    assert rounds_needed(values, target=0.06) == 6
    assert rounds_needed([0.05] * 6) == 6
    assert rounds_needed([0.05] * 5) is None  # no interval yet
    assert rounds_needed([0.0, 0.1] * 10) is None  # never tight enough
    with pytest.raises(ValueError, match=r"target=0.*> 0"):
        rounds_needed(values, target=0)


def test_summary_of_nine_rounds_has_known_median_spread_and_half_width() -> None:
    values = [0.05, 0.04, 0.06, 0.03, 0.07, 0.02, 0.08, 0.01, 0.09]
    s = summarize_slowdowns(values)
    assert s.rounds == tuple(values)
    assert s.median == 0.05
    # inclusive quartiles of 0.01..0.09: the 3rd and 7th values
    assert s.spread == pytest.approx(0.07 - 0.03)
    assert s.half_width == pytest.approx((0.08 - 0.02) / 2)  # [x_(2), x_(8)]
    assert s.rounds_needed is None  # prefixes: 0.025, 0.03, 0.035, 0.03
    assert summarize_slowdowns(values, target=0.026).rounds_needed == 6


def test_summary_of_one_round_and_bad_input() -> None:
    s = summarize_slowdowns([0.04])
    assert (s.median, s.spread, s.half_width, s.rounds_needed) == (0.04, 0.0, None, None)
    with pytest.raises(ValueError, match=r"no rounds.*gemm_rounds >= 1"):
        summarize_slowdowns([])
    with pytest.raises(ValueError, match="must be finite"):
        summarize_slowdowns([0.01, math.nan])


# ------------------------------------------------------------------------- wiring


class _FakeWorker:
    """Records jobs; ``pending`` is how many were submitted since the last ``wait``."""

    def __init__(self, fail: bool = False) -> None:
        self.pending = 0
        self.submitted: list[tuple[int, Any, Any]] = []
        self.fail = fail

    def transfer_async(self, job_id: int, src: Any, dst: Any) -> None:
        self.submitted.append((job_id, src, dst))
        self.pending += 1

    def wait(self, ids: list[int]) -> list[TransferResult]:
        self.pending = 0
        error = "boom" if self.fail else None
        return [TransferResult(j, "store", not self.fail, 0, 0.0, error, "batch") for j in ids]


class _FakeGemm:
    """A GEMM loop that takes ``ms`` per GEMM alone and ``ms * (1 + slowdown)`` while
    ``pending()`` says transfers run."""

    def __init__(self, pending: Any, ms: float = 1.0, slowdown: float = 0.05) -> None:
        self.pending, self.ms, self.slowdown = pending, ms, slowdown
        self.timed: list[bool] = []  # per call: ran beside transfers

    def run(self, count: int) -> float:
        busy = self.pending() > 0
        self.timed.append(busy)
        return self.ms * (1 + self.slowdown) if busy else self.ms


def test_gemm_slowdown_queues_jobs_beside_every_with_timing_and_waits_for_them() -> None:
    worker = _FakeWorker()
    gemm = _FakeGemm(lambda: worker.pending)
    setup = bt._Setup(worker, ("gpu", "cpu"), ("cpu2", "gpu2"), [], 0, *[torch.empty(0)] * 4)
    got = bt._gemm_slowdown(gemm, setup, bt._Jobs(), ["store", "load"], 0.004, rounds=5)
    assert got.rounds == pytest.approx([0.05] * 5)
    assert got.median == pytest.approx(0.05) and got.spread == pytest.approx(0.0)
    # warm-up and sizing alone, then rounds (alone, with), (with, alone), (alone, with), ...
    assert gemm.timed == [False, False] + [False, True, True, False] * 2 + [False, True]
    # 20 GEMMs of 1 ms = 0.02 s alone; jobs of 4 ms: int(2 * 0.02 / 0.004) + 1 = 11 per direction
    assert len(worker.submitted) == 5 * 11 * 2
    assert [src for _, src, _ in worker.submitted[:2]] == ["gpu", "cpu2"]  # store, load
    assert worker.pending == 0
    failing = _FakeWorker(fail=True)
    setup = bt._Setup(failing, ("g", "c"), ("c", "g"), [], 0, *[torch.empty(0)] * 4)
    with pytest.raises(RuntimeError, match="failed: boom"):
        bt._gemm_slowdown(_FakeGemm(lambda: failing.pending), setup, bt._Jobs(), ["store"], 1.0)


def test_mechanism_rows_carry_the_median_and_its_rounds(monkeypatch) -> None:
    """A CPU run of one layout with a fake GEMM that is 5 % slower while jobs are pending: every
    row keeps ``gemm_slowdown`` a float per direction, with the rounds and statistics beside it,
    and the thresholds' cost reader takes the median."""
    pending = [0]

    class CountingWorker(bt.OffloadingWorker):
        def transfer_async(self, job_id: int, src: Any, dst: Any) -> None:  # type: ignore[override]
            pending[0] += 1
            super().transfer_async(job_id, src, dst)

        def wait(self, job_ids: Any) -> list[TransferResult]:
            pending[0] = 0
            return super().wait(job_ids)

    monkeypatch.setattr(bt, "OffloadingWorker", CountingWorker)
    p = TransferBenchParams(
        presets=("qwen2.5-0.5b",), num_blocks=4, repeat=1, warmup=0, job_sizes=(), step_jobs=0,
        gemm_rounds=7,
    )  # fmt: skip
    gemm = _FakeGemm(lambda: pending[0], ms=1e-4)  # a short loop: 2 jobs per timing suffice
    entry = bt._bench_layout(
        TRANSFER_PRESETS["qwen2.5-0.5b"], "layer_major", p, torch.device("cpu"), gemm
    )
    assert set(entry["mechanisms"]) == set(bt.MECHANISMS_BY_LAYOUT["layer_major"])
    for row in entry["mechanisms"].values():
        assert set(row["gemm_slowdown"]) == {"store", "load"}  # no "both" on the CPU
        for d in ("store", "load"):
            assert isinstance(row["gemm_slowdown"][d], float)
            assert row["gemm_slowdown"][d] == pytest.approx(0.05)
            assert row["gemm_slowdown_rounds"][d] == pytest.approx([0.05] * 7)
            assert row["gemm_slowdown_spread"][d] == pytest.approx(0.0)
            assert row["gemm_slowdown_half_width"][d] == pytest.approx(0.0)
            assert row["gemm_slowdown_rounds_needed"][d] == 6
    doc = {"presets": [entry]}
    slow, _ = bt._costs_from_presets(doc)
    assert slow["store"]["staged"] == pytest.approx(0.05)
    assert slow["load"]["batch"] == pytest.approx(0.05)


def test_gemm_rounds_parameter_is_checked_before_any_work() -> None:
    assert TransferBenchParams().gemm_rounds == GEMM_ROUNDS == 9
    with pytest.raises(ValueError, match=r"gemm_rounds=0.*integer >= 1.*--gemm-rounds"):
        run_transfer_bench(TransferBenchParams(gemm_rounds=0), device=torch.device("cpu"))


def test_cli_gemm_rounds_reaches_the_parameters(monkeypatch, capsys) -> None:
    seen: list[TransferBenchParams] = []

    def fake_run(params: TransferBenchParams, **_kwargs: Any) -> dict[str, Any]:
        seen.append(params)
        return {}

    monkeypatch.setattr(bt, "run_transfer_bench", fake_run)
    monkeypatch.setattr(bt, "format_transfer_table", lambda doc: "table")
    assert main(["bench", "transfer", "--gemm-rounds", "15"]) == 0
    assert seen[0].gemm_rounds == 15
    args = build_parser().parse_args(["bench", "transfer"])
    assert args.gemm_rounds == GEMM_ROUNDS
    with pytest.raises(SystemExit) as info:
        main(["bench", "transfer", "--gemm-rounds", "0"])
    assert info.value.code == 2
    assert "--gemm-rounds" in capsys.readouterr().err
