"""The node pool's Prometheus metrics (``kvoff pool serve --metrics-port``), scraped over HTTP
from a real pool: which engine looked up, hit, stored and loaded what."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from node_pool_harness import Served

from kvoff.node_pool import NodePoolClient

prometheus_parser = pytest.importorskip(
    "prometheus_client.parser", reason="prometheus-client (kvoff[metrics]) is not installed"
)

FP = b"model=tiny;layout=layer_major;rank=0"


def _keys(*ids: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in ids]


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_say_which_engine_stored_and_loaded_what(tmp_path: Path) -> None:
    from kvoff.node_pool.metrics import serve_metrics

    served = Served(tmp_path / "pool.sock", f"kvoff-test-np-metrics-{os.getpid()}")
    httpd = None
    try:
        a = NodePoolClient(served.socket, FP, name="engine-a")
        b = NodePoolClient(served.socket, FP, name="engine-b")
        out = a.prepare_store(_keys(1, 2, 3))
        a.complete_store(out.keys_to_store)
        a.flush()
        assert b.lookup(_keys(1)) == 1 and b.lookup(_keys(9)) == 0
        b.prepare_load(_keys(1))  # in flight: a pin of b's
        httpd, _ = serve_metrics(served.server, 0)
        m = _scrape(httpd.server_port)
        pid = (("engine", "engine-a"), ("pid", str(os.getpid())))
        pid_b = (("engine", "engine-b"), ("pid", str(os.getpid())))
        assert m[("kvoff_pool_up", ())] == 1
        assert m[("kvoff_pool_slots", ())] == 16
        assert m[("kvoff_pool_engine_stored_blocks_total", pid)] == 3
        assert m[("kvoff_pool_engine_stored_blocks_total", pid_b)] == 0
        assert m[("kvoff_pool_engine_loaded_blocks_total", pid_b)] == 1
        assert m[("kvoff_pool_engine_pinned_blocks", pid_b)] == 1
        assert m[("kvoff_pool_engine_hit_blocks_total", pid_b)] >= 1
        assert m[("kvoff_pool_blocks", (("state", "stored"),))] == 3
        assert m[("kvoff_pool_blocks", (("state", "free"),))] == 13
        assert m[("kvoff_pool_engines_attached", ())] == 2
        b.complete_load(_keys(1))
        b.close()
        time.sleep(0.05)  # the pool handles the close
        m = _scrape(httpd.server_port)
        assert ("kvoff_pool_engine_stored_blocks_total", pid_b) not in m  # gone with it
        assert m[("kvoff_pool_engines_attached", ())] == 1
        served.stop()  # a pool that no longer answers: up 0, nothing else
        m = _scrape(httpd.server_port)
        assert m == {("kvoff_pool_up", ()): 0}
    finally:
        if httpd is not None:
            httpd.shutdown()
        served.stop()


def test_serve_with_a_taken_metrics_port_fails_clearly_and_leaves_nothing(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    region = f"kvoff-test-np-metrics-port-{os.getpid()}"
    port = taken.getsockname()[1]
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvoff", "pool", "serve", "--slots", "4", "--slot-bytes",
             "4096", "--socket", str(tmp_path / "p.sock"), "--region", region,
             "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        taken.close()
    assert proc.returncode != 0, proc.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}: Address already in use" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "p.sock").exists() and not Path("/dev/shm", region).exists()
    bad = subprocess.run(
        [sys.executable, "-m", "kvoff", "pool", "serve", "--slots", "4", "--slot-bytes", "4096",
         "--metrics-port", "70000"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "'70000' is not a TCP port (0..65535)" in bad.stderr
