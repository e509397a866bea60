"""Hugging Face Accelerate (``[accelerate]`` extra): FSDP2 model + Adam saved through us, resumed elsewhere.

Accelerate 1.16 selects FSDP only on accelerators (``MULTI_CPU`` is not among the types
its ``AcceleratorState`` turns into ``FSDP``), so on CPU the test drives the functions
``Accelerator.save_state`` / ``load_state`` call for FSDP — ``accelerate.utils.fsdp_utils``'s
``save_fsdp_model`` / ``save_fsdp_optimizer`` / ``load_fsdp_*`` with a real ``Accelerator``
and ``FullyShardedDataParallelPlugin(fsdp_version=2)`` — inside
:func:`hyper_parallel_dcp.integrations.accelerate.through_us`.  2 gloo ranks train 4 steps
saving at step 2; one rank resumes and trains to step 4: bit-identical weights.
"""

from __future__ import annotations

import pytest
import torch

from hyper_parallel_dcp.core.testing import free_port_pair, run_console_script, run_distributed

pytest.importorskip("accelerate")
pytestmark = pytest.mark.distributed


def _train(rank: int, world_size: int, root: str, resume: bool) -> dict:
    import warnings

    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import fully_shard

    from hyper_parallel_dcp.integrations.accelerate import through_us

    warnings.filterwarnings("ignore")
    accelerator = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for module in (model[0], model[2], model):
        fully_shard(module)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)  # the same batches on every rank
    batches = [(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(4)]
    state = f"{root}/state"
    if resume:
        with through_us():
            load_fsdp_model(plugin, accelerator, model, state)
            load_fsdp_optimizer(plugin, accelerator, optim, model, state)
    for step in range(2 if resume else 0, 4):
        x, y = batches[step]
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        if step == 1 and not resume:
            with through_us():
                save_fsdp_model(plugin, accelerator, model, state)
                save_fsdp_optimizer(plugin, accelerator, optim, model, state)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def test_accelerate_fsdp2_state_resumes_on_another_world_size_bit_identical(tmp_path):
    def run(world: int, resume: bool) -> dict:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_pair())}
        return run_distributed(_train, world, str(tmp_path), resume, timeout=300, env=env)[0]

    uninterrupted = run(2, False)
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        ckpt = tmp_path / "state" / part
        assert (ckpt / ".metadata").read_bytes()[:1] == b"{"
        done = run_console_script("hp-dcp", "hyper_parallel_dcp.cli", "verify", str(ckpt))
        assert done.returncode == 0, done.stdout + done.stderr
    resumed = run(1, True)
    assert set(resumed) == set(uninterrupted)
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key
