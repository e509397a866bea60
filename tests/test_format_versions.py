"""Format 1 and format 2 checkpoints both load; a newer format is refused naming both versions.

``fixtures/format_v1`` was written by the format-1 writer (``fixtures/make_format_v1.py``);
the same state is saved again here by the current writer (format 2), and both load to the
values the script wrote.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

import hyper_parallel_dcp as dcp
from hyper_parallel_dcp import RaggedShard
from hyper_parallel_dcp.core.errors import CheckpointFormatError
from hyper_parallel_dcp.core.metadata import FORMAT_VERSION, chunk_key

V1 = Path(__file__).resolve().parent / "fixtures" / "format_v1"


def _reference() -> dict:
    """What make_format_v1.py saved, computed here independently."""
    full = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    return {
        "layer.w": torch.arange(30, dtype=torch.float32).reshape(6, 5),
        "layer.ragged": full.reshape(-1)[3:17],
        "layer.bf": torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]).to(torch.bfloat16),
        "name with space": torch.tensor([1, 2, 3]),
        "scalar": torch.tensor(3),
        "extra": {"epoch": 2, "name": "x"},
    }


def _blank() -> dict:
    return {
        "layer.w": torch.zeros(6, 5),
        "layer.ragged": RaggedShard(torch.zeros(14), (4, 5), [(3, 17)]),
        "layer.bf": torch.zeros(3, 2, dtype=torch.bfloat16),
        "name with space": torch.zeros(3, dtype=torch.int64),
        "scalar": torch.tensor(0),
        "extra": {"epoch": 0, "name": ""},
    }


def _check(loaded: dict) -> None:
    ref = _reference()
    for fqn in ("layer.w", "layer.bf", "name with space", "scalar"):
        assert torch.equal(loaded[fqn], ref[fqn]), fqn
    assert torch.equal(loaded["layer.ragged"].local_tensor, ref["layer.ragged"])
    assert loaded["extra"] == ref["extra"]


def _version(path: Path) -> int:
    return json.loads((path / ".metadata").read_text())["format_version"]


@pytest.mark.parametrize("verify", [False, True])
def test_format_1_checkpoint_loads(tmp_path: Path, verify: bool) -> None:
    path = tmp_path / "v1"
    shutil.copytree(V1, path)  # a load never writes, but keep the fixture out of reach anyway
    assert _version(path) == 1
    state = _blank()
    dcp.load(state, checkpoint_id=path, no_dist=True, verify=verify)
    _check(state)


def test_format_2_checkpoint_of_the_same_state_loads(tmp_path: Path) -> None:
    state = _blank()
    dcp.load(state, checkpoint_id=V1, no_dist=True)
    path = tmp_path / "v2"
    dcp.save(state, checkpoint_id=path, no_dist=True)
    assert _version(path) == FORMAT_VERSION == 2
    assert (path / ".metadata").stat().st_size < (V1 / ".metadata").stat().st_size
    again = _blank()
    dcp.load(again, checkpoint_id=path, no_dist=True, verify=True)
    _check(again)
    # the escaped key of an FQN with spaces is in the file; format 1 stored it unescaped
    header = (path / "_rank0_.safetensors").read_bytes()
    assert chunk_key("name with space", (0,)).encode() in header
    assert b"name!20with!20space 000000000000" in header
    assert b"name with space 000000000000" in (V1 / "_rank0_.safetensors").read_bytes()


def test_format_3_is_refused_naming_both_versions(tmp_path: Path) -> None:
    path = tmp_path / "v3"
    shutil.copytree(V1, path)
    doc = json.loads((path / ".metadata").read_text())
    doc["format_version"] = 3
    (path / ".metadata").write_text(json.dumps(doc))
    with pytest.raises(CheckpointFormatError) as info:
        dcp.load(_blank(), checkpoint_id=path, no_dist=True)
    text = str(info.value)
    assert "format_version 3" in text and "the 2 this" in text and str(path / ".metadata") in text


def test_inspect_shows_the_format_version(tmp_path: Path) -> None:
    from hyper_parallel_dcp.cli import main

    path = tmp_path / "v2"
    dcp.save(_reference(), checkpoint_id=path, no_dist=True)
    for ckpt, version in ((V1, 1), (path, 2)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["inspect", str(ckpt), "--json"]) == 0
        assert json.loads(out.getvalue())["format_version"] == version
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["inspect", str(ckpt)]) == 0
        assert f"format version  {version}" in out.getvalue()
