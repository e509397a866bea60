"""``hp-dcp explain`` predicts exactly what a real resharded load reads.

A checkpoint is saved by 4 gloo ranks (tensor-parallel layout).  ``hp-dcp explain`` (the
console script) predicts, for a target layout, each rank's bytes read and files opened,
with and without read-once + broadcast.  Then real gloo ranks load the checkpoint into
DTensors of that layout, and the bytes and files each rank's process really reads (counted
around its ``preadv``/``pread`` system calls, not by the library's span arithmetic) are
compared with the prediction; the loaded values are checked against the saved state dict.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import FileReads, placements_from_text, run_console_script, run_distributed

pytestmark = pytest.mark.distributed

SAVE_LAYOUT = {  # mesh (4,)
    "embed.weight": ["Shard(0)"],
    "qkv.weight": ["Shard(0)"],
    "out.weight": ["Shard(1)"],
    "norm.weight": ["Replicate"],
    "step": None,  # plain tensor
}
# dp=2 x tp=2: replicated over dp (replica groups of 2), norm and step over all 4 ranks.
TARGET_DP_TP = {
    "mesh": {"dp": 2, "tp": 2},
    "default": ["Replicate", "Replicate"],
    "rules": [
        {"match": "embed.weight", "placements": {"tp": "Shard(0)"}},
        {"match": "qkv.weight", "placements": ["Shard(1)", "Shard(0)"]},
        {"match": "out.weight", "placements": {"tp": "Shard(1)"}},
    ],
}
# 2 ranks, every matrix split by columns: strided slices of row-major chunks over-read.
TARGET_COLUMNS = {
    "world_size": 2,
    "mesh": [2],
    "default": ["Shard(1)"],
    "rules": [{"match": "norm.weight", "placements": ["Replicate"]}],
}


def reference() -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    gen = torch.Generator().manual_seed(99)
    tensors = {
        "embed.weight": torch.randn(32, 16, generator=gen),
        "qkv.weight": torch.randn(24, 16, generator=gen).to(torch.bfloat16),
        "out.weight": torch.randn(16, 24, generator=gen).to(torch.bfloat16),
        "norm.weight": torch.randn(16, generator=gen),
        "step": torch.tensor(11, dtype=torch.int64),
    }
    return tensors, {"meta.epoch": 2, "meta.tag": "tp4"}


def _save_worker(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import hyper_parallel_dcp as dcp

    mesh = init_device_mesh("cpu", (world_size,))
    tensors, objects = reference()
    sd: dict = {fqn: full.clone() if SAVE_LAYOUT[fqn] is None else distribute_tensor(full, mesh, placements_from_text(SAVE_LAYOUT[fqn]))
                for fqn, full in tensors.items()}
    sd["meta"] = {k.split(".", 1)[1]: v for k, v in objects.items()}
    dcp.save(sd, checkpoint_id=path)


def _targetplacements_from_text(spec: dict, fqn: str) -> list[str]:
    """Placements of ``fqn`` in a test target, written out independently of the CLI's parser."""
    names = list(spec["mesh"]) if isinstance(spec["mesh"], dict) else None
    for rule in spec.get("rules", []):
        if rule["match"] == fqn:
            p = rule["placements"]
            return [p.get(n, "Replicate") for n in names] if isinstance(p, dict) else list(p)
    ndim = reference()[0][fqn].dim()
    return [p if p == "Replicate" or int(p[6:-1]) < ndim else "Replicate" for p in spec["default"]]


def _data_start(path: Path) -> int:
    """First byte after a safetensors file's header (u64 length + JSON), read here by hand."""
    if path.suffix != ".safetensors":
        return 0
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _load_worker(rank: int, world_size: int, path: str, spec: dict) -> list[tuple[int, list[str]]]:
    """Load twice (broadcast off, then on); returns (bytes read, files read) of each load.

    Both come from the system calls (every ``preadv``/``pread`` of this process, read-ahead
    thread included), not from the library's own counters: the bytes read from the data
    regions of the checkpoint's files, and the names of the files they came from.
    Column slices are read through the span buffer here (in this spawned rank only): copied
    from a mapping of the file, as by default, they make no read call to count.
    """
    from hyper_parallel_dcp.storage_fs.mapping import FileMapping

    FileMapping.open = classmethod(lambda cls, *args, **kwargs: None)  # type: ignore[method-assign]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import hyper_parallel_dcp as dcp

    starts = {str(p.resolve()): _data_start(p) for p in Path(path).iterdir() if p.name.startswith("_rank")}
    mesh_shape = tuple(spec["mesh"].values()) if isinstance(spec["mesh"], dict) else tuple(spec["mesh"])
    mesh = init_device_mesh("cpu", mesh_shape)
    tensors, objects = reference()
    results = []
    for broadcast in (False, True):
        sd: dict = {fqn: distribute_tensor(torch.zeros_like(full), mesh,
                                           placements_from_text(_targetplacements_from_text(spec, fqn)))
                    for fqn, full in tensors.items()}
        sd["meta"] = {k.split(".", 1)[1]: None for k in objects}
        with FileReads() as reads:
            dcp.load(sd, checkpoint_id=path, broadcast_replicated_tensors=broadcast)
        for fqn, full in tensors.items():
            assert torch.equal(sd[fqn].full_tensor(), full), f"{fqn} wrong after load (broadcast={broadcast})"
        assert sd["meta"] == {"epoch": 2, "tag": "tp4"}
        data = [(p, n) for p, off, n in reads.records if p in starts and off >= starts[p]]
        results.append((sum(n for _, n in data), sorted({os.path.basename(p) for p, n in data if n})))
    return results


def hp_dcp(*args: str) -> subprocess.CompletedProcess:
    return run_console_script("hp-dcp", "hyper_parallel_dcp.cli", *args)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("explain") / "step_5"
    run_distributed(_save_worker, 4, str(path), timeout=240)
    return path


@pytest.mark.parametrize("spec", [TARGET_DP_TP, TARGET_COLUMNS], ids=["dp2xtp2", "columns2"])
def test_explain_predicts_the_bytes_a_real_load_reads(ckpt: Path, tmp_path: Path, spec: dict) -> None:
    spec_file = tmp_path / "target.json"
    spec_file.write_text(json.dumps(spec))
    out = hp_dcp("explain", str(ckpt), "--target", str(spec_file), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    predicted = json.loads(out.stdout)
    assert predicted["problems"] == []
    world_size = predicted["target"]["world_size"]
    for fqn in reference()[0]:
        assert predicted["keys"][fqn]["placements"].count(",") == len(predicted["target"]["mesh"]) - 1

    real = run_distributed(_load_worker, world_size, str(ckpt), spec, timeout=240)
    for rank, ((plain_bytes, plain_files), (once_bytes, once_files)) in enumerate(real):
        mine = predicted["ranks"][rank]
        assert mine["bytes_read"] == plain_bytes, f"rank {rank} without broadcast"
        assert mine["files"] == plain_files, f"rank {rank} without broadcast"
        assert mine["read_once"]["bytes_read"] == once_bytes, f"rank {rank} with read-once + broadcast"
        assert mine["read_once"]["files"] == once_files, f"rank {rank} with read-once + broadcast"
    total_plain = sum(r[0][0] for r in real)
    total_once = sum(r[1][0] for r in real)
    assert predicted["total_bytes_read"] == total_plain
    assert predicted["read_once"]["total_bytes_read"] == total_once
    tensors, _ = reference()
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    # every stored byte is needed by someone: without broadcast each replica reads its own copy
    assert total_plain >= total_once >= tensor_bytes
    assert predicted["over_read_factor"] == pytest.approx(total_plain / predicted["stored_bytes"])
    if spec is TARGET_DP_TP:
        # dp replicas: read-once saves reading the replicated half of every matrix again
        assert total_once < total_plain and predicted["read_once"]["broadcast_groups"] > 0
        assert predicted["read_once"]["broadcast_delivered_bytes"] == sum(
            r["read_once"]["broadcast_received"] for r in predicted["ranks"])
    else:
        # column slices of row-major chunks span whole rows: more read than needed
        needed = sum(r["bytes_needed"] for r in predicted["ranks"])
        assert total_plain > needed


def test_explain_reports_missing_mismatched_and_misplaced_keys(ckpt: Path, tmp_path: Path) -> None:
    spec = {
        "mesh": [2],
        "default": ["Shard(0)"],
        "rules": [{"match": "norm.weight", "placements": ["Shard(1)"]}, {"match": "meta.*", "skip": True}],
        "expect": {"lm_head.weight": {"shape": [4, 4]}, "embed.weight": {"shape": [40, 16]},
                   "qkv.weight": {"dtype": "float32"}},
    }
    spec_file = tmp_path / "target.yaml"
    import yaml

    spec_file.write_text(yaml.safe_dump(spec))
    out = hp_dcp("explain", str(ckpt), "--target", str(spec_file), "--json")
    assert out.returncode == 1, out.stderr
    doc = json.loads(out.stdout)
    kinds = {p["fqn"]: p["kind"] for p in doc["problems"]}
    # qkv.weight stored bf16 loads into a float32 target: the copy casts (as torch DCP does)
    assert kinds == {"lm_head.weight": "missing_key", "embed.weight": "mismatch", "norm.weight": "placement"}
    assert doc["objects"] == 0 and "meta.epoch" not in doc["keys"]  # skipped
    # the keys that do load are still counted: out.weight, qkv.weight and step on 2 ranks
    tensors, _ = reference()
    assert doc["tensors"] == 3
    assert doc["stored_bytes"] == sum(tensors[k].numel() * tensors[k].element_size()
                                      for k in ("out.weight", "qkv.weight", "step"))
    human = hp_dcp("explain", str(ckpt), "--target", str(spec_file))
    assert human.returncode == 1 and "the load would fail" in human.stdout and "lm_head.weight" in human.stdout
