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


_GLOBAL_RE = re.compile(r"(?:Unsupported global: GLOBAL|GLOBAL) ([\w.]+)", re.I)
_REASON_RE = re.compile(r"WeightsUnpickler error:\s*(.+?)\s*(?:Check the documentation|$)", re.S)


def deserialize_object(data: bytes | memoryview, *, fqn: str, file: str) -> Any:
    """Restore one object with ``torch.load(weights_only=True)``; never runs stored code.

    Raises :class:`UnsafeObjectError` naming the class when the object needs one that is
    not allow-listed, and :class:`CorruptCheckpointError` (naming ``fqn`` and ``file``)
    for anything else that cannot be read — whatever the bytes are.
    """
    try:
        return torch.load(io.BytesIO(bytes(data)), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        text = str(exc)
        match = _GLOBAL_RE.search(text)
        if match:
            name = match.group(1)
            raise UnsafeObjectError(
                f"{fqn!r} in {file}: restoring it needs {name}, which is not allow-listed; nothing was "
                f"executed. If you trust this checkpoint, allow it with "
                f"torch.serialization.add_safe_globals([{name.rsplit('.', 1)[-1]}])"
            ) from None
        reason = _REASON_RE.search(text)
        raise CorruptCheckpointError(
            f"{fqn!r} in {file}: stored object is not a readable torch.save payload "
            f"({reason.group(1).strip() if reason else text}); nothing was executed"
        ) from None
    except Exception as exc:  # noqa: BLE001 - torch's readers raise many types on damaged bytes
        raise CorruptCheckpointError(
            f"{fqn!r} in {file}: stored object is unreadable: {type(exc).__name__}: {exc}"
        ) from None
