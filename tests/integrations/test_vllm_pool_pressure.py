"""Reuse under CPU pool pressure, through both ways into a real vLLM engine (issue 53).

One engine is given the first ``N`` requests of the bundled conversation trace and then the
same ``N`` again, in one ``generate`` call (``N`` prompts of at most 40 hash ids × 16 tokens,
greedy, ``MAX_TOKENS`` output tokens each, 32-token blocks, a GPU cache of 160 blocks so the
engine's own prefix cache holds little). The second pass can load from kvoff's CPU pool every
full prompt block the first pass stored.

The pool under pressure (``POOL_BYTES``) holds every full prompt block of the first pass, but
not those and the blocks decode fills too. Decode blocks are never reused here (the repeated
prompts do not contain the earlier outputs), so a pool that also stores them must evict
prompt blocks, and on a repeated sequence LRU then evicts the very blocks the next requests
need. vLLM 0.32's OffloadingConnector stores prompt blocks only (its ``offload_prompt_only``
default), and so does KvoffConnector by default (``OffloadingConfig.offload_prompt_only``).
KvoffConnector storing decode blocks too keeps 22,528 external hit tokens here against 24,704
with prompt blocks only (2026-11-28), and with recency at load time as well (as before issue 53)
about a tenth of an ample pool's hits in the larger run of docs/vllm.md.

Reuse is vLLM's own count, ``vllm:external_prefix_cache_hits`` (tokens loaded from the
connector). Outputs must be token-identical to full recompute (no connector, no prefix
caching) in every run.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from kvoff.tools.traces import resolve_trace

pytestmark = pytest.mark.vllm

N = 80
MAX_TOKENS = 32
BLOCK = 32
# tiny llama (conftest): 4 layers × (K, V) × 32 tokens × 2 KV heads × 64 × 4 bytes per block
GPU_BLOCK_BYTES = 4 * 2 * BLOCK * 2 * 64 * 4
PROMPT_BLOCKS = 772  # distinct full prompt blocks of the first pass (checked below)
DECODE_BLOCKS = 80  # full blocks decode fills in the first pass (checked below)
POOL_BLOCKS = 800  # holds the prompt blocks, not the prompt and decode blocks together
POOL_BYTES = POOL_BLOCKS * GPU_BLOCK_BYTES
AMPLE_BYTES = 1 << 30


def _prompts() -> list[list[int]]:
    from kvoff.tools.replay_vllm import prompt_tokens

    out = []
    with resolve_trace("conversation").open() as fh:
        for line in itertools.islice(fh, N):
            r = json.loads(line)
            ids = r["hash_ids"][:40]
            out.append(prompt_tokens(ids, min(r["input_length"], 40 * 512), 16))
    return out


PROMPTS = _prompts()


def _plan(model: str, connector: str, pool_bytes: int | None) -> dict[str, Any]:
    engine: dict[str, Any] = {
        "block_size": BLOCK, "num_gpu_blocks_override": 160, "max_num_seqs": 32,
        "max_model_len": 2048,
    }  # fmt: skip
    if connector == "none":
        engine["enable_prefix_caching"] = False
    return {
        "model": model, "connector": connector, "engine": engine,
        "extra": {} if pool_bytes is None else {"cpu_bytes_to_use": pool_bytes},
        "phases": [{"prompts": PROMPTS + PROMPTS, "max_tokens": MAX_TOKENS, "ignore_eos": True}],
    }  # fmt: skip


@pytest.fixture(scope="module")
def runs(run_engine, tiny_models) -> dict[str, dict[str, Any]]:
    model = str(tiny_models["llama"])
    return {
        "reference": run_engine(_plan(model, "none", None)),
        "kvoff": run_engine(_plan(model, "kvoff", POOL_BYTES)),
        "spec": run_engine(_plan(model, "spec", POOL_BYTES)),
        "ample": run_engine(_plan(model, "kvoff", AMPLE_BYTES)),
    }


def _external(result: dict[str, Any]) -> float:
    return result["phases"][0]["metrics"].get("vllm:external_prefix_cache_hits", 0)


def test_the_scenario_puts_the_pool_under_pressure_only_with_decode_blocks() -> None:
    """The pool sizes the scenario relies on: it holds every full prompt block of the first
    pass, and not those with the full blocks decode adds."""
    blocks = {tuple(p[: (j + 1) * BLOCK]) for p in PROMPTS for j in range(len(p) // BLOCK)}
    decode = sum((len(p) + MAX_TOKENS) // BLOCK - len(p) // BLOCK for p in PROMPTS)
    assert (len(blocks), decode) == (PROMPT_BLOCKS, DECODE_BLOCKS)
    assert PROMPT_BLOCKS < POOL_BLOCKS < PROMPT_BLOCKS + DECODE_BLOCKS


def test_both_ways_in_keep_the_reuse_of_an_ample_pool_under_pressure(runs) -> None:
    ample, kvoff, spec = (_external(runs[k]) for k in ("ample", "kvoff", "spec"))
    assert runs["kvoff"]["cpu_blocks"] == runs["spec"]["cpu_blocks"] == POOL_BLOCKS
    # the second pass finds most of its prompt tokens in an ample pool
    second_pass_tokens = sum(len(p) // BLOCK * BLOCK for p in PROMPTS)
    assert ample >= 0.8 * second_pass_tokens, (ample, second_pass_tokens)
    assert kvoff >= spec >= 0.9 * ample, {"kvoff": kvoff, "spec": spec, "ample": ample}


def test_outputs_stay_token_identical_to_full_recompute(runs) -> None:
    reference = runs["reference"]["phases"][0]["outputs"]
    for name in ("kvoff", "spec", "ample"):
        assert runs[name]["phases"][0]["outputs"] == reference, name


def test_kvoff_stores_no_block_that_decode_fills_by_default(runs) -> None:
    """offload_prompt_only (the default): the connector stores the first pass's prompt blocks
    and nothing decode fills; the second pass loads its prompts and stores nothing new."""
    stored = runs["ample"]["phases"][0]["kvoff"]["blocks_stored"]
    assert stored == PROMPT_BLOCKS
