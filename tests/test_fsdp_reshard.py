"""FSDP2 (``fully_shard``) and FSDP2+TP checkpoints with real gloo ranks.

An MLP with Adam state trains one step on 4 ranks and is saved; it is loaded on 2 ranks,
and the next training step there gives the same losses as the 4-rank run that never
went through the checkpoint.  An FSDP2+TP model (2×2 mesh, ``_StridedShard`` parameters)
is saved and loaded into plain FSDP2 models on 4 and on 2 ranks.
"""

from __future__ import annotations

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

pytestmark = pytest.mark.distributed

GLOBAL_BATCH = 8


def make_mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step`` (same global batch for any world)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=gen)
    y = torch.randn(GLOBAL_BATCH, 5, generator=gen)
    per = GLOBAL_BATCH // world_size
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def train_step(model, optim, step: int, rank: int, world_size: int) -> float:
    """One optimizer step; returns the global mean loss before the update."""
    import torch.distributed as dist

    x, y = batch(step, rank, world_size)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # FSDP averages gradients over ranks: equal shards → global mean
    optim.step()
    optim.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / world_size


def fsdp_model(seed: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = make_mlp(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def fsdp_tp_model(seed: int):
    """2×2 mesh: TP (colwise, rowwise) inside, FSDP over dp: the first weight is _StridedShard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = make_mlp(seed)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def full_params(model) -> dict[str, list]:
    """Full parameter values as nested lists (exact for float32).

    Results cross the process boundary as plain data: a tensor put on a multiprocessing
    queue travels through shared memory that dies with the rank process.
    """
    return {name: p.full_tensor().tolist() for name, p in model.named_parameters()}


def _train_save_continue_on_four(rank: int, world_size: int, root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.tensor.placement_types import _StridedShard

    import hyper_parallel_dcp as dcp

    model, optim = fsdp_model(0, world_size)
    train_step(model, optim, 1, rank, world_size)
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/fsdp4")
    saved = full_params(model)
    exp_avg = {k: v["exp_avg"].full_tensor().tolist() for k, v in optim_sd["state"].items()}
    losses = [train_step(model, optim, s, rank, world_size) for s in (2, 3)]

    # FSDP2 + TP on a 2×2 mesh, saved, then loaded into plain FSDP2 on the same 4 ranks
    tp_model = fsdp_tp_model(7)
    placements = {n: p.placements for n, p in tp_model.named_parameters()}
    assert any(isinstance(pl, _StridedShard) for pl in placements["0.weight"]), placements
    tp_sd = {"model": get_model_state_dict(tp_model)}
    dcp.save(tp_sd, checkpoint_id=f"{root}/fsdp_tp")
    tp_full = full_params(tp_model)
    target, _ = fsdp_model(99, world_size)
    target_sd = get_model_state_dict(target)
    dcp.load({"model": target_sd}, checkpoint_id=f"{root}/fsdp_tp")
    set_model_state_dict(target, target_sd)
    for name, value in full_params(target).items():
        assert value == tp_full[name], f"{name} differs after FSDP+TP → FSDP load"
    return {"saved": saved, "exp_avg": exp_avg, "losses": losses, "tp_full": tp_full}


def _load_continue_on_two(rank: int, world_size: int, root: str, reference: dict) -> list[float]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    import hyper_parallel_dcp as dcp

    model, optim = fsdp_model(123, world_size)  # other initial values, no optimizer state yet
    model_sd, optim_sd = get_state_dict(model, optim)  # initialises Adam state to load into
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/fsdp4")
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for name, value in full_params(model).items():
        assert value == reference["saved"][name], f"{name} differs after 4 → 2 load"
    _, optim_sd = get_state_dict(model, optim)
    for key, state in optim_sd["state"].items():
        assert state["exp_avg"].full_tensor().tolist() == reference["exp_avg"][key], key
    losses = [train_step(model, optim, s, rank, world_size) for s in (2, 3)]

    tp_target, _ = fsdp_model(5, world_size)
    tp_sd = get_model_state_dict(tp_target)
    dcp.load({"model": tp_sd}, checkpoint_id=f"{root}/fsdp_tp")
    set_model_state_dict(tp_target, tp_sd)
    for name, value in full_params(tp_target).items():
        assert value == reference["tp_full"][name], f"{name} differs after FSDP+TP (4) → FSDP (2)"
    return losses


def test_fsdp_adam_four_to_two_ranks_continues_training_identically(tmp_path):
    root = str(tmp_path)
    four = run_distributed(_train_save_continue_on_four, 4, root, timeout=240)
    reference = four[0]
    # the losses after the checkpoint come from the optimizer state too: step 3's loss
    # depends on Adam's moments from steps 1 and 2
    two = run_distributed(_load_continue_on_two, 2, root, reference, timeout=240)
    for losses in two:
        assert losses == pytest.approx(reference["losses"], rel=1e-5, abs=1e-7)
    assert reference["losses"][0] != pytest.approx(reference["losses"][1], rel=1e-3)  # training moved
