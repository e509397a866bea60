"""End to end through the umbrella API and the installed ``hp-dcp-convert`` tool: a
Hugging Face export of a tiny Llama → DCP → ``hyper_parallel_dcp.load`` on 2 ranks
(TP layout); and ``hyper_parallel_dcp.save`` on 2 ranks → HF files that transformers
loads with identical logits."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_console_script, run_distributed

pytestmark = pytest.mark.distributed

_TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)


def _placement(fqn: str, ndim: int):
    from torch.distributed.tensor import Replicate, Shard

    if ndim != 2:
        return [Replicate()]
    return [Shard(1)] if ("o_proj" in fqn or "down_proj" in fqn) else [Shard(0)]


def _sharded(reference: dict, world_size: int, zeros: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    return {k: distribute_tensor(torch.zeros_like(v) if zeros else v, mesh, _placement(k, v.ndim))
            for k, v in reference.items()}


def _umbrella_load(rank: int, world_size: int, dcp_path: str, reference_path: str) -> None:
    import hyper_parallel_dcp as dcp

    reference = torch.load(reference_path, weights_only=True)
    target = _sharded(reference, world_size, zeros=True)
    dcp.load(target, checkpoint_id=dcp_path)
    for fqn, dt in target.items():
        assert torch.equal(dt.full_tensor(), reference[fqn]), f"rank {rank}: {fqn}"


def _umbrella_save(rank: int, world_size: int, reference_path: str, dcp_path: str) -> None:
    import hyper_parallel_dcp as dcp

    dcp.save(_sharded(torch.load(reference_path, weights_only=True), world_size, zeros=False), checkpoint_id=dcp_path)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_console_script("hp-dcp-convert", "hyper_parallel_dcp.offline_transform", *args)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    return LlamaForCausalLM(LlamaConfig(**_TINY)).eval()


def test_hf_to_dcp_with_the_tool_then_umbrella_load_on_two_ranks(tmp_path: Path):
    model = _model()
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    torch.save(model.state_dict(), tmp_path / "reference.pt")
    proc = _cli("hf-to-dcp", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    assert proc.returncode == 0, proc.stderr
    assert "tensors" in proc.stdout
    run_distributed(_umbrella_load, 2, str(tmp_path / "dcp"), str(tmp_path / "reference.pt"), timeout=240)


def test_umbrella_save_on_two_ranks_then_tool_export_loads_in_transformers(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    model = _model()
    torch.save(model.state_dict(), tmp_path / "reference.pt")
    run_distributed(_umbrella_save, 2, str(tmp_path / "reference.pt"), str(tmp_path / "dcp"), timeout=240)
    proc = _cli("dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--max-shard-size", "30KB")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model.config.save_pretrained(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, _TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
