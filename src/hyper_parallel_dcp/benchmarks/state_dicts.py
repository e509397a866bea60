"""The benchmark state dicts, built as DTensors on a 1-D CPU mesh of the world.

- ``dense``: an LLM-like bf16 decoder scaled to a byte budget: TP-sharded embedding and
  attention/MLP matrices (column-parallel ``Shard(0)``, row-parallel ``Shard(1)``) and
  many small replicated norms.
- ``small``: ``count`` tensors of ``kib`` KiB each (global), ``Shard(0)`` (MoE-like).
- ``replicated``: plain tensors held whole by every rank (read-once + broadcast).

``flip=True`` swaps ``Shard(0)`` ↔ ``Shard(1)`` on 2-D tensors: the resharded target.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["dense_shapes", "local_tensors", "make_state_dict", "small_shapes"]

#: (fqn, global shape, kind) with kind one of "col", "row", "rep"
Shapes = list[tuple[str, tuple[int, ...], str]]


def dense_shapes(total_mib: float, hidden: int = 0, vocab: int = 0) -> Shapes:
    """A Llama-like decoder whose bf16 size is about ``total_mib`` MiB (≥ 1 layer).

    By default ``hidden`` is 1024 from 256 MiB up (512 / 256 below) and the embedding
    and LM head take about 5 % of the bytes each, as in a 7B model.
    """
    total = total_mib * 2**20
    if not hidden:
        hidden = 1024 if total_mib >= 256 else 512 if total_mib >= 32 else 256
    if not vocab:
        vocab = max(256, int(0.05 * total / (hidden * 2)))
    inter = hidden * 11 // 4
    per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * 2
    fixed = 2 * vocab * hidden * 2 + hidden * 2
    layers = max(1, int((total - fixed) // per_layer))
    shapes: Shapes = [("model.embed_tokens.weight", (vocab, hidden), "col")]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (hidden, hidden), "col"),
            (p + "self_attn.k_proj.weight", (hidden, hidden), "col"),
            (p + "self_attn.v_proj.weight", (hidden, hidden), "col"),
            (p + "self_attn.o_proj.weight", (hidden, hidden), "row"),
            (p + "mlp.gate_proj.weight", (inter, hidden), "col"),
            (p + "mlp.up_proj.weight", (inter, hidden), "col"),
            (p + "mlp.down_proj.weight", (hidden, inter), "row"),
            (p + "input_layernorm.weight", (hidden,), "rep"),
            (p + "post_attention_layernorm.weight", (hidden,), "rep"),
        ]
    shapes += [("model.norm.weight", (hidden,), "rep"), ("lm_head.weight", (vocab, hidden), "col")]
    return shapes


def small_shapes(count: int, kib: float) -> Shapes:
    """``count`` bf16 tensors of about ``kib`` KiB each, row-sharded."""
    cols = 512
    rows = max(2, int(kib * 1024 // (cols * 2)))
    return [(f"experts.{i}.weight", (rows, cols), "col") for i in range(count)]


def _placements(kind: str, ndim: int, flip: bool) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    if kind == "rep":
        return [Replicate()]
    dim = 0 if kind == "col" else 1
    if flip and ndim == 2:
        dim = 1 - dim
    return [Shard(dim)]


def make_state_dict(shapes: Shapes, *, mesh: Any = None, flip: bool = False, fill: bool = True,
                    replicated: bool = False, seed: int = 0) -> dict[str, Any]:
    """Build the rank's state dict: DTensors on ``mesh`` (or plain tensors).

    ``replicated=True`` or ``mesh=None`` gives whole plain tensors.  ``fill=False``
    leaves values uninitialised (load targets).  Values depend only on the FQN and the
    global position, so any layout of one ``seed`` holds the same global tensor.
    """
    from torch.distributed.tensor import DTensor

    from hyper_parallel_dcp.core.layout import placement_boxes

    out: dict[str, Any] = {}
    for i, (fqn, shape, kind) in enumerate(shapes):
        if mesh is None or replicated:
            t = torch.empty(shape, dtype=torch.bfloat16)
            if fill:
                t.copy_(_values(shape, seed + i))
            out[fqn] = t
            continue
        placements = _placements(kind, len(shape), flip)
        coord = mesh.get_coordinate()
        boxes = placement_boxes(shape, tuple(mesh.shape), coord, placements, fqn)
        box = boxes[0][0]
        local = torch.empty(box.sizes, dtype=torch.bfloat16)
        if fill:
            full = _values(shape, seed + i)
            local.copy_(full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))])
        out[fqn] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                      stride=_contiguous_stride(shape))
    return out


def _values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    # cheap deterministic values (no RNG over a GiB): a ramp offset by the seed
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float32).remainder_(251.0).add_(seed % 7)).to(torch.bfloat16).view(shape)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def local_tensors(state_dict: dict[str, Any], *, owned_only: bool = False, rank: int = 0) -> list[torch.Tensor]:
    """The rank's local tensors; ``owned_only`` keeps replicated ones on rank 0 only
    (the bytes this rank writes after dedup, roughly)."""
    from torch.distributed.tensor import DTensor, Replicate

    out = []
    for value in state_dict.values():
        if isinstance(value, DTensor):
            if owned_only and rank != 0 and all(isinstance(p, Replicate) for p in value.placements):
                continue
            out.append(value.to_local())
        elif isinstance(value, torch.Tensor):
            if owned_only and rank != 0:
                continue
            out.append(value)
    return out
