"""The ``.metadata`` format version, and a look at a document's version without parsing the
rest: no torch (``hp-dcp latest`` decides a step is complete with it).  Exports
:data:`FORMAT_VERSION` and :func:`format_version_of`."""

from __future__ import annotations

import json
from typing import Optional

__all__ = ["FORMAT_VERSION", "format_version_of"]

#: Version of the ``.metadata`` JSON schema this code writes and the newest it reads.
FORMAT_VERSION = 2


def format_version_of(text: bytes) -> Optional[int]:
    """The integer ``format_version`` of a metadata JSON document; ``None`` when it has none."""
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    version = doc.get("format_version") if isinstance(doc, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) else None
