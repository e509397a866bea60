"""Resharded loads that read each stored byte once (SPEC §14), with real gloo ranks.

A chunk several ranks need column slices of is read by one of them as one contiguous run
and its pieces are sent to the others (``broadcast.exchange``).  Each case saves on one
layout and loads on another: every value bit for bit against a reference each rank
computes itself; the bytes read from the files, counted from the system calls
(``FileReads``), are the reader's own count, all of it ``preadv`` of contiguous runs, no
byte read twice over all ranks, ≤ 1.05× the checkpoint's tensor bytes.
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

pytestmark = pytest.mark.distributed

DENSE = {"a": ((16, 24), torch.float32), "b": ((10, 7), torch.bfloat16), "c": ((6, 4, 5), torch.float32),
         "v": ((9,), torch.float32)}
SMALL = {f"e.{i}": ((8, 16), torch.bfloat16) for i in range(40)}
RAGGED = {"w": ((10, 7), torch.float32), "t3": ((4, 3, 5), torch.float32)}
# 1.5 MiB read per rank at world 2: more than one read group, several messages to a peer
WIDE = {f"w.{i}": ((64, 1024), torch.float32) for i in range(12)}
CASES = {"dense": DENSE, "small": SMALL, "ragged": RAGGED, "wide": WIDE}


def reference(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)) * 7)
    return torch.randn(*shape, generator=gen).to(dtype)


def _flat_ranges(rank: int, world: int, total: int) -> list[tuple[int, int]]:
    """Uneven ZeRO-style ranges: rank r holds [cut_r, cut_{r+1}) with cuts off the rows."""
    cuts = [0, *[total * (r + 1) // world + (3 if r % 2 else -2) for r in range(world - 1)], total]
    return [(cuts[rank], cuts[rank + 1])] if cuts[rank + 1] > cuts[rank] else []


def state_dict(case: str, dim: int, *, empty: bool = False, ragged: bool = False) -> dict:
    """The case's tensors as DTensors sharded on ``dim`` (1-D ones on 0), or RaggedShards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hyper_parallel_dcp import RaggedShard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for name, (shape, dtype) in CASES[case].items():
        full = reference(name, shape, dtype)
        if empty:
            full = torch.full_like(full, float("nan"))
        if ragged:
            ranges = _flat_ranges(rank, world, math.prod(shape))
            flat = full.reshape(-1)
            local = torch.cat([flat[s:e] for s, e in ranges]) if ranges else full.new_empty(0)
            sd[name] = RaggedShard(local, shape, ranges)
        else:
            sd[name] = distribute_tensor(full, mesh, [Shard(dim if len(shape) > 1 else 0)], src_data_rank=None)
    return sd


def _save(rank: int, world: int, root: str, cases: list[str]) -> None:
    import hyper_parallel_dcp as dcp

    for case in cases:
        dcp.save(state_dict(case, 0, ragged=case == "ragged"), checkpoint_id=os.path.join(root, f"{case}{world}"))


def _copies_reader(copies: bool):
    """A FileSystemReader that says whether its reads are memory copies (the auto rule's input)."""
    from hyper_parallel_dcp.storage_fs import FileSystemReader

    return type("Reader", (FileSystemReader,), {"reads_are_copies": lambda self: copies})


def _load_one(path: str, case: str, exchange: str, copies: bool | None) -> dict:
    from hyper_parallel_dcp.broadcast import make_read_executor
    from hyper_parallel_dcp.core.pipeline import load_state_dict
    from hyper_parallel_dcp.core.testing import FileReads
    from hyper_parallel_dcp.storage_fs import FileSystemReader

    os.environ["HP_DCP_CHUNK_EXCHANGE"] = exchange
    target = state_dict(case, 1, empty=True)
    reader = FileSystemReader(path) if copies is None else _copies_reader(copies)(path)
    executor = make_read_executor()
    with FileReads() as reads:
        load_state_dict(target, reader, read_executor=executor)
    expected = state_dict(case, 1)
    wrong = [name for name, t in target.items()
             if not torch.equal(t.to_local().view(torch.uint8), expected[name].to_local().view(torch.uint8))]
    files = [(os.path.basename(p), o, n) for p, o, n in reads.records if p.endswith(".safetensors")]
    return {"wrong": wrong, "bytes_read": reader.bytes_read, "reads": files,
            "exchanged": executor.stats.exchanged_chunks}


def _load(rank: int, world: int, root: str, runs: list[tuple[str, str, str, bool | None]]) -> list[dict]:
    out = []
    for saved, case, exchange, copies in runs:
        try:
            out.append(_load_one(os.path.join(root, saved), case, exchange, copies))
        except Exception as exc:  # noqa: BLE001 - the broken checkpoint's error, on every rank
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    return out


def _needed(case: str) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in CASES[case].values())


def _check_read_once(results: list[dict], case: str) -> None:
    assert [r["wrong"] for r in results] == [[]] * len(results)
    assert all(r["exchanged"] > 0 for r in results)
    reads = [r for res in results for r in res["reads"]]
    total = sum(n for _, _, n in reads)
    assert total == sum(res["bytes_read"] for res in results), "bytes read outside preadv of contiguous runs"
    assert total <= 1.05 * _needed(case), (total, _needed(case))
    by_file: dict[str, list[tuple[int, int]]] = {}
    for name, offset, n in reads:
        by_file.setdefault(name, []).append((offset, offset + n))
    for name, spans in by_file.items():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"{name}: a byte read twice: {spans}"


def test_resharded_loads_read_each_byte_once(tmp_path) -> None:
    """Shard(0) → Shard(1) (2-D, uneven bf16, 3-D; 1-D tensors stay contiguous reads), 40
    small tensors, ragged flat ranges saved on 3 ranks, world 4 → 2 and 2 → 4, 3 MiB read
    in several groups and sent in several messages a peer; then the
    auto rule: readers whose reads are memory copies keep their direct reads (each rank
    spans whole chunks), others exchange; a truncated file fails the load on every rank."""
    root = str(tmp_path)
    run_distributed(_save, 2, root, ["dense", "small", "wide"], timeout=120)
    run_distributed(_save, 3, root, ["ragged"], timeout=120)
    run_distributed(_save, 4, root, ["dense"], timeout=120)
    shutil.copytree(tmp_path / "dense2", tmp_path / "bad2")
    victim = sorted((tmp_path / "bad2").glob("*.safetensors"))[0]
    os.truncate(victim, victim.stat().st_size - 8)
    runs = [("dense2", "dense", "1", None), ("small2", "small", "1", None), ("ragged3", "ragged", "1", None),
            ("dense4", "dense", "1", None), ("dense2", "dense", "auto", True), ("dense2", "dense", "auto", False),
            ("bad2", "dense", "1", None), ("wide2", "wide", "1", None)]
    per_rank = run_distributed(_load, 2, root, runs, timeout=120)
    # a reader's failure reaches every rank (its peers do not wait for the pieces forever)
    assert all(victim.name in rank[6]["error"] for rank in per_rank), [rank[6] for rank in per_rank]
    for i, (_, case, _, _) in [*enumerate(runs[:4]), (7, runs[7])]:
        _check_read_once([rank[i] for rank in per_rank], case)
    direct, remote = [rank[4] for rank in per_rank], [rank[5] for rank in per_rank]
    assert [r["wrong"] for r in direct + remote] == [[]] * 4
    assert [r["exchanged"] for r in direct] == [0, 0]
    assert sum(r["bytes_read"] for r in direct) > 1.5 * _needed("dense")
    assert all(r["exchanged"] for r in remote)
    _check_read_once([rank[0] for rank in run_distributed(_load, 4, root, runs[:1], timeout=120)], "dense")
