"""Single-process round trips: HF / torch.save / in-memory → DCP → full state dict or HF,
checked against the original tensors and against a transformers model's logits; and the
``hp-dcp-convert`` command line."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from hf_convert_helpers import fixed_input, logits_of, tree_digest
from safetensors.torch import load_file, save_file

from hyper_parallel_dcp.core.pipeline import load_state_dict
from hyper_parallel_dcp.offline_transform import (
    convert_full_checkpoint_to_dcp,
    dcp_to_full_state_dict,
    full_state_dict_to_dcp_format,
    save_state_dict_as_huggingface_format,
    strip_prefixes,
)
from hyper_parallel_dcp.offline_transform.cli import main
from hyper_parallel_dcp.storage_fs.filesystem import FileSystemReader


@pytest.fixture(scope="module")
def reference(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture()
def hf_dir(model, tmp_path):
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    return tmp_path / "hf"


def _hf_files_as_dict(root: Path) -> dict[str, torch.Tensor]:
    """The tensors of every shard, read by the safetensors library (independent reference)."""
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(root.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def _assert_same(got: dict, expected: dict) -> None:
    assert list(sorted(got)) == list(sorted(expected))
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_hf_to_dcp_round_trip_and_normal_load(hf_dir, tmp_path, reference):
    report = convert_full_checkpoint_to_dcp(hf_dir, tmp_path / "dcp")
    assert report.tensors == len(reference) and report.bytes == sum(t.nbytes for t in reference.values())
    assert (tmp_path / "dcp" / ".metadata").is_file()
    _assert_same(dcp_to_full_state_dict(tmp_path / "dcp"), _hf_files_as_dict(hf_dir))
    _assert_same(dcp_to_full_state_dict(tmp_path / "dcp"), reference)
    # a normal checkpoint: the core load fills a target dict of another dtype-compatible layout in place
    target = {k: torch.zeros_like(v) for k, v in reference.items()}
    load_state_dict(target, FileSystemReader(tmp_path / "dcp"), no_dist=True)
    _assert_same(target, reference)


def test_torch_save_source_with_prefixes_and_objects(tmp_path, reference):
    nested = {"model": {f"_orig_mod.{k}": v for k, v in reference.items()}, "step": 7, "sched": {"lr": [0.1, 0.2]}}
    torch.save(nested, tmp_path / "full.pt")
    convert_full_checkpoint_to_dcp(tmp_path / "full.pt", tmp_path / "dcp", src_platform="torch",
                                   key_mapping=strip_prefixes("model.", "_orig_mod."))
    got = dcp_to_full_state_dict(tmp_path / "dcp")
    assert got.pop("step") == 7 and got.pop("sched.lr") == [0.1, 0.2]
    _assert_same(got, reference)


def test_torch_legacy_format_and_safetensors_file(tmp_path, reference):
    torch.save(reference, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    convert_full_checkpoint_to_dcp(tmp_path / "legacy.pt", tmp_path / "a", src_platform="torch")
    _assert_same(dcp_to_full_state_dict(tmp_path / "a"), reference)
    save_file(reference, tmp_path / "full.safetensors")
    convert_full_checkpoint_to_dcp(tmp_path / "full.safetensors", tmp_path / "b", src_platform="torch")
    _assert_same(dcp_to_full_state_dict(tmp_path / "b"), reference)


class NotAllowListed:
    """A user class: weights_only loading must refuse it (no code from a checkpoint runs)."""


def test_torch_source_refuses_code(tmp_path):
    torch.save({"w": torch.ones(2), "evil": NotAllowListed()}, tmp_path / "evil.pt")
    from hyper_parallel_dcp.core.errors import CheckpointFormatError

    with pytest.raises(CheckpointFormatError, match="evil.pt"):
        convert_full_checkpoint_to_dcp(tmp_path / "evil.pt", tmp_path / "dcp", src_platform="torch")
    assert not (tmp_path / "dcp" / ".metadata").exists()


def test_unknown_platform(tmp_path):
    with pytest.raises(ValueError, match="src_platform"):
        convert_full_checkpoint_to_dcp(tmp_path, tmp_path / "dcp", src_platform="jax")


def test_in_memory_to_dcp_to_hf_gives_identical_logits(model, tmp_path, reference):
    full_state_dict_to_dcp_format(model.state_dict(), tmp_path / "dcp")
    _assert_same(dcp_to_full_state_dict(tmp_path / "dcp"), reference)
    save_state_dict_as_huggingface_format(tmp_path / "hf", str(tmp_path / "dcp"), max_shard_size="64KB")
    model.config.save_pretrained(tmp_path / "hf")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = fixed_input()
    assert torch.equal(logits_of(loaded, ids), logits_of(model, ids))


# ------------------------------------------------------------------------------ CLI
def test_cli_both_directions(hf_dir, tmp_path, reference, capsys):
    assert main(["hf-to-dcp", str(hf_dir), str(tmp_path / "dcp"), "-q"]) == 0
    assert main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "out"), "--max-shard-size", "100KB"]) == 0
    out = capsys.readouterr().out
    assert f"{len(reference)} tensors" in out and "MiB/s" in out
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in reference.values())
    assert not (tmp_path / "out" / "config.json").exists()  # weights and index only
    _assert_same(_hf_files_as_dict(tmp_path / "out"), reference)


def test_cli_refuses_non_empty_destination_and_leaves_it_untouched(hf_dir, tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    before = tree_digest(dst)
    assert main(["hf-to-dcp", str(hf_dir), str(dst)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--overwrite" in err
    assert tree_digest(dst) == before
    assert main(["dcp-to-hf", str(hf_dir), str(dst)]) == 2
    assert tree_digest(dst) == before
    assert main(["hf-to-dcp", str(hf_dir), str(dst), "--overwrite", "-q"]) == 0
    assert (dst / ".metadata").is_file() and (dst / "keep.txt").read_text() == "mine"


def test_cli_errors_name_the_problem(hf_dir, tmp_path, capsys):
    (hf_dir / "model-00007-of-00012.safetensors").unlink()
    assert main(["hf-to-dcp", str(hf_dir), str(tmp_path / "a"), "-q"]) == 1
    assert "model-00007-of-00012.safetensors is missing" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("x")
    assert main(["hf-to-dcp", str(tmp_path / "plain"), str(tmp_path / "b"), "-q"]) == 1
    assert "not a Hugging Face checkpoint" in capsys.readouterr().err
    assert main(["dcp-to-hf", str(tmp_path / "plain"), str(tmp_path / "c"), "-q"]) == 1
    assert "plain" in capsys.readouterr().err
    assert main(["dcp-to-hf", str(tmp_path / "plain"), str(tmp_path / "d"), "--max-shard-size", "5XB"]) == 2
    assert "5XB" in capsys.readouterr().err
    assert main(["dcp-to-hf", str(tmp_path / "plain"), str(tmp_path / "d"), "--dtype", "int3"]) == 2
    assert main(["no-such-command"]) == 2


def test_console_script_and_module_entry(hf_dir, tmp_path):
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("hp-dcp-convert") == "hyper_parallel_dcp.offline_transform.cli:main"
    proc = subprocess.run([sys.executable, "-m", "hyper_parallel_dcp.offline_transform", "hf-to-dcp", str(hf_dir),
                           str(tmp_path / "dcp")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "hf-to-dcp:" in proc.stdout and "tensors" in proc.stdout
    assert "HF -> DCP" not in proc.stderr  # stderr is a pipe: no progress bar drawn into it
    # on a terminal the bar is drawn
    import fcntl
    import os
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a sized terminal
    try:
        tty = subprocess.run([sys.executable, "-m", "hyper_parallel_dcp.offline_transform", "hf-to-dcp", str(hf_dir),
                              str(tmp_path / "dcp2")], stdout=subprocess.PIPE, stderr=follower, timeout=300)
        os.close(follower)
        drawn = b""
        while True:
            try:
                part = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other side is closed and drained
                break
            if not part:
                break
            drawn += part
    finally:
        os.close(leader)
    assert tty.returncode == 0 and b"HF -> DCP" in drawn
