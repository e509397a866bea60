"""A training script that exits while its async save is still being written.

Two real processes (gloo over a file store) call ``async_save`` with a writer that takes
a few seconds, print that the call returned, overwrite their tensors and fall off the end
of the script.  Interpreter exit must wait for the checkpoint in flight: afterwards the
checkpoint is complete, holds the values at the time of the call, and no writer process
is left running.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import free_port_pair

_SCRIPT = textwrap.dedent('''
    import os, sys, time
    import torch, torch.distributed as dist
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.storage_fs import FileSystemWriter

    class SlowWriter(FileSystemWriter):
        def execute_write(self, plan, planner):
            time.sleep(3.0)
            return super().execute_write(plan, planner)

    if __name__ == "__main__":
        rank, world, store, ckpt, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
        sd = {"rows": torch.nn.Parameter(full[rank * 3:(rank + 1) * 3].clone(), requires_grad=False),
              "shared": torch.full((5,), 7.0), "step": 11}
        from hyper_parallel_dcp.core.ragged import RaggedShard
        sd["rows"] = RaggedShard.from_rows(sd["rows"].data, (6, 4), rank * 3)
        kwargs = {"use_gloo": True} if mode == "gloo" else {}
        resp = dcp.async_save(sd, checkpoint_id=ckpt, storage_writer=SlowWriter(ckpt), **kwargs)
        print(f"returned writer={resp.writer_pid}", flush=True)
        sd["shared"].fill_(-1.0)
        sd["rows"].local_tensor.fill_(-1.0)
        # no get_result(), no destroy_process_group(): just exit
''')


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["files", "gloo"])
def test_exit_with_save_in_flight_leaves_complete_checkpoint(tmp_path: Path, mode: str) -> None:
    import hyper_parallel_dcp as dcp

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", HP_DCP_ASYNC_TIMEOUT="90")
    env["MASTER_PORT"] = str(free_port_pair())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(tmp_path / "store"), str(ckpt), mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
             for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "returned writer=" in out
    # every writer process has exited with its training process
    for out, _ in outs:
        pid = int(out.split("returned writer=")[1].split()[0])
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert (ckpt / ".metadata").is_file()
    assert not [n for n in os.listdir(ckpt) if n.startswith(("LOCAL_PLAN_", "STORAGE_DATA_", ".hp-dcp-mailbox"))]
    target = {"rows": torch.zeros(6, 4), "shared": torch.zeros(5), "step": None}
    dcp.load(target, checkpoint_id=ckpt, no_dist=True)
    assert torch.equal(target["rows"], torch.arange(24, dtype=torch.float32).reshape(6, 4))
    assert torch.equal(target["shared"], torch.full((5,), 7.0))
    assert target["step"] == 11
