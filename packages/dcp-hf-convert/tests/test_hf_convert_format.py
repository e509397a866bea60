"""The Hugging Face side of the conversion: sizes, sharding, file layout, key mapping,
dtype cast, and the errors for broken HF checkpoints — each checked against what
``huggingface_hub`` / ``transformers`` themselves do."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from huggingface_hub.serialization._base import parse_size_to_int
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hyper_parallel_dcp.core.errors import CheckpointFormatError, CheckpointNotFoundError, CorruptCheckpointError
from hyper_parallel_dcp.offline_transform import (
    convert_dcp_to_huggingface,
    full_state_dict_to_dcp_format,
    parse_checkpoint_from_huggingface,
    parse_size,
    plan_huggingface_shards,
    save_state_dict_as_huggingface_format,
    scan_huggingface_checkpoint,
    strip_prefixes,
)
from hyper_parallel_dcp.offline_transform.hf_writer import TensorSpec
from hyper_parallel_dcp.offline_transform.keymap import map_keys


def _weight_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if "safetensors" in p.name)


# ------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("text", ["5GB", "500MB", "40KB", "1.5GB", "2TB", " 7 mb "])
def test_decimal_sizes_match_huggingface_hub(text):
    assert parse_size(text) == parse_size_to_int(text.replace(" ", "").upper().replace("MB", "MB"))


@pytest.mark.parametrize("text, expected", [("5GiB", 5 * 2**30), ("512MiB", 512 * 2**20), ("1KiB", 1024),
                                            ("123", 123), ("64B", 64), (4096, 4096)])
def test_binary_sizes_and_plain_bytes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["5XB", "GB", "", "-1GB", 0, -5, True, 1.5, "5 G B"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


# ---------------------------------------------------------------------------- sharding
@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=25), st.integers(1, 400))
def test_shard_plan_matches_huggingface_hub(sizes, limit):
    tensors = {f"t{i:02d}": torch.empty(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    ref = split_torch_state_dict_into_shards(tensors, max_shard_size=limit)
    plan = plan_huggingface_shards([TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()], limit)
    assert plan.files == ref.filename_to_tensors
    assert plan.total_size == ref.metadata["total_size"]
    assert plan.is_sharded == ref.is_sharded


@pytest.mark.parametrize("from_dcp", [False, True])
def test_sharded_files_and_index_equal_save_pretrained(model, tmp_path, from_dcp):
    model.save_pretrained(tmp_path / "ref", max_shard_size="40KB")
    sd = model.state_dict()
    if from_dcp:
        full_state_dict_to_dcp_format(sd, tmp_path / "dcp")
        save_state_dict_as_huggingface_format(tmp_path / "out", str(tmp_path / "dcp"), max_shard_size="40KB")
    else:
        save_state_dict_as_huggingface_format(tmp_path / "out", sd, max_shard_size="40KB")
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert len(_weight_files(ref)) > 3  # really sharded
    assert _weight_files(out) == _weight_files(ref)
    # byte for byte the index transformers writes (keys sorted, indent 2, trailing newline)
    assert (out / "model.safetensors.index.json").read_bytes() == (ref / "model.safetensors.index.json").read_bytes()
    for name in _weight_files(ref):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(str(out / name), "pt") as mine, safe_open(str(ref / name), "pt") as theirs:
            assert mine.metadata() == theirs.metadata() == {"format": "pt"}
            assert sorted(mine.keys()) == sorted(theirs.keys())
            for key in theirs.keys():
                assert torch.equal(mine.get_tensor(key), theirs.get_tensor(key)), key


def test_one_shard_is_model_safetensors_without_index(model, tmp_path):
    model.save_pretrained(tmp_path / "ref")
    save_state_dict_as_huggingface_format(tmp_path / "out", model.state_dict())
    assert _weight_files(tmp_path / "out") == _weight_files(tmp_path / "ref") == ["model.safetensors"]
    ref = load_file(tmp_path / "ref" / "model.safetensors")
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert ref.keys() == out.keys() and all(torch.equal(ref[k], out[k]) for k in ref)


def test_reexport_replaces_weights_and_keeps_other_files(model, tmp_path):
    out = tmp_path / "out"
    save_state_dict_as_huggingface_format(out, model.state_dict(), max_shard_size="40KB")
    model.config.save_pretrained(out)
    save_state_dict_as_huggingface_format(out, model.state_dict(), max_shard_size="1GB")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    save_state_dict_as_huggingface_format(out, model.state_dict(), max_shard_size="100KB")
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" not in files and "config.json" in files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f for f in files if f.startswith("model-")]


def test_dtype_cast_applies_to_floating_tensors_only(tmp_path):
    sd = {"w": torch.randn(8, 4), "ids": torch.arange(6), "mask": torch.tensor([True, False])}
    save_state_dict_as_huggingface_format(tmp_path / "out", sd, dtype="bf16")
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], sd["w"].to(torch.bfloat16))
    assert out["ids"].dtype == torch.int64 and torch.equal(out["ids"], sd["ids"])
    assert torch.equal(out["mask"], sd["mask"])
    full_state_dict_to_dcp_format(sd, tmp_path / "dcp")
    convert_dcp_to_huggingface(tmp_path / "dcp", tmp_path / "out16", dtype=torch.float16)
    out16 = load_file(tmp_path / "out16" / "model.safetensors")
    assert torch.equal(out16["w"], sd["w"].half()) and out16["ids"].dtype == torch.int64
    with pytest.raises(ValueError, match="bf16"):
        save_state_dict_as_huggingface_format(tmp_path / "bad", sd, dtype="int8")


def test_nested_state_dict_and_objects_flatten_to_dotted_names(tmp_path):
    sd = {"model": {"layer": {"weight": torch.ones(2, 3)}}, "step": 7}
    save_state_dict_as_huggingface_format(tmp_path / "out", sd)
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert list(out) == ["model.layer.weight"] and torch.equal(out["model.layer.weight"], torch.ones(2, 3))


# ------------------------------------------------------------------------- key mapping
def test_prefix_rules_apply_in_order_and_callables_may_drop():
    keys = ["_orig_mod.model.embed.weight", "model.norm.weight", "lm_head.weight", "rotary.inv_freq"]
    assert map_keys(keys, strip_prefixes("_orig_mod.", "model.")) == {
        "_orig_mod.model.embed.weight": "embed.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight", "rotary.inv_freq": "rotary.inv_freq",
    }
    assert map_keys(keys, {"model.": "backbone."})["model.norm.weight"] == "backbone.norm.weight"
    kept = map_keys(keys, lambda k: None if k.endswith("inv_freq") else k.upper())
    assert list(kept.values()) == ["_ORIG_MOD.MODEL.EMBED.WEIGHT", "MODEL.NORM.WEIGHT", "LM_HEAD.WEIGHT"]
    with pytest.raises(ValueError, match="both 'a.x' and 'b.x'"):
        map_keys(["a.x", "b.x"], strip_prefixes("a.", "b."))


def test_key_mapping_on_hf_read_and_export(model, tmp_path):
    sd = model.state_dict()
    save_state_dict_as_huggingface_format(tmp_path / "out", sd, key_mapping={"model.": ""})
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert set(out) == {k.removeprefix("model.") for k in sd}
    back = parse_checkpoint_from_huggingface(tmp_path / "out", key_mapping=lambda k: "model." + k if k != "lm_head.weight" else k)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


# ------------------------------------------------------------------ broken HF sources
@pytest.fixture()
def sharded(model, tmp_path):
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    return tmp_path / "hf"


def test_missing_shard_file_is_named(sharded):
    (sharded / "model-00003-of-00012.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError, match="model-00003-of-00012.safetensors is missing"):
        scan_huggingface_checkpoint(sharded)


def test_index_entry_not_in_its_shard_is_named(sharded):
    index_file = sharded / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.extra.weight"] = "model-00002-of-00012.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError, match="'model.extra.weight' to model-00002-of-00012.safetensors"):
        scan_huggingface_checkpoint(sharded)


def test_shard_tensor_missing_from_index_is_named(sharded):
    index_file = sharded / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    files = list(index["weight_map"].values())
    shard = next(f for f in files if files.count(f) >= 2)  # a shard that stays in the index
    victim = next(k for k, v in index["weight_map"].items() if v == shard)
    del index["weight_map"][victim]
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError, match=f"{victim!r} but model.safetensors.index.json has no entry"):
        scan_huggingface_checkpoint(sharded)


def test_index_without_weight_map(sharded):
    (sharded / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointFormatError, match="weight_map"):
        scan_huggingface_checkpoint(sharded)


def test_truncated_shard_is_named(sharded):
    shard = sharded / "model-00005-of-00012.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CorruptCheckpointError, match="model-00005-of-00012.safetensors"):
        scan_huggingface_checkpoint(sharded)


def test_directories_without_an_hf_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="is not a Hugging Face checkpoint"):
        scan_huggingface_checkpoint(tmp_path / "empty")
    full_state_dict_to_dcp_format({"w": torch.ones(3)}, tmp_path / "dcp")
    with pytest.raises(CheckpointNotFoundError, match="dcp-to-hf"):
        scan_huggingface_checkpoint(tmp_path / "dcp")
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        scan_huggingface_checkpoint(tmp_path / "nowhere")
    (tmp_path / "two").mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        save_file({"x": torch.zeros(2)}, tmp_path / "two" / name)
    with pytest.raises(CheckpointFormatError, match="no \\*.safetensors.index.json"):
        scan_huggingface_checkpoint(tmp_path / "two")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(CorruptCheckpointError, match="junk.safetensors"):
        scan_huggingface_checkpoint(tmp_path / "junk.safetensors")


def test_single_file_forms_are_found(model, tmp_path):
    sd = model.state_dict()
    model.save_pretrained(tmp_path / "one")
    shutil.copy(tmp_path / "one" / "model.safetensors", tmp_path / "consolidated.safetensors")
    os.mkdir(tmp_path / "other")
    shutil.copy(tmp_path / "one" / "model.safetensors", tmp_path / "other" / "weights.safetensors")
    for src in (tmp_path / "one", tmp_path / "consolidated.safetensors", tmp_path / "other"):
        got = parse_checkpoint_from_huggingface(src)
        assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd), src
