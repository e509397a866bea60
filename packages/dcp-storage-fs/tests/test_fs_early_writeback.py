"""The filesystem writer starts the kernel's write-out of a data file while writing it.

``FileSystemWriter(sync_files=True)`` asks for write-out every 8 MiB of a file
(``sync_file_range``); the file is still fsynced before the commit, and its bytes and
checksums are those of the state dict.  Where the call is refused, writing goes on
without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.pipeline import load_state_dict, save_state_dict
from hyper_parallel_dcp.storage_fs import FileSystemReader, FileSystemWriter
from hyper_parallel_dcp.storage_fs import filesystem as fs_module
from hyper_parallel_dcp.storage_fs.integrity import verify_checkpoint

MiB = 1 << 20


def _state() -> dict:
    # 24 x 1 MiB float32 chunks, each a distinct ramp, plus an object
    state: dict = {f"w{i:02d}": torch.arange(MiB // 4, dtype=torch.float32) + i for i in range(24)}
    state["step"] = 7
    return state


def _calls(monkeypatch: pytest.MonkeyPatch, answer: bool) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []
    real = fs_module._start_writeback

    def recording(fd: int, offset: int) -> bool:
        calls.append((fd, offset))
        return real(fd, offset) and answer

    monkeypatch.setattr(fs_module, "_start_writeback", recording)
    return calls


def _load_back(path: Path) -> dict:
    target: dict = {f"w{i:02d}": torch.zeros(MiB // 4) for i in range(24)}
    target["step"] = None
    load_state_dict(target, FileSystemReader(path), no_dist=True)
    return target


def test_write_out_starts_every_8_mib_and_the_bytes_are_right(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _calls(monkeypatch, True)
    save_state_dict(_state(), FileSystemWriter(tmp_path / "ck"), no_dist=True)
    # 24 MiB of tensor data plus the header: write-out started at 8 and 16 MiB (and 24)
    offsets = [offset for _, offset in calls]
    assert len(offsets) >= 2 and offsets == sorted(offsets) and offsets[0] == 0, offsets
    assert all(b - a >= 8 * MiB for a, b in zip(offsets, offsets[1:])), offsets
    assert verify_checkpoint(tmp_path / "ck").ok
    loaded = _load_back(tmp_path / "ck")
    for key, value in _state().items():
        assert (torch.equal(loaded[key], value) if isinstance(value, torch.Tensor) else loaded[key] == value), key


def test_refused_write_out_is_not_asked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _calls(monkeypatch, False)
    save_state_dict(_state(), FileSystemWriter(tmp_path / "ck"), no_dist=True)
    assert len(calls) == 1  # refused once: the rest of the file is written without it
    assert verify_checkpoint(tmp_path / "ck").ok
    assert torch.equal(_load_back(tmp_path / "ck")["w23"], _state()["w23"])


def test_no_write_out_without_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _calls(monkeypatch, True)
    save_state_dict(_state(), FileSystemWriter(tmp_path / "ck", sync_files=False), no_dist=True)
    assert calls == []
    assert verify_checkpoint(tmp_path / "ck").ok
