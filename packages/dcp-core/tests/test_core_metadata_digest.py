"""``metadata_digest``: the writer's xxh3 of the whole ``.metadata`` document, checked on
every parse, so a location edited after the save can never be trusted by the reader."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import xxhash

from hyper_parallel_dcp.core.errors import CheckpointError, CheckpointFormatError, CorruptCheckpointError
from hyper_parallel_dcp.core.metadata import (
    METADATA_DIGEST,
    Metadata,
    MetadataIndex,
    metadata_from_json,
    metadata_to_json,
)
from hyper_parallel_dcp.core.testing import sample_metadata


def _sample() -> Metadata:
    """The shared sample with header digests and a non-ASCII planner note."""
    md = sample_metadata()
    md.planner_data = {"note": "café", "lr": 0.1}
    md.header_digests = {"_rank0_.safetensors": "00000000000000aa", "_rank1_.safetensors": "00000000000000bb"}
    return md


def test_the_digest_is_the_last_member_and_hashes_the_rest():
    text = metadata_to_json(_sample())
    member = re.search(r',"metadata_digest":"([0-9a-f]{16})"}$', text)
    assert member is not None
    rest = text[:member.start()] + "}"
    assert member.group(1) == xxhash.xxh3_64_hexdigest(rest.encode())
    # and the rest is the compact document without the key (what a re-serialising reader rebuilds)
    doc = json.loads(text)
    del doc[METADATA_DIGEST]
    assert rest == json.dumps(doc, separators=(",", ":"))


def test_an_intact_document_parses_with_its_header_digests():
    md = _sample()
    back = metadata_from_json(metadata_to_json(md), source="ck/.metadata")
    assert back == md and back.header_digests == md.header_digests
    assert metadata_from_json(metadata_to_json(md).encode()).header_digests == md.header_digests


@pytest.mark.parametrize("reformat", [
    lambda doc: json.dumps(doc, indent=2),
    lambda doc: json.dumps(doc, ensure_ascii=False) + "\n",
    lambda doc: json.dumps({METADATA_DIGEST: doc[METADATA_DIGEST],
                            **{k: v for k, v in doc.items() if k != METADATA_DIGEST}}),  # digest moved first
])
def test_a_reformatted_document_with_the_same_content_is_accepted(reformat):
    md = _sample()
    text = reformat(json.loads(metadata_to_json(md)))
    back = metadata_from_json(text, source="ck/.metadata")
    assert back == md and back.header_digests == md.header_digests


def test_a_hand_edited_chunk_offset_is_refused_naming_the_file():
    doc = json.loads(metadata_to_json(_sample()))
    assert doc["tensors"]["w"]["offset"] == [128, 128]
    doc["tensors"]["w"]["offset"][1] = 100  # valid JSON, still inside the file
    with pytest.raises(CorruptCheckpointError, match=r"ck/\.metadata was changed after the save") as raised:
        metadata_from_json(json.dumps(doc, separators=(",", ":")), source="ck/.metadata")
    assert "metadata_digest" in str(raised.value)


@pytest.mark.parametrize("edit", [
    lambda doc: doc["tensors"]["w"]["sizes"].__setitem__(0, 1),  # chunk shape
    lambda doc: doc["tensors"]["w"].__setitem__("dtype", "float16"),  # dtype of the same size
    lambda doc: doc["tensors"]["w"]["file"].__setitem__(1, 0),  # chunk's file
    lambda doc: doc["header_digests"].__setitem__(0, "00000000000000cc"),  # a header digest
    lambda doc: doc["files"][0]["sizes"].__setitem__(1, 153),  # a file's size
    lambda doc: doc["tensors"]["w"].__setitem__("length", [24, 20]),  # a length column added
    lambda doc: doc.__setitem__("planner_data", None),  # outside the locations: still the save's content
])
def test_every_covered_edit_is_refused(edit):
    doc = json.loads(metadata_to_json(_sample()))
    edit(doc)
    with pytest.raises(CorruptCheckpointError, match="changed after the save"):
        metadata_from_json(json.dumps(doc), source="ck/.metadata")


def test_any_flipped_digit_in_the_content_is_refused():
    text = metadata_to_json(_sample())
    end = text.index(f',"{METADATA_DIGEST}"')
    positions = [i for i, c in enumerate(text[:end]) if c in "0123456789abcdef"]
    assert len(positions) > 100
    for i in positions:
        flipped = text[:i] + ("1" if text[i] != "1" else "2") + text[i + 1:]
        with pytest.raises(CheckpointError) as raised:
            metadata_from_json(flipped, source="ck/.metadata")
        # a flip that breaks the content's own rules is reported by those; any other by the digest
        assert isinstance(raised.value, (CorruptCheckpointError, CheckpointFormatError)), i


def test_a_structural_error_is_still_named_by_its_check():
    doc = json.loads(metadata_to_json(_sample()))
    doc["tensors"]["w"]["offsets"][2] = 3  # rows 3..5 of a 4-row tensor
    with pytest.raises(CheckpointFormatError, match="tensor 'w'.*does not fit its global size"):
        metadata_from_json(json.dumps(doc), source="ck/.metadata")


def test_a_document_without_the_digest_parses_as_before_but_trusts_no_header_digest():
    md = _sample()
    doc = json.loads(metadata_to_json(md))
    del doc[METADATA_DIGEST]
    back = metadata_from_json(json.dumps(doc))
    # every location as written, but no header digest: each file's header is checked chunk by chunk
    assert back == dataclasses.replace(md, header_digests={})
    doc["tensors"]["w"]["offset"][1] = 100  # an older checkpoint edited: parsed (the reader's header check catches it)
    assert metadata_from_json(json.dumps(doc)).storage_data[MetadataIndex("w", (2, 0))].offset == 100


def test_check_digest_false_reads_an_altered_document_without_header_digests():
    doc = json.loads(metadata_to_json(_sample()))
    doc["tensors"]["w"]["offset"][1] = 100
    back = metadata_from_json(json.dumps(doc), check_digest=False)
    assert back.storage_data[MetadataIndex("w", (2, 0))].offset == 100
    assert back.header_digests == {}


@pytest.mark.parametrize("bad", ["0123", "0123456789ABCDEF", 7, ["0123456789abcdef"]])
def test_a_malformed_digest_is_a_format_error(bad):
    doc = json.loads(metadata_to_json(_sample()))
    doc[METADATA_DIGEST] = bad
    with pytest.raises(CheckpointFormatError, match="metadata_digest"):
        metadata_from_json(json.dumps(doc), source="ck/.metadata")


def test_writing_what_was_read_gives_a_valid_digest_again():
    md = _sample()
    doc = json.loads(metadata_to_json(md))
    del doc[METADATA_DIGEST]
    parsed = metadata_from_json(json.dumps(doc))  # an older document: no header digests kept
    again = metadata_to_json(parsed)
    assert METADATA_DIGEST in json.loads(again)
    assert metadata_from_json(again) == dataclasses.replace(md, header_digests={})
