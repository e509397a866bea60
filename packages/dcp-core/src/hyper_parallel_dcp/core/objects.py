"""Non-tensor leaves: saved with ``torch.save``, restored without running code.

Restoring uses ``torch.load(weights_only=True)``: plain containers, numbers, strings,
bytes, tensors, dtypes and sizes load as is; any other class must be allow-listed with
``torch.serialization.add_safe_globals`` (or its ``safe_globals`` context), exactly as for
``torch.load``.  Anything else raises :class:`UnsafeObjectError` naming the class.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch

from .errors import CorruptCheckpointError, UnsafeObjectError

__all__ = ["deserialize_object", "serialize_object"]


def serialize_object(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


_GLOBAL_RE = re.compile(r"(?:Unsupported global: GLOBAL|global) ([\w.]+)")


def deserialize_object(data: bytes | memoryview, *, fqn: str, file: str) -> Any:
    """Restore one object; raises :class:`UnsafeObjectError` or :class:`CorruptCheckpointError`."""
    try:
        return torch.load(io.BytesIO(bytes(data)), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        text = str(exc)
        match = _GLOBAL_RE.search(text)
        if match or "weights_only" in text.lower() or "not an allowed global" in text.lower():
            name = match.group(1) if match else "a class that is not allow-listed"
            raise UnsafeObjectError(
                f"{fqn!r} in {file}: restoring it needs {name}, which is not allow-listed; nothing was "
                f"executed. If you trust this checkpoint, allow it with "
                f"torch.serialization.add_safe_globals([{name.rsplit('.', 1)[-1]}])"
            ) from None
        raise CorruptCheckpointError(f"{fqn!r} in {file}: stored object is unreadable: {text}") from None
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise CorruptCheckpointError(f"{fqn!r} in {file}: stored object is unreadable: {exc}") from None
