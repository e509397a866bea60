"""The header digest: a load checks each file's safetensors header once, by the xxh3 of its
bytes recorded in ``.metadata``; any other header takes the full parse and per-chunk check,
whose errors name the file, the key and the chunk."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import xxhash
from fs_digest_checks import assert_loaded, blank, count_parses, state

from hyper_parallel_dcp.core.errors import CorruptCheckpointError
from hyper_parallel_dcp.core.metadata import chunk_key, metadata_from_json
from hyper_parallel_dcp.core.pipeline import load_state_dict, save_state_dict
from hyper_parallel_dcp.core.testing import run_distributed
from hyper_parallel_dcp.storage_fs import FileSystemReader, FileSystemWriter
from hyper_parallel_dcp.storage_fs.testing import load, save

SHARD = "_rank0_.safetensors"


def _header_bytes(file: Path) -> bytes:
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return raw[:8 + length]


def test_the_save_records_each_tensor_files_header_digest(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(state(), checkpoint_id=path, no_dist=True)
    md = metadata_from_json((path / ".metadata").read_bytes())
    shard = path / SHARD
    # computed here from the file's bytes and size, independently of the writer
    expected = xxhash.xxh3_64_hexdigest(_header_bytes(shard) + struct.pack("<Q", shard.stat().st_size))
    assert md.header_digests == {SHARD: expected}
    assert "_rank0_.bytes" in md.files  # the objects file has no header, so no digest


def test_a_matching_header_is_not_parsed_and_the_values_load(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c"
    save(state(), checkpoint_id=path, no_dist=True)
    parsed = count_parses(monkeypatch)
    target = blank()
    load(target, checkpoint_id=path, no_dist=True)
    assert_loaded(target)
    assert parsed == []
    # verify=True keeps checking every chunk against the header and its checksum
    target = blank()
    load(target, checkpoint_id=path, no_dist=True, verify=True)
    assert_loaded(target)
    assert len(parsed) == 1


def test_metadata_without_digests_loads_through_the_full_check(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An older checkpoint (no ``header_digests``, no ``metadata_digest``) parses the header
    and checks each chunk."""
    path = tmp_path / "c"
    save(state(), checkpoint_id=path, no_dist=True)
    doc = json.loads((path / ".metadata").read_text())
    del doc["header_digests"], doc["metadata_digest"]
    (path / ".metadata").write_text(json.dumps(doc))
    parsed = count_parses(monkeypatch)
    target = blank()
    load(target, checkpoint_id=path, no_dist=True)
    assert_loaded(target)
    assert len(parsed) == 1


def test_a_valid_header_of_other_bytes_loads_through_the_full_check(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A header rewritten by another tool (same entries, other bytes) is not trusted, and
    still loads: the per-chunk check finds every entry where the metadata says."""
    path = tmp_path / "c"
    save(state(), checkpoint_id=path, no_dist=True)
    shard = path / SHARD
    raw = shard.read_bytes()
    doctored = raw.replace(b'{"format":"pt"}', b'{"format":"PT"}', 1)
    assert doctored != raw
    shard.write_bytes(doctored)
    parsed = count_parses(monkeypatch)
    target = blank()
    load(target, checkpoint_id=path, no_dist=True)
    assert_loaded(target)
    assert len(parsed) == 1


@pytest.mark.parametrize("old, new, why", [
    # the shape of 'b' transposed: a valid header that disagrees with the metadata
    (b'"shape":[3,4]', b'"shape":[4,3]', f"'b' chunk at offsets [0, 0]: key {chunk_key('b', (0, 0))!r} has shape [4, 3]"),
    # one digit of an offset: the entry no longer holds its shape's bytes
    (b'"data_offsets":[0,128]', b'"data_offsets":[0,129]', f"header entry {chunk_key('a', (0,))!r}"),
    # one digit of a shape
    (b'"shape":[2,3,4]', b'"shape":[2,3,5]', f"header entry {chunk_key('c', (0, 0, 0))!r}"),
])
def test_one_changed_byte_in_the_header_is_caught(tmp_path: Path, old: bytes, new: bytes, why: str) -> None:
    path = tmp_path / "c"
    save(state(), checkpoint_id=path, no_dist=True)
    shard = path / SHARD
    raw = shard.read_bytes()
    assert raw.count(old) == 1 and len(old) == len(new)
    shard.write_bytes(raw.replace(old, new))
    with pytest.raises(CorruptCheckpointError) as info:
        load(blank(), checkpoint_id=path, no_dist=True)
    assert str(shard) in str(info.value) and why in str(info.value)


def _save_halves(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(64, dtype=torch.float32).view(8, 8)
    save_state_dict({"w": distribute_tensor(full, mesh, [Shard(0)])}, FileSystemWriter(path))


@pytest.mark.distributed
def test_a_file_swapped_with_another_ranks_file_of_the_same_size_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "c"
    run_distributed(_save_halves, 2, str(path))
    target = {"w": torch.zeros(8, 8)}
    load_state_dict(target, FileSystemReader(path), no_dist=True)
    assert torch.equal(target["w"], torch.arange(64, dtype=torch.float32).view(8, 8))
    first, second = path / "_rank0_.safetensors", path / "_rank1_.safetensors"
    one, two = first.read_bytes(), second.read_bytes()
    assert len(one) == len(two) and one != two
    first.write_bytes(two)
    second.write_bytes(one)
    with pytest.raises(CorruptCheckpointError) as info:
        load_state_dict({"w": torch.zeros(8, 8)}, FileSystemReader(path), no_dist=True)
    assert str(first) in str(info.value) and f"key {chunk_key('w', (0, 0))!r} is missing" in str(info.value)


def test_merged_rank_metadata_keeps_every_ranks_digests() -> None:
    """A save without collectives writes a ``{rank}.metadata`` per rank; the merged view
    a load reads keeps each rank's file digest."""
    from hyper_parallel_dcp.core import metadata as m
    from hyper_parallel_dcp.storage_fs import merge_rank_metadata

    def part(rank: int) -> m.Metadata:
        name = f"_rank{rank}_.safetensors"
        md = m.TensorStorageMetadata(m.TensorProperties(torch.float32), torch.Size([4]),
                                     [m.ChunkStorageMetadata((2 * rank,), (2,))])
        info = m.StorageInfo(name, 96, 8, f"{rank:016x}", chunk_key("w", (2 * rank,)))
        return m.Metadata({"w": md}, storage_data={m.MetadataIndex("w", (2 * rank,)): info}, files={name: 104},
                          header_digests={name: f"{rank + 7:016x}"})

    merged = merge_rank_metadata({0: part(0), 1: part(1)})
    assert merged.header_digests == {"_rank0_.safetensors": f"{7:016x}", "_rank1_.safetensors": f"{8:016x}"}
