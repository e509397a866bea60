"""``write_safetensors`` sends the data in writes that end on 2 MiB boundaries of the file
(the page cache then holds 2 MiB folios, which a reader's mapping maps whole).

The files are checked byte for byte against the safetensors layout built independently
(header, then every tensor's bytes in order) and opened with the ``safetensors`` library;
the write calls are recorded at ``os.writev``.
"""

from __future__ import annotations

import io
import json
import os
import struct

import pytest
import torch
from safetensors import safe_open

from hyper_parallel_dcp.storage_fs import safetensors_stream
from hyper_parallel_dcp.storage_fs.safetensors_stream import SAFETENSORS_DTYPES, TensorEntry, write_safetensors

MIB = 1 << 20


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = {}
    for i in range(40):  # 0.5 MiB chunks: a boundary every 4 of them, shifted by the header
        out[f"a{i:02d}"] = torch.randint(-30000, 30000, (256, 1024), dtype=torch.int16, generator=gen)
    out["b_odd"] = torch.randint(0, 255, (7,), dtype=torch.uint8, generator=gen)
    out["c_big"] = torch.randn(9 * MIB // 4, generator=gen)  # 9 MiB: boundaries inside one chunk
    out["d_empty"] = torch.empty(0, 3)
    for i in range(600):  # more small chunks than one writev takes
        out[f"e{i:03d}"] = torch.full((3,), i, dtype=torch.int32)
    out["f_tail"] = torch.randn(3 * MIB // 4, generator=gen)
    return out


def _entries(tensors: dict[str, torch.Tensor]) -> list[TensorEntry]:
    return [TensorEntry(k, v.dtype, tuple(v.shape), (lambda v=v: v)) for k, v in tensors.items()]


def _expected_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        header[k] = {"dtype": SAFETENSORS_DTYPES[v.dtype], "shape": list(v.shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(v.contiguous().numpy().tobytes() for v in tensors.values())


def _check_file(path, tensors) -> None:
    assert path.read_bytes() == _expected_bytes(tensors)
    with safe_open(str(path), "pt") as f:
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v), k


def test_writes_end_on_2_mib_boundaries_and_the_file_is_exact(tmp_path, monkeypatch):
    tensors = _tensors()
    calls: list[tuple[int, int, int]] = []
    real_writev = os.writev

    def recording_writev(fd, buffers):
        start = os.lseek(fd, 0, os.SEEK_CUR)
        done = real_writev(fd, buffers)
        calls.append((start, done, len(buffers)))
        return done

    monkeypatch.setattr(safetensors_stream.os, "writev", recording_writev)
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as f:
        placed = write_safetensors(f, _entries(tensors))
        assert f.tell() == len(_expected_bytes(tensors))
    _check_file(path, tensors)
    data = path.read_bytes()
    for (offset, length, _digest), v in zip(placed, tensors.values()):
        assert data[offset:offset + length] == v.contiguous().numpy().tobytes()
    # contiguous, in order, covering the data section
    assert calls[0][0] == len(data) - sum(v.numel() * v.element_size() for v in tensors.values())
    for (start, done, _), (next_start, _, _) in zip(calls, calls[1:]):
        assert start + done == next_start
    assert calls[-1][0] + calls[-1][1] == len(data)
    # every write but the last ends on a boundary, or is a full batch of small chunks
    for start, done, buffers in calls[:-1]:
        assert (start + done) % (2 * MIB) == 0 or buffers == 512, (start, done, buffers)
    assert sum((start + done) % (2 * MIB) == 0 for start, done, _ in calls) >= 10  # ~30 MiB of data


def test_short_writes_are_completed(tmp_path, monkeypatch):
    """A ``writev`` that writes less than asked (a signal) is continued where it stopped."""
    tensors = _tensors()
    real_writev = os.writev

    def short_writev(fd, buffers):
        total = sum(map(len, buffers))
        if total <= 1000:
            return real_writev(fd, buffers)
        keep, left = [], total // 3 + 1  # a third, cut inside a buffer
        for b in buffers:
            if left <= 0:
                break
            keep.append(b[:left])
            left -= len(keep[-1])
        return real_writev(fd, keep)

    monkeypatch.setattr(safetensors_stream.os, "writev", short_writev)
    path = tmp_path / "short.safetensors"
    with open(path, "wb") as f:
        write_safetensors(f, _entries(tensors))
    _check_file(path, tensors)


def test_a_buffer_without_a_file_descriptor_gets_the_same_bytes():
    tensors = _tensors()
    buffer = io.BytesIO()
    write_safetensors(buffer, _entries(tensors))
    assert buffer.getvalue() == _expected_bytes(tensors)


def test_a_failed_write_raises(tmp_path, monkeypatch):
    def full_disk(fd, buffers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors_stream.os, "writev", full_disk)
    with open(tmp_path / "full.safetensors", "wb") as f, pytest.raises(OSError, match="No space"):
        write_safetensors(f, _entries(_tensors()))
