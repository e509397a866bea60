"""torchtitan (``[torchtitan]`` extra): its CheckpointManager saving through us, resumed elsewhere.

torchtitan's training loop needs its model configs, tokenizer and datasets (and an
accelerator for its defaults), so the test drives its checkpoint component directly:
:class:`hyper_parallel_dcp.integrations.torchtitan.CheckpointManager` built from its
``Config`` with torchtitan's ``OptimizersContainer`` and ``LRSchedulersContainer`` over an
FSDP2 model.  2 gloo ranks train 4 steps saving every 2 (``async_mode="async"``); the
newest step is removed (a crash before it), one rank resumes with ``load()`` (the manager
finds ``step-2``) and trains to step 4: bit-identical weights to the uninterrupted run.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from hyper_parallel_dcp.core.testing import free_port_pair, run_console_script, run_distributed

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.distributed


def _train(rank: int, world_size: int, root: str, resume: bool) -> dict:
    import warnings

    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    from hyper_parallel_dcp.integrations.torchtitan import CheckpointManager

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for module in (model[0], model[2], model):
        fully_shard(module)
    groups = [ParamGroupConfig(pattern=".*", optimizer_name="Adam", optimizer_kwargs={"lr": 0.01})]
    optims = OptimizersContainer.Config(param_groups=groups, implementation="for-loop").build(model_parts=[model])
    scheds = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optims, training_steps=4)
    config = CheckpointManager.Config(enable=True, folder="ckpt", interval=2,
                                      async_mode="disabled" if resume else "async")
    manager = config.build(dataloader=None, model_parts=[model], optimizers=optims, lr_schedulers=scheds, states={},
                           sd_adapter=None, base_folder=root)
    assert manager.load() == resume
    gen = torch.Generator().manual_seed(1)  # the same batches on every rank
    batches = [(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(4)]
    for step in range(2 if resume else 0, 4):
        x, y = batches[step]
        optims.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optims.step()
        scheds.step()
        manager.save(step + 1)
    manager.maybe_wait_for_saving()
    manager.close()
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def test_torchtitan_checkpoint_manager_resumes_on_another_world_size_bit_identical(tmp_path):
    def run(world: int, resume: bool) -> dict:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_pair())}
        return run_distributed(_train, world, str(tmp_path), resume, timeout=300, env=env)[0]

    uninterrupted = run(2, False)
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4"]
    assert (ckpt / "step-2" / ".metadata").read_bytes()[:1] == b"{"
    done = run_console_script("hp-dcp", "hyper_parallel_dcp.cli", "verify", str(ckpt / "step-2"))
    assert done.returncode == 0, done.stdout + done.stderr
    shutil.rmtree(ckpt / "step-4")
    resumed = run(1, True)
    assert set(resumed) == set(uninterrupted)
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key
