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
        hidden_size: model width (elements), for the replay's prefill-cost GEMMs.
        intermediate_size: MLP width (elements), the other GEMM dimension.
        num_params: parameters; a prefill costs about ``2 × num_params`` FLOPs per token
            (Kaplan et al., "Scaling Laws for Neural Language Models", 2020, section 2.1).
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    description: str
    hidden_size: int = 0
    intermediate_size: int = 0
    num_params: int = 0

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
            "3.1 GiB; compute: width 64, MLP 256, 131,072 parameters (2 × (4 × 64² + 3 × 64 × "
            "256), a made-up model for tests)",
            64,
            256,
            131_072,
        ),
        ModelPreset(
            "llama-3-8b",
            32,
            8,
            128,
            torch.bfloat16,
            "Llama-3-8B: 32 layers, 8 KV heads (GQA), head_dim 128, bf16: 128 KiB per token; "
            "hidden 4096, intermediate 14336, 8.03e9 parameters",
            4096,
            14336,
            8_030_000_000,
        ),
        ModelPreset(
            "qwen2.5-7b",
            28,
            4,
            128,
            torch.bfloat16,
            "Qwen2.5-7B: 28 layers, 4 KV heads (GQA 7:1), head_dim 128, bf16: 56 KiB per "
            "token; hidden 3584, intermediate 18944, 7.62e9 parameters",
            3584,
            18944,
            7_620_000_000,
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
