"""The rank hosting the job's TCP store dies mid-save (issue 57 B11): the survivors' error
says the store went away (where it was, that its host rank is gone), at once, not that
the others "did not arrive within 1800 s"."""

from __future__ import annotations

import time

import pytest
import torch

from hyper_parallel_dcp.core.testing import free_port_pair, run_ranks


def _save_with_rank0_hosting_the_store(rank: int, world_size: int, path: str, port: int) -> tuple:
    import os

    import torch.distributed as dist

    import hyper_parallel_dcp as dcp

    # the launcher's file store replaced by a TCP store on rank 0, as init_method="tcp://" or
    # env:// without torchrun's agent gives
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    dist.barrier()
    os.environ["HP_DCP_FAULT"] = "save.write@0"  # rank 0 (and the store with it) dies here
    started = time.monotonic()
    try:
        dcp.save({"w": torch.full((64, 8), 1.0), f"own{rank}": torch.ones(16)}, checkpoint_id=path)
    except Exception as exc:  # noqa: BLE001 - the error is what the test looks at
        return type(exc).__name__, str(exc), time.monotonic() - started
    return "no error", "", time.monotonic() - started


@pytest.mark.distributed
def test_survivors_say_the_store_went_away(tmp_path):
    port = free_port_pair()
    out = run_ranks(_save_with_rank0_hosting_the_store, 3, str(tmp_path / "ckpt"), port, timeout=120)
    assert out[0][0] == "died", out
    for rank in (1, 2):
        status, (kind, text, seconds) = out[rank][0], out[rank][1]
        assert status == "ok", out[rank]
        assert kind == "CheckpointStoreLostError", text
        assert f"127.0.0.1:{port}" in text and "rank 0" in text and "went away" in text, text
        assert "did not arrive" not in text, text
        assert seconds < 60, seconds
