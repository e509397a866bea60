"""The optional dtype cast of an export: which names mean which dtype, and what is cast."""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["cast_floating", "output_dtype", "parse_dtype"]

_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def parse_dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    """``None``, a floating ``torch.dtype``, or one of ``bf16``/``fp16``/``fp32``/``fp64``
    (also their long names).  Raises ``ValueError`` for anything else."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _NAMES:
        return _NAMES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"cannot cast to {dtype!r}: use one of bf16, fp16, fp32, fp64 (or a floating torch.dtype)")


def cast_floating(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``tensor`` in ``dtype`` when it is floating point; integer and bool tensors (and
    everything when ``dtype`` is None) pass through unchanged."""
    if dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


def output_dtype(dtype: torch.dtype, cast: Optional[torch.dtype]) -> torch.dtype:
    """The dtype :func:`cast_floating` gives a tensor of ``dtype``."""
    return cast if cast is not None and dtype.is_floating_point else dtype
