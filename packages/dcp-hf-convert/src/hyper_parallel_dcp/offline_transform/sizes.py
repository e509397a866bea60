"""Shard-size strings as Hugging Face writes them: ``"5GB"``, ``"500MB"``, ``"5GiB"``, or bytes."""

from __future__ import annotations

import re
from typing import Union

__all__ = ["parse_size"]

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(size: Union[int, str]) -> int:
    """Bytes for ``size``: an int, or a string with a decimal (KB/MB/GB/TB, as
    ``huggingface_hub`` reads them: ``"5GB"`` = 5·10⁹) or binary (KiB/MiB/GiB/TiB) unit.

    Raises ``ValueError`` for anything else, or for a size that is not positive.
    """
    if isinstance(size, bool):
        raise ValueError(f"shard size must be an int or a string like '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        match = _SIZE.match(size)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read shard size {size!r}: use bytes or a number with one of the units "
                "KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '5GB'"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"shard size must be an int or a string like '5GB', got {type(size).__name__}")
    if value <= 0:
        raise ValueError(f"shard size must be positive, got {size!r}")
    return value
