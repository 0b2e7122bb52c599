"""Prometheus metrics of a node pool (``kvoff pool serve --metrics-port PORT``): the pool's
blocks, and per engine what it looked up, hit, stored and loaded, so a dashboard shows which
engine stored what.

Served by ``prometheus_client`` (the ``metrics`` extra) on its own HTTP thread. A scrape asks the
pool's serving thread for a snapshot (:meth:`NodePoolServer.call_soon`: the index is never
read while it changes) without the key filter's scan, so it costs the engines' calls a few
microseconds. A pool that does not answer within :data:`SCRAPE_TIMEOUT_S` reports
``kvoff_pool_up 0`` and nothing else.

Metrics (blocks are offloaded blocks, one slot each; ``engine`` is the name an engine attached
with, ``<engine id>-rank<r>`` for vLLM's, and ``pid`` its process id):

=====================================================  =======  ==============================
name                                                   type     what
=====================================================  =======  ==============================
``kvoff_pool_up``                                      gauge    1 when the pool answered
``kvoff_pool_slots``                                   gauge    slots of the pool
``kvoff_pool_slot_bytes``                              gauge    bytes per slot (one rank's)
``kvoff_pool_blocks{state}``                           gauge    slots by state: ``stored``,
                                                                ``free``, ``pending`` (being
                                                                stored), ``reserved`` (for
                                                                engines' stores), ``evictable``
``kvoff_pool_evictions_total``                         counter  blocks evicted
``kvoff_pool_leases_lapsed_total``                     counter  leased blocks never loaded
``kvoff_pool_reserved_stores_total``                   counter  stores into reserved slots
``kvoff_pool_engines_attached``                        gauge    engines connected now
``kvoff_pool_engines_seen_total``                      counter  connections accepted
``kvoff_pool_connections_refused_total``               counter  refused (another user)
``kvoff_pool_engine_looked_up_blocks_total{engine,pid}``  counter  keys this engine looked up
``kvoff_pool_engine_hit_blocks_total{engine,pid}``     counter  of them, hits
``kvoff_pool_engine_stored_blocks_total{engine,pid}``  counter  blocks it stored
``kvoff_pool_engine_loaded_blocks_total{engine,pid}``  counter  blocks it loaded
``kvoff_pool_engine_leased_blocks{engine,pid}``        gauge    blocks leased to it now
``kvoff_pool_engine_pinned_blocks{engine,pid}``        gauge    pins it holds now
``kvoff_pool_tier{tier,stat}``                         gauge    the tiers' counters below the
                                                                pool (``kvoff pool status``'s
                                                                ``tiers``), one series each
=====================================================  =======  ==============================

An engine's counters start at 0 when it attaches and go with its connection (a restarted
engine is a new series: its pid differs).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from kvoff._optional import require

__all__ = ["SCRAPE_TIMEOUT_S", "PoolCollector", "serve_metrics"]

SCRAPE_TIMEOUT_S = 2.0
"""Seconds a scrape waits for the pool's serving thread (it answers within its poll period,
a few milliseconds to ``lease_s / 4`` when idle)."""

_ENGINE_COUNTERS = (
    ("looked_up_blocks", "Keys this engine looked up in the node pool, in blocks"),
    ("hit_blocks", "Keys this engine looked up that were hits, in blocks"),
    ("stored_blocks", "Blocks this engine stored into the node pool"),
    ("loaded_blocks", "Blocks this engine loaded from the node pool"),
)
_ENGINE_GAUGES = (
    ("leased_blocks", "Blocks leased to this engine now (looked up, not loaded yet)"),
    ("pinned_blocks", "Pins this engine holds now (loads in flight)"),
)
_POOL_COUNTERS = (
    ("evictions", "Blocks the node pool evicted"),
    ("leases_lapsed", "Leased blocks whose engine never loaded them"),
    ("reserved_stores", "Stores into slots reserved for the storing engine"),
    ("engines_seen", "Connections the node pool accepted"),
    ("connections_refused", "Connections refused (a peer of another user or group)"),
)
_STATES = ("stored", "free", "pending", "reserved", "evictable")


class PoolCollector:
    """A ``prometheus_client`` collector of a :class:`~kvoff.node_pool.NodePoolServer`'s
    metrics (module docstring), read from the pool's serving thread at each scrape.

    Args:
        server: the pool (serving in another thread: its ``serve_forever`` runs the
            snapshot between two rounds).
        timeout_s: seconds a scrape waits for that thread.

    Raises:
        kvoff._optional.MissingExtraError: ``prometheus_client`` is not installed (``pip
            install "kvoff[metrics]"``).
    """

    def __init__(self, server: Any, timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        self._core = require("prometheus_client.core", "the node pool's Prometheus metrics")
        self.server = server
        self.timeout_s = timeout_s

    def _snapshot(self) -> dict[str, Any] | None:
        done = threading.Event()
        out: dict[str, Any] = {}

        def read() -> None:
            out.update(self.server.status(scan_key_filter=False))
            done.set()

        self.server.call_soon(read)
        return out if done.wait(self.timeout_s) else None

    def collect(self) -> Iterator[Any]:
        """The metric families of one scrape (called by ``prometheus_client``)."""
        core = self._core
        st = self._snapshot()
        yield core.GaugeMetricFamily(
            "kvoff_pool_up", "1 when the node pool answered the scrape", value=int(st is not None)
        )
        if st is None:
            return
        yield core.GaugeMetricFamily("kvoff_pool_slots", "Slots of the node pool",
                                     value=st["num_slots"])  # fmt: skip
        yield core.GaugeMetricFamily("kvoff_pool_slot_bytes", "Bytes of one slot (one rank's)",
                                     value=st["slot_bytes"])  # fmt: skip
        blocks = core.GaugeMetricFamily("kvoff_pool_blocks", "Slots of the node pool by state",
                                        labels=["state"])  # fmt: skip
        for state in _STATES:
            blocks.add_metric([state], st[f"{state}_blocks"])
        yield blocks
        for name, doc in _POOL_COUNTERS:
            yield core.CounterMetricFamily(f"kvoff_pool_{name}", doc, value=st[name])
        yield core.GaugeMetricFamily("kvoff_pool_engines_attached", "Engines connected now",
                                     value=st["engines_attached"])  # fmt: skip
        engines = [e for e in st["engines"] if e["name"] != "kvoff pool status"]
        per_engine = [(core.CounterMetricFamily, f, d) for f, d in _ENGINE_COUNTERS] + [
            (core.GaugeMetricFamily, f, d) for f, d in _ENGINE_GAUGES
        ]
        for kind, field, doc in per_engine:
            family = kind(f"kvoff_pool_engine_{field}", doc, labels=["engine", "pid"])
            for e in engines:
                family.add_metric([e["name"], str(e["pid"])], e[field])
            yield family
        tiers = (st.get("tiers") or {}).get("tiers") or {}
        if tiers:
            family = core.GaugeMetricFamily(
                "kvoff_pool_tier", "Counters of the tiers below the node pool (kvoff pool "
                "status's tiers)", labels=["tier", "stat"],
            )  # fmt: skip
            for tier, stats in sorted(tiers.items()):
                for stat, value in sorted(stats.items()):
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        family.add_metric([tier, stat], value)
            yield family


def serve_metrics(server: Any, port: int, host: str = "127.0.0.1") -> tuple[Any, Any]:
    """Serves ``server``'s metrics on ``http://host:port/metrics`` from a daemon thread, with a
    registry of their own (no process metrics of this Python); returns ``(httpd, thread)``:
    ``httpd.server_port`` is the port (``port=0``: a free one), ``httpd.shutdown()`` stops it.

    Raises:
        kvoff._optional.MissingExtraError: ``prometheus_client`` is not installed.
        OSError: the address cannot be bound (in use, or not this machine's).
    """
    registry_mod = require("prometheus_client.registry", "the node pool's Prometheus metrics")
    exposition = require("prometheus_client.exposition", "the node pool's Prometheus metrics")
    registry = registry_mod.CollectorRegistry()
    registry.register(PoolCollector(server))
    return exposition.start_http_server(port, addr=host, registry=registry)
