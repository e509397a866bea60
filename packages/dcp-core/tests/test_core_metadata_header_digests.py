"""``header_digests`` in the file table: written aligned with the (grouped) file table,
parsed back, carried by ``pack_metadata``, optional for old checkpoints, and checked."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from hyper_parallel_dcp.core import metadata as M
from hyper_parallel_dcp.core.errors import CheckpointFormatError

RANKS = 5


def _sample() -> M.Metadata:
    """One row chunk of ``w`` per rank (a grouped file table), an objects file, a stray file."""
    sd = {
        "w": M.TensorStorageMetadata(M.TensorProperties(torch.bfloat16), torch.Size([2 * RANKS, 6]),
                                   [M.ChunkStorageMetadata((2 * r, 0), (2, 6)) for r in range(RANKS)]),
        "step": M.BytesStorageMetadata(),
    }
    storage = {M.MetadataIndex("w", (2 * r, 0)): M.StorageInfo(f"_rank{r}_.safetensors", 96, 24,
                                                           f"{r:016x}", M.chunk_key("w", (2 * r, 0)))
               for r in range(RANKS)}
    storage[M.MetadataIndex("step")] = M.StorageInfo("_rank0_.bytes", 0, 30, "abcdefabcdefabcd")
    files = {f"_rank{r}_.safetensors": 120 for r in range(RANKS)}
    files.update({"_rank0_.bytes": 30, "extra.safetensors": 200})
    # every tensor file but rank 3's has a digest (a writer that recorded none)
    digests = {f"_rank{r}_.safetensors": f"{r + 10:016x}" for r in range(RANKS) if r != 3}
    digests["extra.safetensors"] = "ffffffffffffffff"
    return M.Metadata(sd, storage_data=storage, files=files, header_digests=digests)


def test_json_round_trip_keeps_every_digest_with_its_file():
    md = _sample()
    text = M.metadata_to_json(md)
    doc = json.loads(text)
    # the rank files are one group: the digests follow the expanded table's order
    assert any(isinstance(entry, dict) for entry in doc["files"])
    assert len(doc["header_digests"]) == len(md.files)
    back = M.metadata_from_json(text)
    assert back.header_digests == md.header_digests
    assert back.files == md.files
    assert back == md


def test_pack_round_trip_keeps_the_digests():
    md = _sample()
    back = M.unpack_metadata(pickle.loads(pickle.dumps(M.pack_metadata(md))))
    assert back.header_digests == md.header_digests and back == md
    parsed = M.metadata_from_json(M.metadata_to_json(md))
    assert M.unpack_metadata(M.pack_metadata(parsed)).header_digests == md.header_digests


def test_a_checkpoint_without_digests_reads_and_writes_none():
    md = _sample()
    md.header_digests = {}
    doc = json.loads(M.metadata_to_json(md))
    assert "header_digests" not in doc  # what older writers wrote, plus the metadata digest
    assert M.metadata_from_json(json.dumps(doc)).header_digests == {}
    # a new checkpoint read without the optional keys (what an older reader sees): the same metadata
    full = json.loads(M.metadata_to_json(_sample()))
    del full["header_digests"], full[M.METADATA_DIGEST]
    assert M.metadata_from_json(json.dumps(full)) == md


@pytest.mark.parametrize("bad", [
    "0123456789abcdef",  # not a list
    ["0123456789abcdef"],  # not one per file
    "wrong length",
    "not hex",
])
def test_malformed_digests_are_refused(bad):
    doc = json.loads(M.metadata_to_json(_sample()))
    if bad == "wrong length":
        bad = ["0123"] + doc["header_digests"][1:]
    elif bad == "not hex":
        bad = ["0123456789abcdeg"] + doc["header_digests"][1:]
    doc["header_digests"] = bad
    with pytest.raises(CheckpointFormatError, match="header_digests"):
        M.metadata_from_json(json.dumps(doc), source="ck/.metadata")


def test_a_digest_of_a_file_without_a_size_is_refused():
    # the digest covers the file's size; found by the metadata fuzz test, where a file whose
    # size was nulled came back elsewhere in the re-written file table
    doc = json.loads(M.metadata_to_json(_sample()))
    pair = next(entry for entry in doc["files"] if isinstance(entry, list) and entry[0] == "extra.safetensors")
    assert doc["header_digests"][-1] is not None  # the last file of the expanded table
    pair[1] = None
    with pytest.raises(CheckpointFormatError, match="'extra.safetensors' has a header digest but no size"):
        M.metadata_from_json(json.dumps(doc), source="ck/.metadata")


def test_chunk_location_reads_the_columns_of_parsed_metadata():
    md = _sample()
    parsed = M.metadata_from_json(M.metadata_to_json(md))
    for r in range(RANKS):
        index = M.MetadataIndex("w", (2 * r, 0))
        info = md.storage_data[index]
        assert M.chunk_location(parsed, index) == (info.relative_path, info.offset, (2, 6))
        # the right hint, and a wrong, out-of-range or negative one, all find the chunk
        for hint in (r, (r + 1) % RANKS, RANKS, -1):
            assert M.chunk_location(parsed, M.MetadataIndex("w", (2 * r, 0), hint)) == (
                info.relative_path, info.offset, (2, 6))
    assert M.chunk_location(parsed, M.MetadataIndex("w", (1, 0))) is None  # no chunk there
    assert M.chunk_location(parsed, M.MetadataIndex("step")) is None  # an object
    assert M.chunk_location(md, M.MetadataIndex("w", (0, 0))) is None  # a plain dict: use storage_data


def test_chunk_locator_answers_as_chunk_location():
    md = _sample()
    parsed = M.metadata_from_json(M.metadata_to_json(md))
    locate = M.chunk_locator(parsed)
    assert locate is not None
    for index in [M.MetadataIndex("w", (2 * r, 0), hint) for r in range(RANKS) for hint in (r, None, RANKS)] + [
            M.MetadataIndex("w", (1, 0)), M.MetadataIndex("step")]:
        assert locate(index) == M.chunk_location(parsed, index)
    assert locate(M.MetadataIndex("w", (2, 0))) == (md.storage_data[M.MetadataIndex("w", (2, 0))].relative_path,
                                                  md.storage_data[M.MetadataIndex("w", (2, 0))].offset, (2, 6))
    assert M.chunk_locator(md) is None  # storage entries as a plain dict: nothing to locate from
