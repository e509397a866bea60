"""``.metadata`` as versioned JSON: round trip, and clear refusals of what it cannot read."""

from __future__ import annotations

import json

import pytest
import torch

from hyper_parallel_dcp.core.errors import CheckpointFormatError
from hyper_parallel_dcp.core.metadata import (
    FORMAT_VERSION,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
    chunk_key,
    metadata_from_json,
    metadata_to_json,
)


def _sample() -> Metadata:
    sd = {
        "w": TensorStorageMetadata(TensorProperties(torch.bfloat16), torch.Size([4, 6]),
                                   [ChunkStorageMetadata((0, 0), (2, 6)), ChunkStorageMetadata((2, 0), (2, 6))]),
        "optim.state.w.step": TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([]),
                                                    [ChunkStorageMetadata((), ())]),
        "e": TensorStorageMetadata(TensorProperties(torch.int64), torch.Size([0, 3]), []),
        "optim.param_groups": BytesStorageMetadata(),
    }
    storage = {
        MetadataIndex("w", (0, 0)): StorageInfo("_rank0_.safetensors", 128, 24, "00ff00ff00ff00ff", chunk_key("w", (0, 0))),
        MetadataIndex("w", (2, 0)): StorageInfo("_rank1_.safetensors", 128, 24, "0123456789abcdef", chunk_key("w", (2, 0))),
        MetadataIndex("optim.state.w.step", ()): StorageInfo("_rank0_.safetensors", 152, 4, None,
                                                             chunk_key("optim.state.w.step", ())),
        MetadataIndex("optim.param_groups"): StorageInfo("_rank0_.bytes", 0, 345, "abcdefabcdefabcd"),
    }
    return Metadata(sd, planner_data={"note": [1, 2]}, storage_data=storage,
                    files={"_rank0_.safetensors": 156, "_rank1_.safetensors": 152, "_rank0_.bytes": 345})


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


def _tensor_entry(**changes):
    doc = json.loads(metadata_to_json(_sample()))
    doc["state_dict_metadata"]["w"].update(changes)
    return json.dumps(doc)


def _storage_entry(**changes):
    doc = json.loads(metadata_to_json(_sample()))
    doc["storage_data"][0].update(changes)
    return json.dumps(doc)


MALFORMED = [
    ("not json {", r"not valid checkpoint metadata JSON"),
    ("[1, 2]", r"no 'format_version'"),
    (json.dumps({"state_dict_metadata": {}}), r"no 'format_version'"),
    (_doc(format_version=True), r"invalid format_version"),
    (_doc(format_version="1"), r"invalid format_version"),
    (_doc(format_version=0), r"invalid format_version"),
    (_doc(state_dict_metadata=[]), r"state_dict_metadata must be an object"),
    (_tensor_entry(dtype="float99"), r"unknown dtype 'float99'.*'w'"),
    (_tensor_entry(type="sparse"), r"unknown item type 'sparse' for 'w'"),
    (_tensor_entry(size=[4, -6]), r"size of 'w'"),
    (_tensor_entry(chunks=[{"offsets": [3, 0], "sizes": [2, 6]}]), r"'w' does not fit its global size \[4, 6\]"),
    (_tensor_entry(chunks=[{"offsets": [0], "sizes": [4]}]), r"'w' does not fit"),
    (_tensor_entry(chunks=[{"offsets": [0, 0]}]), r"malformed: KeyError"),
    (_storage_entry(file="../../etc/passwd"), r"invalid file name '../../etc/passwd'"),
    (_storage_entry(offset=-1), r"byte range"),
    (_doc(files={"_rank0_.safetensors": "big"}), r"'files' must map file names to sizes"),
]


@pytest.mark.parametrize(("text", "pattern"), MALFORMED)
def test_malformed_metadata_is_refused_clearly(text, pattern):
    with pytest.raises(CheckpointFormatError, match=pattern) as info:
        metadata_from_json(text, source="/ckpt/.metadata")
    assert "/ckpt/.metadata" in str(info.value)
    assert isinstance(info.value, ValueError)  # callers may catch it as a ValueError
