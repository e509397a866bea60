"""async_save in its three coordination modes, on real gloo ranks with real writer processes.

Each rank saves DTensor shards (even and uneven), a replicated plain tensor, a 0-dim
tensor and non-tensor leaves three times in a row, overwriting everything right after
each ``async_save`` returns; then a synchronous save; then a save whose writer process is
killed with SIGKILL mid-write, and one more save into the same directory.  The
checkpoints are loaded with other world sizes and compared with a reference computed
from the step number alone.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

#: (shape, dtype) of the global tensors of the reference state
_W, _B, _M = ((8, 6), torch.float32), ((6,), torch.bfloat16), ((5, 4), torch.float32)
_MODES = {"gloo": {"use_gloo": True}, "files": {}, "none": {"use_collectives": False}}


def reference(step: int) -> dict:
    """The full (unsharded) values of every leaf at ``step``."""
    return {
        "w": torch.arange(48, dtype=_W[1]).reshape(_W[0]) + 1000 * step,
        "b": (torch.arange(6) * (step + 1)).to(_B[1]),
        "m": torch.arange(20, dtype=_M[1]).reshape(_M[0]) - step,
        "t": torch.tensor(float(step)),
        "step": step,
        "groups": [{"lr": 0.1 * (step + 1), "betas": (0.9, 0.99)}],
    }


def _state(mesh, step: int) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    ref = reference(step)
    return {
        "model": {"w": distribute_tensor(ref["w"], mesh, [Shard(0)]), "b": ref["b"].clone()},
        "optim": {"state": {"w": {"exp_avg": distribute_tensor(ref["m"], mesh, [Shard(0)]), "step": ref["t"]}},
                  "param_groups": ref["groups"]},
        "extra": {"step": step},
    }


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _fill(sd: dict, step: int, mesh) -> None:
    """Write the values of ``step`` into ``sd`` in place (tensors) or by replacement (objects)."""
    fresh = _state(mesh, step)
    _local(sd["model"]["w"]).copy_(_local(fresh["model"]["w"]))
    sd["model"]["b"].copy_(fresh["model"]["b"])
    _local(sd["optim"]["state"]["w"]["exp_avg"]).copy_(_local(fresh["optim"]["state"]["w"]["exp_avg"]))
    sd["optim"]["state"]["w"]["step"].copy_(fresh["optim"]["state"]["w"]["step"])
    sd["optim"]["param_groups"][0].update(fresh["optim"]["param_groups"][0])
    sd["extra"]["step"] = step


def _scribble(sd: dict) -> None:
    """What training does right after async_save returns: overwrite everything in place."""
    for t in (_local(sd["model"]["w"]), sd["model"]["b"], _local(sd["optim"]["state"]["w"]["exp_avg"]),
              sd["optim"]["state"]["w"]["step"]):
        t.fill_(-7)
    sd["optim"]["param_groups"][0]["lr"] = -1.0
    sd["optim"]["param_groups"][0]["betas"] = (0.0, 0.0)
    sd["extra"]["step"] = -1


def _mailbox_leftovers(path: Path) -> list[str]:
    names = os.listdir(path) if path.is_dir() else []
    return [n for n in names if n.startswith(("LOCAL_PLAN_", "STORAGE_DATA_", ".hp-dcp-mailbox"))]


from hyper_parallel_dcp.storage_fs import FileSystemWriter  # noqa: E402


class SlowWriter(FileSystemWriter):
    """Announces that it is writing (a marker file), then waits, so a test can kill it mid-save."""

    def __init__(self, path, delay: float):
        super().__init__(path)
        self.delay = delay

    def execute_write(self, plan, planner):
        marker = Path(f"{self.path}.writing-{self.rank}")
        marker.write_text(str(os.getpid()))
        time.sleep(self.delay)
        return super().execute_write(plan, planner)


def modes_worker(rank: int, world_size: int, root: str, mode: str) -> dict:
    import async_test_api as dcp
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel_dcp.async_persist import AsyncSaveError
    from hyper_parallel_dcp.async_persist.persist import _get_persister

    kwargs = _MODES[mode]
    mesh = init_device_mesh("cpu", (world_size,))
    sd = _state(mesh, 0)
    calls: list[int] = []
    out: dict = {"cache_hit": [], "calls_at_result": [], "reused": [], "allocated": [], "ptrs_same": [],
                 "leftovers": []}
    first_ptrs = None
    for step in range(3):
        path = Path(root) / f"step{step}"
        resp = dcp.async_save(sd, checkpoint_id=path, callback=lambda s=step: calls.append(s), **kwargs)
        _scribble(sd)  # must not reach the checkpoint
        resp.get_result(timeout=180)
        out["calls_at_result"].append(list(calls))
        out["cache_hit"].append(resp.cache_hit)
        out["reused"].append((resp.staging.reused_bytes, resp.staging.staged_bytes))
        out["allocated"].append(resp.staging.allocated_bytes)
        ptrs = _get_persister().arena.buffer_ptrs()
        first_ptrs = first_ptrs or ptrs
        out["ptrs_same"].append(ptrs == first_ptrs)
        dist.barrier()  # every rank's writer has answered before we look for its files
        out["leftovers"].append(_mailbox_leftovers(path))
        _fill(sd, step + 1, mesh)

    # a synchronous save right after: hits the plan cache that came back from the writer
    planner = dcp.StandardSavePlanner()
    dcp.save(sd, checkpoint_id=Path(root) / "sync3", planner=planner,
             use_collectives=kwargs.get("use_collectives", True))
    out["sync_cache_hit"] = planner.cache_hit

    # kill the writer mid-save: the future fails clearly, nothing is committed
    killed = Path(root) / "killed"
    resp = dcp.async_save(sd, checkpoint_id=killed, storage_writer=SlowWriter(killed, delay=30.0), **kwargs)
    marker = Path(f"{killed}.writing-{rank}")
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    out["marker_seen"] = marker.exists()
    try:
        os.kill(resp.writer_pid, signal.SIGKILL)
    except ProcessLookupError:  # the other rank's writer died first and this one stopped
        pass
    try:
        resp.get_result(timeout=60)
        out["kill_error"] = None
    except AsyncSaveError as exc:
        out["kill_error"] = str(exc)
    dist.barrier()
    out["metadata_after_kill"] = sorted(n for n in os.listdir(killed) if n.endswith("metadata")) if killed.is_dir() else []

    # the next save starts a fresh writer and lands, into the same directory
    _fill(sd, 4, mesh)
    resp = dcp.async_save(sd, checkpoint_id=killed, **kwargs)
    _scribble(sd)
    resp.get_result(timeout=180)
    out["recovered_cache_hit"] = resp.cache_hit
    out["recovered_reused"] = (resp.staging.reused_bytes, resp.staging.staged_bytes)
    out["new_writer"] = resp.writer_pid
    dist.barrier()
    return out


def load_worker(rank: int, world_size: int, paths: list, steps: list) -> list:
    """Load each checkpoint into a fresh layout of ``world_size`` ranks; report mismatches."""
    import async_test_api as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    problems = []
    for path, step in zip(paths, steps):
        target = {
            "model": {"w": distribute_tensor(torch.zeros(_W[0], dtype=_W[1]), mesh, [Shard(0)]),
                      "b": torch.zeros(_B[0], dtype=_B[1])},
            "optim": {"state": {"w": {"exp_avg": distribute_tensor(torch.zeros(_M[0]), mesh, [Shard(0)]),
                                      "step": torch.tensor(-5.0)}},
                      "param_groups": None},
            "extra": {"step": None},
        }
        dcp.load(target, checkpoint_id=path)
        problems += _compare(target, step, path, full=lambda t: t.full_tensor())
    return problems


def _compare(target: dict, step: int, path, full) -> list:
    ref = reference(step)
    got = {
        "w": full(target["model"]["w"]), "b": target["model"]["b"], "m": full(target["optim"]["state"]["w"]["exp_avg"]),
        "t": target["optim"]["state"]["w"]["step"], "step": target["extra"]["step"],
        "groups": target["optim"]["param_groups"],
    }
    problems = []
    for key in ("w", "b", "m", "t"):
        if not torch.equal(got[key], ref[key]):
            problems.append(f"{path}: {key} = {got[key].tolist()} expected {ref[key].tolist()}")
    for key in ("step", "groups"):
        if got[key] != ref[key]:
            problems.append(f"{path}: {key} = {got[key]!r} expected {ref[key]!r}")
    return problems


def load_single_process(path: Path, step: int) -> list:
    import async_test_api as dcp

    target = {
        "model": {"w": torch.zeros(_W[0], dtype=_W[1]), "b": torch.zeros(_B[0], dtype=_B[1])},
        "optim": {"state": {"w": {"exp_avg": torch.zeros(_M[0]), "step": torch.tensor(-5.0)}}, "param_groups": None},
        "extra": {"step": None},
    }
    dcp.load(target, checkpoint_id=path, no_dist=True)
    return _compare(target, step, path, full=lambda t: t)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", sorted(_MODES))
def test_async_save_modes(tmp_path: Path, mode: str) -> None:
    from hyper_parallel_dcp.core.testing import free_port_pair, run_distributed

    env = {"HP_DCP_ASYNC_TIMEOUT": "90", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_pair())}
    results = run_distributed(modes_worker, 2, str(tmp_path), mode, timeout=400, env=env)
    collectives = mode != "none"
    for rank, out in enumerate(results):
        # the callback ran exactly once per save, before the future resolved
        assert out["calls_at_result"] == [[0], [0, 1], [0, 1, 2]], (rank, out["calls_at_result"])
        # the 2nd and 3rd saves reuse the staging slots (same addresses, nothing allocated)
        staged = out["reused"][0][1]
        assert staged > 0 and out["allocated"][0] >= staged
        assert out["reused"][1:] == [(staged, staged)] * 2 and out["allocated"][1:] == [0, 0]
        assert out["ptrs_same"] == [True, True, True]
        # ... and the plan cache computed in the writer process (off without collectives)
        assert out["cache_hit"] == ([False, True, True] if collectives else [False, False, False])
        assert out["sync_cache_hit"] is collectives
        assert out["leftovers"] == [[], [], []]
        # the killed writer: a clear error through the future, nothing committed
        assert out["marker_seen"]
        # each rank's future names its writer's SIGKILL, or (when the other rank's kill came
        # first and this writer stopped) the rank whose writer failed
        other = f"failed on rank(s) [{1 - rank}]"
        assert out["kill_error"] is not None and ("SIGKILL" in out["kill_error"] or other in out["kill_error"]), \
            out["kill_error"]
        assert out["metadata_after_kill"] == []
        assert out["recovered_reused"] == (staged, staged)
        assert out["recovered_cache_hit"] is collectives
    assert any("SIGKILL" in out["kill_error"] for out in results), [out["kill_error"] for out in results]
    # a fresh writer process per rank after the kill
    assert len({out["new_writer"] for out in results}) == 2

    steps = {"step0": 0, "step1": 1, "step2": 2, "sync3": 3, "killed": 4}
    expected_meta = [".metadata"] if collectives else ["0.metadata", "1.metadata"]
    for name, step in steps.items():
        files = sorted(n for n in os.listdir(tmp_path / name) if n.endswith("metadata"))
        assert files == expected_meta, (name, files)
        assert _mailbox_leftovers(tmp_path / name) == []
        # world size 1 (saved on 2): every tensor reassembled from the shards of both ranks
        assert load_single_process(tmp_path / name, step) == []
    if mode == "files":
        # and on 3 ranks: uneven Shard(0) boxes cut across the saved ones
        paths = [str(tmp_path / n) for n in steps]
        problems = run_distributed(load_worker, 3, paths, list(steps.values()), timeout=300)
        assert problems == [[], [], []]


def all_sharded_worker(rank: int, world_size: int, root: str) -> list:
    import async_test_api as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    ref = reference(1)
    # nothing replicated: the global step keeps every rank's plan as sent, and its answer
    # (the save id alone) reaches the writer of rank 1 through a mailbox file
    sd = {"w": distribute_tensor(ref["w"], mesh, [Shard(0)]), "m": distribute_tensor(ref["m"], mesh, [Shard(1)])}
    resp = dcp.async_save(sd, checkpoint_id=Path(root) / "sharded")
    resp.get_result(timeout=180)
    target = {"w": torch.zeros(_W[0], dtype=_W[1]), "m": torch.zeros(_M[0], dtype=_M[1])}
    dcp.load(target, checkpoint_id=Path(root) / "sharded", no_dist=True)
    return [key for key in ("w", "m") if not torch.equal(target[key], ref[key])]


@pytest.mark.distributed
def test_async_save_files_mode_of_a_state_dict_with_nothing_replicated(tmp_path: Path) -> None:
    from hyper_parallel_dcp.core.testing import free_port_pair, run_distributed

    env = {"HP_DCP_ASYNC_TIMEOUT": "90", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_pair())}
    assert run_distributed(all_sharded_worker, 2, str(tmp_path), timeout=300, env=env) == [[], []]


def session_worker(rank: int, world_size: int) -> tuple[str, str]:
    import torch.distributed as dist

    from hyper_parallel_dcp.async_persist.persist import mailbox_session

    os.environ.pop("TORCHELASTIC_RESTART_COUNT", None)
    # rank 0 asks last, after every other rank has its token: no rank may wait for rank 0
    # (the first ranks of two sub-groups used to set it, and the others to wait for them)
    token = "" if rank == 0 else mailbox_session()
    dist.barrier()
    if rank == 0:
        token = mailbox_session()
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"  # torchrun restarted the workers
    restarted = mailbox_session()
    return token, restarted


@pytest.mark.distributed
def test_mailbox_session_token_is_one_per_job_and_restart_and_no_rank_waits_for_another() -> None:
    from hyper_parallel_dcp.core.testing import run_distributed

    results = run_distributed(session_worker, 3, timeout=60)
    tokens, restarted = {t for t, _ in results}, {r for _, r in results}
    assert len(tokens) == 1 and len(restarted) == 1, results
    assert tokens != restarted and all(len(t) == 12 for t in tokens | restarted), results


def stage_groups_worker(rank: int, world_size: int, root: str) -> list:
    import async_test_api as dcp
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    stage = rank // 2
    bad = []
    for step in (1, 2):
        # both stages save at once, each over its own sub-group (pipeline parallelism)
        sd = {f"stage{stage}.w": torch.full((8, 4), float(10 * step + stage)), "step": step}
        dcp.async_save(sd, checkpoint_id=Path(root) / f"stage{stage}" / f"step_{step}",
                       process_group=groups[stage]).get_result(timeout=120)
        target = {f"stage{stage}.w": torch.zeros(8, 4), "step": 0}
        dcp.load(target, checkpoint_id=Path(root) / f"stage{stage}" / f"step_{step}", process_group=groups[stage])
        if not torch.equal(target[f"stage{stage}.w"], sd[f"stage{stage}.w"]) or target["step"] != step:
            bad.append(step)
    return bad


@pytest.mark.distributed
def test_two_sub_groups_async_save_at_once(tmp_path: Path) -> None:
    from hyper_parallel_dcp.core.testing import free_port_pair, run_distributed

    # the first ranks of both groups used to set the job's mailbox token, and a member
    # could read the other group's: its writer then waited for files never written
    env = {"HP_DCP_ASYNC_TIMEOUT": "60", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_pair())}
    assert run_distributed(stage_groups_worker, 4, str(tmp_path), timeout=300, env=env) == [[], [], [], []]
