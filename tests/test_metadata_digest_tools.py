"""Every tool that writes ``.metadata`` leaves a valid ``metadata_digest``, and what it
wrote loads (through the header digests where it recorded them); an edit after any of
them is refused.

The writers: ``save``, ``async_save`` (its writer process), ``CheckpointManager``,
``hp-dcp-convert hf-to-dcp`` and ``torch-dcp-to-dcp``, and the object-store writer (moto's
S3 server on 127.0.0.1).  A save without collectives (``{rank}.metadata``) is in
``test_fs_metadata_digest.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xxhash

import hyper_parallel_dcp as dcp
from hyper_parallel_dcp.core.errors import CorruptCheckpointError
from hyper_parallel_dcp.core.metadata import metadata_from_json
from hyper_parallel_dcp.storage_object.testing import TEST_BUCKET

pytest_plugins = ("hyper_parallel_dcp.storage_object.testing",)


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"embed": torch.randn(16, 8, generator=g), "proj": torch.randn(8, 12, generator=g).bfloat16(),
            "bias": torch.randn(12, generator=g)}


def _assert_digest(raw: bytes, *, header_digests: bool = True) -> None:
    """The digest is the last member and the xxh3 of the bytes before it (computed here)."""
    doc = json.loads(raw)
    cut = raw.rindex(b',"metadata_digest":"')
    assert raw[cut:] == b',"metadata_digest":"' + doc["metadata_digest"].encode() + b'"}'
    assert doc["metadata_digest"] == xxhash.xxh3_64_hexdigest(raw[:cut] + b"}")
    md = metadata_from_json(raw)
    assert bool(md.header_digests) is header_digests


def _assert_loads(checkpoint_id, full: dict[str, torch.Tensor]) -> None:
    sd = {k: torch.zeros_like(v) for k, v in full.items()}
    dcp.load(sd, checkpoint_id=checkpoint_id, no_dist=True)
    for k, v in full.items():
        assert torch.equal(sd[k], v), k


def _shift_first_offset(raw: bytes) -> bytes:
    """The hand edit: one chunk's byte offset moved by 4 (valid JSON)."""
    doc = json.loads(raw)
    entry = next(iter(doc["tensors"].values()))
    entry["offset"][0] += 4
    return json.dumps(doc).encode()


def _assert_edit_refused(path: Path, full: dict[str, torch.Tensor]) -> None:
    meta = path / ".metadata"
    meta.write_bytes(_shift_first_offset(meta.read_bytes()))
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata was changed after the save"):
        _assert_loads(path, full)


def test_save(tmp_path: Path) -> None:
    full = _full()
    dcp.save(full, checkpoint_id=tmp_path / "c", no_dist=True)
    _assert_digest((tmp_path / "c" / ".metadata").read_bytes())
    _assert_loads(tmp_path / "c", full)
    _assert_edit_refused(tmp_path / "c", full)


def test_async_save(tmp_path: Path) -> None:
    full = _full()
    dcp.async_save(dict(full), checkpoint_id=tmp_path / "c", no_dist=True).get_result(timeout=240)
    _assert_digest((tmp_path / "c" / ".metadata").read_bytes())
    _assert_loads(tmp_path / "c", full)
    _assert_edit_refused(tmp_path / "c", full)


def test_checkpoint_manager(tmp_path: Path) -> None:
    full = _full()
    with dcp.CheckpointManager(tmp_path / "run", keep_last=2) as manager:
        manager.save(3, {"model": dict(full)})
    step = tmp_path / "run" / "step_3"
    _assert_digest((step / ".metadata").read_bytes())
    sd = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
    dcp.load(sd, checkpoint_id=step, no_dist=True)
    assert all(torch.equal(sd["model"][k], v) for k, v in full.items())


def test_hf_to_dcp(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from hyper_parallel_dcp.offline_transform.cli import main as convert

    full = _full()
    (tmp_path / "hf").mkdir()
    save_file(full, str(tmp_path / "hf" / "model.safetensors"))
    assert convert(["hf-to-dcp", str(tmp_path / "hf"), str(tmp_path / "c"), "-q"]) == 0
    _assert_digest((tmp_path / "c" / ".metadata").read_bytes())
    _assert_loads(tmp_path / "c", full)
    _assert_edit_refused(tmp_path / "c", full)


def test_torch_dcp_to_dcp(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as torch_dcp

    from hyper_parallel_dcp.offline_transform.cli import main as convert

    full = _full()
    torch_dcp.save(dict(full), checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    assert convert(["torch-dcp-to-dcp", str(tmp_path / "torch"), str(tmp_path / "c"), "-q"]) == 0
    _assert_digest((tmp_path / "c" / ".metadata").read_bytes())
    _assert_loads(tmp_path / "c", full)
    _assert_edit_refused(tmp_path / "c", full)


def test_object_store(s3_test_env, s3_proxy) -> None:
    from hyper_parallel_dcp.storage_object import ObjectStore

    full = _full()
    url = f"s3://{TEST_BUCKET}/digest/step_1"
    dcp.save(full, checkpoint_id=url, no_dist=True)
    store = ObjectStore(TEST_BUCKET)
    raw = store.get("digest/step_1/.metadata")
    _assert_digest(raw)
    _assert_loads(url, full)
    # the object-store reader checks no header: the digest is its only guard against an edit
    store.put("digest/step_1/.metadata", _shift_first_offset(raw))
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata was changed after the save"):
        _assert_loads(url, full)
