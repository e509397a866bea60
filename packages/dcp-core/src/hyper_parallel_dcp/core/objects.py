"""Non-tensor leaves: saved with ``torch.save``, restored without running code.

Restoring uses ``torch.load(weights_only=True)``: any class beyond plain data must be
allow-listed (``torch.serialization.add_safe_globals``), else :class:`UnsafeObjectError`
names it.  The CRC-32s of the archive's members are checked first (``torch.load`` does
not, and a damaged pickle may decode to a wrong value).
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CorruptCheckpointError, UnsafeObjectError

__all__ = ["StoredObject", "deserialize_object", "serialize_object"]


@dataclass(frozen=True)
class StoredObject:
    """A non-tensor leaf given as its stored (``torch.save``) bytes, written as they are:
    the converters carry an object across formats without unpickling it."""

    data: bytes


def serialize_object(obj: Any) -> bytes:
    """The stored bytes of a non-tensor leaf: ``torch.save``'s, or a :class:`StoredObject`'s own."""
    if isinstance(obj, StoredObject):
        return obj.data
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
    data = bytes(data)
    _check_crcs(data, fqn, file)
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
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


_DOS_DIRECTORY = 0x10  # the directory bit of a zip member's MS-DOS attributes


def _check_crcs(data: bytes, fqn: str, file: str) -> None:
    """Raise :class:`CorruptCheckpointError` unless the CRC-32 of the archive's pickle and
    of its tensor data agree with their bytes (``zipfile`` checks them as it reads).  Not
    a zip archive (``torch.save``'s legacy format, a plain pickle): nothing to check."""
    if not data.startswith(b"PK\x03\x04"):
        return
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for info in archive.infolist():
                name = info.filename
                if not (name.endswith("data.pkl") or "/data/" in name):
                    continue
                if info.external_attr & _DOS_DIRECTORY:
                    # torch's reader would leave the tensor's memory uninitialised
                    raise zipfile.BadZipFile(f"{name!r} is marked as a directory")
                if info.CRC:  # 0: saved with compute_crc32 = False
                    archive.read(info)
    except Exception as exc:  # noqa: BLE001 - zipfile raises several types on damaged bytes
        raise CorruptCheckpointError(
            f"{fqn!r} in {file}: stored object is damaged ({type(exc).__name__}: {exc}); nothing was executed"
        ) from None
