"""The format utilities every package shares: the atomic write and the header parser."""

from __future__ import annotations

import errno
import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hyper_parallel_dcp.storage_fs import atomic
from hyper_parallel_dcp.storage_fs.safetensors_header import (
    MAX_HEADER_BYTES,
    HeaderEntry,
    SafetensorsHeaderError,
    read_header,
)


# ------------------------------------------------------------------ write_file_atomic
def test_atomic_write_replaces_the_file_and_returns_its_size(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old contents")
    assert atomic.write_file_atomic(path, lambda f: f.write(b"new"), True) == 3
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_atomic_write_failure_keeps_the_old_file_and_removes_the_temp(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")

    def half_then_fail(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match=r"writing checkpoint file .*f\.bin failed: No space left on device") as info:
        atomic.write_file_atomic(path, half_then_fail, False)
    assert info.value.errno == errno.ENOSPC
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_atomic_write_with_a_unique_temp_name(tmp_path, monkeypatch):
    seen = []
    real_open = open

    def spy_open(file, *args, **kwargs):
        seen.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(atomic, "open", spy_open, raising=False)
    atomic.write_file_atomic(tmp_path / "m.pkl", lambda f: f.write(b"x"), sync=False, unique_temp=True)
    atomic.write_file_atomic(tmp_path / "n.pkl", lambda f: f.write(b"y"), sync=False)
    assert seen == [str(tmp_path / f"m.pkl.{os.getpid()}{atomic.TMP_SUFFIX}"), str(tmp_path / f"n.pkl{atomic.TMP_SUFFIX}")]
    assert (tmp_path / "m.pkl").read_bytes() == b"x" and (tmp_path / "n.pkl").read_bytes() == b"y"


# ------------------------------------------------------------------------ read_header
def _raw_file(path, header: dict, data: bytes, length_field=None):
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if length_field is None else length_field) + raw + data)
    return path


def _parse(path):
    with open(path, "rb") as f:
        return read_header(f, path.stat().st_size)


def _library_accepts(path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                f.get_tensor(key)
        return True
    except Exception:  # noqa: BLE001 - the library raises several types; its verdict is all we need
        return False


def test_header_of_a_library_written_file(tmp_path):
    tensors = {"b": torch.arange(6, dtype=torch.int64).reshape(2, 3), "a": torch.ones(4, dtype=torch.bfloat16),
               "empty": torch.zeros(0, 5)}
    save_file(tensors, tmp_path / "x.safetensors")
    header = _parse(tmp_path / "x.safetensors")
    raw = (tmp_path / "x.safetensors").read_bytes()
    data_start = 8 + struct.unpack("<Q", raw[:8])[0]
    assert set(header) == set(tensors)
    for key, t in tensors.items():
        entry = header[key]
        assert entry.shape == tuple(t.shape)
        assert entry.end - entry.begin == t.numel() * t.element_size()
        assert entry.begin >= data_start
        got = torch.frombuffer(bytearray(raw[entry.begin:entry.end]), dtype=t.dtype) if t.numel() else t
        assert torch.equal(got.reshape(t.shape), t)


GOOD = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "v": {"dtype": "I8", "shape": [3], "data_offsets": [8, 11]}}


@pytest.mark.parametrize(
    "header, data, why",
    [
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12 bytes"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "trailing bytes"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "leave a gap"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "v": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "overlap"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "lies outside"),
        ({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
    ],
)
def test_malformed_headers_are_refused_like_the_library_refuses_them(tmp_path, header, data, why):
    path = _raw_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(SafetensorsHeaderError, match=why):
        _parse(path)
    assert not _library_accepts(path)


def test_a_well_formed_raw_file_is_accepted_by_both(tmp_path):
    path = _raw_file(tmp_path / "ok.safetensors", GOOD, b"\0" * 11)
    assert _parse(path) == {"w": HeaderEntry("F32", (2,), 0 + _data_start(path), 8 + _data_start(path)),
                            "v": HeaderEntry("I8", (3,), 8 + _data_start(path), 11 + _data_start(path))}
    assert _library_accepts(path)


def _data_start(path):
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_header_size_cap_is_the_library_cap(tmp_path):
    assert MAX_HEADER_BYTES == 100_000_000
    # a length field just over the cap is refused before anything is allocated, even
    # when the file is large enough to hold it (a sparse file)
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        f.truncate(MAX_HEADER_BYTES + 64)
    with pytest.raises(SafetensorsHeaderError, match="does not fit"):
        _parse(path)


# ------------------------------------------------------------------ metadata_complete
def test_metadata_complete_needs_json_of_a_known_format_version(tmp_path):
    from hyper_parallel_dcp.core.metadata import FORMAT_VERSION
    from hyper_parallel_dcp.storage_fs.latest import metadata_complete

    assert not metadata_complete(tmp_path / "absent")
    assert not metadata_complete(tmp_path)  # no .metadata
    meta = tmp_path / ".metadata"
    newer = json.dumps({"format_version": FORMAT_VERSION + 1}).encode()
    current = json.dumps({"format_version": FORMAT_VERSION}).encode()
    cases = [(b"{not json", False), (b"[]", False), (b'{"format_version": true}', False),
             (b'{"format_version": 0}', False), (newer, False), (current, True), (b'{"format_version": 1}', True)]
    for text, complete in cases:
        meta.write_bytes(text)
        assert metadata_complete(tmp_path) is complete, text


def test_storage_fs_layout_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys, hyper_parallel_dcp.storage_fs.layout, hyper_parallel_dcp.storage_fs.latest; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
