"""torch DCP parity in one process: the allow-list, every dtype, Stateful, casts, partial loads."""

from __future__ import annotations

import json
import pickle
import warnings

import pytest
import torch

import hyper_parallel_dcp as dcp
from hyper_parallel_dcp.core.errors import MismatchError, MissingKeyError, UnsafeObjectError

QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}


def every_dtype() -> list[torch.dtype]:
    names = sorted(n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)
                   and str(getattr(torch, n)) == f"torch.{n}" and n not in QUANTIZED)
    return [getattr(torch, n) for n in names]


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (NaN payloads and all)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}[a.dtype.itemsize]
    if a.dtype.itemsize == 16:
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    return torch.equal(a.view(bits).contiguous(), b.view(bits).contiguous())


def _torch_save(sd: dict, path) -> None:
    import torch.distributed.checkpoint as tdcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(sd, checkpoint_id=str(path), no_dist=True)


def test_every_torch_dtype_round_trips_bit_exact_whole_and_sliced(tmp_path):
    dtypes = every_dtype()
    assert {torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.complex128, torch.uint64} <= set(dtypes)
    sd = {str(d).removeprefix("torch."): random_bits(d, (4, 6), i) for i, d in enumerate(dtypes)}
    dcp.save(sd, checkpoint_id=tmp_path / "all", no_dist=True)
    whole = {k: torch.zeros_like(v.view(torch.uint8)).view(v.dtype) for k, v in sd.items()}
    dcp.load(whole, checkpoint_id=tmp_path / "all", no_dist=True)
    for key, value in sd.items():
        assert same_bits(whole[key], value), key
    # a column slice (strided destination, staged copy) of each
    for key, value in sd.items():
        target = torch.zeros_like(value.view(torch.uint8)).view(value.dtype)
        from hyper_parallel_dcp.core.chunks import ChunkBox
        from hyper_parallel_dcp.core.layout import TensorShards

        piece = target[:, 2:5]
        dcp.load({key: TensorShards((4, 6), value.dtype, [(ChunkBox((0, 2), (4, 3)), piece)])},
                 checkpoint_id=tmp_path / "all", no_dist=True)
        assert same_bits(piece, value[:, 2:5]), key
    doc = json.loads((tmp_path / "all" / ".metadata").read_text())["tensors"]
    assert doc["float8_e8m0fnu"]["dtype"] == "float8_e8m0fnu" and doc["float8_e8m0fnu"]["stored_as"] == "uint8"
    assert doc["complex128"]["stored_as"] == "float64" and "stored_as" not in doc["bfloat16"]
    # the files stay plain safetensors
    from safetensors import safe_open

    with safe_open(str(tmp_path / "all" / "_rank0_.safetensors"), framework="pt") as f:
        assert len(list(f.keys())) == len(sd)


def test_quantized_dtype_is_refused_by_name(tmp_path):
    q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    with pytest.raises(Exception, match="quantized dtype torch.qint8"):
        dcp.save({"q": q}, checkpoint_id=tmp_path / "q", no_dist=True)


def test_torch_saved_dtypes_load_bit_exact(tmp_path):
    sd = {}
    for i, dtype in enumerate(every_dtype()):
        one = {str(dtype).removeprefix("torch."): random_bits(dtype, (3, 4), 100 + i)}
        try:  # torch's own save cannot plan bits*/sub-byte ints (torch.iinfo fails on them)
            _torch_save(one, tmp_path / "probe" / str(i))
        except BaseException:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            continue
        sd.update(one)
    assert {"float8_e8m0fnu", "float8_e4m3fnuz", "float4_e2m1fn_x2", "complex128", "uint64"} <= set(sd)
    _torch_save(sd, tmp_path / "t")
    target = {k: torch.zeros_like(v.view(torch.uint8)).view(v.dtype) for k, v in sd.items()}
    dcp.load(target, checkpoint_id=tmp_path / "t", no_dist=True)
    for key, value in sd.items():
        assert same_bits(target[key], value), key


def test_a_transposed_and_a_sliced_torch_chunk_load_exactly(tmp_path):
    base = torch.arange(48.0).view(6, 8)
    _torch_save({"t": base.t(), "n": base[1:4]}, tmp_path / "t")  # non-contiguous, storage offset
    target = {"t": torch.zeros(8, 6), "n": torch.zeros(3, 8)}
    dcp.load(target, checkpoint_id=tmp_path / "t", no_dist=True)
    assert torch.equal(target["t"], base.t()) and torch.equal(target["n"], base[1:4])


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_metadata_pickle_is_refused_named_and_nothing_runs(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    from hyper_parallel_dcp.cli import main as hp_dcp

    path = tmp_path / "evil"
    _torch_save({"w": torch.ones(2)}, path)
    marker = tmp_path / "pwned"
    good = pickle.loads((path / ".metadata").read_bytes())
    evil = Metadata(good.state_dict_metadata, planner_data=_Evil(str(marker)), storage_data=good.storage_data)
    (path / ".metadata").write_bytes(pickle.dumps(evil))
    with pytest.raises(UnsafeObjectError, match=r"needs (posix|os)\.system.*allow-list.*nothing was executed"):
        dcp.load({"w": torch.zeros(2)}, checkpoint_id=path, no_dist=True)
    assert hp_dcp(["inspect", str(path)]) == 1
    assert not marker.exists()
    # the unmodified pickle is fine, proving the refusal is about the class
    (path / ".metadata").write_bytes(pickle.dumps(good))
    target = {"w": torch.zeros(2)}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    assert torch.equal(target["w"], torch.ones(2))


def test_objects_of_unlisted_classes_in_a_torch_checkpoint_are_refused(tmp_path):
    from fractions import Fraction

    _torch_save({"c": Fraction(1, 3)}, tmp_path / "t")
    with pytest.raises(UnsafeObjectError, match="fractions.Fraction"):
        dcp.load({"c": None}, checkpoint_id=tmp_path / "t", no_dist=True)
    from torch.serialization import safe_globals

    with safe_globals([Fraction]):
        target = {"c": None}
        dcp.load(target, checkpoint_id=tmp_path / "t", no_dist=True)
    assert target["c"] == Fraction(1, 3)


class AppState:
    """The Stateful of torch's DCP tutorial (model + optimizer)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, state_dict):
        self.model.load_state_dict(state_dict["model"])
        self.optimizer.load_state_dict(state_dict["optim"])


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optim.step()
    return model, optim


def test_stateful_is_expanded_on_save_and_restored_through_load_state_dict(tmp_path):
    model, optim = _trained(0)
    dcp.save({"app": AppState(model, optim), "step": 4}, checkpoint_id=tmp_path / "s", no_dist=True)
    doc = json.loads((tmp_path / "s" / ".metadata").read_text())
    assert "app.model.weight" in doc["tensors"] and "app.optim.state.0.exp_avg" in doc["tensors"]
    assert not (tmp_path / "s" / "_rank0_.bytes").read_bytes().count(b"AppState")
    other_model, other_optim = _trained(1)
    sd = {"app": AppState(other_model, other_optim), "step": 0}
    app = sd["app"]
    dcp.load(sd, checkpoint_id=tmp_path / "s", no_dist=True)
    assert sd["app"] is app and sd["step"] == 4
    assert torch.equal(other_model.weight, model.weight)
    assert torch.equal(other_optim.state_dict()["state"][0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])
    # the same with torch's own save: the stored keys are the same, so either loads the other
    _torch_save({"app": AppState(model, optim), "step": 4}, tmp_path / "t")
    third_model, third_optim = _trained(2)
    sd = {"app": AppState(third_model, third_optim), "step": 0}
    dcp.load(sd, checkpoint_id=tmp_path / "t", no_dist=True)
    assert torch.equal(third_model.weight, model.weight) and sd["step"] == 4


def test_f32_checkpoint_loads_into_bf16_and_shape_still_must_match(tmp_path):
    w = torch.randn(4, 6)
    dcp.save({"w": w}, checkpoint_id=tmp_path / "c", no_dist=True)
    half = {"w": torch.zeros(4, 6, dtype=torch.bfloat16)}
    dcp.load(half, checkpoint_id=tmp_path / "c", no_dist=True)
    assert torch.equal(half["w"], w.to(torch.bfloat16))
    with pytest.raises(MismatchError, match=r"'w': shape mismatch"):
        dcp.load({"w": torch.zeros(6, 4, dtype=torch.bfloat16)}, checkpoint_id=tmp_path / "c", no_dist=True)


def test_allow_partial_load_leaves_missing_keys_untouched(tmp_path):
    dcp.save({"w": torch.ones(3), "step": 2}, checkpoint_id=tmp_path / "c", no_dist=True)
    target = {"w": torch.zeros(3), "new": torch.full((2,), 5.0), "note": "keep"}
    with pytest.raises(MissingKeyError, match="'new'"):
        dcp.load(target, checkpoint_id=tmp_path / "c", no_dist=True)
    dcp.load(target, checkpoint_id=tmp_path / "c", no_dist=True, allow_partial_load=True)
    assert torch.equal(target["w"], torch.ones(3)) and torch.equal(target["new"], torch.full((2,), 5.0))
    assert target["note"] == "keep"


def test_our_stateful_checkpoint_converted_back_loads_with_torch(tmp_path):
    import torch.distributed.checkpoint as tdcp

    from hyper_parallel_dcp.offline_transform.cli import main as convert

    model, optim = _trained(0)
    dcp.save({"app": AppState(model, optim), "step": 4}, checkpoint_id=tmp_path / "ours", no_dist=True)
    assert convert(["dcp-to-torch-dcp", str(tmp_path / "ours"), str(tmp_path / "torch"), "-q"]) == 0
    other_model, other_optim = _trained(3)
    sd = {"app": AppState(other_model, other_optim), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.load(sd, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    assert torch.equal(other_model.weight, model.weight) and sd["step"] == 4
    assert other_optim.state_dict()["param_groups"] == optim.state_dict()["param_groups"]
    assert torch.equal(other_optim.state_dict()["state"][0]["exp_avg_sq"], optim.state_dict()["state"][0]["exp_avg_sq"])


def test_an_unknown_stream_extension_is_refused_by_name(tmp_path):
    path = tmp_path / "t"
    _torch_save({"w": torch.ones(3), "o": {"k": 1}}, path)
    md = pickle.loads((path / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.transform_descriptors = ["stream.lz9/1"]
    (path / ".metadata").write_bytes(pickle.dumps(md))
    from hyper_parallel_dcp.core.errors import CheckpointFormatError

    with pytest.raises(CheckpointFormatError, match=r"extension 'stream\.lz9/1'.*supported: stream\.zstd/1"):
        dcp.load({"w": torch.zeros(3)}, checkpoint_id=path, no_dist=True)
    with pytest.raises(CheckpointFormatError, match=r"extension 'stream\.lz9/1'"):
        dcp.load({"o": {"k": 0}}, checkpoint_id=path, no_dist=True)


def test_zstd_compressed_torch_checkpoint(tmp_path):
    """torch's own ZStandard stream extension: read when 'zstandard' is installed, else a
    clear error naming the package."""
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint._extension import ZStandard

    path = tmp_path / "z"
    value = torch.arange(12.0).view(3, 4)
    if not ZStandard.is_available():
        # torch cannot write it either here; fake the descriptor on a plain save
        _torch_save({"w": value}, path)
        md = pickle.loads((path / ".metadata").read_bytes())
        for info in md.storage_data.values():
            info.transform_descriptors = ["stream.zstd/1"]
        (path / ".metadata").write_bytes(pickle.dumps(md))
        from hyper_parallel_dcp.core.errors import CheckpointFormatError

        with pytest.raises(CheckpointFormatError, match=r"stream\.zstd.*install the 'zstandard' package"):
            dcp.load({"w": torch.zeros(3, 4)}, checkpoint_id=path, no_dist=True)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save({"w": value}, storage_writer=tdcp.FileSystemWriter(str(path), _extensions=[ZStandard()]),
                  no_dist=True)
    target = {"w": torch.zeros(3, 4)}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    assert torch.equal(target["w"], value)


class RunInfo:
    """A user class: its objects load only once it is allow-listed."""

    def __init__(self, name: str, steps: int) -> None:
        self.name, self.steps = name, steps

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunInfo) and vars(self) == vars(other)


def test_converters_carry_a_user_class_object_as_its_stored_bytes(tmp_path):
    from hyper_parallel_dcp.offline_transform.blocks import CheckpointBlocks
    from hyper_parallel_dcp.offline_transform.cli import main as convert

    info = RunInfo("run1", 7)
    _torch_save({"w": torch.arange(6.0), "info": info, "plain": [{"lr": 0.1}]}, tmp_path / "torch")
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    assert convert(["torch-dcp-to-dcp", str(tmp_path / "torch"), ours]) == 0  # was: refused, not allow-listed
    assert convert(["dcp-to-torch-dcp", ours, back]) == 0
    stored = [CheckpointBlocks(p).object_bytes("info") for p in (tmp_path / "torch", ours, back)]
    assert stored[0] == stored[1] == stored[2]  # the pickle's bytes, never unpickled on the way
    for path in (ours, back):
        target = {"w": torch.zeros(6), "info": None}
        with pytest.raises(UnsafeObjectError, match="RunInfo"):  # the load applies the allow-list
            dcp.load(target, checkpoint_id=path, no_dist=True)
        with torch.serialization.safe_globals([RunInfo]):
            dcp.load(target, checkpoint_id=path, no_dist=True)
        assert target["info"] == info and torch.equal(target["w"], torch.arange(6.0))
