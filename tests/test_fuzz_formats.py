"""Fuzzing the parsers that read untrusted bytes: only clean ``CheckpointError``s, never wrong numbers.

Bounded: a few hundred examples per property, no example database (fast and repeatable).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp import load, save
from hyper_parallel_dcp.core.errors import CheckpointError
from hyper_parallel_dcp.core.metadata import METADATA_DIGEST, Metadata, metadata_from_json, metadata_to_json
from hyper_parallel_dcp.core.objects import deserialize_object, serialize_object
from hyper_parallel_dcp.storage_fs.integrity import check_complete, verify_checkpoint

FUZZ = settings(max_examples=250, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FUZZ_FILES = settings(FUZZ, max_examples=80)


def _state() -> dict:
    return {
        "a": torch.arange(40, dtype=torch.float32).reshape(8, 5),
        "b": torch.arange(6, dtype=torch.int16),
        "obj": {"lr": 0.5, "tags": ["x", "y"]},
    }


def _blank() -> dict:
    return {"a": torch.zeros(8, 5), "b": torch.zeros(6, dtype=torch.int16), "obj": {"lr": 0.0, "tags": ["", ""]}}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fuzz") / "ckpt"
    save(_state(), checkpoint_id=path, no_dist=True)
    return path


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def _kept(written, given, where: str = "$") -> None:
    """Every value the parser kept (as written back out) is the value it was given."""
    if written in ({}, []) and not given:  # an optional mapping or list left empty (null, false, {}...)
        return
    if isinstance(written, dict):
        assert isinstance(given, dict), where
        for key, value in written.items():
            if key not in given:  # a field the input left out: only an empty default may appear
                assert value in (None, {}, []), f"{where}.{key} = {value!r} appeared from nowhere"
                continue
            _kept(value, given[key], f"{where}.{key}")
    elif isinstance(written, list):
        assert isinstance(given, list) and len(given) == len(written), where
        for i, (w, g) in enumerate(zip(written, given)):
            _kept(w, g, f"{where}[{i}]")
    elif isinstance(written, float) and math.isnan(written):  # NaN == NaN is False
        assert isinstance(given, float) and math.isnan(given), f"{where}: parsed {written!r} from {given!r}"
    else:
        assert written == given and type(written) is type(given) or (
            isinstance(written, float) and isinstance(given, int) and not isinstance(given, bool)
            and written == given), f"{where}: parsed {written!r} from {given!r}"


def _parse_cleanly(text) -> None:
    """Either a clean ``CheckpointError``, or metadata that says exactly what the text says."""
    try:
        md = metadata_from_json(text, source="fuzz")
    except CheckpointError:
        return
    assert isinstance(md, Metadata)
    written = metadata_to_json(md)
    assert metadata_from_json(written, source="round trip") == md
    doc = json.loads(written)
    del doc[METADATA_DIGEST]  # the writer's digest of what it wrote, never a parsed value
    _kept(doc, json.loads(text))


@FUZZ
@given(st.binary(max_size=400))
def test_metadata_parser_on_random_bytes(data: bytes) -> None:
    _parse_cleanly(data)


@FUZZ
@given(json_values)
def test_metadata_parser_on_random_json(value) -> None:
    _parse_cleanly(json.dumps(value))


def _mutate(doc, data, depth: int = 0):
    """Replace one randomly chosen node of ``doc`` (a JSON tree) by a random JSON value."""
    if depth > 0 and data.draw(st.integers(0, 3)) == 0 or not isinstance(doc, (dict, list)) or not doc:
        return data.draw(json_values)
    if isinstance(doc, dict):
        key = data.draw(st.sampled_from(sorted(doc)))
        if data.draw(st.integers(0, 9)) == 0:
            del doc[key]
            return doc
        doc[key] = _mutate(doc[key], data, depth + 1)
    else:
        i = data.draw(st.integers(0, len(doc) - 1))
        doc[i] = _mutate(doc[i], data, depth + 1)
    return doc


@FUZZ
@given(st.data())
def test_metadata_parser_on_mutated_metadata(good: Path, data) -> None:
    doc = json.loads((good / ".metadata").read_text())
    del doc[METADATA_DIGEST]  # the content checks, as a document without the digest meets them
    for _ in range(data.draw(st.integers(1, 3))):
        doc = _mutate(copy.deepcopy(doc), data)
    _parse_cleanly(json.dumps(doc))


@pytest.mark.parametrize("case", ["a file nothing refers to, unsized", "an unsized file listed first"])
def test_a_file_table_with_unsized_files_is_written_back_as_read(good: Path, case: str) -> None:
    """Two documents the mutation fuzz found: the writer dropped the first's unreferenced
    unsized file and listed the second's sized file first."""
    doc = json.loads((good / ".metadata").read_text())
    del doc[METADATA_DIGEST]
    doc.pop("header_digests", None)
    assert [name for name, _ in doc["files"]] == ["_rank0_.safetensors", "_rank0_.bytes"]
    if case == "a file nothing refers to, unsized":
        doc["objects"], doc["files"][1][1] = {}, None
    else:
        doc["files"][0][1] = None
    md = metadata_from_json(json.dumps(doc), source="test")
    assert list(md.files) == (["_rank0_.safetensors"] if doc["objects"] == {} else ["_rank0_.bytes"])
    _parse_cleanly(json.dumps(doc))
    assert json.loads(metadata_to_json(md))["files"] == doc["files"]


@FUZZ
@given(st.data())
def test_a_mutated_metadata_with_its_digest_is_refused(good: Path, data) -> None:
    """With the writer's digest kept, any mutation that changes the content is refused."""
    original = json.loads((good / ".metadata").read_text())
    doc = copy.deepcopy(original)
    for _ in range(data.draw(st.integers(1, 3))):
        doc = _mutate(copy.deepcopy(doc), data)
    if isinstance(doc, dict):
        doc[METADATA_DIGEST] = original[METADATA_DIGEST]

    def content(d) -> str:  # as serialised: 1, 1.0 and true differ there
        return json.dumps({k: v for k, v in d.items() if k != METADATA_DIGEST} if isinstance(d, dict) else d)

    changed = content(doc) != content(original)
    try:
        md = metadata_from_json(json.dumps(doc), source="fuzz")
    except CheckpointError as exc:
        assert changed, f"an unchanged document was refused: {exc}"
        return
    assert not changed and md.header_digests  # only the document as saved parses, and is trusted


def test_metadata_parser_on_deep_nesting() -> None:
    for text in ("[" * 100_000 + "]" * 100_000, '{"format_version": 1, "state_dict_metadata": ' + "[" * 50_000):
        _parse_cleanly(text)


@FUZZ
@given(st.binary(max_size=300))
def test_object_loader_on_random_bytes(data: bytes) -> None:
    try:
        value = deserialize_object(data, fqn="obj", file="fuzz.bytes")
    except CheckpointError:
        return
    _plain(value)


@FUZZ
@given(st.data())
def test_object_loader_on_mutated_pickles(data) -> None:
    blob = bytearray(serialize_object({"lr": 0.5, "t": torch.ones(2), "tags": ["x", "y"]}))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] = data.draw(st.integers(0, 255))
    try:
        value = deserialize_object(bytes(blob), fqn="obj", file="fuzz.bytes")
    except CheckpointError:
        return
    _plain(value)


def _plain(value) -> None:
    """A successful decode of damaged bytes still yields only plain data (no other objects)."""
    if isinstance(value, dict):
        for k, v in value.items():
            _plain(k)
            _plain(v)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            _plain(v)
    else:
        assert value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.Tensor)), type(value)


# ------------------------------------------------------------------ shard files
shard_edits = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
        st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
        st.tuples(st.just("insert"), st.integers(0, 10_000), st.integers(0, 255)),
    ),
    min_size=1,
    max_size=4,
)


def _apply(file: Path, edits) -> bool:
    """Apply ``edits`` to ``file``; returns whether its bytes changed."""
    raw = file.read_bytes()
    data = bytearray(raw)
    for kind, pos, value in edits:
        pos = pos % (len(data) + 1)
        if kind == "flip" and pos < len(data):
            data[pos] ^= value
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = bytes([value])
    file.write_bytes(bytes(data))
    return bytes(data) != raw


def _load_or_clean_error(path: Path, verify: bool):
    target = _blank()
    try:
        load(target, checkpoint_id=path, no_dist=True, verify=verify)
    except CheckpointError:
        return None
    return target


def test_undamaged_copy_loads(good: Path) -> None:
    """The baseline of the property below: the intact checkpoint loads, verified, exactly."""
    loaded = _load_or_clean_error(good, verify=True)
    assert loaded is not None
    ref = _state()
    assert torch.equal(loaded["a"], ref["a"]) and torch.equal(loaded["b"], ref["b"]) and loaded["obj"] == ref["obj"]
    assert verify_checkpoint(good).ok


@FUZZ_FILES
@given(edits=shard_edits, which=st.sampled_from(["_rank0_.safetensors", "_rank0_.bytes"]))
def test_damaged_shard_file_never_loads_wrong_numbers(good: Path, edits, which: str) -> None:
    with tempfile.TemporaryDirectory(prefix="hp-dcp-fuzz-") as tmp:
        path = Path(tmp) / "ckpt"
        shutil.copytree(good, path)
        _apply(path / which, edits)
        loaded = _load_or_clean_error(path, verify=True)
        if loaded is not None:  # allowed only if what was loaded is exactly what was saved
            ref = _state()
            assert torch.equal(loaded["a"], ref["a"]) and torch.equal(loaded["b"], ref["b"])
            assert loaded["obj"] == ref["obj"]
        _load_or_clean_error(path, verify=False)  # unverified: may not notice, but must not crash
        report = verify_checkpoint(path)
        assert report.ok == (loaded is not None), report.problems  # offline check agrees with the load
        assert isinstance(check_complete(path).complete, bool)
