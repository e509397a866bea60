"""``pack_metadata`` / ``unpack_metadata``: the form in which a save's coordinator sends the
global metadata to the other ranks.  It must give back metadata equal to the original
(every field, columnar or plain tensors, storage tables) and hold only plain data.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from hyper_parallel_dcp.core.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    ChunkTable,
    Metadata,
    StorageInfo,
    StorageTable,
    TensorProperties,
    TensorStorageMetadata,
    metadata_from_json,
    metadata_to_json,
    pack_metadata,
    tensor_metadata_from_columns,
    unpack_metadata,
)
from hyper_parallel_dcp.core.testing import sample_metadata


def _sample() -> Metadata:
    """The shared sample plus a planned (columnar) tensor, one stored as another dtype, and
    a rank's own copy of an object."""
    md = sample_metadata()
    md.state_dict_metadata["cols"] = tensor_metadata_from_columns(
        "cols", TensorProperties(torch.float32), torch.Size([2, 8]), 2, 2, [0, 0, 0, 4], [2, 4, 2, 4], ascending=True)
    md.state_dict_metadata["f8"] = TensorStorageMetadata(TensorProperties(torch.float8_e8m0fnu, stored_as=torch.uint8),
                                                         torch.Size([3]), [ChunkStorageMetadata((0,), (3,))])
    md.rank_objects = {"rng": {1: StorageInfo("_rank1_.bytes", 0, 9, None)}}
    return md


def _same(a: Metadata, b: Metadata) -> None:
    assert b == a
    assert list(b.state_dict_metadata) == list(a.state_dict_metadata)  # order kept
    for fqn, md in a.state_dict_metadata.items():
        other = b.state_dict_metadata[fqn]
        assert type(other) is not BytesStorageMetadata or type(md) is BytesStorageMetadata
        if isinstance(md, TensorStorageMetadata):
            assert other.properties == md.properties and other.size == md.size
            assert [(c.offsets, c.sizes) for c in other.chunks] == [(c.offsets, c.sizes) for c in md.chunks]
    assert dict(b.storage_data or {}) == dict(a.storage_data or {})
    # the lookup hint of a chunk's key is the chunk's position (it takes no part in equality)
    for key in b.storage_data or {}:
        if key.offset is not None:
            chunks = b.state_dict_metadata[key.fqn].chunks
            assert chunks[key.index].offsets == key.offset


def test_round_trip_through_pickle_is_equal_and_plain():
    md = _sample()
    packed = pack_metadata(md)
    data = pickle.dumps(packed)
    # plain data only: no class of this project is named in the bytes
    assert b"hyper_parallel_dcp" not in data and b"torch" not in data
    _same(md, unpack_metadata(pickle.loads(data)))


def test_round_trip_of_parsed_metadata_and_of_no_storage():
    md = metadata_from_json(metadata_to_json(_sample()))  # columnar tensors, lazy storage view
    _same(md, unpack_metadata(pickle.loads(pickle.dumps(pack_metadata(md)))))
    bare = Metadata({"x": BytesStorageMetadata()}, storage_data=None)
    back = unpack_metadata(pack_metadata(bare))
    assert back == bare and back.storage_data is None
    empty = Metadata({}, storage_data={})
    assert unpack_metadata(pack_metadata(empty)) == empty


def test_unknown_layout_is_refused():
    packed = pack_metadata(_sample())
    with pytest.raises(ValueError, match="unknown layout"):
        unpack_metadata((99,) + packed[1:])


def test_unpacked_metadata_compares_copies_and_pickles_as_the_metadata():
    import copy
    import dataclasses

    md = _sample()
    assert unpack_metadata(pack_metadata(md)) == md
    assert md == unpack_metadata(pack_metadata(md))  # from either side
    assert unpack_metadata(pack_metadata(md)) != dataclasses.replace(md, planner_data=None)
    assert repr(unpack_metadata(pack_metadata(md))) == repr(unpack_metadata(pack_metadata(md)))
    assert dataclasses.replace(unpack_metadata(pack_metadata(md)), planner_data=7).planner_data == 7
    _same(md, pickle.loads(pickle.dumps(unpack_metadata(pack_metadata(md)))))
    _same(md, copy.deepcopy(unpack_metadata(pack_metadata(md))))
    changed = copy.copy(unpack_metadata(pack_metadata(md)))
    changed.files = {}
    assert changed.files == {} and changed.state_dict_metadata.keys() == md.state_dict_metadata.keys()
    assert changed.storage_data == md.storage_data
    with pytest.raises(AttributeError):
        unpack_metadata(pack_metadata(md)).no_such_field  # noqa: B018


def test_unpacking_builds_no_object_per_chunk():
    md = _sample()
    back = unpack_metadata(pickle.loads(pickle.dumps(pack_metadata(md))))
    assert type(back) is Metadata and isinstance(back.storage_data, StorageTable)
    for fqn, entry in back.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            assert isinstance(entry.chunks, ChunkTable), fqn
