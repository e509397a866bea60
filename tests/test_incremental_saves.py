"""Incremental saves (SPEC §14): a chunk equal to the same chunk of an earlier checkpoint is
referenced, not written.  Bytes written, bit-exact restores (also after retention deleted
the steps between), the manager's ``full_every``, the tools and converters, s3://, and the
error when a referenced checkpoint was deleted by hand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.errors import CheckpointNotFoundError
from hyper_parallel_dcp.core.metadata import is_file_name, referenced_checkpoint
from hyper_parallel_dcp.core.testing import run_distributed

pytest_plugins = ("hyper_parallel_dcp.storage_object.testing",)

TENSORS, ROWS, COLS = 50, 256, 256  # 50 x 256 KiB fp32: one tensor is 2 % of the model


def _model(changed: int = 0) -> dict[str, torch.Tensor]:
    """A frozen base; ``changed`` > 0 adds ``changed`` to tensor 7 only."""
    g = torch.Generator().manual_seed(3)
    sd = {f"layer{i}.w": torch.randn(ROWS, COLS, generator=g) for i in range(TENSORS)}
    sd["layer7.w"] += changed
    return sd


def _own_bytes(ckpt: Path) -> int:
    """Bytes in the checkpoint's own directory: what the save wrote."""
    return sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())


def _sharded_worker(rank: int, world_size: int, root: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import hyper_parallel_dcp as dcp

    mesh = init_device_mesh("cpu", (world_size,))

    def sharded(sd):
        return {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in sd.items()}

    dcp.save(sharded(_model()), checkpoint_id=f"{root}/step_1")
    md = dcp.save(sharded(_model(1)), checkpoint_id=f"{root}/step_2", incremental_from=f"{root}/step_1")
    target = sharded({k: torch.zeros_like(v) for k, v in _model().items()})
    dcp.load(target, checkpoint_id=f"{root}/step_2", verify=True)
    expected = _model(1)
    assert all(torch.equal(target[k].full_tensor(), expected[k]) for k in expected)
    return sum(info.length for info in md.storage_data.values() if referenced_checkpoint(info.relative_path))


@pytest.mark.distributed
def test_frozen_base_save_writes_only_the_changed_bytes(tmp_path):
    referenced = run_distributed(_sharded_worker, 2, str(tmp_path))
    changed = ROWS * COLS * 4
    total = TENSORS * changed
    assert referenced == [total - changed] * 2  # every unchanged chunk, on both ranks' metadata
    written = _own_bytes(tmp_path / "step_2")  # two data files' headers and .metadata included
    assert written <= 1.05 * changed, (written, changed)
    assert _own_bytes(tmp_path / "step_1") > total
    # another layout, one process: the references resolve the same
    import hyper_parallel_dcp as dcp

    out = {k: torch.zeros_like(v) for k, v in _model().items()}
    dcp.load(out, checkpoint_id=tmp_path / "step_2", no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in _model(1).items())


def test_chain_points_at_the_bytes_and_tools_resolve_references(tmp_path, capsys):
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.cli import main
    from hyper_parallel_dcp.cli.inspect_ckpt import describe_checkpoint
    from hyper_parallel_dcp.offline_transform import convert_dcp_to_huggingface, dcp_to_full_state_dict
    from hyper_parallel_dcp.offline_transform.torch_dcp import convert_dcp_to_torch_dcp

    sd = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16), "c": torch.arange(7)}
    dcp.save(sd, checkpoint_id=tmp_path / "step_1", no_dist=True)
    sd2 = {**sd, "b": sd["b"] * 2}
    dcp.save(sd2, checkpoint_id=tmp_path / "step_2", no_dist=True, incremental_from=tmp_path / "step_1")
    sd3 = {**sd2, "c": sd["c"] + 1}
    dcp.save(sd3, checkpoint_id=tmp_path / "step_3", no_dist=True, incremental_from=tmp_path / "step_2")
    doc = json.loads((tmp_path / "step_3" / ".metadata").read_text())
    names = [entry[0] for entry in doc["files"]]
    # a reference names the file holding the bytes, never another reference
    assert sorted(names) == ["../step_1/_rank0_.safetensors", "../step_2/_rank0_.safetensors", "_rank0_.safetensors"]
    described = describe_checkpoint(tmp_path / "step_3")
    assert described["complete"] and described["referenced_bytes"] == {"step_1": 48, "step_2": 10}
    assert described["own_bytes"] == (tmp_path / "step_3" / "_rank0_.safetensors").stat().st_size
    assert main(["verify", str(tmp_path / "step_3")]) == 0
    full = dcp_to_full_state_dict(tmp_path / "step_3")
    assert all(torch.equal(full[k], v) for k, v in sd3.items())
    convert_dcp_to_huggingface(tmp_path / "step_3", tmp_path / "hf")
    from safetensors.torch import load_file

    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(hf[k], v) for k, v in sd3.items())
    convert_dcp_to_torch_dcp(tmp_path / "step_3", tmp_path / "tdcp")
    out = {k: torch.zeros_like(v) for k, v in sd3.items()}
    dcp.load(out, checkpoint_id=tmp_path / "tdcp", no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in sd3.items())
    capsys.readouterr()


def test_deleted_reference_names_the_file_and_the_step_needing_it(tmp_path):
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.storage_fs.integrity import verify_checkpoint

    dcp.save(_model(), checkpoint_id=tmp_path / "step_1", no_dist=True)
    dcp.save(_model(1), checkpoint_id=tmp_path / "step_2", no_dist=True, incremental_from=tmp_path / "step_1")
    shutil.rmtree(tmp_path / "step_1")
    missing = str(tmp_path / "step_1" / "_rank0_.safetensors")
    with pytest.raises(CheckpointNotFoundError) as err:
        dcp.load({k: torch.zeros_like(v) for k, v in _model().items()}, checkpoint_id=tmp_path / "step_2",
                 no_dist=True)
    assert f"checkpoint file {missing} is missing: checkpoint step_2 is an incremental save" in str(err.value)
    assert "restore step_1" in str(err.value)
    report = verify_checkpoint(tmp_path / "step_2")
    assert not report.ok and any(p.startswith(f"checkpoint file {missing} is missing: checkpoint step_2")
                                 for p in report.problems), report.problems


def test_incremental_from_must_be_beside_the_checkpoint(tmp_path):
    import hyper_parallel_dcp as dcp

    dcp.save({"a": torch.ones(2)}, checkpoint_id=tmp_path / "x" / "step_1", no_dist=True)
    with pytest.raises(ValueError, match="must be another checkpoint beside"):
        dcp.save({"a": torch.ones(2)}, checkpoint_id=tmp_path / "step_2", no_dist=True,
                 incremental_from=tmp_path / "x" / "step_1")
    with pytest.raises(ValueError, match="must be another checkpoint beside"):
        dcp.save({"a": torch.ones(2)}, checkpoint_id=tmp_path / "x" / "step_1", no_dist=True,
                 incremental_from=tmp_path / "x" / "step_1")


def test_reference_names_in_the_format():
    assert is_file_name("../step_3/_rank0_.safetensors") and referenced_checkpoint("../step_3/f") == "step_3"
    for bad in ("../../a/b", "../a/b/c", "../a", "../../b", "a/b", "../a/..", ".././b"):
        assert referenced_checkpoint(bad) is None and not is_file_name(bad), bad


def _lora(step: int) -> torch.Tensor:
    return torch.full((16, 16), float(step))


def test_manager_restores_every_kept_step_after_retention_deleted_the_steps_between(tmp_path):
    from hyper_parallel_dcp import CheckpointManager

    saved = {}
    with CheckpointManager(tmp_path, keep_last=1, keep_every=3, incremental=True) as manager:
        for step in range(1, 7):
            head = torch.full((4,), 2.0 if step >= 2 else 1.0)  # changes once, at step 2
            sd = {"base": _model(), "lora": _lora(step), "head": head}
            manager.save(step, sd)
            saved[step] = sd
        # 3 and 6 are kept (keep_every, newest); 1 holds the frozen base, 2 the head they point at
        assert manager.all_steps() == [1, 2, 3, 6]
        for step in manager.all_steps():
            out = {"base": {k: torch.zeros_like(v) for k, v in _model().items()}, "lora": torch.zeros(16, 16),
                   "head": torch.zeros(4)}
            assert manager.restore(out, step=step) == step
            assert torch.equal(out["lora"], _lora(step)) and torch.equal(out["head"], saved[step]["head"])
            assert all(torch.equal(out["base"][k], v) for k, v in _model().items())
    assert (tmp_path / "step_6" / "_rank0_.safetensors").stat().st_size < 16 * 16 * 4 + 256  # lora and its header


def test_manager_full_every_bounds_the_chain(tmp_path):
    from hyper_parallel_dcp import CheckpointManager

    with CheckpointManager(tmp_path, keep_last=None, incremental=True, full_every=3) as manager:
        for step in range(1, 8):
            manager.save(step, {"base": _model(), "lora": _lora(step)})
    bases = {s: json.loads((tmp_path / f"step_{s}" / "hp-dcp-step.json").read_text())["incremental_from"]
             for s in range(1, 8)}
    assert bases == {1: None, 2: 1, 3: 2, 4: None, 5: 4, 6: 5, 7: None}
    assert _own_bytes(tmp_path / "step_4") > TENSORS * ROWS * COLS * 4


def test_incremental_save_on_s3(s3_test_env, s3_proxy):
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.storage_object.files import ObjectFiles
    from hyper_parallel_dcp.storage_object.testing import TEST_BUCKET

    root = f"s3://{TEST_BUCKET}/incremental"
    dcp.save(_model(), checkpoint_id=f"{root}/step_1", no_dist=True)
    dcp.save(_model(1), checkpoint_id=f"{root}/step_2", no_dist=True, incremental_from=f"{root}/step_1")
    changed = ROWS * COLS * 4
    assert ObjectFiles(f"{root}/step_2").total_size() <= 1.05 * changed
    out = {k: torch.zeros_like(v) for k, v in _model().items()}
    dcp.load(out, checkpoint_id=f"{root}/step_2", no_dist=True, verify=True)
    assert all(torch.equal(out[k], v) for k, v in _model(1).items())
    ObjectFiles(f"{root}/step_1").remove()
    with pytest.raises(CheckpointNotFoundError, match=f"{root}/step_1/_rank0_.safetensors is missing: checkpoint "
                                                      "step_2 is an incremental save"):
        dcp.load(out, checkpoint_id=f"{root}/step_2", no_dist=True)


def test_manager_incremental_on_s3_keeps_the_base(s3_test_env, s3_proxy):
    from hyper_parallel_dcp import CheckpointManager
    from hyper_parallel_dcp.storage_object.testing import TEST_BUCKET

    with CheckpointManager(f"s3://{TEST_BUCKET}/managed", keep_last=1, incremental=True) as manager:
        for step in range(1, 4):
            manager.save(step, {"base": _model(), "lora": _lora(step)})
        assert manager.all_steps() == [1, 3]  # 2 deleted; 1 holds the base that 3 points at
        out = {"base": {k: torch.zeros_like(v) for k, v in _model().items()}, "lora": torch.zeros(16, 16)}
        assert manager.restore(out) == 3
    assert torch.equal(out["lora"], _lora(3)) and all(torch.equal(out["base"][k], v) for k, v in _model().items())
