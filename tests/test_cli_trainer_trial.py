"""``hp-dcp`` as a trainer met it: ``verify`` of a torch DCP directory, ``ls`` and
``clean --dry-run`` agreeing about leftovers, ``ls``/``latest``/``clean`` without torch,
and ``dir(hyper_parallel_dcp)`` showing the API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import hyper_parallel_dcp as dcp
from hyper_parallel_dcp.cli import main as hp_dcp


def test_verify_of_a_complete_torch_dcp_directory_says_there_is_nothing_to_check(tmp_path, capsys):
    import torch.distributed.checkpoint as tdcp

    sd = {f"layer{i}.weight": torch.full((8, 8), float(i)) for i in range(50)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save({**sd, "step": 3}, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    assert hp_dcp(["verify", str(tmp_path / "torch")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("OK: ") and "no checksums" in out[0], out
    assert hp_dcp(["verify", str(tmp_path / "torch"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["format"] == "torch-dcp" and doc["problems"] == []
    # an incomplete one is still a problem found
    next((tmp_path / "torch").glob("*.distcp")).unlink()
    assert hp_dcp(["verify", str(tmp_path / "torch")]) == 1
    assert "FAILED" in capsys.readouterr().out


def _age(path: Path, seconds: float) -> None:
    old = time.time() - seconds
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (old, old), follow_symlinks=False)


def _listed(args: list[str], key: str, capsys) -> list[tuple[int, str, str]]:
    assert hp_dcp(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    return sorted((x["step"], x["kind"], x["path"]) for x in doc[key])


def test_ls_and_clean_dry_run_list_the_same_leftovers(tmp_path, capsys):
    with dcp.CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in (1, 4):
            mgr.save(step, {"w": torch.ones(4) * step})
    dead = tmp_path / ".step_2.hp-dcp-staging-dead"  # a save killed long ago
    dead.mkdir()
    (dead / "_rank0_.safetensors.hp-dcp-tmp").write_bytes(b"x" * 100)
    _age(dead, 3600)
    (tmp_path / ".step_2.hp-dcp-lock").write_text("{}")  # its lock file, nobody holds it
    _age(tmp_path / ".step_2.hp-dcp-lock", 3600)
    fresh = tmp_path / "step_3"  # killed a moment ago (or still writing)
    fresh.mkdir()
    (fresh / "LOCAL_PLAN_0.pkl").write_bytes(b"x")
    for grace in ([], ["--grace", "0"]):
        in_ls = _listed(["ls", str(tmp_path), *grace], "leftovers", capsys)
        in_clean = _listed(["clean", str(tmp_path), "--dry-run", *grace], "removed", capsys)
        assert in_ls == in_clean, (grace, in_ls, in_clean)
        assert {kind for _, kind, _ in in_ls} >= {"staging", "lock"}
        assert (3 in {step for step, _, _ in in_ls}) == bool(grace)  # recent: only with --grace 0
    assert hp_dcp(["ls", str(tmp_path)]) == 0
    assert f"'hp-dcp clean {tmp_path}' removes them" in capsys.readouterr().out


def test_dir_of_the_package_is_its_api():
    assert dir(dcp) == sorted(dcp.__all__)
    assert "importlib" not in dir(dcp) and "extend_path" not in dir(dcp)


@pytest.mark.parametrize("command", ["ls", "latest", "clean"])
def test_ls_latest_and_clean_import_no_torch(tmp_path, command):
    with dcp.CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, {"w": torch.ones(4)})
    code = ("import sys\nfrom hyper_parallel_dcp.cli import main\n"
            f"rc = main([{command!r}, {str(tmp_path / 'root')!r}])\n"
            "print('torch' in sys.modules, rc, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stderr.strip().splitlines()[-1] == "False 0", proc.stderr


def test_latest_decides_from_the_json_and_checks_a_torch_dcp_step_fully(tmp_path, capsys):
    import torch.distributed.checkpoint as tdcp

    root = tmp_path / "root"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(root / "step_1"), no_dist=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save({"w": torch.ones(4)}, checkpoint_id=str(root / "step_2"), no_dist=True)
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(root / "step_3"), no_dist=True)
    doc = json.loads((root / "step_3" / ".metadata").read_text())
    (root / "step_3" / ".metadata").write_text(json.dumps({**doc, "format_version": 99}))  # a newer writer's
    assert hp_dcp(["latest", str(root)]) == 0
    assert capsys.readouterr().out.strip() == str(root / "step_2")  # the pickle: check_complete
    (root / "step_2" / "__0_0.distcp").unlink()
    assert hp_dcp(["latest", str(root)]) == 0
    assert capsys.readouterr().out.strip() == str(root / "step_1")
