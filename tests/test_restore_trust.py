"""A resume you can trust (SPEC §10): ``CheckpointManager.restore`` verifies what it loads,
falls back past a damaged step with a warning naming the step, the file and the failure,
says so when there is nothing to resume, and takes ``load``'s options."""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest
import torch

import hyper_parallel_dcp as dcp
from hyper_parallel_dcp.core.errors import CheckpointNotFoundError
from hyper_parallel_dcp.core.testing import run_distributed


def _state(step: int) -> dict:
    return {"model": {"w": torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64) + step},
            "optim": {"m": torch.full((256,), step * 10.0), "step": step}}


def _zeros() -> dict:
    return {"model": {"w": torch.zeros(64, 64)}, "optim": {"m": torch.zeros(256), "step": -1}}


def _assert_state(sd: dict, step: int) -> None:
    expected = _state(step)
    assert torch.equal(sd["model"]["w"], expected["model"]["w"])
    assert torch.equal(sd["optim"]["m"], expected["optim"]["m"])
    assert sd["optim"]["step"] == step


def _saved(root: Path, steps: tuple[int, ...] = (1, 2)) -> dcp.CheckpointManager:
    mgr = dcp.CheckpointManager(root, keep_last=None)
    for step in steps:
        assert mgr.save(step, _state(step))
    return mgr


def _tensor_files(step_dir: Path) -> list[Path]:
    return sorted(step_dir.glob("*.safetensors"))


def _flip_data_byte(path: Path, at: int = 5000) -> None:
    data = bytearray(path.read_bytes())
    header = struct.unpack("<Q", data[:8])[0]
    data[8 + header + at] ^= 0x01
    path.write_bytes(bytes(data))


def _damage_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8 + 3] = 0xFF  # inside the JSON header: no longer UTF-8
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 100])


@pytest.mark.parametrize("damage", [_flip_data_byte, _damage_header, _truncate, Path.unlink],
                         ids=["bit_flip", "header", "truncated", "missing"])
def test_a_damaged_newest_step_is_skipped_with_a_warning_and_the_older_one_loads(tmp_path, caplog, damage):
    mgr = _saved(tmp_path)
    victim = _tensor_files(tmp_path / "step_2")[0]
    damage(victim)
    sd = _zeros()
    with caplog.at_level(logging.WARNING, logger="hyper_parallel_dcp"):
        assert mgr.restore(sd) == 1
    _assert_state(sd, 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 2" in w and victim.name in w for w in warnings), warnings
    mgr.close()


def test_a_bit_flip_is_loaded_as_is_only_when_verification_is_off(tmp_path):
    mgr = _saved(tmp_path)
    _flip_data_byte(_tensor_files(tmp_path / "step_2")[0], at=0)
    sd = _zeros()
    assert mgr.restore(sd, verify=False) == 2  # the caller asked not to check: the step loads
    assert not torch.equal(sd["model"]["w"], _state(2)["model"]["w"])  # and holds the flipped bit
    mgr.close()


def test_a_damaged_step_asked_for_by_number_raises_naming_the_file(tmp_path):
    mgr = _saved(tmp_path)
    victim = _tensor_files(tmp_path / "step_2")[0]
    _flip_data_byte(victim)
    with pytest.raises(Exception, match=victim.name):
        mgr.restore(_zeros(), step=2)
    mgr.close()


def test_every_step_damaged_means_nothing_to_resume(tmp_path, caplog):
    mgr = _saved(tmp_path)
    for step in (1, 2):
        _flip_data_byte(_tensor_files(tmp_path / f"step_{step}")[0])
    with caplog.at_level(logging.WARNING, logger="hyper_parallel_dcp"):
        assert mgr.restore(_zeros()) is None
    with pytest.raises(CheckpointNotFoundError, match=str(tmp_path)):
        mgr.restore(_zeros(), required=True)
    mgr.close()


@pytest.mark.parametrize("kind", ["missing_root", "nothing_complete"])
def test_nothing_to_resume_logs_one_line_naming_the_root_and_required_raises(tmp_path, caplog, kind):
    root = tmp_path / "typo"
    if kind == "nothing_complete":
        (root / "step_5").mkdir(parents=True)  # an interrupted save: no .metadata
    mgr = dcp.CheckpointManager(root)
    with caplog.at_level(logging.INFO, logger="hyper_parallel_dcp"):
        assert mgr.restore(_zeros()) is None
    lines = [r.getMessage() for r in caplog.records if str(root) in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    with pytest.raises(CheckpointNotFoundError, match=str(root)):
        mgr.restore(_zeros(), required=True)
    mgr.close()


def test_restore_takes_loads_options_and_location_is_public(tmp_path):
    mgr = _saved(tmp_path, steps=(3,))
    assert mgr.location(3) == str(tmp_path / "step_3")
    grown = _zeros()
    grown["model"]["new_layer"] = torch.full((4,), 7.0)  # the model gained a layer since step 3
    with pytest.raises(Exception, match="new_layer"):
        mgr.restore(grown)
    assert mgr.restore(grown, allow_partial_load=True) == 3
    _assert_state(grown, 3)
    assert torch.equal(grown["model"]["new_layer"], torch.full((4,), 7.0))  # left as it was
    mgr.close()


def test_a_hand_made_step_without_metadata_older_than_a_new_step_is_removed(tmp_path):
    mgr = _saved(tmp_path, steps=(3,))
    stray = tmp_path / "step_7"
    stray.mkdir()
    (stray / "notes.txt").write_text("copied by hand")  # not even a file a save writes
    assert mgr.save(8, _state(8))
    assert not stray.exists()
    assert mgr.all_steps() == [3, 8]
    mgr.close()


def _corrupt_then_restore_worker(rank: int, world_size: int, root: str) -> int | None:
    import torch.distributed as dist

    mgr = dcp.CheckpointManager(root, keep_last=None)
    for step in (1, 2):
        mgr.save(step, _state(step))
    if rank == 1:  # rank 1's own shard of step 2 is damaged; rank 0 reads nothing bad
        for path in _tensor_files(Path(root) / "step_2"):
            _flip_data_byte(path, at=10)
    dist.barrier()
    sd = _zeros()
    restored = mgr.restore(sd)
    if restored is not None:
        _assert_state(sd, restored)
    mgr.close()
    return restored


@pytest.mark.distributed
def test_a_step_damaged_where_one_rank_reads_falls_back_on_every_rank(tmp_path):
    assert run_distributed(_corrupt_then_restore_worker, 2, str(tmp_path)) == [1, 1]


def _rank_local_objects_worker(rank: int, world_size: int, root: str) -> dict:
    sd = {"w": torch.ones(4), "loader": {"position": 100 + rank, "seed": [rank] * 3}, "shared": "same"}
    dcp.save(sd, checkpoint_id=root)
    target = {"w": torch.zeros(4), "loader": {"position": -1, "seed": []}, "shared": ""}
    dcp.load(target, checkpoint_id=root)
    return {"position": target["loader"]["position"], "seed": target["loader"]["seed"], "shared": target["shared"]}


@pytest.mark.distributed
def test_per_rank_objects_under_one_key_come_back_to_their_own_rank_with_collectives(tmp_path):
    out = run_distributed(_rank_local_objects_worker, 2, str(tmp_path))
    assert out == [{"position": 100, "seed": [0, 0, 0], "shared": "same"},
                   {"position": 101, "seed": [1, 1, 1], "shared": "same"}]
    md = dcp.FileSystemReader(str(tmp_path)).load_metadata()
    # copies that differ are each kept; equal copies are stored once
    assert sorted(md.rank_objects["loader.position"]) == [0, 1]
    assert "shared" not in md.rank_objects
