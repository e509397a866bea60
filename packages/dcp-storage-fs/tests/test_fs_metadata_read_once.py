"""``.metadata`` is read from storage once per job with collectives, once per rank without.

Real gloo ranks; every read of a ``*.metadata`` file is counted where it happens
(``Path.read_bytes``, which the filesystem reader uses for metadata and nothing else).
"""

from __future__ import annotations

import json
import pathlib
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.pipeline import load_state_dict, save_state_dict
from hyper_parallel_dcp.core.testing import run_distributed
from hyper_parallel_dcp.storage_fs import FileSystemReader, FileSystemWriter

pytestmark = pytest.mark.distributed


def _full() -> torch.Tensor:
    return torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)


def _save(rank: int, world_size: int, path: str, use_collectives: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {"w": distribute_tensor(_full(), mesh, [Shard(0)]), "bias": torch.arange(4.0) + 10,
             "step": 7}
    if use_collectives:
        save_state_dict(state, FileSystemWriter(path))
    else:  # every rank its own files and {rank}.metadata; the whole tensor from each rank
        state = {f"w{rank}": _full() + rank, "step": 7}
        save_state_dict(state, FileSystemWriter(path), use_collectives=False)


def _counting_reads() -> list[str]:
    reads: list[str] = []
    original = pathlib.Path.read_bytes

    def read_bytes(self: pathlib.Path) -> bytes:
        if self.name.endswith("metadata"):
            reads.append(self.name)
        return original(self)

    pathlib.Path.read_bytes = read_bytes  # type: ignore[method-assign]  # in this spawned rank only
    return reads


def _load(rank: int, world_size: int, path: str, use_collectives: bool, coordinator_rank: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    reads = _counting_reads()
    mesh = init_device_mesh("cpu", (world_size,))
    state = {"w": distribute_tensor(torch.zeros(12, 5), mesh, [Shard(0)]), "bias": torch.zeros(4), "step": 0}
    load_state_dict(state, FileSystemReader(path), use_collectives=use_collectives,
                    coordinator_rank=coordinator_rank)
    assert torch.equal(state["w"].full_tensor(), _full())
    assert torch.equal(state["bias"], torch.arange(4.0) + 10) and state["step"] == 7
    return reads


def _load_rank_files(rank: int, world_size: int, path: str, use_collectives: bool) -> list[str]:
    reads = _counting_reads()
    state = {f"w{r}": torch.zeros(12, 5) for r in range(world_size)}
    state["step"] = 0
    load_state_dict(state, FileSystemReader(path), use_collectives=use_collectives)
    for r in range(world_size):
        assert torch.equal(state[f"w{r}"], _full() + r)
    assert state["step"] == 7
    return reads


def _load_expecting_failure(rank: int, world_size: int, path: str) -> str:
    try:
        load_state_dict({"bias": torch.zeros(4)}, FileSystemReader(path))
    except Exception as exc:  # noqa: BLE001 - the test checks the message on every rank
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("read-once") / "ckpt"
    run_distributed(_save, 3, str(path), True, timeout=240)
    return path


@pytest.mark.parametrize("coordinator_rank", [0, 2])
def test_with_collectives_only_the_coordinator_reads_metadata_once(saved: Path, coordinator_rank: int) -> None:
    reads = run_distributed(_load, 3, str(saved), True, coordinator_rank, timeout=240)
    expected = [[] for _ in range(3)]
    expected[coordinator_rank] = [".metadata"]
    assert reads == expected


def test_without_collectives_every_rank_reads_it(saved: Path) -> None:
    reads = run_distributed(_load, 3, str(saved), False, 0, timeout=240)
    assert reads == [[".metadata"]] * 3


def test_rank_metadata_fallback_is_read_once_and_merged(tmp_path: Path) -> None:
    path = tmp_path / "local"
    run_distributed(_save, 3, str(path), False, timeout=240)
    assert not (path / ".metadata").exists()
    assert sorted(p.name for p in path.glob("*.metadata")) == ["0.metadata", "1.metadata", "2.metadata"]
    attempts = [".metadata", "0.metadata", "1.metadata", "2.metadata"]  # .metadata: tried, not there
    reads = run_distributed(_load_rank_files, 3, str(path), True, timeout=240)
    assert sorted(reads[0]) == attempts and reads[1:] == [[], []]
    reads = run_distributed(_load_rank_files, 3, str(path), False, timeout=240)
    assert [sorted(r) for r in reads] == [attempts] * 3


def test_a_metadata_failure_is_raised_on_every_rank_naming_the_file(tmp_path: Path, saved: Path) -> None:
    missing = tmp_path / "nowhere"
    for message in run_distributed(_load_expecting_failure, 3, str(missing), timeout=240):
        assert "CheckpointNotFoundError" in message or "CheckpointException" in message, message
        assert str(missing) in message and "does not exist" in message
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in saved.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    doc = json.loads((broken / ".metadata").read_text())
    doc["format_version"] = 3
    (broken / ".metadata").write_text(json.dumps(doc))
    for message in run_distributed(_load_expecting_failure, 3, str(broken), timeout=240):
        assert str(broken / ".metadata") in message and "format_version 3" in message, message
