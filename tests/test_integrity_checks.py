"""Integrity: completeness by stat, checksums, corrupted/truncated shards, bad metadata, unsafe pickles."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import xxhash

from hyper_parallel_dcp import load, save
from hyper_parallel_dcp.core.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeObjectError,
)
from hyper_parallel_dcp.core.metadata import (
    FORMAT_VERSION,
    Metadata,
    MetadataIndex,
    StorageInfo,
    metadata_from_json,
    metadata_to_json,
)
from hyper_parallel_dcp.core.planner import LoadItemType, ReadItem
from hyper_parallel_dcp.core.testing import run_distributed
from hyper_parallel_dcp.storage_fs import FileSystemReader
from hyper_parallel_dcp.storage_fs.integrity import check_complete, find_latest_checkpoint, verify_checkpoint


def _state(scale: float = 1.0) -> dict:
    return {
        "a": torch.arange(100, dtype=torch.float32) * scale,
        "b": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "nested": {"c": torch.arange(6, dtype=torch.int64), "step": 7, "name": "run-1"},
    }


def _blank() -> dict:
    return {
        "a": torch.zeros(100),
        "b": torch.zeros(3, 4, dtype=torch.bfloat16),
        "nested": {"c": torch.zeros(6, dtype=torch.int64), "step": 0, "name": ""},
    }


def _flip(file: Path, pos: int) -> None:
    data = bytearray(file.read_bytes())
    data[pos] ^= 0x01
    file.write_bytes(bytes(data))


def _metadata(path: Path) -> Metadata:
    return metadata_from_json((path / ".metadata").read_bytes())


def _write_metadata(path: Path, md: Metadata) -> None:
    """Doctor a checkpoint through the metadata API, whichever format version it writes."""
    (path / ".metadata").write_text(metadata_to_json(md))


def _entry(path: Path, fqn: str) -> StorageInfo:
    return next(info for index, info in _metadata(path).storage_data.items() if index.fqn == fqn)


# ------------------------------------------------------------------- completeness
def test_check_complete_accepts_a_saved_checkpoint(tmp_path: Path) -> None:
    save(_state(), checkpoint_id=tmp_path / "c", no_dist=True)
    report = check_complete(tmp_path / "c")
    assert report.complete and report.problems == [] and report.format_version == FORMAT_VERSION == 2
    assert report.metadata is not None
    expected = {n: (tmp_path / "c" / n).stat().st_size for n in os.listdir(tmp_path / "c") if not n.startswith(".")}
    assert report.metadata.files == expected


def test_check_complete_reports_each_problem(tmp_path: Path) -> None:
    assert not check_complete(tmp_path / "missing").complete
    assert "does not exist" in check_complete(tmp_path / "missing").problems[0]
    (tmp_path / "empty").mkdir()
    report = check_complete(tmp_path / "empty")
    assert not report.complete and "neither .metadata" in report.problems[0]

    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    shard = path / "_rank0_.safetensors"
    size = shard.stat().st_size
    os.truncate(shard, size - 5)
    report = check_complete(path)
    assert not report.complete
    assert any(f"{shard} has {size - 5} bytes, the metadata records {size}" in p for p in report.problems)
    shard.unlink()
    assert any(f"{shard} is missing" in p for p in check_complete(path).problems)


def test_check_complete_never_reads_shard_data(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    _flip(path / "_rank0_.safetensors", (path / "_rank0_.safetensors").stat().st_size - 1)
    assert check_complete(path).complete  # same size: only verify_checkpoint can tell
    assert not verify_checkpoint(path).ok


def test_find_latest_checkpoint_skips_incomplete(tmp_path: Path) -> None:
    assert find_latest_checkpoint(tmp_path / "nothing") is None
    assert find_latest_checkpoint(tmp_path) is None
    for step in (10, 20, 30, 40, 200):
        save(_state(step), checkpoint_id=tmp_path / f"step_{step}", no_dist=True)
    (tmp_path / "step_200" / ".metadata").unlink()  # a save that never finished
    shard = tmp_path / "step_40" / "_rank0_.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    (tmp_path / "notes").mkdir()
    shutil.copytree(tmp_path / "step_30", tmp_path / ".step_999")  # hidden: e.g. a staging dir
    assert find_latest_checkpoint(tmp_path) == tmp_path / "step_30"
    assert find_latest_checkpoint(str(tmp_path)) == tmp_path / "step_30"


# ------------------------------------------------------------------- verification
def test_verify_checkpoint_counts_every_byte(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    seen: list[tuple[int, int]] = []
    report = verify_checkpoint(path, progress=lambda d, t: seen.append((d, t)))
    assert report.ok, report.problems
    tensor_bytes = 100 * 4 + 12 * 2 + 6 * 8
    object_bytes = (path / "_rank0_.bytes").stat().st_size
    assert report.bytes_checked == tensor_bytes + object_bytes
    assert report.chunks_checked == 3 + 2  # three tensors, two objects
    assert seen[-1] == (report.bytes_checked, report.bytes_checked)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_verify_checkpoint_names_the_corrupt_chunk(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    entry = _entry(path, "b")
    _flip(path / entry.relative_path, entry.offset + 3)
    report = verify_checkpoint(path)
    assert not report.ok and len(report.problems) == 1
    assert f"{path / entry.relative_path}: 'b' chunk at offsets [0, 0]: checksum mismatch" in report.problems[0]


def test_verified_load_names_file_fqn_and_chunk(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    entry = _entry(path, "nested.c")
    _flip(path / entry.relative_path, entry.offset + 10)
    with pytest.raises(CorruptCheckpointError) as info:
        load(_blank(), checkpoint_id=path, no_dist=True, verify=True)
    text = str(info.value)
    assert str(path / "_rank0_.safetensors") in text and "'nested.c'" in text and "offsets [0]" in text


def test_verified_load_of_an_object_detects_a_flip(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    entry = _entry(path, "nested.name")
    _flip(path / "_rank0_.bytes", entry.offset + entry.length - 30)
    with pytest.raises(CorruptCheckpointError, match="nested.name"):
        load(_blank(), checkpoint_id=path, no_dist=True, verify=True)


def test_unverified_load_of_an_object_refuses_a_flipped_value(tmp_path: Path) -> None:
    # without verify nothing hashes the bytes file; the archive's CRCs still catch a
    # damaged step count, which torch.load alone decodes as 6
    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    entry = _entry(path, "nested.step")
    file = path / entry.relative_path
    blob = file.read_bytes()[entry.offset:entry.offset + entry.length]
    at = blob.index(b"K\x07.")  # BININT1 7, STOP
    _flip(file, entry.offset + at + 1)
    with pytest.raises(CorruptCheckpointError, match="'nested.step' in .*_rank0_.bytes: stored object is damaged"):
        load(_blank(), checkpoint_id=path, no_dist=True)


def _save_sharded(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    save({"w": distribute_tensor(full, mesh, [Shard(0)])}, checkpoint_id=path)


@pytest.mark.distributed
def test_partial_read_of_a_corrupt_chunk_is_detected(tmp_path: Path) -> None:
    """A resharded load reading only the intact half of a chunk still hashes the whole chunk."""
    path = tmp_path / "c"
    run_distributed(_save_sharded, 2, str(path), timeout=180)
    entry = _metadata(path).storage_data[MetadataIndex("w", (4, 0))]
    assert entry.relative_path == "_rank1_.safetensors"
    _flip(path / entry.relative_path, entry.offset + entry.length - 1)  # last row of rows 4..7
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)

    def read_rows_4_5(verify: bool) -> torch.Tensor:
        reader = FileSystemReader(path, verify=verify)
        reader.set_up_storage_reader(reader.load_metadata(), is_coordinator=True)
        item = ReadItem(LoadItemType.TENSOR, MetadataIndex("w", (4, 0)), (0, 0), MetadataIndex("w", (4, 0)),
                        (0, 0), (2, 6))
        out = torch.empty(2, 6)
        reader.read_into(item, out)
        return out

    assert torch.equal(read_rows_4_5(False), full[4:6])  # the rows read are intact...
    with pytest.raises(CorruptCheckpointError) as info:  # ...but the chunk is not
        read_rows_4_5(True)
    assert "_rank1_.safetensors" in str(info.value) and "'w' chunk at offsets [4, 0]" in str(info.value)
    with pytest.raises(CorruptCheckpointError, match=r"offsets \[4, 0\]"):
        load({"w": torch.zeros(8, 6)}, checkpoint_id=path, no_dist=True, verify=True)
    report = verify_checkpoint(path)
    assert not report.ok and "'w' chunk at offsets [4, 0]: checksum mismatch" in report.problems[0]


# ------------------------------------------------------------------- truncation, bad headers
def test_truncated_shard_is_refused_without_verify(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    shard = path / "_rank0_.safetensors"
    os.truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(CorruptCheckpointError, match="truncated") as info:
        load(_blank(), checkpoint_id=path, no_dist=True, verify=False)
    assert str(shard) in str(info.value)


def test_truncated_shard_with_doctored_sizes_is_still_refused(tmp_path: Path) -> None:
    """Even when .metadata is edited to the truncated size, the header check catches it."""
    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    shard = path / "_rank0_.safetensors"
    new_size = shard.stat().st_size - 8
    os.truncate(shard, new_size)
    md = _metadata(path)
    md.files["_rank0_.safetensors"] = new_size
    _write_metadata(path, md)
    with pytest.raises(CorruptCheckpointError, match="outside") as info:
        load(_blank(), checkpoint_id=path, no_dist=True)
    assert str(shard) in str(info.value)


def test_header_disagreeing_with_metadata_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    shard = path / "_rank0_.safetensors"
    raw = shard.read_bytes()
    doctored = raw.replace(b'"shape":[3,4]', b'"shape":[4,3]', 1)
    assert doctored != raw
    shard.write_bytes(doctored)
    with pytest.raises(CorruptCheckpointError) as info:
        load(_blank(), checkpoint_id=path, no_dist=True)
    assert "'b' chunk at offsets [0, 0]" in str(info.value) and "shape [4, 3]" in str(info.value)


# ------------------------------------------------------------------- bad .metadata
def test_metadata_not_json(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointFormatError) as info:
        load(_blank(), checkpoint_id=path, no_dist=True)
    # a pickle protocol byte first: read as torch DCP metadata, which this is not either
    assert str(path / ".metadata") in str(info.value) and "not a readable torch DCP metadata pickle" in str(info.value)
    report = check_complete(path)
    assert not report.complete and report.format_version is None


def test_metadata_of_a_future_version(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    doc = json.loads((path / ".metadata").read_text())
    doc["format_version"] = 99
    (path / ".metadata").write_text(json.dumps(doc))
    with pytest.raises(CheckpointFormatError) as info:
        load(_blank(), checkpoint_id=path, no_dist=True)
    assert "format_version 99" in str(info.value) and f"the {FORMAT_VERSION} this" in str(info.value)
    report = check_complete(path)
    assert not report.complete and report.format_version == 99
    assert find_latest_checkpoint(tmp_path) is None


class _Evil:
    """Unpickling this would create ``marker`` (stands in for arbitrary code)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _plant_object(path: Path, fqn: str, blob: bytes) -> None:
    """Replace the stored object ``fqn`` with ``blob`` and make .metadata agree (sizes, checksum)."""
    md = _metadata(path)
    storage = dict(md.storage_data)
    entry = storage[MetadataIndex(fqn)]
    file = path / entry.relative_path
    data = file.read_bytes()
    data = data[: entry.offset] + blob + data[entry.offset + entry.length:]
    shift = len(blob) - entry.length
    for index, other in storage.items():
        if other.relative_path == entry.relative_path and other.offset > entry.offset:
            storage[index] = replace(other, offset=other.offset + shift)
    storage[MetadataIndex(fqn)] = replace(entry, length=len(blob), checksum=xxhash.xxh3_64_hexdigest(blob))
    md.storage_data = storage
    md.files[entry.relative_path] = len(data)
    file.write_bytes(data)
    _write_metadata(path, md)


@pytest.mark.parametrize("kind", ["torch_zip", "raw_pickle"])
def test_bytes_file_with_code_does_not_run(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    marker = tmp_path / "pwned"
    if kind == "torch_zip":
        import io

        buf = io.BytesIO()
        torch.save({"x": _Evil(str(marker))}, buf)
        blob = buf.getvalue()
    else:
        blob = pickle.dumps(_Evil(str(marker)), protocol=2)  # the legacy torch.save format
    _plant_object(path, "nested.name", blob)
    assert verify_checkpoint(path).ok  # consistent metadata: only the content is hostile
    for verify in (False, True):
        with pytest.raises(UnsafeObjectError) as info:
            load(_blank(), checkpoint_id=path, no_dist=True, verify=verify)
        assert "'nested.name'" in str(info.value) and "_rank0_.bytes" in str(info.value)
        assert "mkdir" in str(info.value) and "not allow-listed" in str(info.value)
    assert not marker.exists()


def test_foreign_pickle_protocol_in_bytes_file(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    marker = tmp_path / "pwned"
    _plant_object(path, "nested.name", pickle.dumps(_Evil(str(marker)), protocol=5))
    with pytest.raises(CorruptCheckpointError, match="nothing was executed") as info:
        load(_blank(), checkpoint_id=path, no_dist=True)
    assert "'nested.name'" in str(info.value)
    assert not marker.exists()


def test_pickled_metadata_file_does_not_run(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(_state(), checkpoint_id=path, no_dist=True)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    with pytest.raises(UnsafeObjectError, match=r"needs (posix|os)\.mkdir.*nothing was executed"):
        load(_blank(), checkpoint_id=path, no_dist=True)
    assert not check_complete(path).complete
    assert not marker.exists()


@dataclass
class Point:
    x: int
    y: int


def test_allow_listed_user_class_loads(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save({"p": Point(1, 2), "t": torch.ones(2)}, checkpoint_id=path, no_dist=True)
    target = {"p": None, "t": torch.zeros(2)}
    with pytest.raises(UnsafeObjectError, match="Point"):
        load(target, checkpoint_id=path, no_dist=True)
    with torch.serialization.safe_globals([Point]):
        load(target, checkpoint_id=path, no_dist=True, verify=True)
    assert target["p"] == Point(1, 2) and torch.equal(target["t"], torch.ones(2))


def test_mailbox_reader_does_not_run_code(tmp_path: Path) -> None:
    """The async mailbox files are read with the restricted unpickler: no code runs."""
    safe_pickle = pytest.importorskip("hyper_parallel_dcp.async_persist.safe_pickle")
    marker = tmp_path / "pwned"
    with pytest.raises(safe_pickle.UnsafePickleError, match="mkdir"):
        safe_pickle.loads(pickle.dumps(("tag", _Evil(str(marker)))), source="LOCAL_PLAN_0.pkl")
    assert not marker.exists()
    assert safe_pickle.loads(safe_pickle.dumps(("tag", {"a": [1, 2.5, "x"]}))) == ("tag", {"a": [1, 2.5, "x"]})


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=str(tmp_path / "nope")):
        load(_blank(), checkpoint_id=tmp_path / "nope", no_dist=True)


def test_roundtrip_with_verify(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(_state(3.0), checkpoint_id=path, no_dist=True)
    target = _blank()
    load(target, checkpoint_id=path, no_dist=True, verify=True)
    ref = _state(3.0)
    assert torch.equal(target["a"], ref["a"]) and torch.equal(target["b"], ref["b"])
    assert torch.equal(target["nested"]["c"], ref["nested"]["c"])
    assert target["nested"]["step"] == 7 and target["nested"]["name"] == "run-1"
