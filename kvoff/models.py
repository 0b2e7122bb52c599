"""KV shape presets for the replay and the benchmarks (full-attention layers only for now).

Numbers are from the models' published ``config.json`` files (num_hidden_layers,
num_key_value_heads, head_dim or hidden_size / num_attention_heads, torch_dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvoff.specs import FullAttentionSpec

__all__ = ["MODEL_PRESETS", "ModelPreset", "get_model_preset"]


@dataclass(frozen=True)
class ModelPreset:
    """A model's KV cache shape: ``num_layers`` identical full-attention layers.

    Attributes:
        name: preset name.
        num_layers: attention layers.
        num_kv_heads: KV heads per layer (one rank).
        head_size: elements per head.
        dtype: KV cache element type.
        description: where the numbers come from.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    description: str

    def layer_spec(self, block_size: int) -> FullAttentionSpec:
        """The spec of one layer for GPU blocks of ``block_size`` tokens."""
        return FullAttentionSpec(block_size, self.num_kv_heads, self.head_size, self.dtype)

    def bytes_per_token(self) -> int:
        """KV bytes per token over all layers (one rank)."""
        return self.num_layers * self.layer_spec(1).page_size_bytes


MODEL_PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            "tiny",
            2,
            1,
            4,
            torch.float16,
            "2 layers × 1 KV head × head_size 4, fp16: 32 bytes per token, so a replay of the "
            "whole conversation trace with a 200,000-block pool (512-token blocks) needs about "
            "3.1 GiB",
        ),
        ModelPreset(
            "llama-3-8b",
            32,
            8,
            128,
            torch.bfloat16,
            "Llama-3-8B: 32 layers, 8 KV heads (GQA), head_dim 128, bf16: 128 KiB per token",
        ),
        ModelPreset(
            "qwen2.5-7b",
            28,
            4,
            128,
            torch.bfloat16,
            "Qwen2.5-7B: 28 layers, 4 KV heads (GQA 7:1), head_dim 128, bf16: 56 KiB per token",
        ),
    )
}


def get_model_preset(name: str) -> ModelPreset:
    """Return the preset called ``name``.

    Raises:
        ValueError: for an unknown name; the message lists the presets.
    """
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}"
        ) from None
