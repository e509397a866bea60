"""torch's "Getting Started with Distributed Checkpoint" (FSDP2 + a Stateful AppState), on
CPU/gloo, with ONE line changed: the import of ``dcp``.

    torchrun --nproc-per-node 2 torch_dcp_tutorial.py save CKPT_DIR   # 2 steps, save, step 3
    torchrun --nproc-per-node 2 torch_dcp_tutorial.py load CKPT_DIR   # load, step 3

Both print the loss of step 3 on rank 0 (``LOSS <value>``): a resume gives the same.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

import hyper_parallel_dcp as dcp  # was: import torch.distributed.checkpoint as dcp


class AppState(Stateful):
    """This is a useful wrapper for checkpointing the Application State. Since this object is compliant
    with the Stateful protocol, DCP will automatically call state_dict/load_stat_dict as needed in the
    dcp.save/load APIs.
    """

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        # this line automatically manages FSDP FQN's, as well as sets the default state dict type to FSDP.SHARDED_STATE_DICT
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        # sets our state dicts on the model and optimizer, now that we've loaded
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(16, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def step(model, optimizer, n):
    torch.manual_seed(100 + n)
    loss = model(torch.rand(8, 16)).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def main(mode, checkpoint_dir):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = fully_shard(ToyModel())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    if mode == "save":
        step(model, optimizer, 1)
        step(model, optimizer, 2)
        state_dict = {"app": AppState(model, optimizer)}
        dcp.save(state_dict, checkpoint_id=checkpoint_dir)
    else:
        state_dict = {"app": AppState(model, optimizer)}
        dcp.load(state_dict=state_dict, checkpoint_id=checkpoint_dir)
    loss = step(model, optimizer, 3)
    if dist.get_rank() == 0:
        print(f"LOSS {loss!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
