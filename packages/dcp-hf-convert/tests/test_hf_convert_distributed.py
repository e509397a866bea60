"""Real multi-process round trips (gloo on CPU): a checkpoint converted from Hugging Face
loads into a 2-rank TP/FSDP-sharded state dict, and a checkpoint saved by a 4-rank 2-D
(dp × tp) job exports to Hugging Face files that transformers loads with identical logits."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

pytestmark = pytest.mark.distributed

_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROWWISE = ("o_proj", "down_proj")


def _tp_fsdp_placements(fqn: str, ndim: int):
    """TP-style for attention/MLP, FSDP-style row sharding for embeddings, replicated norms."""
    from torch.distributed.tensor import Replicate, Shard

    if ndim == 2 and any(p in fqn for p in _COLWISE):
        return [Shard(0)]
    if ndim == 2 and any(p in fqn for p in _ROWWISE):
        return [Shard(1)]
    if ndim == 2:
        return [Shard(0)]
    return [Replicate()]


def _load_sharded(rank: int, world_size: int, dcp_path: str, reference_path: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hyper_parallel_dcp.core.pipeline import load_state_dict
    from hyper_parallel_dcp.storage_fs.filesystem import FileSystemReader

    reference = torch.load(reference_path, weights_only=True)
    mesh = init_device_mesh("cpu", (world_size,))
    target = {k: distribute_tensor(torch.zeros_like(v), mesh, _tp_fsdp_placements(k, v.ndim)) for k, v in reference.items()}
    load_state_dict(target, FileSystemReader(dcp_path))
    for fqn, dt in target.items():
        (placement,) = dt.placements
        expected = reference[fqn]
        if isinstance(placement, Shard):
            expected = expected.chunk(world_size, dim=placement.dim)[rank]
        assert torch.equal(dt.to_local(), expected), f"rank {rank}: {fqn} differs"
    return len(target)


def _save_2d(rank: int, world_size: int, reference_path: str, dcp_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hyper_parallel_dcp.core.pipeline import save_state_dict
    from hyper_parallel_dcp.storage_fs.filesystem import FileSystemWriter

    reference = torch.load(reference_path, weights_only=True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sd = {}
    for fqn, tensor in reference.items():
        if tensor.ndim == 2 and any(p in fqn for p in _COLWISE + _ROWWISE):
            tp_dim = 0 if any(p in fqn for p in _COLWISE) else 1
            placements = [Shard(1 - tp_dim), Shard(tp_dim)]  # dp shards the other dim
        elif tensor.ndim == 2:
            placements = [Shard(0), Replicate()]
        else:
            placements = [Replicate(), Replicate()]
        sd[fqn] = distribute_tensor(tensor, mesh, placements)
    save_state_dict(sd, FileSystemWriter(dcp_path))


def test_hf_to_dcp_loads_into_two_rank_tp_fsdp_layout(tmp_path):
    from hf_convert_helpers import tiny_llama
    from safetensors.torch import load_file

    from hyper_parallel_dcp.offline_transform import convert_full_checkpoint_to_dcp

    tiny_llama().save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    reference = {}
    for shard in sorted((tmp_path / "hf").glob("*.safetensors")):
        reference.update(load_file(shard))  # read by the safetensors library, not by us
    torch.save(reference, tmp_path / "reference.pt")
    convert_full_checkpoint_to_dcp(tmp_path / "hf", tmp_path / "dcp")
    counts = run_distributed(_load_sharded, 2, str(tmp_path / "dcp"), str(tmp_path / "reference.pt"), timeout=240)
    assert counts == [len(reference)] * 2


def test_four_rank_checkpoint_exports_to_identical_logits(tmp_path):
    from hf_convert_helpers import fixed_input, logits_of, tiny_llama
    from transformers import AutoModelForCausalLM

    from hyper_parallel_dcp.offline_transform import dcp_to_full_state_dict, save_state_dict_as_huggingface_format
    from hyper_parallel_dcp.offline_transform.cli import main

    model = tiny_llama()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(reference, tmp_path / "reference.pt")
    run_distributed(_save_2d, 4, str(tmp_path / "reference.pt"), str(tmp_path / "dcp"), timeout=240)
    assert len(list((tmp_path / "dcp").glob("_rank*_.safetensors"))) == 4

    full = dcp_to_full_state_dict(tmp_path / "dcp")
    assert sorted(full) == sorted(reference)
    assert all(torch.equal(full[k], reference[k]) for k in reference)
    save_state_dict_as_huggingface_format(tmp_path / "hf", full, max_shard_size="64KB")
    # the streaming path (what the CLI runs) must produce the same export
    assert main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf_cli"), "--max-shard-size", "64KB", "-q"]) == 0
    ids = fixed_input()
    expected = logits_of(model, ids)
    for out in ("hf", "hf_cli"):
        model.config.save_pretrained(tmp_path / out)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / out).eval()
        assert torch.equal(logits_of(loaded, ids), expected), out
