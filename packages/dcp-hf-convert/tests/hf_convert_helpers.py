"""Shared helpers of the hf-convert tests: a tiny local Llama (no network) and file digests."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def tiny_llama(seed: int = 0):
    """A 2-layer Llama with hidden size 64, random weights from ``seed``, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()


def fixed_input(batch: int = 2, length: int = 11) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, TINY_LLAMA["vocab_size"], (batch, length), generator=gen)


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def tree_digest(root: str | os.PathLike) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root`` (to prove it was untouched)."""
    out = {}
    base = Path(root)
    for path in sorted(base.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(base))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out
