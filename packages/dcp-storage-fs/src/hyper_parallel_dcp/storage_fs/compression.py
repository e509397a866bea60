"""Lossless compression of tensor chunks (SPEC §14): byte planes, zstd in frames.

``save(..., compression="zstd")`` writes each rank's tensor chunks into ``_rank{r}_.zstd``
(the file name in ``.metadata`` names the codec) instead of ``_rank{r}_.safetensors``: one
payload per chunk, whose raw bytes are cut into frames of :data:`FRAME_BYTES` (a multiple
of the element width).  Codec version 2 moves each 2-, 4- or 8-byte word's sign bit below
the 8 bits that follow it (a float's top byte is then its exponent alone; version 1 rotated
the word left by a bit instead), splits the frame into byte planes by element width (the
exponent bytes together compress, the mantissa bytes do not dilute them) and
zstd-compresses it as Huffman-coded literals alone (:func:`_literal_frame`; with few
matches where python-zstandard's cffi backend is missing).  A payload is ``<u32 frame bytes
| codec version << 24><u32 frame count>``, the frames' compressed sizes (u32 each; u64 before
version 2), then their xxh3 (the low 32 bits; before version 2 each frame carried zstd's
content checksum instead), then the frames; its own checksum is the xxh3 of the payload as
stored.  Compression bench rows ``byte-planes+zstd`` (hidden 1024): bf16 weights 69.3 % (v0)
-> 64.9 % (v1, few matches) -> 64.22-64.23 % of their bytes (literals alone, v2 in 1 MiB
frames; ZipNN 64.23-64.24 %), fp32 Adam moments 83.4 % -> 81.5 % -> 81.43-81.45 % (ZipNN
81.43-81.46 %; three runs, ours the smaller in each).  A load decompresses only the
frames the slice it reads touches (:func:`decode_span`), on threads; version 0 (no
rotation) and 1 payloads still load.  Needs the ``zstandard`` package, the ``[zstd]`` extra.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import functools
import itertools
import math
import os
import struct
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
import xxhash

from hyper_parallel_dcp.core.chunks import row_major_strides, slice_span
from hyper_parallel_dcp.core.errors import CheckpointError, CorruptCheckpointError
from hyper_parallel_dcp.core.metadata import Metadata, MetadataIndex, StorageInfo, chunk_locator
from hyper_parallel_dcp.core.planner import ReadItem

from .incremental import missing_file_error

__all__ = ["CODEC_SUFFIX", "CODEC_VERSION", "FRAME_BYTES", "ZSTD_EXTRA", "decode_span", "encode_chunk", "is_compressed_file",
           "CompressedFiles", "READ_AHEAD_BYTES", "decode_frames", "fetch_span", "zstd_module"]

#: the suffix of a rank's file of compressed chunks: ``_rank{r}_.zstd``
CODEC_SUFFIX = ".zstd"
#: raw bytes per frame (rounded down to the element width): what a partial load decompresses at least
FRAME_BYTES = 1 << 20
#: the payload's codec version (the top byte of its first u32): 2 moves each word's sign bit below
#: its top byte and checks each frame by the low 32 bits of its xxh3 in the frame table; 1 (older
#: payloads) rotated the sign bit next to the mantissa, zstd's checksum in each frame; 0 did neither
CODEC_VERSION = 2
#: what to install for compressed checkpoints
ZSTD_EXTRA = "hyper-parallel-dcp-storage-fs[zstd]"
#: compressed payload bytes a load reads ahead of its decoding (at least one chunk)
READ_AHEAD_BYTES = 64 << 20
_HEAD = struct.Struct("<II")
_BLOCK = 128 << 10  # zstd's largest block
_PIECE = 256 << 10  # output bytes merged at a time
_READS_IN_FLIGHT = 2  # payloads the read-ahead reads at once


def is_compressed_file(name: str) -> bool:
    """Whether data file ``name`` holds compressed chunks."""
    return name.endswith(CODEC_SUFFIX)


def zstd_module(what: str) -> Any:
    """The ``zstandard`` module; :class:`CheckpointError` naming the extra (and ``what``
    needed it) when it is not installed."""
    try:
        import zstandard
    except ImportError:
        raise CheckpointError(f"{what} needs zstd compression, which is not installed: "
                              f"pip install '{ZSTD_EXTRA}' (the zstandard package)") from None
    return zstandard


def _frame_bytes(width: int) -> int:
    return FRAME_BYTES - FRAME_BYTES % width


def _params(zstd: Any) -> Any:
    # without zstd's sequence API (below): the fast strategy, a 128 KiB window, a 64-entry
    # hash table, 7-byte matches: the exponent plane of trained weights is near i.i.d., so
    # matches cost more than the Huffman-coded literals they replace; these find few
    # (compression bench: bf16 exponent plane 29.8 % of its bytes vs 36.3 % at level 3)
    return zstd.ZstdCompressionParameters(strategy=zstd.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6,
                                          search_log=1, min_match=7, target_length=0, write_checksum=False)


@functools.cache
def _sequence_api() -> Any:
    """python-zstandard's cffi binding of libzstd (``lib``, ``ffi``) when it has
    ``ZSTD_compressSequences``, else ``None`` (the cffi backend needs the ``cffi`` package)."""
    try:
        from zstandard.backend_cffi import ffi, lib
    except ImportError:
        return None
    return (lib, ffi) if hasattr(lib, "ZSTD_compressSequences") else None


_local = threading.local()  # per thread: a compression context and its output; a decompression context, its scratch


def _literal_frame(lib: Any, ffi: Any, planes: np.ndarray) -> bytes:
    """A zstd frame of ``planes`` as Huffman-coded literals alone, a block per 128 KiB.

    Even a few matches cost more than they save on an exponent plane; one literal run per
    block (``ZSTD_compressSequences``, no match search) leaves only zstd's Huffman coder
    (compression bench rows ``byte-planes+zstd``: bf16 weights 64.9 % -> 64.2 % of their
    bytes, fp32 moments 81.5 % -> 81.4 %, one-thread compression bf16 449 -> 619 MB/s, fp32
    609 -> 649 MB/s).  Any zstd decoder reads it."""
    cctx = getattr(_local, "cctx", None)
    if cctx is None:
        cctx = _local.cctx = ffi.gc(lib.ZSTD_createCCtx(), lib.ZSTD_freeCCtx)
        for key, value in ((lib.ZSTD_c_blockDelimiters, lib.ZSTD_sf_explicitBlockDelimiters),
                           (lib.ZSTD_c_checksumFlag, 0), (lib.ZSTD_c_windowLog, 17)):
            lib.ZSTD_CCtx_setParameter(cctx, key, value)
    size, plane = planes.nbytes, planes.shape[-1]
    # blocks end where planes do (a block has one Huffman table: bf16 biases 76 % -> 65 %)
    lengths = [min(_BLOCK, plane - at) for at in range(0, plane, _BLOCK)] * (size // plane)
    runs = ffi.new("ZSTD_Sequence[]", max(1, len(lengths)))  # offset 0, match length 0: a block's literals
    for block, length in enumerate(lengths):
        runs[block].litLength = length
    bound = lib.ZSTD_compressBound(size)
    if len(getattr(_local, "dst", b"")) < bound:  # reused, not zeroed and faulted in a frame: compress +5 %
        _local.dst = bytearray(bound)
    written = lib.ZSTD_compressSequences(cctx, ffi.from_buffer(_local.dst), bound, runs, max(1, len(lengths)),
                                          ffi.from_buffer(planes), size)
    if lib.ZSTD_isError(written):
        raise RuntimeError(f"zstd: {ffi.string(lib.ZSTD_getErrorName(written)).decode()}")
    return bytes(memoryview(_local.dst)[:written])


def _words(width: int) -> Any:
    return {2: np.uint16, 4: np.uint32, 8: np.uint64}.get(width)


@functools.cache
def _masks(width: int) -> tuple[Any, Any, Any]:
    """Of a ``width``-byte word in codec version 2: its top byte, the bit below it (the sign's
    place), the bits below that (where they stay)."""
    words, below = _words(width), 8 * width - 9
    return words(((1 << 8 * width) - 1) ^ ((1 << 8 * width - 8) - 1)), words(1 << below), words((1 << below) - 1)


def encode_chunk(raw: torch.Tensor, width: int, zstd: Any) -> bytes:
    """The payload of one chunk: ``raw`` (its bytes, a flat uint8 CPU tensor) of ``width``-byte elements."""
    step, words, api = _frame_bytes(width), _words(width), _sequence_api()
    params = _params(zstd)  # a compressor is not shared between threads: one per frame
    compress: Callable[[np.ndarray], bytes] = (
        functools.partial(_literal_frame, api[0], api[1]) if api is not None
        else lambda part: zstd.ZstdCompressor(compression_params=params).compress(part))
    flat = raw.numpy()

    def frame(at: int) -> bytes:
        part = flat[at:at + step]
        if words is not None:  # the sign bit moved below the 8 bits after it: the top plane is the exponent alone
            word, (top, sign, low) = part.view(words), _masks(width)
            part = (((word << words(1)) & top) | ((word >> words(8)) & sign) | (word & low)).view(np.uint8)
            part = np.ascontiguousarray(part.reshape(-1, width).T)
        return compress(part)

    # a chunk's frames on threads: a save's first chunk is on the link sooner
    frames = _spread(lambda index: frame(index * step), -(-raw.numel() // step))
    # each frame's xxh3 in the table, not zstd's content checksum (its xxh64 of the raw bytes
    # cost a third of zstd's decoding): a damaged frame fails its hash before it is decoded
    table = [*map(len, frames), *(_frame_hash(frame) for frame in frames)]
    return b"".join([_HEAD.pack(step | CODEC_VERSION << 24, len(frames)), struct.pack(f"<{len(table)}I", *table),
                     *frames])


def _frame_hash(frame: Union[bytes, memoryview]) -> int:
    return xxhash.xxh3_64_intdigest(frame) & 0xFFFFFFFF


def fetch_span(read_at: Callable[[int, int], Union[bytes, memoryview]], start: int, end: int, width: int,
               where: Callable[[], str]) -> tuple[Any, ...]:
    """What :func:`decode_frames` needs of raw bytes ``[start, end)`` of a chunk (its frame
    table and the compressed frames that span touches), read through ``read_at(offset, n)``;
    the last item is the payload bytes read.  Raises :class:`CorruptCheckpointError` naming
    ``where()`` for a frame table that does not cover the span."""
    head = read_at(0, _HEAD.size)
    if len(head) < _HEAD.size:
        raise CorruptCheckpointError(f"{where()}: compressed chunk truncated (no frame table)")
    step, count = _HEAD.unpack(head)
    step, version = step & 0xFFFFFF, step >> 24
    # u64 compressed sizes; from version 2 u32 sizes, then the frames' xxh3 (its low 32 bits)
    kind = "I" if version >= 2 else "Q"
    table = struct.unpack(f"<{(2 if version >= 2 else 1) * count}{kind}", read_at(_HEAD.size, 8 * count)) if count else ()
    sizes, hashes, head_bytes = table[:count], table[count:], _HEAD.size + 8 * count
    if end <= start:
        return step, version, count, 0, b"", (), (), head_bytes
    first, last = start // step if step else 0, (end - 1) // step if step else 0
    if step == 0 or step % width or last >= count or version > CODEC_VERSION:
        raise CorruptCheckpointError(f"{where()}: the frame table (codec version {version}, {count} frames of {step} "
                                     f"bytes) does not cover bytes [{start}, {end}); a newer version may have written it")
    blob = read_at(head_bytes + sum(sizes[:first]), sum(sizes[first:last + 1]))
    starts = tuple(itertools.accumulate(sizes[first:last + 1], initial=0))
    return step, version, count, first, blob, starts, hashes[first:last + 1], len(blob) + head_bytes


def _inflate(zstd: Any, frame: memoryview, size: int) -> np.ndarray:
    """``frame`` decompressed, zstd's checksum checked where it has one; a frame longer than
    ``size`` comes back longer or raises ``zstd.ZstdError``.  With the cffi backend by one
    ``ZSTD_decompressDCtx`` call into this thread's reused scratch (a fresh ``bytes`` a frame
    is faulted in page by page; a ``stream_reader`` into the scratch, one thread, CPU time,
    4 MiB bench frames: bf16 1556 -> 1775 MB/s, fp32 1257 -> 1508 MB/s)."""
    api = _sequence_api()
    if api is None:
        return np.frombuffer(zstd.ZstdDecompressor().decompress(frame, max_output_size=size + 1), np.uint8)
    lib, ffi = api
    if len(getattr(_local, "scratch", b"")) <= size:
        _local.scratch, _local.dctx = bytearray(size + 1), ffi.gc(lib.ZSTD_createDCtx(), lib.ZSTD_freeDCtx)
    got = lib.ZSTD_decompressDCtx(_local.dctx, ffi.from_buffer(_local.scratch), size + 1, ffi.from_buffer(frame),
                                  len(frame))
    if lib.ZSTD_isError(got):
        raise zstd.ZstdError(ffi.string(lib.ZSTD_getErrorName(got)).decode())
    return np.frombuffer(_local.scratch, np.uint8, got)


def _merge(rows: np.ndarray, word: np.ndarray, spare: np.ndarray, words: Any, version: int) -> None:
    """Planes ``rows`` (one a byte of the words) into ``word``, the sign bit put back per ``version``."""
    width, spare = len(rows), spare[:word.nbytes].view(words)
    plain = width - 2 if version >= 2 else width - 1  # the planes below the top one or-ed in as they are
    word[:] = rows[-1]
    word <<= words(8 * width - (9 if version >= 2 else 8))
    if version >= 2:
        # the sign, the top bit of plane width-2: that plane sign-extended into signed words,
        # shifted, masked to the sign and the bits below it, or-ed in: 5 passes for bf16 and 11
        # for fp32, where undoing a rotation took 7 and 13 (one 256 KiB piece in cache, one
        # thread, median of 300: bf16 5979 -> 9172 MB/s)
        signed, (_, sign, low) = spare.view(f"i{width}"), _masks(width)
        signed[:] = rows[-2].view(np.int8)
        if width > 2:
            signed <<= signed.dtype.type(8 * width - 16)
        signed &= (low | (sign << words(8))).view(signed.dtype)
        word |= spare
    for byte in range(plain):
        spare[:] = rows[byte]
        if byte:
            spare <<= words(8 * byte)
        word |= spare
    if version == 1:  # rotate the sign bit back
        np.left_shift(word, words(8 * width - 1), out=spare)
        word >>= words(1)
        word |= spare


def decode_frames(fetched: tuple[Any, ...], start: int, end: int, width: int, zstd: Any,
                  where: Callable[[], str], into: Optional[np.ndarray] = None) -> np.ndarray:
    """Raw bytes ``[start, end)`` of the chunk (a uint8 array) from ``fetch_span``'s result;
    its frames on threads.  ``into``: where to put them, when ``[start, end)`` is the whole
    chunk (``end - start`` bytes; what is returned).  Raises :class:`CorruptCheckpointError`
    naming ``where()`` and the frame for a frame that does not decompress to its size."""
    step, version, count, first, blob, starts, hashes, _ = fetched
    if end <= start:
        return np.empty(0, np.uint8)
    blob, words, base, last = memoryview(blob), _words(width), first * step, first + len(starts) - 2
    out = into if into is not None else np.empty(min(count * step, (last + 1) * step) - base, np.uint8)

    def one(frame: int) -> None:
        # one frame: zstd into the thread's scratch, then the planes merged into ``out``
        stored = blob[starts[frame - first]:starts[frame - first + 1]]
        try:
            if hashes and _frame_hash(stored) != hashes[frame - first]:
                raise zstd.ZstdError("its xxh3 does not match the frame table's")
            planes = _inflate(zstd, stored, step)
        except zstd.ZstdError as exc:
            raise CorruptCheckpointError(f"{where()}: compressed frame {frame} of {count} is corrupt ({exc}); the "
                                         "checkpoint is damaged: restore it or load another") from None
        if len(planes) % width or (frame < count - 1 and len(planes) != step) or frame * step + len(planes) < min(
                end, (frame + 1) * step) or frame * step - base + len(planes) > len(out):
            raise CorruptCheckpointError(f"{where()}: compressed frame {frame} of {count} decompressed to "
                                         f"{len(planes)} bytes, not {step}")
        target = out[frame * step - base:frame * step - base + len(planes)]
        rows = planes.reshape(width, -1)
        if words is None:
            target.reshape(-1, width)[:] = rows.T
            return
        # planes widened by plain casts (a ufunc's ``dtype=`` buffers), in 256 KiB pieces that
        # stay in the core's cache (bench tensors, one thread: fp32 980 -> 1349 MB/s; 64 KiB
        # lose, 512 KiB-1 MiB no better), through a reused spare (no page faults)
        spare = getattr(_local, "spare", None)
        if spare is None:
            spare = _local.spare = np.empty(_PIECE, np.uint8)
        for at in range(0, len(rows[0]), _PIECE // width):
            _merge(rows[:, at:at + _PIECE // width], target.view(words)[at:at + _PIECE // width], spare, words, version)

    _spread(lambda index: one(first + index), last + 1 - first)
    return out if into is not None else out[start - base:end - base]


def decode_span(read_at: Callable[[int, int], Union[bytes, memoryview]], start: int, end: int, width: int, zstd: Any,
                where: Callable[[], str]) -> tuple[np.ndarray, int]:
    """``(raw bytes [start, end) of the chunk as a uint8 array, payload bytes read)``:
    :func:`fetch_span` then :func:`decode_frames`."""
    fetched = fetch_span(read_at, start, end, width, where)
    return decode_frames(fetched, start, end, width, zstd, where), fetched[-1]


@functools.cache
def _pool() -> cf.ThreadPoolExecutor:
    return cf.ThreadPoolExecutor(max(1, (os.cpu_count() or 1) - 1), thread_name_prefix="hp-dcp-unzstd")


def _spread(work: Callable[[int], Any], count: int) -> list[Any]:
    """``[work(0), ..., work(count - 1)]``, run on this thread and the pool's (zstd and numpy
    release the GIL), each taking the next index; a pool thread that starts late is cancelled
    or finds none left, so this thread never idles waiting for one to be scheduled (on a
    loaded machine that wait, not the work, set the pace)."""
    results: list[Any] = [None] * count
    todo = iter(range(count))  # next() of a range iterator is atomic under the GIL

    def drain() -> None:
        for index in todo:
            results[index] = work(index)

    helpers = [_pool().submit(drain) for _ in range(min(count - 1, (os.cpu_count() or 1) - 1))]
    try:
        drain()
    finally:
        for helper in helpers:
            helper.cancel()
        cf.wait(helpers)
    for helper in helpers:
        if not helper.cancelled():
            helper.result()
    return results


class CompressedFiles:
    """The open ``.zstd`` files of a checkpoint, for the reader.  :meth:`read_ahead` reads the
    payloads of compressed chunks on two threads, up to :data:`READ_AHEAD_BYTES` ahead of
    :meth:`read_item`'s decoding, so a link stays busy while a chunk decodes: those of the
    whole load when the reader's ``execute_read`` hands it all (else a batch's), a whole
    chunk's payload in one read.  Compression bench, load of the trained state under the
    200 MB/s cap, plain ÷ compressed load time: 1.22-1.23× quiet with one thread and three
    reads a chunk; with one read a chunk and two in flight, at load average 7-11, 1.18-1.24×
    (the same code before: 1.01-1.10×), against 1.28× at most.
    ``fetch(fd, n, offset)`` reads their bytes (``os.pread``); ``bytes_read``: payload bytes decoded."""

    def __init__(self) -> None:
        self._open: dict[str, Any] = {}
        self._opening = threading.Lock()  # the read-ahead threads share the open files
        self._seen: tuple[Any, bool] = (None, False)  # (a metadata's files, whether one is compressed)
        self._waiting: collections.deque = collections.deque()  # (item, job, payload bytes) not yet started
        self._ahead: collections.deque = collections.deque()  # (item, future, payload bytes), in read order
        self._thread: Optional[cf.ThreadPoolExecutor] = None
        self._whole = False  # the queue holds the whole load's payloads
        self.fetch: Callable[[int, int, int], bytes] = os.pread
        self.bytes_read = 0

    def any_in(self, metadata: Any) -> bool:
        """Whether ``metadata`` (a ``Metadata`` or ``None``) names a compressed file (kept per file table)."""
        files = None if metadata is None else metadata.files
        if files is not self._seen[0]:
            self._seen = (files, files is not None and any(map(is_compressed_file, files)))
        return self._seen[1]

    def read_ahead(self, root: Path, metadata: Metadata, items: list[ReadItem],
                   verified: Optional[set[MetadataIndex]], whole: bool = False) -> None:
        """Start reading the payloads of ``items``' compressed chunks (of the checkpoint in
        ``root``), in order; ``verified``: the chunks whose checksum was checked (``None``: no checks).
        ``whole``: ``items`` are the whole load, so the calls for its batches change nothing
        until :meth:`cancel` (a batch's end no longer stops the link while its last chunks decode)."""
        if self._whole and not whole:
            return
        self.cancel()
        self._whole = whole
        for item in items:
            job = self._job(root, metadata, item, verified)
            if job is not None:
                self._waiting.append((item, job, job.args[2].length))
        self._top_up()

    def _job(self, root: Path, metadata: Metadata, item: ReadItem,
             verified: Optional[set[MetadataIndex]]) -> Optional[functools.partial]:
        index = item.storage_index
        locate = chunk_locator(metadata)
        where = None if locate is None else locate(index)
        if where is None or not is_compressed_file(where[0]):
            return None
        md = metadata.state_dict_metadata[index.fqn]
        return functools.partial(self._fetch, root / where[0], where[0], metadata.storage_data[index],  # type: ignore
                                 tuple(where[2]), md.properties.dtype, item,  # type: ignore[union-attr]
                                 verified is not None and index not in verified)

    def _top_up(self) -> None:
        ahead = sum(entry[2] for entry in self._ahead)
        while self._waiting and (not self._ahead or ahead < READ_AHEAD_BYTES):
            item, job, length = self._waiting.popleft()
            if self._thread is None:
                # two payloads in flight: the next read is queued on the link while the one
                # before it is still arriving, so a thread woken late leaves no gap
                self._thread = cf.ThreadPoolExecutor(_READS_IN_FLIGHT, thread_name_prefix="hp-dcp-read-ahead")
            self._ahead.append((item, self._thread.submit(job), length))
            ahead += length

    def _fetch(self, path: Path, name: str, info: StorageInfo, sizes: tuple[int, ...], dtype: torch.dtype,
               item: ReadItem, verify: bool) -> tuple[Any, ...]:
        # on the read-ahead thread: the frames the slice touches (the whole payload, checked, with verify)
        index = item.storage_index
        label = f"{path}: {index.fqn!r} chunk at offsets {list(index.offset or ())}"
        with self._opening:
            handle = self._open.get(name)
            if handle is None:
                try:
                    handle = self._open[name] = open(path, "rb")
                except FileNotFoundError:
                    raise missing_file_error(str(path), name) from None
        fd, fetch = handle.fileno(), self.fetch

        def read_at(position: int, length: int) -> Any:
            return fetch(fd, max(0, min(length, info.length - position)), info.offset + position)

        lengths = tuple(item.lengths) if item.lengths else sizes
        offsets = tuple(item.storage_offsets) if item.lengths else (0,) * len(sizes)
        first, span, _ = slice_span(sizes, offsets, lengths)
        whole = verify or span == math.prod(sizes)
        if whole:  # the whole payload in one read, not three (head, table, frames): one wait for the link
            view = memoryview(read_at(0, info.length))
            if verify and xxhash.xxh3_64_hexdigest(view) != info.checksum:
                raise CorruptCheckpointError(f"checksum mismatch in {label}: the compressed chunk does not match "
                                             f"its recorded xxh3 {info.checksum}")
            read_at = lambda position, length: view[position:position + length]  # noqa: E731
        width = dtype.itemsize
        fetched = fetch_span(read_at, first * width, (first + span) * width, width, lambda: label)
        return fetched, info.length if whole else fetched[-1], label, info, dtype, sizes, lengths, first, span

    def read_item(self, root: Path, metadata: Metadata, item: ReadItem, dest: torch.Tensor, offset: Optional[int],
                  strides: Any, verified: Optional[set[MetadataIndex]]) -> Optional[int]:
        """Read ``item`` of the checkpoint in directory ``root`` into ``dest`` (``dest.as_strided(item.lengths,
        strides, offset)`` with an ``offset``) when its chunk is in a compressed file: the
        payload bytes read; ``None``, nothing done, otherwise.  ``verified``: check each chunk's
        payload checksum once (the chunks checked are added).  Raises
        :class:`CheckpointNotFoundError` naming a missing file, :class:`CorruptCheckpointError`
        naming file and chunk, :class:`CheckpointError` naming the extra without ``zstandard``."""
        if self._ahead and self._ahead[0][0] is item:
            future = self._ahead.popleft()[1]
            self._top_up()
            fetched, read, label, info, dtype, sizes, lengths, first, span = future.result()
        else:  # not read ahead (read_into, or a chunk of a plain file)
            job = self._job(root, metadata, item, verified)
            if job is None:
                return None
            fetched, read, label, info, dtype, sizes, lengths, first, span = job()
        zstd = zstd_module(f"{root / info.relative_path}: {item.storage_index.fqn!r}, stored in the compressed file "
                           f"{info.relative_path},")
        width = dtype.itemsize
        target = dest if offset is None else dest.as_strided(item.lengths, strides, offset)
        into = None  # a whole chunk into a contiguous tensor of its dtype: decoded in place, no copy
        if span and span == target.numel() == math.prod(sizes) and target.dtype == dtype and target.is_cpu and \
                target.is_contiguous():
            into = target.detach().view(-1).view(torch.uint8).numpy()
        raw = decode_frames(fetched, first * width, (first + span) * width, width, zstd, lambda: label, into)
        if span and into is None:
            target.copy_(torch.from_numpy(raw).view(dtype).as_strided(lengths, row_major_strides(sizes), 0))
        if verified is not None:
            verified.add(item.storage_index)
        self.bytes_read += read
        return read

    def cancel(self) -> None:
        """Drop the payloads not yet read (a stream left early)."""
        for entry in self._ahead:
            entry[1].cancel()
        self._ahead.clear()
        self._waiting.clear()
        self._whole = False

    def close(self) -> None:
        self.cancel()
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None
        while self._open:
            self._open.popitem()[1].close()
