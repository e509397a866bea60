"""``.metadata`` as versioned JSON: round trip, and clear refusals of what it cannot read.

Format 2 (column-shaped) is written; format 1 (one object per chunk) is still read.
"""

from __future__ import annotations

import copy
import json
import math
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.core.errors import CheckpointFormatError, CorruptCheckpointError
from hyper_parallel_dcp.core.metadata import (
    FORMAT_VERSION,
    METADATA_DIGEST,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    ChunkTable,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
    chunk_key,
    metadata_from_json,
    metadata_to_json,
)
from hyper_parallel_dcp.core.testing import sample_metadata

_sample = sample_metadata


def test_json_round_trip_is_exact():
    md = _sample()
    text = metadata_to_json(md)
    doc = json.loads(text)  # plain JSON, no pickle
    assert doc["format_version"] == FORMAT_VERSION
    back = metadata_from_json(text)
    assert back == md
    assert back.state_dict_metadata["w"].properties.dtype is torch.bfloat16
    assert back.storage_data[MetadataIndex("w", (2, 0))].relative_path == "_rank1_.safetensors"
    assert metadata_from_json(text.encode()) == md  # bytes as read from disk


def test_chunk_key_string_order_is_numeric_order_within_an_fqn():
    offsets = [(0, 10), (2, 0), (10, 0), (9, 100), (100, 1)]
    keys = sorted(chunk_key("w", o) for o in offsets)
    assert keys == [chunk_key("w", o) for o in sorted(offsets)]


def test_format_2_is_column_shaped_with_no_string_per_chunk():
    doc = json.loads(metadata_to_json(_sample()))
    assert doc["format_version"] == 2
    # numbered names sharing prefix and suffix: one group, a number each
    assert doc["files"] == [{"prefix": "_rank", "suffix": "_.safetensors", "numbers": [0, 1], "sizes": [156, 152]},
                            ["_rank0_.bytes", 345]]
    w = doc["tensors"]["w"]
    # one size for both chunks; digests back to back; keys and lengths derived, not stored
    assert w == {"dtype": "bfloat16", "size": [4, 6], "count": 2, "offsets": [0, 0, 2, 0], "sizes": [2, 6],
                 "file": [0, 1], "offset": [128, 128], "checksum": "00ff00ff00ff00ff0123456789abcdef"}
    assert doc["tensors"]["optim.state.w.step"]["checksum"] == [None]  # not all digests: a list
    assert doc["objects"] == {"optim.param_groups": {"file": 2, "offset": 0, "length": 345,
                                                     "checksum": "abcdefabcdefabcd"}}
    assert "other_storage" not in doc


def test_keys_that_are_not_derivable_and_stray_entries_round_trip():
    md = _sample()
    md.storage_data[MetadataIndex("w", (2, 0))] = StorageInfo("_rank1_.safetensors", 128, 24, None, "renamed")
    md.storage_data[MetadataIndex("ghost", (1,))] = StorageInfo("_rank1_.safetensors", 0, 4, None, "g")
    md.storage_data[MetadataIndex("w", (1, 1))] = StorageInfo("x.safetensors", 0, 4, "ffffffffffffffff", None)
    md.storage_data[MetadataIndex("optim.state.w.step", ())] = StorageInfo("_rank0_.safetensors", 152, 2, None,
                                                                           chunk_key("optim.state.w.step", ()))
    doc = json.loads(metadata_to_json(md))
    assert doc["tensors"]["w"]["keys"] == {"1": "renamed"}
    assert "length" not in doc["tensors"]["w"] and doc["tensors"]["optim.state.w.step"]["length"] == [2]
    assert len(doc["other_storage"]) == 2
    back = metadata_from_json(json.dumps(doc))
    assert back == md and dict(back.storage_data) == md.storage_data


def test_rank_objects_round_trip_and_are_written_only_when_present():
    md = _sample()
    assert "rank_objects" not in json.loads(metadata_to_json(md))  # no copies: the document as before
    md.rank_objects = {"optim.param_groups": {0: StorageInfo("_rank0_.bytes", 0, 345, "abcdefabcdefabcd"),
                                              3: StorageInfo("_rank3_.bytes", 0, 340, None)}}
    md.files["_rank3_.bytes"] = 340
    text = metadata_to_json(md)
    doc = json.loads(text)
    assert list(doc["rank_objects"]) == ["optim.param_groups"]
    assert doc["rank_objects"]["optim.param_groups"]["3"]["offset"] == 0
    back = metadata_from_json(text)
    assert back == md and back.object_storage("optim.param_groups", 3).relative_path == "_rank3_.bytes"
    doc["rank_objects"]["optim.param_groups"]["3"]["offset"] = 1  # covered by the metadata digest
    with pytest.raises(CorruptCheckpointError, match="changed after the save"):
        metadata_from_json(json.dumps(doc, separators=(",", ":")))
    del doc["metadata_digest"]
    doc["rank_objects"] = {"rng": {"-1": doc["rank_objects"]["optim.param_groups"]["0"]}}
    with pytest.raises(CheckpointFormatError, match="'rank_objects' entry 'rng'"):
        metadata_from_json(json.dumps(doc))


def test_storage_table_lookups_and_chunk_tables():
    back = metadata_from_json(metadata_to_json(_sample()))
    w = back.state_dict_metadata["w"]
    assert isinstance(w.chunks, ChunkTable)  # columns: no chunk object until one is read
    assert w.chunks == [ChunkStorageMetadata((0, 0), (2, 6)), ChunkStorageMetadata((2, 0), (2, 6))]
    assert isinstance(w, TensorStorageMetadata) and w.chunks[1] == ChunkStorageMetadata((2, 0), (2, 6))
    storage = back.storage_data
    assert len(storage) == 4 and MetadataIndex("w", (2, 0)) in storage and MetadataIndex("w", (1, 0)) not in storage
    assert storage[MetadataIndex("w", (2, 0), index=0)].checksum == "0123456789abcdef"  # a wrong hint is checked
    assert storage.get(MetadataIndex("w")) is None and storage.get(MetadataIndex("nope", (0,))) is None
    assert storage[MetadataIndex("w", (0, 0))].key == chunk_key("w", (0, 0))
    assert pickle.loads(pickle.dumps(back)) == back  # sent over collectives as is


# A format-1 document as the format-1 writer produced it (tests/fixtures/format_v1 has a
# whole checkpoint written by it).
V1 = {
    "format_version": 1,
    "state_dict_metadata": {
        "w": {"type": "tensor", "dtype": "bfloat16", "size": [4, 6],
              "chunks": [{"offsets": [0, 0], "sizes": [2, 6]}, {"offsets": [2, 0], "sizes": [2, 6]}]},
        "optim.state.w.step": {"type": "tensor", "dtype": "float32", "size": [], "chunks": [{"offsets": [], "sizes": []}]},
        "e": {"type": "tensor", "dtype": "int64", "size": [0, 3], "chunks": []},
        "optim.param_groups": {"type": "bytes"},
    },
    "storage_data": [
        {"fqn": "w", "file": "_rank0_.safetensors", "offset": 128, "length": 24, "offsets": [0, 0],
         "key": "w 000000000000_000000000000", "checksum": "00ff00ff00ff00ff"},
        {"fqn": "w", "file": "_rank1_.safetensors", "offset": 128, "length": 24, "offsets": [2, 0],
         "key": "w 000000000002_000000000000", "checksum": "0123456789abcdef"},
        {"fqn": "optim.state.w.step", "file": "_rank0_.safetensors", "offset": 152, "length": 4, "offsets": [],
         "key": "optim.state.w.step "},
        {"fqn": "optim.param_groups", "file": "_rank0_.bytes", "offset": 0, "length": 345, "checksum": "abcdefabcdefabcd"},
    ],
    "files": {"_rank0_.safetensors": 156, "_rank1_.safetensors": 152, "_rank0_.bytes": 345},
    "planner_data": {"note": [1, 2]},
}


def test_format_1_still_reads_to_the_same_metadata():
    back = metadata_from_json(json.dumps(V1))
    expected = _sample()
    expected.format_version = 1
    assert back == expected
    again = metadata_from_json(metadata_to_json(back))  # a format-1 checkpoint re-saved is format 2
    assert again.format_version == 2 and again.storage_data == back.storage_data


def _doc(**changes):
    doc = json.loads(metadata_to_json(_sample()))
    doc.update(changes)
    return json.dumps(doc)


def test_newer_format_version_is_refused_giving_both_versions():
    with pytest.raises(CheckpointFormatError) as info:
        metadata_from_json(_doc(format_version=FORMAT_VERSION + 1), source="/ckpt/.metadata")
    text = str(info.value)
    assert "/ckpt/.metadata" in text and str(FORMAT_VERSION + 1) in text and str(FORMAT_VERSION) in text
    assert "upgrade" in text


def _v1(mutate):
    doc = copy.deepcopy(V1)
    mutate(doc)
    return json.dumps(doc)


def _v2_tensor(**changes):
    doc = json.loads(metadata_to_json(_sample()))
    doc["tensors"]["w"].update(changes)
    return json.dumps(doc)


MALFORMED = [
    ("not json {", r"not valid checkpoint metadata JSON"),
    ("[1, 2]", r"no 'format_version'"),
    (json.dumps({"state_dict_metadata": {}}), r"no 'format_version'"),
    (_doc(format_version=True), r"invalid format_version"),
    (_doc(format_version="1"), r"invalid format_version"),
    (_doc(format_version=0), r"invalid format_version"),
    # format 1
    (_v1(lambda d: d.update(state_dict_metadata=[])), r"state_dict_metadata must be an object"),
    (_v1(lambda d: d["state_dict_metadata"]["w"].update(dtype="float99")), r"unknown dtype 'float99'.*'w'"),
    (_v1(lambda d: d["state_dict_metadata"]["w"].update(type="sparse")), r"unknown item type 'sparse' for 'w'"),
    (_v1(lambda d: d["state_dict_metadata"]["w"].update(size=[4, -6])), r"size of 'w'"),
    (_v1(lambda d: d["state_dict_metadata"]["w"].update(chunks=[{"offsets": [3, 0], "sizes": [2, 6]}])),
     r"'w' does not fit its global size \[4, 6\]"),
    (_v1(lambda d: d["state_dict_metadata"]["w"].update(chunks=[{"offsets": [0, 0]}])), r"malformed: KeyError"),
    (_v1(lambda d: d["storage_data"][0].update(file="../../etc/passwd")), r"invalid file name '../../etc/passwd'"),
    (_v1(lambda d: d["storage_data"][0].update(offset=-1)), r"byte range"),
    (_v1(lambda d: d.update(files={"_rank0_.safetensors": "big"})), r"'files' must map file names to sizes"),
    # format 2
    (_doc(files={"_rank0_.safetensors": 1}), r"'files' must be a list of \[name, size\] pairs"),
    (_doc(files=[{"prefix": "a", "suffix": "", "numbers": [1, 2], "sizes": [1]}]), r"file group 'a'"),
    (_doc(files=[{"prefix": "a", "suffix": "", "numbers": [1, 1], "sizes": [1, 1]}]), r"names a file twice"),
    (_doc(files=[{"prefix": "../", "suffix": "", "numbers": [1, 2], "sizes": [1, 1]}]), r"invalid file name '../1'"),
    (_doc(files=[["../../etc/passwd", 1]]), r"invalid file name '../../etc/passwd'"),
    (_doc(files=[["a", 1], ["a", 2]]), r"names a file twice"),
    (_doc(files=[["a", -1]]), r"size of 'a' must be an integer >= 0"),
    (_doc(tensors=[]), r"'tensors' and 'objects' must be objects"),
    (_v2_tensor(dtype="float99"), r"unknown dtype 'float99'.*'w'"),
    (_v2_tensor(size=[4, -6]), r"tensor 'w': size"),
    (_v2_tensor(count=3), r"tensor 'w': offsets must be a list of 6 integers"),
    (_v2_tensor(offsets=[0, 0, 3, 0]), r"offsets=\[3, 0\] sizes=\[2, 6\] does not fit its global size \[4, 6\]"),
    (_v2_tensor(sizes=[2, 6, 2, -1]), r"sizes must hold integers >= 0, found -1"),
    (_v2_tensor(sizes=[2, 6, 2]), r"sizes must be a list of 4 integers"),
    (_v2_tensor(sizes=[3, 6]), r"offsets=\[2, 0\] sizes=\[3, 6\] does not fit"),
    (_v2_tensor(sizes=[2, 6, 3, 6]), r"offsets=\[2, 0\] sizes=\[3, 6\] does not fit"),  # one size per chunk
    (_v2_tensor(sizes=[2, -1]), r"sizes must hold integers >= 0, found -1"),  # one size for all, checked once
    (_v2_tensor(sizes=[2, 6.0]), r"sizes must hold integers >= 0, found 6.0"),
    (_v2_tensor(checksum="00ff00ff00ff00ff"), r"checksum must be 2 xxh3 digests of 16 hex digits"),
    (_v2_tensor(checksum="00ff00ff00ff00ff0123456789ABCDEF"), r"checksum must be 2 xxh3 digests"),
    (_v2_tensor(offsets=[0, 0, 2, 0.5]), r"offsets must hold integers >= 0, found 0.5"),
    (_v2_tensor(offsets=[0, 0, 2, True]), r"offsets must hold integers >= 0, found True"),
    (_v2_tensor(file=[0, 7]), r"file index 7 is not in the file table of 3"),
    (_v2_tensor(offset=[0]), r"offset must be a list of 2 integers"),
    (_v2_tensor(checksum=["a", 5]), r"checksum must be a list of 2 strings or nulls"),
    (_v2_tensor(keys={"9": "k"}), r"invalid key entry '9'"),
    (_v2_tensor(count=None), r"count must be an integer >= 0"),
    (_v2_tensor(offsets=None), r"offsets must be a list"),
    (_doc(objects={"o": {"file": 9, "offset": 0, "length": 1}}), r"object 'o' names file 9"),
    (_doc(objects={"o": {"file": 0, "offset": -1, "length": 1}}), r"byte range of object 'o'"),
    (_doc(objects={"w": {}}), r"'w' is both a tensor and an object"),
    (_doc(tensors={"w": {"dtype": "float32", "size": [2], "offsets": [0], "sizes": [2]}}), r"malformed: KeyError: 'count'"),
]


@pytest.mark.parametrize(("text", "pattern"), MALFORMED)
def test_malformed_metadata_is_refused_clearly(text, pattern):
    with pytest.raises(CheckpointFormatError, match=pattern) as info:
        metadata_from_json(text, source="/ckpt/.metadata")
    assert "/ckpt/.metadata" in str(info.value)
    assert isinstance(info.value, ValueError)  # callers may catch it as a ValueError


# ---------------------------------------------------------------- any Metadata round-trips
_NAMES = st.text(alphabet="ab .!_\x00\u00e9", min_size=1, max_size=5)
_FILES = st.sampled_from(["_rank0_.safetensors", "_rank1_.safetensors", "_rank0_.bytes", "x y", "_rank10_.bytes",
                          "a007", "a7", "12", "3", "m-00001-of-00002.st"])
_CHECKSUMS = st.one_of(st.none(), st.text(alphabet="0123456789abcdef", min_size=16, max_size=16), st.text(max_size=3))
_INFOS = st.builds(StorageInfo, _FILES, st.integers(0, 2**40), st.integers(0, 2**33), _CHECKSUMS,
                   st.one_of(st.none(), st.text(max_size=4)))


@st.composite
def _metadata(draw) -> Metadata:
    sd = {}
    storage = {}
    for fqn in draw(st.lists(_NAMES, unique=True, max_size=6)):
        if draw(st.booleans()):
            sd[fqn] = BytesStorageMetadata()
            if draw(st.booleans()):
                storage[MetadataIndex(fqn)] = draw(_INFOS)
            continue
        shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.bool]))
        stored_as = draw(st.sampled_from([None, torch.uint8, torch.uint16]))  # a same-size view, or not
        boxes = draw(st.lists(st.tuples(*[st.integers(0, d) for d in shape]), unique=True, max_size=5))
        chunks = []
        for offsets in boxes:
            sizes = tuple(draw(st.integers(0, d - o)) for o, d in zip(offsets, shape))
            chunks.append(ChunkStorageMetadata(offsets, sizes))
            stored = draw(st.sampled_from(["derived", "other key", "none"]))
            if stored != "none":
                info = draw(_INFOS)
                key = chunk_key(fqn, offsets) if stored == "derived" else info.key
                length = math.prod(sizes) * (stored_as or dtype).itemsize if stored == "derived" else info.length
                storage[MetadataIndex(fqn, offsets)] = StorageInfo(info.relative_path, info.offset, length,
                                                                   info.checksum, key)
        sd[fqn] = TensorStorageMetadata(TensorProperties(dtype, stored_as), torch.Size(shape), chunks)
    for _ in range(draw(st.integers(0, 2))):  # entries that name no saved item
        offsets = draw(st.one_of(st.none(), st.lists(st.integers(0, 9), max_size=2).map(tuple)))
        storage[MetadataIndex(draw(_NAMES), offsets)] = draw(_INFOS)
    files = draw(st.dictionaries(_FILES, st.integers(0, 2**40), max_size=3))
    planner_data = draw(st.one_of(st.none(), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)))
    return Metadata(sd, planner_data=planner_data, storage_data=storage, files=files)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_metadata())
def test_any_metadata_round_trips_exactly(md):
    text = metadata_to_json(md)
    back = metadata_from_json(text)
    assert back == md
    assert dict(back.storage_data) == md.storage_data and len(back.storage_data) == len(md.storage_data)
    for index, info in md.storage_data.items():
        assert back.storage_data[index] == info
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            chunks = back.state_dict_metadata[fqn].chunks
            assert isinstance(chunks, ChunkTable) and list(chunks) == list(entry.chunks)
    assert metadata_from_json(metadata_to_json(back)) == md  # writing what was read changes nothing


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**40) | st.text(max_size=20),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                     max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_mutated_document_is_refused_or_fully_usable(data):
    """Checks run at parse time: what parses can be materialised (chunks, every storage
    entry) without any error later, when a rank first touches it."""
    doc = json.loads(metadata_to_json(_sample()))
    # the content checks, as a document without the digest meets them (with it, any change
    # is refused: test_core_metadata_digest.py)
    del doc[METADATA_DIGEST]
    for _ in range(data.draw(st.integers(1, 3))):
        node = doc
        path = []
        while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
            key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
            path.append((node, key))
            node = node[key]
        if path:
            parent, key = path[-1]
            parent[key] = data.draw(_JSON)
    try:
        md = metadata_from_json(json.dumps(doc))
    except CheckpointFormatError:
        return
    for entry in md.state_dict_metadata.values():
        if isinstance(entry, TensorStorageMetadata):
            assert all(len(c.offsets) == len(c.sizes) == len(entry.size) for c in entry.chunks)
    assert len(dict(md.storage_data)) == len(md.storage_data)
    for info in md.storage_data.values():
        assert isinstance(info.relative_path, str) and info.offset >= 0 and info.length >= 0


def test_a_chunk_table_is_an_immutable_sequence_equal_to_its_list():
    chunks = [ChunkStorageMetadata((0, 0), (2, 6)), ChunkStorageMetadata((2, 0), (2, 6)),
              ChunkStorageMetadata((0, 0), (1, 1))]
    table = ChunkTable(2, 3, [0, 0, 2, 0, 0, 0], [2, 6, 2, 6, 1, 1])
    assert table == chunks and chunks == table and table == tuple(chunks) and table != chunks[:2]
    assert len(table) == 3 and table[-1] == chunks[2] and table[1:] == chunks[1:] and list(table) == chunks
    assert table == ChunkTable.of(chunks, 2) and ChunkTable.of(table, 2) is table
    assert table.index(chunks[1]) == 1 and chunks[0] in table and table.count(chunks[0]) == 1
    assert not table.ascending and ChunkTable(2, 2, [0, 0, 2, 0], [2, 6, 2, 6]).ascending
    assert table.find((0, 0)) == 0 and table.find((0, 0), hint=2) == 2 and table.find((2, 0), hint=0) == 1
    assert table.find((9, 9)) is None
    assert pickle.loads(pickle.dumps(table)) == table and repr(table) == f"ChunkTable({chunks!r})"
    with pytest.raises(IndexError):
        table[3]  # noqa: B018
    with pytest.raises(TypeError):
        hash(table)
    with pytest.raises(ValueError, match="3 chunks of 2 dims"):
        ChunkTable(2, 3, [0, 0], [2, 6])
    empty = ChunkTable(0, 2, [], [])  # a 0-d tensor's chunks
    assert list(empty) == [ChunkStorageMetadata((), ())] * 2 and ChunkTable(3, 0, [], []) == []
