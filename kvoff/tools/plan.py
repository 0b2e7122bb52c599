"""``kvoff plan``: what fits — GPU blocks, CPU blocks and the max model length of a model.

Model presets (per-rank KV shapes), a JSON layer-spec file format, the plan computation
(:func:`compute_plan`: :func:`kvoff.get_kv_cache_config` then :class:`kvoff.CPUOffloadingSpec`)
and its text / JSON rendering.

Specs file format (JSON)::

    {"layers": [
      {"type": "full_attention", "count": 30, "block_size": 16, "num_kv_heads": 8,
       "head_size": 128, "dtype": "bf16"},
      {"type": "sliding_window", "name": "swa", "count": 2, "block_size": 16,
       "num_kv_heads": 8, "head_size": 128, "dtype": "bf16", "sliding_window": 4096},
      {"type": "mla", "block_size": 64, "num_kv_heads": 1, "head_size": 576, "dtype": "bf16"},
      {"type": "mamba", "block_size": 80, "shapes": [[8192, 3], [8192, 16]],
       "dtypes": ["bf16", "bf16"], "page_size_padded": 327680}
    ]}

``type`` is one of ``full_attention``, ``sliding_window``, ``mla``, ``mamba``; the other keys
are the spec's constructor arguments. ``count`` (default 1) repeats the entry. Layer names are
``name`` (a single layer) or ``name.0 .. name.{count-1}``; without ``name`` they are
``layers.{i}`` by position in the file. A bare list instead of ``{"layers": [...]}`` is accepted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvoff.kv_cache_config import get_kv_cache_config, pool_bytes_per_block
from kvoff.offloading_spec import CPUOffloadingSpec
from kvoff.pinned import SHM_DIR, SHM_HEADER_BYTES
from kvoff.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

__all__ = [
    "PLAN_PRESETS",
    "Plan",
    "PlanPreset",
    "compute_plan",
    "load_specs_file",
    "specs_from_json",
]

_SPEC_TYPES: dict[str, type] = {
    "full_attention": FullAttentionSpec,
    "sliding_window": SlidingWindowSpec,
    "mla": MLAAttentionSpec,
    "mamba": MambaSpec,
}


@dataclass(frozen=True)
class PlanPreset:
    """A model's per-rank KV cache layout for ``kvoff plan``.

    Attributes:
        name: preset name (``--model``).
        description: the model and where its numbers come from.
        build: returns layer name → spec, in layer order.
    """

    name: str
    description: str
    build: Callable[[], dict[str, KVCacheSpec]]

    def layer_specs(self) -> dict[str, KVCacheSpec]:
        """Layer name → spec of the preset (a fresh dict)."""
        return self.build()


def _uniform(num_layers: int, spec: KVCacheSpec) -> Callable[[], dict[str, KVCacheSpec]]:
    return lambda: {f"layers.{i}": spec for i in range(num_layers)}


def _gemma3_27b() -> dict[str, KVCacheSpec]:
    # config.json (text_config): num_hidden_layers 62, num_key_value_heads 16, head_dim 128,
    # sliding_window 1024, sliding_window_pattern 6 (5 local layers, then 1 global), bf16.
    # Layer i is global (full attention) when (i + 1) % 6 == 0: layers 5, 11, ..., 59 → 10 full,
    # 52 sliding-window layers.
    full = FullAttentionSpec(16, 16, 128, torch.bfloat16)
    local = SlidingWindowSpec(16, 16, 128, torch.bfloat16, 1024)
    return {f"layers.{i}": full if (i + 1) % 6 == 0 else local for i in range(62)}


def _jamba_v01() -> dict[str, KVCacheSpec]:
    # Jamba-v0.1 config.json: num_hidden_layers 32, attn_layer_period 8, attn_layer_offset 4
    # (attention at layers 4, 12, 20, 28; the other 28 are Mamba), num_key_value_heads 8,
    # hidden_size 4096 / num_attention_heads 32 = head 128, mamba_expand 2 (d_inner 8192),
    # mamba_d_conv 4, mamba_d_state 16, bf16 (state cache in the model dtype).
    # Mamba state: conv (8192, 3) + ssm (8192, 16) in bf16 = 49,152 + 262,144 = 311,296 bytes.
    # Attention needs 2 × 8 × 128 × 2 = 4,096 bytes per token: block_size 80 (the first
    # multiple of 16 with 80 × 4,096 = 327,680 >= 311,296); the Mamba page is padded to 327,680.
    attn = FullAttentionSpec(80, 8, 128, torch.bfloat16)
    mamba = MambaSpec(80, ((8192, 3), (8192, 16)), (torch.bfloat16, torch.bfloat16), 327_680)
    return {f"layers.{i}": attn if i % 8 == 4 else mamba for i in range(32)}


PLAN_PRESETS: dict[str, PlanPreset] = {
    p.name: p
    for p in (
        PlanPreset(
            "llama-3-8b",
            "Llama-3-8B (config.json: num_hidden_layers 32, num_key_value_heads 8, head_dim "
            "4096/32 = 128, bfloat16): 32 full-attention layers, 16-token blocks, 64 KiB pages",
            _uniform(32, FullAttentionSpec(16, 8, 128, torch.bfloat16)),
        ),
        PlanPreset(
            "qwen3-32b",
            "Qwen3-32B (config.json: num_hidden_layers 64, num_key_value_heads 8, head_dim 128, "
            "bfloat16): 64 full-attention layers, 16-token blocks, 64 KiB pages",
            _uniform(64, FullAttentionSpec(16, 8, 128, torch.bfloat16)),
        ),
        PlanPreset(
            "gemma-3-27b",
            "Gemma-3-27B (config.json: 62 layers, 5:1 sliding-window:full, sliding_window 1024, "
            "16 KV heads, head_dim 128, bfloat16): 52 sliding-window + 10 full layers, "
            "16-token blocks, 128 KiB pages",
            _gemma3_27b,
        ),
        PlanPreset(
            "deepseek-v3",
            "DeepSeek-V3 (config.json: num_hidden_layers 61, kv_lora_rank 512 + "
            "qk_rope_head_dim 64 = 576, bfloat16): 61 MLA layers, one 576-element latent per "
            "token, 64-token blocks (FlashMLA), 72 KiB pages",
            _uniform(61, MLAAttentionSpec(64, 1, 576, torch.bfloat16)),
        ),
        PlanPreset(
            "jamba-v0.1",
            "Jamba-v0.1 (config.json: 32 layers, attention every 8th from layer 4, 8 KV heads, "
            "head 128, Mamba d_inner 8192, d_conv 4, d_state 16, bfloat16): 4 attention + 28 "
            "Mamba layers, 80-token blocks, Mamba states padded to the 320 KiB attention page",
            _jamba_v01,
        ),
    )
}


def specs_from_json(data: Any) -> dict[str, KVCacheSpec]:
    """Layer name → spec from the parsed specs-file JSON (format in this module's docstring).

    Raises:
        ValueError: for a malformed file, an unknown ``type`` (the choices are listed), a bad
            or unknown spec argument, a bad ``count`` or a repeated layer name.
    """
    layers = data.get("layers") if isinstance(data, Mapping) else data
    if not isinstance(layers, list) or not layers:
        raise ValueError(
            'the specs file must be {"layers": [...]} (or a list) with at least one layer entry'
        )
    specs: dict[str, KVCacheSpec] = {}
    for index, entry in enumerate(layers):
        if not isinstance(entry, Mapping):
            raise ValueError(f"layer entry {index} is not a JSON object: {entry!r}")
        args = dict(entry)
        kind = args.pop("type", None)
        if kind not in _SPEC_TYPES:
            raise ValueError(
                f"layer entry {index}: unknown type {kind!r}; use one of {sorted(_SPEC_TYPES)}"
            )
        count = args.pop("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"layer entry {index}: count must be an int >= 1, got {count!r}")
        name = args.pop("name", None)
        try:
            spec = _SPEC_TYPES[kind](**args)
        except TypeError as exc:
            raise ValueError(f"layer entry {index} ({kind}): {exc}") from None
        except ValueError as exc:
            raise ValueError(f"layer entry {index} ({kind}): {exc}") from None
        for k in range(count):
            if name is None:
                layer = f"layers.{len(specs)}"
            else:
                layer = str(name) if count == 1 else f"{name}.{k}"
            if layer in specs:
                raise ValueError(f"layer entry {index}: layer name {layer!r} is used twice")
            specs[layer] = spec
    return specs


def load_specs_file(path: str | Path) -> dict[str, KVCacheSpec]:
    """Read a JSON specs file (format in this module's docstring).

    Raises:
        FileNotFoundError: when the file does not exist.
        ValueError: for invalid JSON or content (see :func:`specs_from_json`).
    """
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    return specs_from_json(data)


def _kind(spec: KVCacheSpec) -> str:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        first = next(iter(spec.kv_cache_specs.values()))
        return f"per-layer pages ({_kind(first)})"
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding_window({spec.sliding_window})"
    return {
        FullAttentionSpec: "full_attention",
        MLAAttentionSpec: "mla",
        MambaSpec: "mamba",
    }[type(spec)]


@dataclass(frozen=True)
class Plan:
    """The result of :func:`compute_plan`.

    Attributes:
        kv_cache_config: the GPU plan (one rank).
        cpu: the CPU plan (pool over all ranks).
        source: the preset name or specs file it was computed for.
    """

    kv_cache_config: KVCacheConfig
    cpu: CPUOffloadingSpec
    source: str

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (bytes and tokens as ints)."""
        config = self.kv_cache_config
        groups = [
            {
                "index": i,
                "kind": _kind(g.kv_cache_spec),
                "num_layers": len(g.layer_names),
                "layers": list(g.layer_names),
                "block_size": g.kv_cache_spec.block_size,
                "page_size_bytes": g.kv_cache_spec.page_size_bytes,
                "max_num_blocks": g.kv_cache_spec.max_num_blocks(config.max_model_len or 1),
            }
            for i, g in enumerate(config.kv_cache_groups)
        ]
        gpu_bs = self.cpu.gpu_block_size[0]
        return {
            "source": self.source,
            "groups": groups,
            "num_tensors": len(config.kv_cache_tensors),
            "gpu": {
                "num_blocks": config.num_blocks,
                "block_size": gpu_bs,
                "tokens": config.num_blocks * gpu_bs,
                "pool_bytes_per_block": pool_bytes_per_block(config.kv_cache_groups),
                "total_bytes": config.total_bytes,
            },
            "cpu": {
                "num_blocks": self.cpu.num_blocks,
                "offloaded_block_size": self.cpu.offloaded_block_size,
                "block_size_factor": self.cpu.block_size_factor,
                "tokens": self.cpu.num_tokens,
                "kv_bytes_per_block": self.cpu.kv_bytes_per_block,
                "bytes_per_rank": self.cpu.num_blocks * self.cpu.bytes_per_offloaded_block,
                "cpu_bytes_to_use": self.cpu.cpu_bytes_to_use,
                "world_size": self.cpu.world_size,
                "eviction_policy": self.cpu.eviction_policy,
                # with secondary tiers, every rank's pool lives in /dev/shm
                # (kvoff.pinned.HostPool) when the workers run in processes of their own
                # (KvoffConnector under vLLM's "mp" executor) and always under vLLM's
                # OffloadingConnector (KvoffOffloadingSpec): the pools plus one header page each
                "shared_memory_bytes": self.cpu.world_size
                * (self.cpu.num_blocks * self.cpu.bytes_per_offloaded_block + SHM_HEADER_BYTES),
            },
            "max_model_len": config.max_model_len,
        }

    def format(self) -> str:
        """The plan as human-readable text."""
        d = self.to_dict()
        gib = 2**30
        lines = [f"kvoff plan for {d['source']}", f"  groups ({len(d['groups'])}):"]
        for g in d["groups"]:
            names = g["layers"]
            shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            lines.append(
                f"    {g['index']:>3}  {g['kind']:<24} {g['num_layers']:>3} layers ({shown}), "
                f"block_size {g['block_size']}, page {g['page_size_bytes']:,} bytes"
            )
        gpu, cpu = d["gpu"], d["cpu"]
        lines += [
            f"  GPU (per rank): {gpu['num_blocks']:,} blocks × {gpu['block_size']} tokens = "
            f"{gpu['tokens']:,} tokens; {gpu['pool_bytes_per_block']:,} bytes per block in "
            f"{d['num_tensors']} tensors, {gpu['total_bytes'] / gib:.2f} GiB",
            f"  CPU ({cpu['world_size']} rank(s), {cpu['eviction_policy']}): "
            f"{cpu['num_blocks']:,} blocks × {cpu['offloaded_block_size']} tokens = "
            f"{cpu['tokens']:,} tokens; {cpu['bytes_per_rank'] / gib:.2f} GiB per rank",
            f"  /dev/shm with tiers (workers in processes of their own, or the spec path): "
            f"{cpu['shared_memory_bytes'] / gib:.2f} GiB ({_shm_free_text()})",
            f"  max model length: {d['max_model_len']:,} tokens",
        ]
        return "\n".join(lines)


def _shm_free_text() -> str:
    """What this machine has free in /dev/shm, for the plan's text."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return f"this machine has no {SHM_DIR}"
    return f"this machine has {st.f_bavail * st.f_frsize / 2**30:.2f} GiB free there"


def compute_plan(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    gpu_memory: int,
    cpu_bytes: int,
    *,
    world_size: int = 1,
    num_gpu_blocks_override: int | None = None,
    max_model_len: int | None = None,
    offloaded_block_size: int | None = None,
    eviction_policy: str = "lru",
    source: str = "specs",
) -> Plan:
    """GPU plan then CPU plan for one model.

    Args:
        kv_cache_specs: layer name → spec (per rank).
        gpu_memory: bytes of GPU memory for the KV cache on one rank.
        cpu_bytes: bytes of CPU memory for the pool over all ranks.
        world_size: tensor-parallel ranks (the specs are not resharded).
        num_gpu_blocks_override: fixed GPU block count (invariant 5).
        max_model_len: required length in tokens; ``None`` auto-fits.
        offloaded_block_size: tokens per offloaded block; ``None`` = the GPU block size.
        eviction_policy: CPU pool policy.
        source: a label for the output.

    Raises:
        ValueError: whatever :func:`kvoff.get_kv_cache_config` or
            :class:`kvoff.CPUOffloadingSpec` raises.
    """
    config = get_kv_cache_config(
        kv_cache_specs,
        gpu_memory,
        max_model_len=max_model_len,
        num_gpu_blocks_override=num_gpu_blocks_override,
    )
    cpu = CPUOffloadingSpec(
        config,
        cpu_bytes_to_use=cpu_bytes,
        block_size=offloaded_block_size,
        world_size=world_size,
        eviction_policy=eviction_policy,
    )
    return Plan(config, cpu, source)
