"""``write_safetensors`` sends the data in writes that end on 2 MiB boundaries of the file
(the page cache then holds folios of that size, which a reader's mapping maps whole), 256
KiB on a VM that reports free pages to its host or with ``HP_DCP_ALIGNED_WRITES=0``.

The files are checked byte for byte against the safetensors layout built independently
(header, then every tensor's bytes in order) and opened with the ``safetensors`` library;
the write calls are recorded at ``os.writev``.  A chunk waits for a later write only when
it stays valid until then (a ``stable`` entry, the standard planner's data, a copy the
writer made); a planner that refills one buffer must still get the right values.
"""

from __future__ import annotations

import io
import json
import os
import struct

import pytest
import torch
from safetensors import safe_open

from hyper_parallel_dcp.core.pipeline import load_state_dict, save_state_dict
from hyper_parallel_dcp.core.planner import SavePlanner, WriteItem
from hyper_parallel_dcp.core.save_planning import StandardSavePlanner
from hyper_parallel_dcp.storage_fs import FileSystemReader, FileSystemWriter, host_memory, safetensors_stream
from hyper_parallel_dcp.storage_fs.host_memory import PinnedBuffer
from hyper_parallel_dcp.storage_fs.safetensors_stream import SAFETENSORS_DTYPES, TensorEntry, write_safetensors

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _aligned_writes_on(monkeypatch):
    # 2 MiB boundaries (see _AlignedWrites): these tests turn it on, one test checks the default
    monkeypatch.setenv("HP_DCP_ALIGNED_WRITES", "1")


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


def _entries(tensors: dict[str, torch.Tensor], stable: bool = True) -> list[TensorEntry]:
    return [TensorEntry(k, v.dtype, tuple(v.shape), (lambda v=v: v), stable=stable) for k, v in tensors.items()]


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


@pytest.mark.parametrize(("setting", "reporting", "align"), [
    ("1", True, 2 * MIB), ("0", False, 256 << 10),
    (None, False, 2 * MIB), (None, True, 256 << 10), ("auto", True, 256 << 10),
])
def test_writes_end_on_boundaries_and_the_file_is_exact(tmp_path, monkeypatch, setting, reporting, align):
    """2 MiB with ``HP_DCP_ALIGNED_WRITES=1``, 256 KiB with ``0``; by default (unset or
    ``auto``) 2 MiB unless the machine reports free pages to its host."""
    if setting is None:
        monkeypatch.delenv("HP_DCP_ALIGNED_WRITES")
    else:
        monkeypatch.setenv("HP_DCP_ALIGNED_WRITES", setting)
    monkeypatch.setattr(host_memory, "_reporting_here", lambda: reporting)
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
        assert (start + done) % align == 0 or buffers == 512, (start, done, buffers)
    # ~30 MiB of data in 641 non-empty chunks: writes up to boundaries, not one per chunk
    assert sum((start + done) % align == 0 for start, done, _ in calls) >= 10
    assert len(calls) < 60


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


# --- holding a fetched tensor until a later write is safe only when it stays valid ---------


def _reused_buffer_entries(tensors: dict[str, torch.Tensor]) -> list[TensorEntry]:
    """Entries whose ``fetch`` refills one buffer for each call, as the Hugging Face
    importer's planner does: a tensor held past the next fetch has the next one's bytes."""
    buffer = torch.empty(max(v.numel() * v.element_size() for v in tensors.values()), dtype=torch.uint8)

    def fetch(v: torch.Tensor) -> torch.Tensor:
        out = buffer[:v.numel() * v.element_size()].view(v.dtype).view(v.shape)
        out.copy_(v)
        return out

    return [TensorEntry(k, v.dtype, tuple(v.shape), (lambda v=v: fetch(v))) for k, v in tensors.items()]


def test_entries_from_a_reused_buffer_are_written_before_the_next_fetch(tmp_path):
    tensors = _tensors()
    path = tmp_path / "reused.safetensors"
    with open(path, "wb") as f:
        write_safetensors(f, _reused_buffer_entries(tensors))
    _check_file(path, tensors)


def test_an_unstable_entry_is_written_in_one_call_and_a_copy_made_here_is_held(tmp_path, monkeypatch):
    """Without ``stable`` each chunk goes out before the next fetch (one call per chunk);
    a chunk the writer had to copy (not contiguous) is its own and may wait for a boundary."""
    gen = torch.Generator().manual_seed(3)
    tensors = {f"t{i}": torch.randint(0, 100, (1024, 512), dtype=torch.int16, generator=gen) for i in range(8)}
    transposed = {k: v.t().contiguous().t() for k, v in tensors.items()}  # same values, not contiguous
    calls: list[int] = []
    real_writev = os.writev

    def recording_writev(fd, buffers):
        calls.append(len(buffers))
        return real_writev(fd, buffers)

    monkeypatch.setattr(safetensors_stream.os, "writev", recording_writev)
    with open(tmp_path / "plain.safetensors", "wb") as f:
        write_safetensors(f, _entries(tensors, stable=False))
    _check_file(tmp_path / "plain.safetensors", tensors)
    assert len(calls) == len(tensors)  # one write per chunk, none held
    calls.clear()
    with open(tmp_path / "copied.safetensors", "wb") as f:
        write_safetensors(f, _entries(transposed, stable=False))
    _check_file(tmp_path / "copied.safetensors", tensors)
    assert len(calls) < len(tensors)  # 1 MiB copies: two per write, cut at boundaries


class _OneBufferPlanner(StandardSavePlanner):
    """Like the Hugging Face importer's planner: each tensor is copied into one buffer that
    the next ``resolve_data`` call overwrites (overriding ``resolve_data`` without declaring
    ``resolved_data_stable`` leaves it False)."""

    def __init__(self, source: dict[str, torch.Tensor]) -> None:
        super().__init__(enable_plan_caching=False, remove_redundancy=False)
        self.source = source
        self.buffer = torch.empty(max(v.numel() * v.element_size() for v in source.values()), dtype=torch.uint8)

    def resolve_data(self, write_item: WriteItem):
        v = self.source[write_item.index.fqn]
        out = self.buffer[:v.numel() * v.element_size()].view(v.dtype).view(v.shape)
        return out.copy_(v)


def _recorded_writes(monkeypatch) -> list[int]:
    ends: list[int] = []  # file offset where each writev ended
    real_writev = os.writev

    def recording_writev(fd, buffers):
        done = real_writev(fd, buffers)
        ends.append(os.lseek(fd, 0, os.SEEK_CUR))
        return done

    monkeypatch.setattr(safetensors_stream.os, "writev", recording_writev)
    return ends


def _saved_and_loaded(path, tensors, planner) -> None:
    plan_sd = {k: torch.empty_like(v, device="meta") for k, v in tensors.items()}
    save_state_dict(plan_sd if isinstance(planner, _OneBufferPlanner) else tensors, FileSystemWriter(path), planner,
                    no_dist=True)
    loaded = {k: torch.zeros_like(v) for k, v in tensors.items()}
    load_state_dict(loaded, FileSystemReader(path), no_dist=True)
    for k, v in tensors.items():
        assert torch.equal(loaded[k], v), k


def test_a_planner_that_reuses_one_buffer_saves_the_right_values(tmp_path, monkeypatch):
    tensors = {k: v for k, v in _tensors().items() if k.startswith("a")}  # 40 x 0.5 MiB
    ends = _recorded_writes(monkeypatch)
    _saved_and_loaded(tmp_path / "reused", tensors, _OneBufferPlanner(tensors))
    assert len(ends) == len(tensors)  # each chunk written before the next resolve_data
    ends.clear()
    # the standard planner's chunks (views of the state dict) wait for 2 MiB boundaries
    _saved_and_loaded(tmp_path / "standard", tensors, StandardSavePlanner())
    assert len(ends) <= len(tensors) // 4 + 1
    assert sum(end % (2 * MIB) == 0 for end in ends) >= len(tensors) // 4 - 1


def test_the_standard_planner_declares_its_data_stable_and_a_subclass_keeps_a_declaration():
    class Declared(StandardSavePlanner):
        resolved_data_stable = True

        def resolve_data(self, write_item):
            return super().resolve_data(write_item)

    class Untouched(StandardSavePlanner):
        pass

    assert SavePlanner.resolved_data_stable is False
    assert Declared.resolved_data_stable and Untouched.resolved_data_stable
    assert _OneBufferPlanner.resolved_data_stable is False


def _virtio_device(root, name, device_id, features, bound=True):
    device = root / name
    device.mkdir(parents=True)
    (device / "device").write_text(f"0x{device_id:04x}\n")
    (device / "features").write_text(features + "\n")
    if bound:
        (device / "driver").symlink_to(root)  # any directory: sysfs links the bound driver's
    return device


# the balloon's negotiated features as sysfs prints them (one character per bit, bit 0
# first): stats, deflate on OOM, free page reporting; and the same without reporting
_REPORTING = "0110010000000000000000000000010010000000000000000000000000000000"
_NO_REPORTING = "0110000000000000000000000000010010000000000000000000000000000000"


def test_free_page_reporting_is_a_bound_balloon_with_the_reporting_feature(tmp_path):
    """Read from sysfs: the dev VM's balloon (device 5, bit 5 set, driver bound) reports;
    no balloon, a balloon without the feature or without its driver, or no virtio bus
    does not.  Unreadable entries are skipped."""
    root = tmp_path / "devices"
    assert host_memory.free_page_reporting(tmp_path / "missing") is False
    _virtio_device(root, "virtio1", 0x1, "1" * 64)  # a network device: bits mean other things
    _virtio_device(root, "virtio2", 0x5, _NO_REPORTING)
    _virtio_device(root, "virtio3", 0x5, _REPORTING, bound=False)
    (root / "virtio4").mkdir()  # no attribute files
    _virtio_device(root, "virtio5", 0x5, "01")  # fewer bits than the feature's
    assert host_memory.free_page_reporting(root) is False
    _virtio_device(root, "virtio6", 0x5, _REPORTING)
    assert host_memory.free_page_reporting(root) is True


def test_large_folio_writes_follows_the_setting_then_the_machine(monkeypatch):
    for reporting in (True, False):
        monkeypatch.setattr(host_memory, "_reporting_here", lambda reporting=reporting: reporting)
        monkeypatch.setenv("HP_DCP_ALIGNED_WRITES", "1")
        assert host_memory.large_folio_writes() is True
        monkeypatch.setenv("HP_DCP_ALIGNED_WRITES", "0")
        assert host_memory.large_folio_writes() is False
        monkeypatch.setenv("HP_DCP_ALIGNED_WRITES", "auto")
        assert host_memory.large_folio_writes() is (not reporting)
        monkeypatch.delenv("HP_DCP_ALIGNED_WRITES")
        assert host_memory.large_folio_writes() is (not reporting)


def test_a_setting_that_is_not_a_flag_is_refused(monkeypatch):
    monkeypatch.setenv("HP_DCP_ALIGNED_WRITES", "maybe")
    with pytest.raises(ValueError, match="HP_DCP_ALIGNED_WRITES='maybe'"):
        write_safetensors(io.BytesIO(), _entries(_tensors()))


def test_only_the_pending_tail_of_a_copy_made_here_is_copied_again(tmp_path):
    """A large chunk's tail waits for the next boundary: a copy the writer made is not held
    for it (the tail is copied out), the state dict's own bytes are."""
    from hyper_parallel_dcp.storage_fs.safetensors_stream import _AlignedWrites, tensor_bytes

    for owned in (False, True):
        big = torch.arange(9 * MIB, dtype=torch.int64).to(torch.uint8)
        with open(tmp_path / f"f{owned}", "wb") as f:
            f.write(b"abc")
            writes = _AlignedWrites(f, 3, 256 << 10)
            writes.add(tensor_bytes(big), big, owned)
            assert len(writes._views) == 1 and len(writes._views[0]) == 3  # written up to 9 MiB
            assert (writes._keep[0] is big) is not owned
            assert isinstance(writes._views[0].obj, bytes) is owned
            writes.finish()
        assert (tmp_path / f"f{owned}").read_bytes() == b"abc" + big.numpy().tobytes()


@pytest.mark.parametrize("capacity", [3 * MIB + 5, 64 * MIB])
def test_a_device_chunk_goes_through_the_reused_buffer_in_parts(tmp_path, capacity):
    """A ``PinnedBuffer`` of ``capacity`` (how a device chunk is written, driven here with a
    host tensor): the file holds what was pending before it, then its bytes in order, and the digest is
    the chunk's own, whether it takes one part or several."""
    import xxhash

    gen = torch.Generator().manual_seed(3)
    before = torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=gen)
    chunk = torch.randn(5 * MIB // 4, generator=gen)  # 5 MiB of float32: two parts of 3 MiB
    after = torch.randint(0, 256, (77,), dtype=torch.uint8, generator=gen)
    bounce = PinnedBuffer(capacity)
    with open(tmp_path / "f.bin", "wb") as f:
        writes = safetensors_stream._AlignedWrites(f, 0)
        writes.add(memoryview(before.numpy()), before)
        digest = safetensors_stream._write_through(chunk, bounce, writes)
        writes.add(memoryview(after.numpy()), after)
        writes.finish()
    expected = before.numpy().tobytes() + chunk.numpy().tobytes() + after.numpy().tobytes()
    assert (tmp_path / "f.bin").read_bytes() == expected
    assert digest == xxhash.xxh3_64_hexdigest(chunk.numpy().tobytes())
    assert bounce._buffer is not None and bounce._buffer.numel() == min(capacity, chunk.nbytes)
