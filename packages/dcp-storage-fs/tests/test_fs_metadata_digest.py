"""``.metadata`` changed after the save is caught by a default load (no ``verify``).

With header digests, a file whose header matches its digest has every chunk located from
``.metadata`` alone; before ``metadata_digest``, an edited chunk offset there loaded the
wrong bytes silently.  Now the load refuses the file, naming it and the first chunk
whose location disagrees with its file's header.
"""

from __future__ import annotations

import json
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
from hyper_parallel_dcp.storage_fs.integrity import check_complete, verify_checkpoint
from hyper_parallel_dcp.storage_fs.testing import load, save


def _edit(path: Path, change) -> None:
    """A hand edit as a user makes it: json.load, change, json.dump (valid JSON)."""
    doc = json.loads((path / ".metadata").read_text())
    change(doc)
    (path / ".metadata").write_text(json.dumps(doc, indent=1))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "c"
    save(state(), checkpoint_id=path, no_dist=True)
    return path


def test_a_hand_edited_chunk_offset_fails_a_default_load(saved: Path) -> None:
    data = saved / "_rank0_.safetensors"
    size = data.stat().st_size
    doc = json.loads((saved / ".metadata").read_text())
    first = doc["tensors"]["a"]["offset"][0]
    # 'a' shifted by one float32 inside the file: the header digest still matches, and the
    # bytes there are real data (the rest of 'a', then 'b'), so nothing else would notice
    _edit(saved, lambda d: d["tensors"]["a"]["offset"].__setitem__(0, first + 4))
    assert data.stat().st_size == size
    target = blank()
    with pytest.raises(CorruptCheckpointError) as raised:
        load(target, checkpoint_id=saved, no_dist=True)
    message = str(raised.value)
    assert f"{saved / '.metadata'} was changed after the save" in message
    assert (f"{data}: 'a' chunk at offsets [0]: key {chunk_key('a', (0,))!r} occupies bytes "
            f"[{first}, {first + 128}), the metadata says [{first + 4}, {first + 132})") in message
    assert torch.equal(target["a"], torch.zeros(32))  # nothing was read


@pytest.mark.parametrize("change, what", [
    # a chunk's shape: same element count, another layout
    (lambda d: d["tensors"]["b"].update(size=[4, 3], sizes=[4, 3]), "'b' chunk at offsets [0, 0]"),
    # a dtype of the same size
    (lambda d: d["tensors"]["b"].update(dtype="float16"), "'b' chunk at offsets [0, 0]"),
    # a file's header digest
    (lambda d: d["header_digests"].__setitem__(0, "0" * 16), "none in the chunk locations"),
])
def test_other_edited_locations_fail_a_default_load(saved: Path, change, what: str) -> None:
    _edit(saved, change)
    with pytest.raises(CorruptCheckpointError, match="was changed after the save") as raised:
        load(blank(), checkpoint_id=saved, no_dist=True)
    assert what in str(raised.value)


def test_a_flipped_byte_elsewhere_in_metadata_fails_a_default_load(saved: Path) -> None:
    raw = (saved / ".metadata").read_bytes()
    doc = json.loads(raw)
    checksum = doc["tensors"]["c"]["checksum"]
    at = raw.index(checksum.encode()) + 5  # a digit of c's recorded checksum, in the raw bytes
    flipped = raw[:at] + (b"0" if raw[at:at + 1] != b"0" else b"1") + raw[at + 1:]
    (saved / ".metadata").write_bytes(flipped)
    with pytest.raises(CorruptCheckpointError) as raised:
        load(blank(), checkpoint_id=saved, no_dist=True)
    assert f"{saved / '.metadata'} was changed after the save" in str(raised.value)
    assert "none in the chunk locations" in str(raised.value)


def test_the_tools_report_the_altered_file_and_what_disagrees(saved: Path) -> None:
    first = json.loads((saved / ".metadata").read_text())["tensors"]["a"]["offset"][0]
    _edit(saved, lambda d: d["tensors"]["a"]["offset"].__setitem__(0, first + 4))
    report = check_complete(saved)
    assert not report.complete and report.metadata is not None
    assert any("was changed after the save" in p for p in report.problems)
    problems = verify_checkpoint(saved).problems
    assert any("was changed after the save" in p for p in problems)
    assert any(f"{chunk_key('a', (0,))!r} occupies bytes [{first}, {first + 128})" in p for p in problems)


def test_an_older_checkpoint_without_the_digest_loads_as_before(saved: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Written before ``metadata_digest`` (header digests present or not): every file's
    header is parsed and each chunk compared, and the values load."""
    _edit(saved, lambda d: d.pop("metadata_digest"))
    parsed = count_parses(monkeypatch)
    target = blank()
    load(target, checkpoint_id=saved, no_dist=True)
    assert_loaded(target)
    assert parsed == [(saved / "_rank0_.safetensors").stat().st_size]
    # and an edited offset in it is caught by that per-chunk check, naming the key
    first = json.loads((saved / ".metadata").read_text())["tensors"]["a"]["offset"][0]
    _edit(saved, lambda d: d["tensors"]["a"]["offset"].__setitem__(0, first + 4))
    with pytest.raises(CorruptCheckpointError, match=f"key {chunk_key('a', (0,))!r} occupies bytes"):
        load(blank(), checkpoint_id=saved, no_dist=True)


def test_an_intact_checkpoint_still_skips_the_header_parse(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = (saved / ".metadata").read_bytes()
    doc = json.loads(raw)
    rest = raw[:raw.rindex(b',"metadata_digest"')] + b"}"
    assert doc["metadata_digest"] == xxhash.xxh3_64_hexdigest(rest)  # computed here, from the bytes
    parsed = count_parses(monkeypatch)
    target = blank()
    load(target, checkpoint_id=saved, no_dist=True)
    assert_loaded(target)
    assert parsed == []
    # re-indented by a JSON tool, same content: still trusted
    (saved / ".metadata").write_text(json.dumps(doc, indent=2))
    target = blank()
    load(target, checkpoint_id=saved, no_dist=True)
    assert_loaded(target)
    assert parsed == []


def _save_rank_local(rank: int, world_size: int, path: str) -> None:
    save_state_dict({f"w{rank}": torch.arange(6.0) + rank, "step": 3}, FileSystemWriter(path),
                    use_collectives=False)


@pytest.mark.distributed
def test_rank_metadata_files_carry_a_valid_digest(tmp_path: Path) -> None:
    path = tmp_path / "local"
    run_distributed(_save_rank_local, 2, str(path), timeout=240)
    for rank in (0, 1):
        raw = (path / f"{rank}.metadata").read_bytes()
        assert json.loads(raw)["metadata_digest"] == xxhash.xxh3_64_hexdigest(
            raw[:raw.rindex(b',"metadata_digest"')] + b"}")
        metadata_from_json(raw)
    target = {"w0": torch.zeros(6), "w1": torch.zeros(6), "step": 0}
    load(target, checkpoint_id=path, no_dist=True)
    assert torch.equal(target["w0"], torch.arange(6.0)) and torch.equal(target["w1"], torch.arange(6.0) + 1)
    doc = json.loads((path / "1.metadata").read_text())
    doc["tensors"]["w1"]["offset"][0] += 4
    (path / "1.metadata").write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match=r"1\.metadata was changed after the save"):
        load(target, checkpoint_id=path, no_dist=True)


def _save_halves(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(64, dtype=torch.float32).view(8, 8)
    save_state_dict({"w": distribute_tensor(full, mesh, [Shard(0)])}, FileSystemWriter(path))


def _load_halves(rank: int, world_size: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    target = {"w": distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0)])}
    try:
        load_state_dict(target, FileSystemReader(path))
    except Exception as exc:  # noqa: BLE001 - the test checks every rank's message
        return f"{type(exc).__name__}: {exc}"
    return "loaded" if torch.equal(target["w"].full_tensor(), torch.arange(64.0).view(8, 8)) else "wrong values"


@pytest.mark.distributed
def test_two_ranks_reading_metadata_once_both_refuse_an_edited_offset(tmp_path: Path) -> None:
    path = tmp_path / "c"
    run_distributed(_save_halves, 2, str(path), timeout=240)
    assert run_distributed(_load_halves, 2, str(path), timeout=240) == ["loaded", "loaded"]
    # rank 1's rows shifted by one row (32 bytes) inside rank 1's file: on main, rows 3.. of w loaded as 4..
    _edit(path, lambda d: d["tensors"]["w"]["offset"].__setitem__(1, d["tensors"]["w"]["offset"][1] + 32))
    for message in run_distributed(_load_halves, 2, str(path), timeout=240):
        assert "CorruptCheckpointError" in message or "CheckpointException" in message, message
        assert f"{path / '.metadata'} was changed after the save" in message, message
        assert f"{chunk_key('w', (4, 0))!r} occupies bytes" in message, message
