"""``ReadItem`` and ``MetadataIndex`` fill their fields themselves (faster than a frozen
dataclass's generated ``__init__``): they must behave exactly as the plain frozen
dataclasses with the same fields, which this test builds as the reference."""

import copy
import dataclasses
import pickle
from dataclasses import dataclass, field
from typing import Optional

import pytest

from hyper_parallel_dcp.core.metadata import MetadataIndex
from hyper_parallel_dcp.core.planner import LoadItemType, ReadItem


@dataclass(frozen=True)
class _ReferenceIndex:
    fqn: str
    offset: Optional[tuple] = None
    index: Optional[int] = field(default=None, hash=False, compare=False)


@dataclass(frozen=True)
class _ReferenceItem:
    type: LoadItemType
    dest_index: object
    dest_offsets: tuple
    storage_index: object
    storage_offsets: tuple
    lengths: tuple
    source: Optional[int] = None


INDEX_ARGS = [("w",), ("w", (0, 4)), ("w", (0, 4), 3), ("layers.0.w", (), 0)]


@pytest.mark.parametrize("args", INDEX_ARGS)
def test_metadata_index_is_the_frozen_dataclass(args):
    made, reference = MetadataIndex(*args), _ReferenceIndex(*args)
    assert dataclasses.astuple(made) == dataclasses.astuple(reference)
    assert [f.name for f in dataclasses.fields(made)] == [f.name for f in dataclasses.fields(reference)]
    # the hint takes no part in equality or hashing
    other = MetadataIndex(args[0], *(args[1:2] or [None]), 99)
    assert made == other and hash(made) == hash(other)
    assert hash(made) == hash(_ReferenceIndex(*args[:2]))
    assert MetadataIndex(fqn=args[0], offset=(args[1:2] or [None])[0]) == made
    assert pickle.loads(pickle.dumps(made)) == made and copy.deepcopy(made) == made
    assert dataclasses.replace(made, fqn="other").fqn == "other"
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.fqn = "x"  # type: ignore[misc]
    assert repr(made) == repr(reference).replace("_ReferenceIndex", "MetadataIndex")


@pytest.mark.parametrize("source", [None, 0, 3])
def test_read_item_is_the_frozen_dataclass(source):
    dest, stored = MetadataIndex("w", (0, 8)), MetadataIndex("w", (4, 0), 1)
    args = (LoadItemType.TENSOR, dest, (0, 2), stored, (1, 0), (3, 6))
    made = ReadItem(*args) if source is None else ReadItem(*args, source)
    reference = _ReferenceItem(*args) if source is None else _ReferenceItem(*args, source)
    assert dataclasses.astuple(made) == dataclasses.astuple(reference)
    assert made.source == source
    keywords = ReadItem(type=args[0], dest_index=dest, dest_offsets=(0, 2), storage_index=stored,
                        storage_offsets=(1, 0), lengths=(3, 6), source=source)
    assert keywords == made and hash(keywords) == hash(made)
    assert made != dataclasses.replace(made, source=7) and dataclasses.replace(made, source=7).source == 7
    assert pickle.loads(pickle.dumps(made)) == made and copy.deepcopy(made) == made
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.lengths = (1, 1)  # type: ignore[misc]
    assert repr(made) == repr(reference).replace("_ReferenceItem", "ReadItem")
    with pytest.raises(TypeError):
        ReadItem(LoadItemType.TENSOR, dest)  # type: ignore[call-arg]
