"""A pickle reader that builds only plain data, for the mailbox files (a checkpoint directory
others can write to): builtin containers, numbers, strings, ``torch.Size``, dtypes and the
core records listed here.  Exports :func:`dumps`, :func:`loads`, :class:`UnsafePickleError`."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

__all__ = ["UnsafePickleError", "dumps", "loads"]

_BUILTINS = frozenset({"dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "bool", "str", "bytes",
                       "bytearray", "slice", "range"})

_CORE = {
    "hyper_parallel_dcp.core.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageInfo", "TensorStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "BytesStorageMetadata",
    }),
    "hyper_parallel_dcp.core.planner": frozenset({"SavePlan", "WriteItem", "WriteItemType"}),
    # a save plan's items as columns: a JSON string and three byte strings
    "hyper_parallel_dcp.core.plan_columns": frozenset({"WriteColumns"}),
    "hyper_parallel_dcp.core.storage": frozenset({"WriteResult"}),
    # a failure on one rank travels to the others as this plain record (strings only)
    "hyper_parallel_dcp.core.collectives": frozenset({"_Failure"}),
}


class UnsafePickleError(pickle.UnpicklingError):
    """A mailbox file names a class outside the allow-list."""


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, source: str):
        super().__init__(io.BytesIO(data))
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _BUILTINS:
            return super().find_class(module, name)
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        if module == "torch":
            if name == "Size":
                return torch.Size
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        if name in _CORE.get(module, ()):
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"{self.source}: refusing to load {module}.{name}; mailbox files may only hold plain "
            "containers, numbers, strings, torch sizes/dtypes and hyper_parallel_dcp.core plan/metadata records"
        )


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` (protocol 4) for a mailbox file."""
    return pickle.dumps(obj, protocol=4)


def loads(data: bytes, source: str = "<mailbox>") -> Any:
    """Unpickle ``data`` allowing only the plain types listed in this module; raises
    :class:`UnsafePickleError` naming ``source`` and the refused class."""
    return _RestrictedUnpickler(data, source).load()
