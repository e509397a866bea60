"""Stored objects: damaged archives are refused, not decoded to a wrong value."""

from __future__ import annotations

import io
import pickletools
import struct
import zipfile

import pytest
import torch
import torch.utils.serialization

from hyper_parallel_dcp.core.errors import CorruptCheckpointError
from hyper_parallel_dcp.core.objects import deserialize_object, serialize_object


def _pickle_at(blob: bytes) -> tuple[int, bytes]:
    """Where the archive's pickle lies in ``blob``, and its bytes."""
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        data = archive.read(name)
    pos = blob.find(data)
    assert pos > 0 and blob.count(data) == 1
    return pos, data


def test_a_pickle_cut_short_before_a_tensor_is_rebuilt_is_refused() -> None:
    # what the fuzz test found: a STOP in place of the tensor's REDUCE made the archive
    # decode to the rebuild's arguments (its storage among them) in place of the tensor
    blob = bytearray(serialize_object({"lr": 0.5, "t": torch.ones(2)}))
    pos, data = _pickle_at(bytes(blob))
    # the last REDUCE calls the rebuild (its arguments' OrderedDict() is reduced before it)
    reduce_at = max(at for op, _, at in pickletools.genops(data) if op.name == "REDUCE")
    blob[pos + reduce_at] = ord(".")
    cut = torch.load(io.BytesIO(bytes(blob)), weights_only=True)  # torch does not check the CRC
    assert isinstance(cut, tuple) and isinstance(cut[0], torch.TypedStorage)
    with pytest.raises(CorruptCheckpointError, match=r"'opt' in f\.bytes: stored object is damaged.*CRC"):
        deserialize_object(bytes(blob), fqn="opt", file="f.bytes")


@pytest.mark.parametrize("member", ["pickle", "tensor data"])
def test_a_flipped_bit_of_a_stored_value_is_refused(member: str) -> None:
    blob = bytearray(serialize_object({"lr": 0.5, "t": torch.tensor([1.0, 2.0])}))
    if member == "pickle":
        pos, data = _pickle_at(bytes(blob))
        at = next(at for op, arg, at in pickletools.genops(data) if op.name == "BINFLOAT" and arg == 0.5)
        blob[pos + at + 3] ^= 0x10  # the 8 bytes after the opcode: 0.5 -> 0.5 + 2**-13
    else:
        at = blob.find(struct.pack("<2f", 1.0, 2.0))  # the tensor's bytes (little-endian)
        assert at > 0
        blob[at] ^= 0x01  # 1.0 -> 1.0 + 2**-23
    unchecked = torch.load(io.BytesIO(bytes(blob)), weights_only=True)
    assert unchecked["lr"] != 0.5 or not torch.equal(unchecked["t"], torch.tensor([1.0, 2.0]))
    with pytest.raises(CorruptCheckpointError, match="'opt' in f.bytes: stored object is damaged"):
        deserialize_object(bytes(blob), fqn="opt", file="f.bytes")


def test_archives_without_crcs_and_the_legacy_format_still_load() -> None:
    value = {"step": 7, "t": torch.arange(3.0)}
    config = torch.utils.serialization.config.save
    config.compute_crc32 = False
    try:
        no_crcs = serialize_object(value)
    finally:
        config.compute_crc32 = True
    with zipfile.ZipFile(io.BytesIO(no_crcs)) as archive:
        assert {info.CRC for info in archive.infolist()} == {0}
    legacy = io.BytesIO()
    torch.save(value, legacy, _use_new_zipfile_serialization=False)
    for blob in (no_crcs, legacy.getvalue(), serialize_object(value)):
        got = deserialize_object(blob, fqn="opt", file="f.bytes")
        assert got["step"] == 7 and torch.equal(got["t"], torch.arange(3.0))


def test_tensor_data_marked_as_a_directory_is_refused() -> None:
    # one damaged byte of the central directory (the member's MS-DOS attributes): torch's
    # reader then skips reading the tensor's bytes and returns its uninitialised memory
    blob = bytearray(serialize_object({"t": torch.ones(4)}))
    with zipfile.ZipFile(io.BytesIO(bytes(blob))) as archive:
        name = next(n for n in archive.namelist() if "/data/" in n)
    record = blob.index(b"PK\x01\x02")  # the central directory's records, in turn
    while blob[record + 46:record + 46 + len(name)] != name.encode():
        record = blob.index(b"PK\x01\x02", record + 4)
    blob[record + 38] |= 0x10  # external attributes: the directory bit
    with pytest.raises(CorruptCheckpointError, match="'opt' in f.bytes: stored object is damaged.*directory"):
        deserialize_object(bytes(blob), fqn="opt", file="f.bytes")
