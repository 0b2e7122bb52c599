"""``kvoff replay --sweep-capacity``: hit rate per eviction policy and CPU pool size.

For every pool size (CPU blocks) and every policy, one whole replay of the trace
(:func:`kvoff.tools.replay.run_replay`: real stores and loads through the worker, every loaded
block verified) with that policy; ``min`` is Belady's offline optimum
(:func:`kvoff.tools.belady.run_min_replay`). All other options (trace, block sizes, GPU prefix
cache, model, limit) are the same for every point. The result is a table (and JSON) of hit
rates, the fraction of the gap from a baseline policy to MIN that each policy closes,
``(policy - baseline) / (min - baseline)``, and optionally hit-rate curves drawn with
matplotlib (``--plot FILE.png``).

**Store admission.** A policy may carry the manager's ``store_threshold`` (a block is stored only
once it was offered that many times): ``lru+t2`` is LRU with ``store_threshold=2``, so
``--policies lru,lru+t2`` reports the filter beside the plain policy in one sweep. A name without
``+tN`` takes ``--store-threshold`` (``ReplayConfig.store_threshold``, default 0: off); ``+t0``
turns it off for that line. Rows are labelled ``policy+tN`` whenever N >= 2. ``min`` (the
offline optimum) never takes a threshold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoff._optional import extra_imports
from kvoff.tools.belady import MIN_POLICY, run_min_replay
from kvoff.tools.replay import ReplayConfig, ReplayResult, run_replay
from kvoff.tools.traces import TraceRequest, load_trace

__all__ = [
    "DEFAULT_SWEEP_POLICIES",
    "PolicySweep",
    "SweepPoint",
    "format_sweep_table",
    "parse_capacities",
    "parse_policies",
    "plot_sweep",
    "policy_label",
    "resolve_policies",
    "run_policy_sweep",
    "split_policy",
    "sweep_policy_names",
]

MAX_STORE_THRESHOLD = 1 << 20
"""Largest ``+tN`` (the manager's ``store_threshold`` bound)."""

PLOT_FEATURE = "drawing hit-rate curves (--plot, plot_sweep)"
"""What needs matplotlib, as :class:`kvoff._optional.MissingExtraError` names it."""

DEFAULT_SWEEP_POLICIES = ("lru", "arc", "probation", MIN_POLICY)
"""Policies of a sweep when ``--policies`` is not given: every engine policy, then MIN."""


def sweep_policy_names() -> tuple[str, ...]:
    """Names a sweep accepts: the registered eviction policies, then ``min``."""
    from kvoff import _scheduler

    return (*_scheduler.eviction_policies(), MIN_POLICY)


def parse_capacities(text: str) -> tuple[int, ...]:
    """Pool sizes from a comma-separated list of CPU block counts, e.g. ``1000,3000,10000``.

    Raises:
        ValueError: for an empty list, an item that is not a positive integer (naming it), or a
            repeated size.
    """
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ValueError(
            f"--sweep-capacity {text!r} has an empty item; give CPU block counts separated by "
            "commas, e.g. 1000,3000,10000"
        )
    sizes: list[int] = []
    for item in items:
        try:
            value = int(item.replace("_", ""))
        except ValueError:
            raise ValueError(
                f"--sweep-capacity item {item!r} is not an integer number of CPU blocks; "
                "e.g. 1000,3000,10000"
            ) from None
        if value < 1:
            raise ValueError(f"--sweep-capacity item {item!r} must be at least 1 CPU block")
        if value in sizes:
            raise ValueError(f"--sweep-capacity repeats {value}; give each pool size once")
        sizes.append(value)
    return tuple(sizes)


def split_policy(spec: str) -> tuple[str, int | None]:
    """``(policy, store_threshold)`` of a sweep policy: ``"lru"`` -> ``("lru", None)`` (the
    sweep's default threshold applies), ``"lru+t2"`` -> ``("lru", 2)``.

    Raises:
        ValueError: an unknown policy (listing the choices), a suffix that is not ``+t`` and an
            integer in [0, 2**20], or ``min`` with a threshold >= 2 (naming the item).
    """
    choices = sweep_policy_names()
    name, plus, suffix = spec.strip().lower().partition("+")
    if name not in choices:
        raise ValueError(f"unknown policy {name!r}; choose from: " + ", ".join(choices))
    if not plus:
        return name, None
    digits = suffix[1:] if suffix.startswith("t") else ""
    if not digits.isdigit() or int(digits) > MAX_STORE_THRESHOLD:
        raise ValueError(
            f"policy {spec!r}: write a store threshold as {name}+tN with N in 0..2**20 (e.g. "
            f"{name}+t2: store a block once it was offered twice)"
        )
    threshold = int(digits)
    if name == MIN_POLICY and threshold >= 2:
        why = "min is the offline optimum without an admission filter"
        raise ValueError(f"policy {spec!r}: {why}; drop its +tN")
    return name, threshold


def policy_label(policy: str, store_threshold: int) -> str:
    """A sweep row's name: ``policy``, or ``policy+tN`` when ``store_threshold`` N >= 2."""
    return f"{policy}+t{store_threshold}" if store_threshold >= 2 else policy


def resolve_policies(
    specs: Sequence[str], default_threshold: int = 0
) -> tuple[tuple[str, str, int], ...]:
    """``(label, policy, store_threshold)`` per sweep policy, a spec without ``+tN`` taking
    ``default_threshold`` (``min`` always 0).

    Raises:
        ValueError: a bad spec (see :func:`split_policy`), or two specs that name the same
            replay (e.g. ``lru+t2`` twice, or ``lru`` and ``lru+t2`` with a default of 2).
    """
    out: list[tuple[str, str, int]] = []
    for spec in specs:
        name, threshold = split_policy(spec)
        if threshold is None:
            threshold = 0 if name == MIN_POLICY else default_threshold
        label = policy_label(name, threshold)
        if any(label == seen for seen, _, _ in out):
            raise ValueError(
                f"policies {list(specs)!r} name the replay {label!r} twice (with the store "
                f"threshold {default_threshold} for names without +tN); give each once"
            )
        out.append((label, name, threshold))
    return tuple(out)


def parse_policies(text: str) -> tuple[str, ...]:
    """Policies from a comma-separated list, e.g. ``lru,arc,probation,min`` or
    ``lru,lru+t2,probation`` (``+tN``: that line's ``store_threshold``, see the module notes).

    Raises:
        ValueError: for an empty list, an unknown name (listing the choices), a bad ``+tN``,
            or a repeated item.
    """
    choices = sweep_policy_names()
    names = [item.strip().lower() for item in text.split(",")]
    if not text.strip() or any(not name for name in names):
        raise ValueError(
            f"--policies {text!r} has an empty item; give names separated by commas from: "
            + ", ".join(choices)
            + " (optionally with a store threshold: lru+t2)"
        )
    for name in names:
        try:
            split_policy(name)
        except ValueError as exc:
            raise ValueError(f"--policies: {exc}") from None
    if len(set(names)) != len(names):
        raise ValueError(f"--policies {text!r} repeats a policy; give each once")
    return tuple(names)


@dataclass(frozen=True)
class SweepPoint:
    """One replay of a sweep.

    Attributes:
        policy: the row's label: the eviction policy (or ``min``), ``+tN`` when it ran with a
            ``store_threshold`` N >= 2.
        cpu_blocks: CPU pool size in offloaded blocks.
        hit_rate: hit tokens / input tokens (GPU prefix cache and kvoff together).
        hit_tokens: tokens not recomputed.
        cpu_hit_tokens: tokens loaded from the CPU pool.
        evictions: blocks evicted from the CPU pool.
        stores_skipped: offloaded blocks not stored because ``prepare_store`` found no room.
        corrupted_blocks: loaded GPU blocks whose bytes were wrong (0 unless broken; MIN moves
            no bytes).
        wall_s: seconds the replay took.
        store_threshold: the manager's ``store_threshold`` (0: no admission filter).
        stores_filtered: offloaded blocks the admission filter skipped.
    """

    policy: str
    cpu_blocks: int
    hit_rate: float
    hit_tokens: int
    cpu_hit_tokens: int
    evictions: int
    stores_skipped: int
    corrupted_blocks: int
    wall_s: float
    store_threshold: int = 0
    stores_filtered: int = 0

    @classmethod
    def from_result(cls, result: ReplayResult) -> SweepPoint:
        """The point of one replay's totals."""
        return cls(
            policy=policy_label(result.policy, result.store_threshold),
            cpu_blocks=result.cpu_blocks,
            hit_rate=result.hit_rate,
            hit_tokens=result.hit_tokens,
            cpu_hit_tokens=result.cpu_hit_tokens,
            evictions=result.evictions,
            stores_skipped=result.stores_skipped,
            corrupted_blocks=result.corrupted_blocks,
            wall_s=result.wall_s,
            store_threshold=result.store_threshold,
            stores_filtered=result.stores_filtered,
        )


@dataclass(frozen=True)
class PolicySweep:
    """Hit rates of every policy at every pool size on one trace.

    Attributes:
        config: the replay options shared by every point (``cpu_blocks``, ``policy`` and
            ``store_threshold`` are those of the first point; each point has its own).
        capacities: pool sizes, CPU blocks, in sweep order.
        policies: the rows' labels (:attr:`SweepPoint.policy`), in sweep order.
        requests: requests replayed.
        input_tokens: input tokens replayed.
        max_hit_rate: the full-block maximum (an unbounded pool: every full block seen before
            is a hit).
        points: one per (policy, capacity), policies outer.
    """

    config: ReplayConfig
    capacities: tuple[int, ...]
    policies: tuple[str, ...]
    requests: int
    input_tokens: int
    max_hit_rate: float
    points: tuple[SweepPoint, ...]

    def point(self, policy: str, cpu_blocks: int) -> SweepPoint:
        """The point of ``policy`` at ``cpu_blocks``.

        Raises:
            KeyError: when the sweep has no such point.
        """
        for p in self.points:
            if p.policy == policy and p.cpu_blocks == cpu_blocks:
                return p
        raise KeyError(f"no point for policy {policy!r} at {cpu_blocks} CPU blocks")

    def gap_closed(
        self, policy: str, cpu_blocks: int, baseline: str = "lru", reference: str = MIN_POLICY
    ) -> float | None:
        """``(policy - baseline) / (reference - baseline)`` in hit rate at ``cpu_blocks``: the
        fraction of the gap from the baseline to the offline optimum that ``policy`` closes.
        ``None`` when the sweep lacks one of the three or the gap is 0.
        """
        try:
            h = self.point(policy, cpu_blocks).hit_rate
            b = self.point(baseline, cpu_blocks).hit_rate
            r = self.point(reference, cpu_blocks).hit_rate
        except KeyError:
            return None
        return None if r == b else (h - b) / (r - b)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the options, then per policy the hit rate at each capacity, the points,
        and per policy and capacity the gap closed from ``lru`` to ``min`` (when both ran)."""
        gaps = {
            p: {str(c): self.gap_closed(p, c) for c in self.capacities}
            for p in self.policies
            if p not in ("lru", MIN_POLICY)
        }
        return {
            "config": dataclasses.asdict(self.config)
            | {"cpu_blocks": None, "policy": None, "store_threshold": None},
            "capacities": list(self.capacities),
            "policies": list(self.policies),
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "max_hit_rate": self.max_hit_rate,
            "hit_rate": {
                p: {str(c): self.point(p, c).hit_rate for c in self.capacities}
                for p in self.policies
            },
            "gap_closed_lru_to_min": gaps
            if "lru" in self.policies and MIN_POLICY in self.policies
            else {},
            "points": [dataclasses.asdict(p) for p in self.points],
        }


def run_policy_sweep(
    base: ReplayConfig,
    capacities: Sequence[int],
    policies: Sequence[str],
    requests: list[TraceRequest] | None = None,
    log: Callable[[str], None] | None = None,
) -> PolicySweep:
    """Replays ``base`` once per policy and pool size (``cpu_blocks`` replaced, ``cpu_bytes``
    cleared); see the module docstring.

    Args:
        base: the shared replay options; ``base.store_threshold`` applies to policies without
            ``+tN``.
        capacities: pool sizes in CPU blocks (see :func:`parse_capacities`).
        policies: names from :func:`sweep_policy_names`, each optionally with ``+tN`` (see
            the module notes).
        requests: already loaded requests (else the trace is read once).
        log: called with a line after each replay.

    Raises:
        ValueError: for no capacities or policies, an unknown policy or a bad ``+tN`` (see
            :func:`resolve_policies`), a capacity < 1, a disk or remote tier (the points must
            start empty), ``min`` with ``engines > 1``, or a bad replay configuration (see
            :func:`kvoff.tools.replay.run_replay`).
    """
    if not capacities:
        raise ValueError("a sweep needs at least one capacity (CPU blocks)")
    if not policies:
        raise ValueError("a sweep needs at least one policy")
    specs = resolve_policies(policies, base.store_threshold)
    for c in capacities:
        if c < 1:
            raise ValueError(f"capacity {c} CPU blocks is not positive; every pool needs >= 1")
    if base.disk_path is not None or base.remote_url is not None:
        # the tiers outlive a replay: later points would hit what earlier points left there
        raise ValueError(
            "a sweep replays every point on an empty CPU pool; a disk or remote tier would keep "
            "the blocks of earlier points; drop --disk-path and --remote-url (and KVOFF_DISK_PATH "
            "/ KVOFF_REMOTE_URL) or replay each point with kvoff replay"
        )
    if any(name == MIN_POLICY for _, name, _ in specs) and base.engines > 1:
        raise ValueError(
            "policy 'min' simulates one CPU pool offline; drop the tiers and --engines"
        )
    if requests is None:
        requests = load_trace(base.trace, base.limit, base.trace_block_size)
    points: list[SweepPoint] = []
    max_hit_rate = 0.0
    input_tokens = 0
    n_requests = 0
    for label, policy, threshold in specs:
        for c in capacities:
            config = dataclasses.replace(
                base, cpu_blocks=c, cpu_bytes=None, policy=policy, store_threshold=threshold
            )
            if policy == MIN_POLICY:
                result = run_min_replay(config, requests=requests)
            else:
                result = run_replay(config, requests=requests)
            points.append(SweepPoint.from_result(result))
            max_hit_rate = result.max_hit_rate
            input_tokens = result.input_tokens
            n_requests = result.requests
            if log is not None:
                log(
                    f"{label:>10} {c:>9,} CPU blocks: hit rate {result.hit_rate:.4f} "
                    f"({result.wall_s:.1f} s)"
                )
    return PolicySweep(
        config=dataclasses.replace(base, cpu_blocks=capacities[0], cpu_bytes=None),
        capacities=tuple(capacities),
        policies=tuple(label for label, _, _ in specs),
        requests=n_requests,
        input_tokens=input_tokens,
        max_hit_rate=max_hit_rate,
        points=tuple(points),
    )


def format_sweep_table(sweep: PolicySweep) -> str:
    """The hit rates as a text table (policies as rows, capacities as columns), then, when
    ``lru`` and ``min`` ran, the gap from LRU to MIN that each other policy closes."""
    cols = [f"{c:,}" for c in sweep.capacities]
    width = max(9, *(len(c) for c in cols))
    name_w = max(10, *(len(p) for p in sweep.policies))
    lines = [
        f"hit rate (hit tokens / input tokens) on {sweep.requests:,} requests of trace "
        f"{sweep.config.trace!r}; full-block maximum {sweep.max_hit_rate:.4f}",
        f"{'CPU blocks':<{name_w}}" + "".join(f"{c:>{width + 2}}" for c in cols),
    ]
    for p in sweep.policies:
        row = "".join(f"{sweep.point(p, c).hit_rate:>{width + 2}.4f}" for c in sweep.capacities)
        lines.append(f"{p:<{name_w}}" + row)
    others = [p for p in sweep.policies if p not in ("lru", MIN_POLICY)]
    if "lru" in sweep.policies and MIN_POLICY in sweep.policies and others:
        lines.append("gap closed from lru to min: (policy - lru) / (min - lru)")
        for p in others:
            cells = []
            for c in sweep.capacities:
                g = sweep.gap_closed(p, c)
                cells.append(f"{'-' if g is None else f'{g:.3f}':>{width + 2}}")
            lines.append(f"{p:<{name_w}}" + "".join(cells))
    return "\n".join(lines)


def plot_sweep(sweep: PolicySweep, path: str | Path) -> None:
    """Draws the hit-rate curves (hit rate against CPU blocks, log scale; one line per policy,
    MIN dashed, the full-block maximum dotted) into the image file ``path`` (PNG, SVG, PDF:
    by its suffix) with matplotlib's non-interactive Agg backend.

    Raises:
        kvoff._optional.MissingExtraError: when matplotlib is not installed (an ``ImportError`` that
            names ``pip install "kvoff[plot]"``).
        ValueError: when matplotlib cannot write that file type.
    """
    with extra_imports("matplotlib", PLOT_FEATURE):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.5), dpi=120)
    try:
        xs = list(sweep.capacities)
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        for p in sweep.policies:
            ys = [sweep.point(p, xs[i]).hit_rate for i in order]
            style = "--" if p == MIN_POLICY else ":" if "+t" in p else "-"
            label = "Belady MIN (offline)" if p == MIN_POLICY else p
            ax.plot([xs[i] for i in order], ys, style, marker="o", label=label)
        ax.axhline(sweep.max_hit_rate, color="gray", linestyle=":", label="unbounded pool")
        ax.set_xscale("log")
        ax.set_xlabel("CPU pool size (offloaded blocks)")
        ax.set_ylabel("hit rate (hit tokens / input tokens)")
        ob = sweep.config.offloaded_block_size
        ax.set_title(
            f"kvoff replay, trace {Path(sweep.config.trace).stem!r}: {sweep.requests:,} "
            f"requests, {ob}-token blocks"
        )
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="best")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
