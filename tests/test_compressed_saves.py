"""``save(..., compression="zstd")`` (SPEC §14): byte planes + zstd frames in ``_rank{r}_.zstd``.
Bit-exact round trips (every dtype, codec versions 0, 1 and 2, resharded loads on 2 ranks that decompress only the
frames they touch), the error without the extra, and a corrupt frame named."""

from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch

from hyper_parallel_dcp.core.errors import CheckpointError, CorruptCheckpointError
from hyper_parallel_dcp.core.testing import run_distributed

pytest.importorskip("zstandard")

ROWS, COLS = 3000, 1000  # 12 MB of fp32: three 4 MiB frames


def _four_mib_frames(monkeypatch) -> None:
    """Saves in this test cut 4 MiB frames (what its frame counts are of; loads read the
    frame size from each payload)."""
    from hyper_parallel_dcp.storage_fs import compression

    monkeypatch.setattr(compression, "FRAME_BYTES", 4 << 20)


def _state() -> dict:
    g = torch.Generator().manual_seed(11)
    weights = torch.randn(ROWS, COLS, generator=g)
    return {"big": weights, "w_bf16": weights[:300, :700].bfloat16(), "ints": torch.arange(-5, 10),
            "flags": torch.rand(17, generator=g) > 0.5, "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.zeros(0, 4), "zeros": torch.zeros(512, 512), "meta": {"epoch": 3}}


def _zeros_like(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"epoch": 0} for k, v in sd.items()}


def test_round_trip_is_bit_exact_and_writes_no_safetensors(tmp_path):
    import hyper_parallel_dcp as dcp

    sd = _state()
    dcp.save(sd, checkpoint_id=tmp_path / "z", no_dist=True, compression="zstd")
    names = sorted(os.listdir(tmp_path / "z"))
    assert names == [".metadata", "_rank0_.bytes", "_rank0_.zstd"]
    raw = sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))
    # the zeros compress to nearly nothing; random fp32 mantissas do not
    assert (tmp_path / "z" / "_rank0_.zstd").stat().st_size < raw - 512 * 512 * 4 * 0.99
    for verify in (False, True):
        out = _zeros_like(sd)
        dcp.load(out, checkpoint_id=tmp_path / "z", no_dist=True, verify=verify)
        assert out["meta"] == {"epoch": 3}
        assert all(torch.equal(out[k], v) for k, v in sd.items() if isinstance(v, torch.Tensor))
    dcp.save(sd, checkpoint_id=tmp_path / "plain", no_dist=True)  # off by default: plain safetensors
    assert sorted(os.listdir(tmp_path / "plain")) == [".metadata", "_rank0_.bytes", "_rank0_.safetensors"]
    with pytest.raises(ValueError, match="'lz4'"):
        dcp.save(sd, checkpoint_id=tmp_path / "x", no_dist=True, compression="lz4")


def _resharded_worker(rank: int, world_size: int, path: str, dim: int) -> tuple[bool, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.storage_fs import FileSystemReader

    mesh = init_device_mesh("cpu", (world_size,))
    full = _state()["big"]
    target = {"big": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(dim)])}
    reader = FileSystemReader(path)
    dcp.load(target, storage_reader=reader)
    return torch.equal(target["big"].full_tensor(), full), reader.bytes_read


@pytest.mark.distributed
def test_a_resharded_load_decompresses_only_the_frames_it_touches(tmp_path, monkeypatch):
    import hyper_parallel_dcp as dcp

    _four_mib_frames(monkeypatch)
    dcp.save({"big": _state()["big"]}, checkpoint_id=tmp_path / "z", no_dist=True, compression="zstd")
    payload = (tmp_path / "z" / "_rank0_.zstd").stat().st_size
    (exact0, read0), (exact1, read1) = run_distributed(_resharded_worker, 2, str(tmp_path / "z"), 0)
    assert exact0 and exact1
    # rows [0, 1500) are bytes [0, 6 MB): frames 0 and 1 of 3; rows [1500, 3000) frames 1 and 2
    assert 0.6 * payload < read0 < 0.75 * payload and 0.6 * payload < read1 < 0.75 * payload, (read0, read1, payload)
    (exact0, _), (exact1, _) = run_distributed(_resharded_worker, 2, str(tmp_path / "z"), 1)  # column halves
    assert exact0 and exact1


def test_without_the_extra_the_error_names_it(tmp_path, monkeypatch):
    import hyper_parallel_dcp as dcp

    sd = {"w": torch.ones(4, 4)}
    dcp.save(sd, checkpoint_id=tmp_path / "z", no_dist=True, compression="zstd")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # an import of it now fails
    with pytest.raises(CheckpointError, match=r"pip install 'hyper-parallel-dcp-storage-fs\[zstd\]'"):
        dcp.save(sd, checkpoint_id=tmp_path / "y", no_dist=True, compression="zstd")
    with pytest.raises(CheckpointError, match=r"'w', stored in the compressed file _rank0_.zstd, needs zstd "
                                              r"compression, which is not installed: pip install "
                                              r"'hyper-parallel-dcp-storage-fs\[zstd\]'"):
        dcp.load({"w": torch.zeros(4, 4)}, checkpoint_id=tmp_path / "z", no_dist=True)


def test_a_corrupt_frame_names_the_chunk_and_the_file(tmp_path, monkeypatch):
    import hyper_parallel_dcp as dcp

    _four_mib_frames(monkeypatch)
    dcp.save({"big": _state()["big"]}, checkpoint_id=tmp_path / "z", no_dist=True, compression="zstd")
    path = tmp_path / "z" / "_rank0_.zstd"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2  # inside frame 1 of 3
    data[middle:middle + 64] = bytes(64)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"{path}: 'big' chunk at offsets \[0, 0\]: compressed frame 1 "
                                                     "of 3 is corrupt"):
        dcp.load({"big": torch.zeros(ROWS, COLS)}, checkpoint_id=tmp_path / "z", no_dist=True)
    with pytest.raises(CorruptCheckpointError, match=rf"checksum mismatch in {path}: 'big'"):
        dcp.load({"big": torch.zeros(ROWS, COLS)}, checkpoint_id=tmp_path / "z", no_dist=True, verify=True)


def test_compressed_incremental_save_references_an_uncompressed_base(tmp_path):
    import hyper_parallel_dcp as dcp

    sd = _state()
    dcp.save(sd, checkpoint_id=tmp_path / "step_1", no_dist=True)
    changed = {**sd, "ints": sd["ints"] + 1}
    md = dcp.save(changed, checkpoint_id=tmp_path / "step_2", no_dist=True, compression="zstd",
                  incremental_from=tmp_path / "step_1")
    assert sorted(md.files) == ["../step_1/_rank0_.safetensors", "_rank0_.bytes", "_rank0_.zstd"]
    out = _zeros_like(sd)
    dcp.load(out, checkpoint_id=tmp_path / "step_2", no_dist=True, verify=True)
    assert all(torch.equal(out[k], v) for k, v in changed.items() if isinstance(v, torch.Tensor))


def _v0_payload(raw: torch.Tensor, width: int, zstandard) -> bytes:
    """A codec version 0 payload (before the sign-bit rotation): byte planes, zstd level 3."""
    import struct

    from hyper_parallel_dcp.storage_fs.compression import FRAME_BYTES

    step = FRAME_BYTES - FRAME_BYTES % width
    c = zstandard.ZstdCompressor(level=3, write_checksum=True)
    frames = [c.compress(raw[at:at + step].view(-1, width).t().contiguous().numpy()) for at in range(0, raw.numel(), step)]
    return struct.pack(f"<II{len(frames)}Q", step, len(frames), *map(len, frames)) + b"".join(frames)


def _v1_payload(raw: torch.Tensor, width: int, zstandard, step: int) -> bytes:
    """A codec version 1 payload: each word rotated left by one bit, byte planes, zstd's
    content checksum in each frame, the compressed sizes alone in the frame table."""
    import struct

    import numpy as np

    flat = raw.numpy()
    if width in (2, 4, 8):
        word = flat.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[width])
        flat = ((word << word.dtype.type(1)) | (word >> word.dtype.type(8 * width - 1))).view(np.uint8)
    c = zstandard.ZstdCompressor(level=1, write_checksum=True)
    frames = [c.compress(np.ascontiguousarray(flat[at:at + step].reshape(-1, width).T)) for at in range(0, len(flat), step)]
    return struct.pack(f"<II{len(frames)}Q", step | 1 << 24, len(frames), *map(len, frames)) + b"".join(frames)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.int8])
def test_codec_v2_puts_the_exponent_alone_in_the_top_plane_and_v0_and_v1_payloads_still_decode(dtype):
    import struct

    import xxhash
    import zstandard

    from hyper_parallel_dcp.storage_fs.compression import CODEC_VERSION, decode_span, encode_chunk

    values = (torch.randn(1_200_000, generator=torch.Generator().manual_seed(5)) * 40).to(dtype)
    raw, width = values.view(-1).view(torch.uint8), values.element_size()
    v2 = encode_chunk(raw, width, zstandard)
    step, count = struct.unpack("<II", v2[:8])
    assert step >> 24 == CODEC_VERSION == 2 and count == -(-raw.numel() // (step & 0xFFFFFF))
    table = struct.unpack(f"<{2 * count}I", v2[8:8 + 8 * count])  # sizes, then each frame's xxh3 (low 32 bits)
    frames = [v2[at:at + size] for at, size in zip(itertools.accumulate(table[:count], initial=8 + 8 * count), table[:count])]
    assert sum(map(len, frames)) + 8 + 8 * count == len(v2)
    assert list(table[count:]) == [xxhash.xxh3_64_intdigest(frame) & 0xFFFFFFFF for frame in frames]
    if width in (2, 4) and dtype.is_floating_point:  # frame 0's top plane: the 8 exponent bits of each element
        first = zstandard.ZstdDecompressor().decompress(frames[0])
        n = len(first) // width
        exponent = (values.view(-1)[:n].view({2: torch.int16, 4: torch.int32}[width]).to(torch.int64) >> (8 * width - 9)) & 0xFF
        assert first[-n:] == bytes(exponent.to(torch.uint8).tolist())
    start, end = 300_001 * width, 1_100_000 * width  # a span over frame boundaries
    v1 = _v1_payload(raw, width, zstandard, step & 0xFFFFFF)
    for payload in (v2, v1, _v0_payload(raw, width, zstandard)):
        whole, _ = decode_span(lambda at, n, p=payload: p[at:at + n], 0, raw.numel(), width, zstandard, lambda: "t")
        part, _ = decode_span(lambda at, n, p=payload: p[at:at + n], start, end, width, zstandard, lambda: "t")
        assert whole.tobytes() == raw.numpy().tobytes() and part.tobytes() == raw.numpy()[start:end].tobytes()
    # a damaged frame: version 2 fails its xxh3, version 1 zstd's checksum; both name the frame
    for payload, head in ((v2, 8 + 8 * count), (v1, 8 + 8 * count)):
        damaged = bytearray(payload)
        damaged[head + 40] ^= 0x10
        with pytest.raises(CorruptCheckpointError, match=f"t: compressed frame 0 of {count} is corrupt"):
            decode_span(lambda at, n, p=bytes(damaged): p[at:at + n], 0, raw.numel(), width, zstandard, lambda: "t")
    newer = struct.pack("<I", (step & 0xFFFFFF) | (CODEC_VERSION + 1) << 24) + v2[4:]
    with pytest.raises(CorruptCheckpointError, match="t: the frame table \\(codec version 3.*a newer version"):
        decode_span(lambda at, n: newer[at:at + n], 0, raw.numel(), width, zstandard, lambda: "t")


def test_payloads_are_read_ahead_on_a_thread_and_checked_once(tmp_path, monkeypatch):
    """The read-ahead thread reads each payload once (``verify``: whole, hashed there); bit-exact."""
    import threading

    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.storage_fs import FileSystemReader, compression

    sd = {f"w{i}": torch.randn(200, 300, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    md = dcp.save(sd, checkpoint_id=tmp_path / "z", no_dist=True, compression="zstd")
    monkeypatch.setattr(compression, "READ_AHEAD_BYTES", 1)  # one chunk ahead at a time
    reader, threads = FileSystemReader(tmp_path / "z", verify=True), []

    def fetch(fd: int, n: int, offset: int) -> bytes:
        threads.append(threading.current_thread().name)
        return os.pread(fd, n, offset)

    reader.compressed.fetch = fetch
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert all(torch.equal(target[k], sd[k]) for k in sd)
    assert len(threads) == len(sd) and all(name.startswith("hp-dcp-read-ahead") for name in threads)
    assert reader.bytes_read == sum(info.length for info in md.storage_data.values())


def test_literal_only_frames_are_no_larger_and_the_fallback_compressor_payloads_still_decode(monkeypatch):
    """With zstd's sequence API (python-zstandard's cffi backend) each frame is Huffman-coded
    literals alone, a block per plane's 128 KiB; without it the fast-strategy compressor
    writes the same format.  Both decode bit-exact, whole and in part; the former is smaller."""
    import zstandard

    from hyper_parallel_dcp.storage_fs import compression

    if compression._sequence_api() is None:
        pytest.skip("python-zstandard's cffi backend is not installed")
    g = torch.Generator().manual_seed(7)
    for values in ((torch.randn(3_000_000, generator=g) * 0.02).bfloat16(), torch.randn(1_500_000, generator=g) ** 2,
                   (torch.randn(700, generator=g) * 0.01).bfloat16()):  # small: one block a plane
        raw, width = values.view(-1).view(torch.uint8), values.element_size()
        literal = compression.encode_chunk(raw, width, zstandard)
        with monkeypatch.context() as patch:
            patch.setattr(compression, "_sequence_api", lambda: None)
            fallback = compression.encode_chunk(raw, width, zstandard)
            for payload in (literal, fallback):  # decoded without the cffi backend too
                whole, _ = compression.decode_span(lambda at, n, p=payload: p[at:at + n], 0, raw.numel(), width,
                                                   zstandard, lambda: "t")
                assert whole.tobytes() == raw.numpy().tobytes()
        assert len(literal) < len(fallback)
        start, end = 1001 * width, (raw.numel() // width - 999) * width
        for payload in (literal, fallback):
            whole, _ = compression.decode_span(lambda at, n, p=payload: p[at:at + n], 0, raw.numel(), width, zstandard,
                                               lambda: "t")
            part, _ = compression.decode_span(lambda at, n, p=payload: p[at:at + n], start, end, width, zstandard,
                                              lambda: "t")
            assert whole.tobytes() == raw.numpy().tobytes() and part.tobytes() == raw.numpy()[start:end].tobytes()


def test_a_load_reads_every_payload_ahead_across_its_batches(tmp_path, monkeypatch):
    """``execute_read`` queues the whole load's payloads: a batch's end does not restart the
    read-ahead (each payload read once, on its thread), and the loaded values are bit-exact."""
    import threading

    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp.storage_fs import FileSystemReader
    from hyper_parallel_dcp.storage_fs import reader as reader_module

    sd = {f"w{i}": torch.randn(300, 300, generator=torch.Generator().manual_seed(i)) for i in range(7)}
    md = dcp.save(sd, checkpoint_id=tmp_path / "z", no_dist=True, compression="zstd")
    monkeypatch.setattr(reader_module, "BATCH_ITEMS", 2)  # four batches
    reader, reads = FileSystemReader(tmp_path / "z"), []
    calls = []
    original = reader.compressed.read_ahead

    def read_ahead(*args, **kwargs):
        calls.append(len(reader.compressed._ahead) + len(reader.compressed._waiting))
        return original(*args, **kwargs)

    def fetch(fd: int, n: int, offset: int) -> bytes:
        reads.append((threading.current_thread().name, offset))
        return os.pread(fd, n, offset)

    reader.compressed.read_ahead, reader.compressed.fetch = read_ahead, fetch
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert all(torch.equal(target[k], sd[k]) for k in sd)
    assert calls[0] == 0 and len(calls) >= 4 and all(queued > 0 for queued in calls[1:])  # later batches: queued
    assert all(name.startswith("hp-dcp-read-ahead") for name, _ in reads)
    assert reader.bytes_read == sum(info.length for info in md.storage_data.values())
