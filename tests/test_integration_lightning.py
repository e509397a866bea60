"""PyTorch Lightning (``[lightning]`` extra): a Trainer with FSDP2 saves through us and resumes elsewhere.

2 gloo ranks train 4 steps with :class:`hyper_parallel_dcp.integrations.lightning.ModelParallelStrategy`,
saving at step 2 (the end of the first epoch); the checkpoint is ours (JSON ``.metadata``,
``hp-dcp verify`` passes).  One rank resumes it with ``fit(ckpt_path=...)`` and trains to
step 4: its weights equal, bit for bit, those of the uninterrupted 2-rank run (every rank
sees the same batches, so the world size does not change the arithmetic).
"""

from __future__ import annotations

import pytest
import torch

from hyper_parallel_dcp.core.testing import free_port_pair, run_console_script, run_distributed

pytest.importorskip("pytorch_lightning")
pytestmark = pytest.mark.distributed


def _train(rank: int, world_size: int, root: str, resume: bool) -> dict:
    import warnings

    import pytorch_lightning as pl
    from torch.distributed.fsdp import fully_shard

    from hyper_parallel_dcp.integrations.lightning import ModelParallelStrategy

    warnings.filterwarnings("ignore")

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    class SaveAtStep2(pl.Callback):
        def on_train_batch_end(self, trainer, *_) -> None:
            if trainer.global_step == 2:
                trainer.save_checkpoint(f"{root}/ckpt")

    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=4)  # the same batches on every rank
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=ModelParallelStrategy(), max_steps=4,
                         use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                         callbacks=[] if resume else [SaveAtStep2()])
    model = Net()
    trainer.fit(model, loader, ckpt_path=f"{root}/ckpt" if resume else None)
    return {k: v.full_tensor() for k, v in model.net.state_dict().items()}


def test_lightning_fsdp2_resumes_on_another_world_size_bit_identical(tmp_path):
    def run(world: int, resume: bool) -> dict:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_pair())}
        return run_distributed(_train, world, str(tmp_path), resume, timeout=300, env=env)[0]

    uninterrupted = run(2, False)
    ckpt = tmp_path / "ckpt"
    assert (ckpt / ".metadata").read_bytes()[:1] == b"{" and (ckpt / "meta.pt").is_file()
    done = run_console_script("hp-dcp", "hyper_parallel_dcp.cli", "verify", str(ckpt))
    assert done.returncode == 0, done.stdout + done.stderr
    resumed = run(1, True)
    assert set(resumed) == set(uninterrupted)
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key
