"""The option values of a conversion: shard and batch sizes (``"5GB"``) and export dtypes (``"bf16"``)."""

from __future__ import annotations

import re
from typing import Optional, Union

import torch

__all__ = ["cast_floating", "output_dtype", "parse_dtype", "parse_size"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
           "fp64": torch.float64, "float64": torch.float64}


def parse_size(size: Union[int, str]) -> int:
    """Bytes for ``size``: an int, or a string with a decimal (``"5GB"`` = 5·10⁹, as ``huggingface_hub``
    reads it) or binary (KiB/MiB/GiB/TiB) unit; ``ValueError`` for anything else or a size not positive."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        kind = repr(size) if isinstance(size, bool) else type(size).__name__
        raise ValueError(f"shard size must be an int or a string like '5GB', got {kind}")
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE.match(size)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"cannot read shard size {size!r}: use bytes or a number with one of the units "
                             "KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '5GB'")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"shard size must be positive, got {size!r}")
    return value


def parse_dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    """``None``, a floating ``torch.dtype``, or one of ``bf16``/``fp16``/``fp32``/``fp64``
    (also their long names).  Raises ``ValueError`` for anything else."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"cannot cast to {dtype!r}: use one of bf16, fp16, fp32, fp64 (or a floating torch.dtype)")


def cast_floating(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``tensor`` in ``dtype`` when it is floating point; other tensors (and every tensor
    when ``dtype`` is None) pass through unchanged."""
    if dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


def output_dtype(dtype: torch.dtype, cast: Optional[torch.dtype]) -> torch.dtype:
    """The dtype :func:`cast_floating` gives a tensor of ``dtype``."""
    return cast if cast is not None and dtype.is_floating_point else dtype
