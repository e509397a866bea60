"""What ``dcp-to-hf`` exports: a trainer checkpoint's model by default, ``--only PREFIX``
``--strip-prefix PREFIX``, ``--all``."""

from __future__ import annotations

import warnings

import torch
from safetensors import safe_open

from hyper_parallel_dcp.offline_transform.cli import main


def _trainer_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": 3}


def _exported(path) -> dict:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_only_and_strip_prefix_select_the_model_from_both_formats(tmp_path):
    import torch.distributed.checkpoint as tdcp

    from hyper_parallel_dcp.core.pipeline import save_state_dict
    from hyper_parallel_dcp.storage_fs import FileSystemWriter

    state = _trainer_state()
    save_state_dict(state, FileSystemWriter(tmp_path / "ours"), no_dist=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(state, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    expected = {k: v for k, v in state["model"].items()}
    for name in ("ours", "torch"):
        out = tmp_path / f"hf-{name}"
        assert main(["dcp-to-hf", str(tmp_path / name), str(out), "--only", "model.", "--strip-prefix", "model.",
                     "-q"]) == 0
        got = _exported(out)
        assert set(got) == set(expected), name
        for key, value in expected.items():
            assert torch.equal(got[key], value), (name, key)
    # repeatable: two prefixes; without --strip-prefix the names stay
    out = tmp_path / "two"
    assert main(["dcp-to-hf", str(tmp_path / "ours"), str(out), "--only", "model.0.", "--only", "model.1.bias",
                 "-q"]) == 0
    assert set(_exported(out)) == {"model.0.weight", "model.0.bias", "model.1.bias"}
    # --all: optimizer state is exported too
    out = tmp_path / "all"
    assert main(["dcp-to-hf", str(tmp_path / "ours"), str(out), "--all", "-q"]) == 0
    assert "optim.state.0.exp_avg" in _exported(out)


def test_the_skipped_objects_warning_names_only_the_entries_the_selection_keeps(tmp_path, caplog):
    from hyper_parallel_dcp.core.pipeline import save_state_dict
    from hyper_parallel_dcp.storage_fs import FileSystemWriter

    save_state_dict(_trainer_state(), FileSystemWriter(tmp_path / "ours"), no_dist=True)
    logger = "hyper_parallel_dcp.offline_transform.from_dcp"

    def warned(*args: str) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger=logger):
            assert main(["dcp-to-hf", str(tmp_path / "ours"), str(tmp_path / f"out{len(args)}"), *args, "-q"]) == 0
        return [r.getMessage() for r in caplog.records if r.name == logger]

    # the model holds no objects: `--only model.` leaves nothing out that it asked for
    assert warned("--only", "model.") == []
    # the whole checkpoint: the step and the optimizer's param_groups are named
    (message,) = warned("--all")
    assert "2 non-tensor entries are not exported" in message
    assert "'step'" in message and "'optim.param_groups'" in message


def test_a_trainer_checkpoint_exports_the_models_weights_by_default_and_says_so(tmp_path, caplog):
    from hyper_parallel_dcp.core.pipeline import save_state_dict
    from hyper_parallel_dcp.storage_fs import FileSystemWriter

    state = _trainer_state()
    save_state_dict(state, FileSystemWriter(tmp_path / "ours"), no_dist=True)
    with caplog.at_level("WARNING", logger="hyper_parallel_dcp.offline_transform"):
        assert main(["dcp-to-hf", str(tmp_path / "ours"), str(tmp_path / "hf"), "-q"]) == 0
    got = _exported(tmp_path / "hf")
    assert set(got) == set(state["model"])  # no optimizer moments, no step: the model, 'model.' stripped
    for key, value in state["model"].items():
        assert torch.equal(got[key], value), key
    said = [r.getMessage() for r in caplog.records if "trainer checkpoint" in r.getMessage()]
    assert len(said) == 1 and "'model.'" in said[0] and "--all" in said[0], said
    # --all: everything, under the checkpoint's own names
    assert main(["dcp-to-hf", str(tmp_path / "ours"), str(tmp_path / "every"), "--all", "-q"]) == 0
    assert {"model.0.weight", "optim.state.0.exp_avg", "optim.state.0.exp_avg_sq"} <= set(_exported(tmp_path / "every"))
    assert main(["dcp-to-hf", str(tmp_path / "ours"), str(tmp_path / "x"), "--all", "--only", "model."]) == 2


def test_a_models_own_state_dict_keeps_its_model_prefix(tmp_path):
    from hyper_parallel_dcp.core.pipeline import save_state_dict
    from hyper_parallel_dcp.storage_fs import FileSystemWriter

    # a Hugging Face model's state dict: 'model.layers...' beside 'lm_head.weight', all tensors
    weights = {"model.embed.weight": torch.ones(4, 2), "model.norm.weight": torch.ones(2),
               "lm_head.weight": torch.full((4, 2), 2.0)}
    save_state_dict(weights, FileSystemWriter(tmp_path / "plain"), no_dist=True)
    assert main(["dcp-to-hf", str(tmp_path / "plain"), str(tmp_path / "hf"), "-q"]) == 0
    got = _exported(tmp_path / "hf")
    assert set(got) == set(weights) and all(torch.equal(got[k], v) for k, v in weights.items())
