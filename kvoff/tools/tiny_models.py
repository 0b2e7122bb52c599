"""Tiny random-weight models for running a real engine on a CPU (``kvoff replay --engine vllm``
and the engine integration tests).

Every model has 4 layers, hidden size 256, 4 attention heads over 2 KV heads of 64, a 512-token
vocabulary and ``initializer_range`` 0.2, saved in bfloat16 (about 5 MB). The large random
weights make greedy outputs depend on the KV contents: vLLM's ``load_format="dummy"`` weights
(about ±1e-3) do not, so a corrupted cache would go unnoticed with them.

Kinds (:data:`TINY_MODELS`):
    ``llama``: full attention in every layer.
    ``mistral``: a 384-token sliding window in every layer.
    ``gemma3``: hybrid, sliding window (256 tokens) and full attention layers alternating: two
        KV cache groups in vLLM.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["TINY_MODELS", "TINY_VOCAB_SIZE", "tiny_model", "write_tiny_model"]

TINY_MODELS = ("llama", "mistral", "gemma3")
"""The kinds of tiny model :func:`write_tiny_model` writes."""
TINY_VOCAB_SIZE = 512
"""Vocabulary size of every tiny model (token ids 0 .. 511)."""

_VERSION = 1  # part of the cache folder name: bump when the models change


def write_tiny_model(kind: str, path: Path) -> Path:
    """Writes the tiny model ``kind`` (weights seeded with 0) to ``path`` as a Hugging Face
    folder (config.json and safetensors); returns ``path``. Needs ``transformers``.

    Raises:
        ValueError: an unknown kind (naming the choices).
    """
    if kind not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {kind!r}; choose one of {list(TINY_MODELS)}")
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    common = {
        "vocab_size": TINY_VOCAB_SIZE, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1 << 17, "initializer_range": 0.2, "head_dim": 64,
    }  # fmt: skip
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=384))
    else:
        model = Gemma3ForCausalLM(
            Gemma3TextConfig(
                **common,
                sliding_window=256,
                query_pre_attn_scalar=64,
                layer_types=["sliding_attention", "full_attention"] * 2,
            )
        )
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def models_dir() -> Path:
    """The default folder of the tiny models: ``models/`` in kvoff's cache folder
    (:func:`kvoff.calibration.cache_root`: ``$KVOFF_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvoff``,
    else ``~/.cache/kvoff``; not created)."""
    from kvoff.calibration import cache_root

    return cache_root() / "models"


def tiny_model(kind: str, root: Path | None = None) -> Path:
    """The folder of tiny model ``kind``, written on first use under ``root`` (default:
    :func:`models_dir`, ``models/`` in kvoff's cache folder). A folder that already holds
    the model is reused; the model is written to a temporary folder and renamed, so a run that
    is interrupted leaves no half-written model behind.

    Raises:
        ValueError: an unknown kind.
        OSError: the folder cannot be written.
    """
    if kind not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {kind!r}; choose one of {list(TINY_MODELS)}")
    if root is None:
        root = models_dir()
    path = Path(root) / f"tiny-{kind}-v{_VERSION}"
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    write_tiny_model(kind, tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process won the race: use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "config.json").exists():
            raise
    return path
