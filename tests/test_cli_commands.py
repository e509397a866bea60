"""``hp-dcp`` inspect / diff / verify / latest / convert, run as the real console script
on checkpoints written by real 4-rank gloo saves; printed values are checked against the
state dict the ranks saved (rebuilt here from the same seed)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import placements_from_text, run_console_script, run_distributed

pytestmark = pytest.mark.distributed

MESH = (2, 2)
# FQN -> placements on the (2, 2) mesh; None: a plain tensor (replicated).
LAYOUT_2D = {
    "model.embed.weight": ("Shard(0)", "Shard(1)"),
    "model.proj.weight": ("Replicate", "Shard(1)"),  # 10 columns over 2: replicated over dim 0
    "model.norm.weight": ("Replicate", "Replicate"),
    "model.odd": ("Shard(0)", "Replicate"),  # 5 rows over 2: uneven
    "model.new": ("Replicate", "Shard(0)"),
    "optim.step": None,
}
# The same tensors on a 1-D mesh of 4, split along the last dim: another file layout.
LAYOUT_1D = {
    "model.embed.weight": ("Shard(1)",),
    "model.proj.weight": ("Shard(1)",),  # 10 columns over 4: 3, 3, 3, 1
    "model.norm.weight": ("Shard(0)",),
    "model.odd": ("Shard(1)",),  # 3 columns over 4: one rank holds nothing
    "model.new": ("Shard(0)",),
    "optim.step": None,
}


def reference(variant: str) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Full tensors and objects of checkpoint ``a`` (step 10) or ``b`` (step 20)."""
    gen = torch.Generator().manual_seed(1234)
    tensors = {
        "model.embed.weight": torch.randn(16, 8, generator=gen),
        "model.proj.weight": torch.randn(6, 10, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.randn(8, generator=gen),
        "model.odd": torch.randn(5, 3, generator=gen).to(torch.float16),
        "optim.step": torch.tensor(7, dtype=torch.int64),
    }
    objects: dict[str, object] = {"extra.epoch": 3, "extra.name": "run-a"}
    if variant == "b":
        tensors["model.embed.weight"][3, 2] += 0.5
        tensors["model.proj.weight"] = (tensors["model.proj.weight"].double() * 1.01).to(torch.bfloat16)
        del tensors["model.odd"]
        tensors["model.new"] = torch.arange(4.0).reshape(2, 2)
        objects["extra.epoch"] = 4
    return tensors, objects


def _state_dict(variant: str, mesh, layout: dict) -> dict:
    from torch.distributed.tensor import distribute_tensor

    tensors, objects = reference(variant)
    sd: dict = {}
    for fqn, full in tensors.items():
        placements = layout[fqn]
        sd[fqn] = full.clone() if placements is None else distribute_tensor(
            full, mesh, placements_from_text(placements))
    sd["extra"] = {k.split(".", 1)[1]: v for k, v in objects.items()}
    return sd


def _save_worker(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp import StandardSavePlanner

    mesh2 = init_device_mesh("cpu", MESH)
    mesh1 = init_device_mesh("cpu", (world_size,))
    dcp.save(_state_dict("a", mesh2, LAYOUT_2D), checkpoint_id=os.path.join(root, "step_10"))
    dcp.save(_state_dict("b", mesh2, LAYOUT_2D), checkpoint_id=os.path.join(root, "step_20"))
    # same keys, another layout: the plan cached by the first save does not apply
    dcp.save(_state_dict("a", mesh1, LAYOUT_1D), checkpoint_id=os.path.join(root, "relayout_10"),
             planner=StandardSavePlanner(enable_plan_caching=False))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    run_distributed(_save_worker, 4, str(root), timeout=240)
    # An interrupted save: everything but .metadata.
    shutil.copytree(root / "step_20", root / "step_30")
    (root / "step_30" / ".metadata").unlink()
    return root


def hp_dcp(*args: str) -> subprocess.CompletedProcess:
    """Run the installed console script (or the module when it is not on PATH)."""
    return run_console_script("hp-dcp", "hyper_parallel_dcp.cli", *args)


def _expected_chunks(shape: tuple[int, ...], placements) -> int:
    """Stored chunks of a tensor: non-empty torch.chunk pieces per sharded dim, multiplied."""
    if placements is None:
        return 1
    per_dim = [1] * len(shape)
    for mesh_size, p in zip(MESH, placements):
        if p.startswith("Shard"):
            d = int(p[6:-1])
            per_dim[d] = len(torch.arange(shape[d]).chunk(mesh_size))
    return math.prod(per_dim)


def test_inspect_json_matches_saved_state_dict(ckpts: Path) -> None:
    out = hp_dcp("inspect", str(ckpts / "step_10"), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    tensors, objects = reference("a")
    assert doc["complete"] is True and doc["format_version"] == 2 and doc["problems"] == []
    assert sorted(doc["tensors"]) == sorted(tensors)
    for fqn, full in tensors.items():
        got = doc["tensors"][fqn]
        assert got["shape"] == list(full.shape), fqn
        assert got["dtype"] == str(full.dtype).removeprefix("torch."), fqn
        assert got["bytes"] == full.numel() * full.element_size(), fqn
        assert got["chunks"] == _expected_chunks(tuple(full.shape), LAYOUT_2D[fqn]), fqn
    assert doc["objects"] == sorted(objects)
    on_disk = {p.name: p.stat().st_size for p in (ckpts / "step_10").iterdir() if p.name.startswith("_rank")}
    assert {name: f["bytes"] for name, f in doc["files"].items()} == on_disk
    assert sum(r["bytes"] for r in doc["ranks"]) == sum(on_disk.values())
    assert all(name.startswith(f"_rank{r['rank']}_.") for r in doc["ranks"] for name in r["files"])


def test_inspect_human_output_and_chunk_listing(ckpts: Path) -> None:
    out = hp_dcp("inspect", str(ckpts / "step_10"), "--chunks")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "complete        yes" in lines
    tensors, _ = reference("a")
    for fqn, full in tensors.items():
        row = next(line for line in lines if line.split()[:1] == [fqn])
        assert "[" + ", ".join(map(str, full.shape)) + "]" in row
        assert str(full.dtype).removeprefix("torch.") in row
        assert row.split()[-1] == str(full.numel() * full.element_size())
    # the embed chunk table lists the four boxes of an (8 x 4) tiling
    doc = json.loads(hp_dcp("inspect", str(ckpts / "step_10"), "--json", "--chunks").stdout)
    boxes = sorted((tuple(c["offsets"]), tuple(c["sizes"])) for c in doc["tensors"]["model.embed.weight"]["chunk_list"])
    assert boxes == [((0, 0), (8, 4)), ((0, 4), (8, 4)), ((8, 0), (8, 4)), ((8, 4), (8, 4))]
    assert all(c["checksum"] and c["file"].endswith(".safetensors") for c in
               doc["tensors"]["model.embed.weight"]["chunk_list"])


def test_inspect_incomplete_and_missing(ckpts: Path, tmp_path: Path) -> None:
    out = hp_dcp("inspect", str(ckpts / "step_30"), "--json")
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    assert doc["complete"] is False and doc["problems"] and doc["tensors"] == {}
    assert "NO" in hp_dcp("inspect", str(ckpts / "step_30")).stdout
    # a data file shorter than recorded: incomplete, and the problem names the file
    broken = tmp_path / "broken"
    shutil.copytree(ckpts / "step_10", broken)
    victim = broken / "_rank1_.safetensors"
    victim.write_bytes(victim.read_bytes()[:-16])
    out = hp_dcp("inspect", str(broken), "--json")
    assert out.returncode == 1
    assert any("_rank1_.safetensors" in p for p in json.loads(out.stdout)["problems"])
    missing = hp_dcp("inspect", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_diff_same_state_different_layouts_is_identical(ckpts: Path) -> None:
    out = hp_dcp("diff", str(ckpts / "step_10"), str(ckpts / "relayout_10"), "--json", "--block-mib", "0.0001")
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["identical"] is True and doc["only_in_a"] == [] and doc["only_in_b"] == []
    tensors, objects = reference("a")
    assert sorted(doc["keys"]) == sorted(list(tensors) + list(objects))
    assert all(k["max_abs"] == 0 and k["differing"] == 0 for fqn, k in doc["keys"].items() if fqn in tensors)


def test_diff_reports_values_and_keys(ckpts: Path) -> None:
    a, objects_a = reference("a")
    b, objects_b = reference("b")
    results = []
    for block in ("256", "0.0001"):  # whole tensors, and a few rows per block
        out = hp_dcp("diff", str(ckpts / "step_10"), str(ckpts / "step_20"), "--json", "--block-mib", block)
        assert out.returncode == 1, out.stderr
        results.append(json.loads(out.stdout))
    assert results[0] == results[1]
    doc = results[0]
    assert doc["identical"] is False
    assert doc["only_in_a"] == ["model.odd"] and doc["only_in_b"] == ["model.new"]
    for fqn in ("model.embed.weight", "model.proj.weight", "model.norm.weight", "optim.step"):
        x, y = a[fqn].double(), b[fqn].double()
        diff = (x - y).abs()
        denom = torch.maximum(x.abs(), y.abs())
        rel = torch.where(diff == 0, torch.zeros_like(diff), diff / denom)
        got = doc["keys"][fqn]
        assert got["max_abs"] == pytest.approx(float(diff.max()), rel=1e-12, abs=0), fqn
        assert got["max_rel"] == pytest.approx(float(rel.max()), rel=1e-12, abs=0), fqn
        assert got["differing"] == int((diff > 0).sum()), fqn
        assert got["equal"] is (got["differing"] == 0)
    assert doc["keys"]["model.embed.weight"]["differing"] == 1
    assert doc["keys"]["extra.epoch"]["equal"] is False and doc["keys"]["extra.name"]["equal"] is True
    # tolerances: proj differs by ~1 % relative, embed by 0.5 absolute
    out = hp_dcp("diff", str(ckpts / "step_10"), str(ckpts / "step_20"), "--json", "--rtol", "0.05")
    keys = json.loads(out.stdout)["keys"]
    assert keys["model.proj.weight"]["equal"] is True and keys["model.embed.weight"]["equal"] is False
    human = hp_dcp("diff", str(ckpts / "step_10"), str(ckpts / "step_20"))
    assert human.returncode == 1
    assert "only in A (1): model.odd" in human.stdout and "only in B (1): model.new" in human.stdout
    assert "DIFFERENT" in human.stdout


def test_verify_ok_and_corrupted(ckpts: Path, tmp_path: Path) -> None:
    out = hp_dcp("verify", str(ckpts / "step_10"), "--json")
    assert out.returncode == 0, out.stdout
    doc = json.loads(out.stdout)
    files = [p for p in (ckpts / "step_10").iterdir() if p.name.startswith("_rank")]
    assert doc["ok"] is True and doc["problems"] == []
    # every stored chunk and object, and all of their bytes (file sizes minus headers)
    assert doc["chunks_checked"] > 0 and 0 < doc["bytes_checked"] < sum(p.stat().st_size for p in files)
    bad = tmp_path / "bad"
    shutil.copytree(ckpts / "step_10", bad)
    victim = bad / "_rank0_.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF  # flip bits of the last chunk's data, same size
    victim.write_bytes(bytes(data))
    out = hp_dcp("verify", str(bad))
    assert out.returncode == 1
    assert "FAILED" in out.stdout and "_rank0_.safetensors" in out.stdout and "checksum mismatch" in out.stdout


def test_latest_skips_incomplete(ckpts: Path, tmp_path: Path) -> None:
    out = hp_dcp("latest", str(ckpts))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(ckpts / "step_20")  # step_30 has no .metadata
    assert json.loads(hp_dcp("latest", str(ckpts), "--json").stdout)["latest"] == str(ckpts / "step_20")
    empty = tmp_path / "empty"
    empty.mkdir()
    out = hp_dcp("latest", str(empty))
    assert out.returncode == 1 and out.stdout == "" and "no complete checkpoint" in out.stderr


def test_usage_errors_exit_2(ckpts: Path, tmp_path: Path) -> None:
    assert hp_dcp().returncode == 2
    assert hp_dcp("inspect").returncode == 2
    assert hp_dcp("diff", str(ckpts / "step_10")).returncode == 2
    assert hp_dcp("diff", str(ckpts / "step_10"), str(ckpts / "step_20"), "--atol", "-1").returncode == 2
    assert hp_dcp("explain", str(ckpts / "step_10")).returncode == 2  # --target is required
    out = hp_dcp("explain", str(ckpts / "step_10"), "--target", str(tmp_path / "none.json"))
    assert out.returncode == 2 and "none.json" in out.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"mesh": [2, 2], "default": ["Shard(0)"]}')
    out = hp_dcp("explain", str(ckpts / "step_10"), "--target", str(bad))
    assert out.returncode == 2 and "1 placement(s) for a mesh of 2" in out.stderr
    bad.write_text('{"mesh": [2], "default": ["Partial"]}')
    out = hp_dcp("explain", str(ckpts / "step_10"), "--target", str(bad))
    assert out.returncode == 2 and "Partial" in out.stderr
    for cmd in ("inspect", "verify", "explain", "diff", "latest", "convert"):
        help_out = hp_dcp(cmd, "--help")
        assert help_out.returncode == 0 and "usage:" in help_out.stdout, cmd


def test_convert_delegates_to_the_converter(ckpts: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out_dir = tmp_path / "hf"
    # --all: every tensor (the default for this trainer-shaped checkpoint is the model's weights only)
    out = hp_dcp("convert", "dcp-to-hf", str(ckpts / "step_10"), str(out_dir), "--all", "--quiet")
    assert out.returncode == 0, out.stdout + out.stderr
    exported: dict[str, torch.Tensor] = {}
    for f in out_dir.glob("*.safetensors"):
        exported.update(load_file(str(f)))
    tensors, _ = reference("a")
    assert set(exported) == set(tensors)
    assert all(torch.equal(exported[k], v) for k, v in tensors.items())
    # a non-empty destination without --overwrite is the converter's usage error
    assert hp_dcp("convert", "dcp-to-hf", str(ckpts / "step_10"), str(out_dir)).returncode == 2
