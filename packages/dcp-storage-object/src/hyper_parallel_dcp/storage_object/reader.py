"""``ObjectStoreReader``: ranged GETs of exactly the bytes a load needs, many in flight.

A read item becomes byte ranges of its object: one range for a slice that is contiguous
in the object (row sharding, ragged ranges), otherwise one per contiguous run of the slice, the closest runs
merged into one request while the bytes fetched stay within
1 + :data:`READ_OVERHEAD` of the bytes needed.  Ranges longer than
``range_size`` are split, and every piece goes to a pool of ``read_concurrency``
threads.  A piece lands straight in the destination tensor when the slice is contiguous
and the destination a contiguous CPU tensor of the stored dtype; otherwise in a host
staging buffer copied from afterwards.  Each response's ``Content-Range`` gives the
object's size, checked against ``.metadata`` (a replaced or truncated object is caught
without an extra request).  ``verify`` fetches and hashes each touched chunk whole.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import ctypes
import itertools
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import torch
import xxhash

from hyper_parallel_dcp.core.chunks import slice_span
from hyper_parallel_dcp.core.errors import CheckpointFormatError, CheckpointNotFoundError, CorruptCheckpointError
from hyper_parallel_dcp.core.metadata import (
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
    metadata_from_json,
)
from hyper_parallel_dcp.core.objects import deserialize_object
from hyper_parallel_dcp.core.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from hyper_parallel_dcp.core.storage import StorageReader, read_items
from hyper_parallel_dcp.storage_fs.rank_metadata import RANK_METADATA, merge_rank_metadata

from .client import ObjectStore, ObjectStoreSettings, parse_url
from .writer import METADATA_OBJECT

__all__ = ["READ_OVERHEAD", "ObjectStoreReader", "byte_runs"]

#: Extra bytes a read may fetch (as a fraction of the bytes it needs) to merge the runs
#: of a strided slice into fewer requests (S3 serves one range per GET).
READ_OVERHEAD = 0.1
#: Staging bytes of items in flight in ``execute_read`` before the oldest is awaited.
_WINDOW_BYTES = 512 << 20


def _strides(sizes: Sequence[int]) -> list[int]:
    out = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        out[d] = out[d + 1] * sizes[d + 1]
    return out


def byte_runs(chunk_sizes: Sequence[int], offsets: Sequence[int], lengths: Sequence[int],
              itemsize: int, overhead: float = READ_OVERHEAD) -> list[tuple[int, int]]:
    """``(start, length)`` byte ranges (relative to the chunk) covering the sub-box
    ``offsets + lengths`` of a row-major chunk, in order.

    One range per contiguous run of the box, then the smallest gaps between runs are
    merged (one request instead of two) while the bytes fetched stay within
    ``1 + overhead`` times the bytes needed.
    """
    if not lengths:
        return [(0, itemsize)]
    if any(n == 0 for n in lengths):
        return []
    strides = _strides(chunk_sizes)
    # the innermost dims the box spans fully form one contiguous run with the dim before
    k = len(lengths) - 1
    while k > 0 and lengths[k] == chunk_sizes[k]:
        k -= 1
    run = lengths[k] * strides[k] * itemsize
    starts = [(sum(i * s for i, s in zip(idx, strides)) + offsets[k] * strides[k]) * itemsize
              for idx in itertools.product(*[range(o, o + n) for o, n in zip(offsets[:k], lengths[:k])])]
    gaps = [b - a - run for a, b in zip(starts, starts[1:])]
    budget = overhead * run * len(starts)
    merged = [False] * len(gaps)
    for i in sorted(range(len(gaps)), key=gaps.__getitem__):
        if gaps[i] > budget:
            break
        budget -= gaps[i]
        merged[i] = True
    out = [(starts[0], run)]
    for i, start in enumerate(starts[1:]):
        if merged[i]:
            out[-1] = (out[-1][0], start + run - out[-1][0])
        else:
            out.append((start, run))
    return out


def _view(tensor: torch.Tensor) -> memoryview:
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class _Read:
    """GETs in flight for one read item, or for a batch of small adjacent ones.

    ``targets``: ``(item, destination, staging view to copy from or None)``.
    """

    __slots__ = ("targets", "futures", "nbytes", "check")

    def __init__(self) -> None:
        self.targets: list[tuple[ReadItem, torch.Tensor, Optional[torch.Tensor]]] = []
        self.futures: list[cf.Future] = []
        self.nbytes = 0
        self.check: Optional[Any] = None


class ObjectStoreReader(StorageReader):
    """Reads a checkpoint from ``s3://bucket/prefix`` with ranged GETs.

    ``verify`` checks the xxh3 of every stored chunk a read touches (the whole chunk is
    fetched once).  ``bytes_read`` counts the bytes fetched, ``requests`` the GETs.
    """

    def __init__(self, url: Union[str, None] = None, *, verify: bool = False,
                 settings: Optional[ObjectStoreSettings] = None) -> None:
        self.settings = settings or ObjectStoreSettings()
        self.verify = verify
        self.url: Optional[str] = None
        self.store: Optional[ObjectStore] = None
        self.prefix = ""
        self.rank = 0
        self.metadata: Optional[Metadata] = None
        self._is_global = True
        self._verified: set[MetadataIndex] = set()
        self._pool: Optional[cf.ThreadPoolExecutor] = None
        self.bytes_read = 0
        self.requests = 0
        if url is not None:
            self.reset(url)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pool"] = None
        return state

    def reset(self, checkpoint_id: Union[str, Any, None] = None) -> None:
        if checkpoint_id is not None:
            scheme, bucket, prefix = parse_url(str(checkpoint_id))
            self.url = f"{scheme}://{bucket}/{prefix}"
            if self.store is None or self.store.bucket != bucket or self.store.scheme != scheme:
                self.store = ObjectStore(bucket, self.settings, scheme)
            self.prefix = prefix
        self.metadata = None
        self._verified = set()
        self.bytes_read = 0
        self.requests = 0

    def location(self) -> Optional[str]:
        return self.url

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _store(self) -> ObjectStore:
        if self.store is None:
            raise ValueError("ObjectStoreReader has no checkpoint URL: pass checkpoint_id or a URL")
        return self.store

    def _executor(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self.settings.read_concurrency, thread_name_prefix="hp-dcp-get")
        return self._pool

    # -- metadata --------------------------------------------------------------------------
    def load_metadata(self) -> Metadata:
        """``.metadata``, or every ``{rank}.metadata`` merged; :class:`CheckpointNotFoundError`
        naming the URL when there is neither."""
        store = self._store()
        try:
            text = store.get(self._key(METADATA_OBJECT))
        except CheckpointNotFoundError:
            text = None
        if text is not None:
            self.metadata, self._is_global = metadata_from_json(text, source=f"{self.url}/{METADATA_OBJECT}"), True
            return self.metadata
        parts: dict[int, Metadata] = {}
        for key, size in store.list_objects(self._key(""), delimiter="/"):
            match = RANK_METADATA.match(key.rsplit("/", 1)[-1])
            if match and size >= 0:
                parts[int(match.group(1))] = metadata_from_json(store.get(key), source=store.url(key))
        if not parts:
            from hyper_parallel_dcp.storage_fs.integrity import checkpoints_inside_hint

            from .files import ObjectFiles

            hint = checkpoints_inside_hint(ObjectFiles(self.url, store=store)) if self.url else ""
            raise CheckpointNotFoundError(f"{self.url} holds no checkpoint: neither {METADATA_OBJECT} nor any "
                                          f"{{rank}}.metadata object (an interrupted save leaves none){hint}")
        self.metadata, self._is_global = merge_rank_metadata(parts), False
        return self.metadata

    @property
    def collectives_required(self) -> bool:
        return self._is_global

    def set_up_storage_reader(self, metadata: Metadata, *, is_coordinator: bool, rank: int = 0) -> None:
        self.metadata = metadata
        self.rank = rank

    # -- planning a read ---------------------------------------------------------------------
    def _info(self, index: MetadataIndex) -> StorageInfo:
        assert self.metadata is not None and self.metadata.storage_data is not None
        info = self.metadata.storage_data.get(index)
        if info is None:
            raise CheckpointFormatError(f"{index.fqn!r}: the metadata of {self.url} has no storage entry for "
                                        f"the chunk at {index.offset}")
        return info

    def _tensor_md(self, index: MetadataIndex) -> tuple[TensorStorageMetadata, tuple[int, ...]]:
        assert self.metadata is not None
        md = self.metadata.state_dict_metadata[index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        if index.index is not None and index.index < len(md.chunks) and md.chunks[index.index].offsets == index.offset:
            return md, md.chunks[index.index].sizes
        for chunk in md.chunks:
            if chunk.offsets == index.offset:
                return md, chunk.sizes
        raise CheckpointFormatError(f"{index.fqn!r}: no stored chunk at offsets {index.offset}")

    def _fetch(self, name: str, start: int, dest: memoryview) -> None:
        """One ranged GET (split at ``range_size``) into ``dest``; checks the object's size."""
        key = self._key(name)
        expected = (self.metadata.files if self.metadata else {}).get(name)
        total = self._store().get_range_into(key, start, dest)
        if expected is not None and total != expected:
            raise CorruptCheckpointError(f"{self.url}/{name} has {total} bytes but the metadata records "
                                         f"{expected} (truncated or replaced)")

    def _pieces(self, name: str, start: int, dest: memoryview) -> list[tuple[str, int, memoryview]]:
        step = self.settings.range_size
        return [(name, start + i, dest[i:i + step]) for i in range(0, len(dest), step)]

    def _start(self, item: ReadItem, dest: torch.Tensor) -> _Read:
        """Plan ``item``'s GETs into ``dest`` and submit them to the pool."""
        index = item.storage_index
        info = self._info(index)
        md, chunk_sizes = self._tensor_md(index)
        dtype = md.properties.dtype
        itemsize = dtype.itemsize
        where = f"{self.url}/{info.relative_path}: {index.fqn!r} chunk at offsets {list(index.offset or ())}"
        if item.lengths and any(o + n > s for o, n, s in zip(item.storage_offsets, item.lengths, chunk_sizes)):
            raise CheckpointFormatError(f"{where}: requested region offsets={list(item.storage_offsets)} "
                                        f"lengths={list(item.lengths)} exceeds the stored chunk of size "
                                        f"{list(chunk_sizes)}")
        run = _Read()
        source: Optional[torch.Tensor] = None
        lengths = tuple(item.lengths) if item.lengths else tuple(chunk_sizes)
        offsets = tuple(item.storage_offsets) if item.lengths else tuple(0 for _ in chunk_sizes)
        first, span, contiguous = slice_span(chunk_sizes, offsets, lengths)
        pieces: list[tuple[str, int, memoryview]] = []
        name = info.relative_path
        if span == 0:
            pass
        elif self.verify and index not in self._verified:
            if info.checksum is None:
                raise CorruptCheckpointError(f"{where} has no recorded checksum; load with verify=False "
                                             "to read it unverified")
            whole = torch.empty(info.length, dtype=torch.uint8)
            pieces = self._pieces(name, info.offset, _view(whole))

            def check(whole: torch.Tensor = whole) -> None:
                digest = xxhash.xxh3_64_hexdigest(_view(whole))
                if digest != info.checksum:
                    raise CorruptCheckpointError(f"checksum mismatch in {where} (key {info.key!r}): xxh3 "
                                                 f"{digest}, metadata records {info.checksum}")
                self._verified.add(index)

            run.check = check
            elements = whole.view(dtype) if info.length else whole
            source = elements.as_strided(lengths, _strides(chunk_sizes), first)
        elif contiguous and dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype:
            pieces = self._pieces(name, info.offset + first * itemsize, _view(dest))
        else:
            pin = dest.device.type not in ("cpu", "meta") and torch.accelerator.is_available() \
                if hasattr(torch, "accelerator") else False
            staging = torch.empty(span * itemsize, dtype=torch.uint8, pin_memory=pin)
            buf = _view(staging)
            base = first * itemsize
            for start, length in byte_runs(chunk_sizes, offsets, lengths, itemsize):
                pieces += self._pieces(name, info.offset + start, buf[start - base:start - base + length])
            source = staging.view(dtype).as_strided(lengths, _strides(chunk_sizes))
        run.targets.append((item, dest, source))
        self._submit(run, pieces)
        return run

    def _submit(self, run: _Read, pieces: list[tuple[str, int, memoryview]]) -> None:
        pool = self._executor()
        for piece in pieces:
            run.nbytes += len(piece[2])
            run.futures.append(pool.submit(self._fetch, *piece))

    def _batchable(self, item: ReadItem, dest: torch.Tensor) -> Optional[tuple[str, int, int]]:
        """``(object, first byte, bytes)`` of a small read whose bytes are contiguous in the
        object, which can share one GET with its neighbours; None otherwise."""
        if self.verify or item.type is LoadItemType.BYTE_IO:
            return None
        info = self._info(item.storage_index)
        md, chunk_sizes = self._tensor_md(item.storage_index)
        lengths = tuple(item.lengths) if item.lengths else tuple(chunk_sizes)
        offsets = tuple(item.storage_offsets) if item.lengths else tuple(0 for _ in chunk_sizes)
        if item.lengths and any(o + n > c for o, n, c in zip(offsets, lengths, chunk_sizes)):
            return None  # _start raises the error naming it
        first, span, contiguous = slice_span(chunk_sizes, offsets, lengths)
        nbytes = span * md.properties.dtype.itemsize
        if not contiguous or nbytes == 0 or nbytes >= self.settings.range_size:
            return None
        return info.relative_path, info.offset + first * md.properties.dtype.itemsize, nbytes

    def _start_batch(self, batch: list[tuple[ReadItem, torch.Tensor, tuple[str, int, int]]]) -> _Read:
        """One GET for several small reads lying back to back in one object (a model's many
        small tensors: one request per ``range_size`` instead of one per tensor)."""
        if len(batch) == 1:
            return self._start(batch[0][0], batch[0][1])
        name, begin, _ = batch[0][2]
        end = batch[-1][2][1] + batch[-1][2][2]
        staging = torch.empty(end - begin, dtype=torch.uint8)
        run = _Read()
        for item, dest, (_, start, nbytes) in batch:
            md, chunk_sizes = self._tensor_md(item.storage_index)
            lengths = tuple(item.lengths) if item.lengths else tuple(chunk_sizes)
            view = staging[start - begin:start - begin + nbytes].view(md.properties.dtype).view(lengths)
            run.targets.append((item, dest, view))
        self._submit(run, [(name, begin, _view(staging))])
        return run

    def _finish(self, run: _Read) -> None:
        try:
            for f in run.futures:
                f.result()
        except BaseException:
            for f in run.futures:
                f.cancel()
            raise
        self.bytes_read += run.nbytes
        self.requests += len(run.futures)
        if run.check is not None:
            run.check()
        for _, dest, source in run.targets:
            if source is not None:
                dest.copy_(source)

    # -- the reader interface --------------------------------------------------------------
    def read_into(self, item: ReadItem, dest: torch.Tensor) -> None:
        """Fill ``dest`` (shape ``item.lengths``) with the stored slice; its ranges are
        fetched in parallel.  Raises :class:`CorruptCheckpointError` for a size or checksum
        mismatch, :class:`ObjectStoreError` naming bucket and key when a request fails."""
        self._finish(self._start(item, dest))

    def read_object(self, item: ReadItem) -> Any:
        """A pickled object, fetched with one ranged GET of exactly its bytes."""
        info = self._info(item.storage_index)
        if self.metadata is not None and self.metadata.rank_objects:  # per-rank save: this rank's copy (SPEC §4)
            info = self.metadata.object_storage(item.storage_index.fqn, self.rank) or info
        blob = bytearray(info.length)
        if info.length:
            self._fetch(info.relative_path, info.offset, memoryview(blob))
            self.requests += 1
        self.bytes_read += info.length
        where = f"{self.url}/{info.relative_path}"
        if self.verify and info.checksum is not None and xxhash.xxh3_64_hexdigest(blob) != info.checksum:
            raise CorruptCheckpointError(f"checksum mismatch in {where}: object {item.storage_index.fqn!r} "
                                         "does not match its recorded xxh3")
        return deserialize_object(bytes(blob), fqn=item.storage_index.fqn, file=where)

    def read_stream(self, pairs: Iterable[tuple[ReadItem, Optional[torch.Tensor]]]
                    ) -> Iterator[tuple[ReadItem, Any]]:
        """``(item, destination filled)`` or ``(item, object)`` for each ``(item, destination
        or None for an object)``, in the order given, with the GETs of the items ahead in
        flight: small reads back to back in one object share a GET (up to ``range_size``),
        up to ~512 MiB of staging or ``4 * read_concurrency`` reads outstanding.  The
        broadcast load's executor reads through this when the reader offers it."""
        pending: collections.deque[Any] = collections.deque()
        batch: list[tuple[ReadItem, torch.Tensor, tuple[str, int, int]]] = []
        staged = 0

        def launch(run: Any) -> Iterator[tuple[ReadItem, Any]]:
            nonlocal staged
            pending.append(run)
            staged += run.nbytes if isinstance(run, _Read) else 0
            while pending and (staged > _WINDOW_BYTES or len(pending) > 4 * self.settings.read_concurrency):
                yield from land(pending.popleft())

        def land(run: Any) -> Iterator[tuple[ReadItem, Any]]:
            nonlocal staged
            if not isinstance(run, _Read):
                yield run  # an object, read when its turn came
                return
            staged -= run.nbytes
            self._finish(run)
            for item, dest, _ in run.targets:
                yield item, dest

        try:
            for item, dest in pairs:
                span = None if dest is None else self._batchable(item, dest)
                if batch and (span is None or span[0] != batch[-1][2][0]
                              or span[1] != batch[-1][2][1] + batch[-1][2][2]
                              or span[1] + span[2] - batch[0][2][1] > self.settings.range_size):
                    yield from launch(self._start_batch(batch))
                    batch = []
                if dest is None:
                    yield from launch((item, self.read_object(item)))
                elif span is None:
                    yield from launch(self._start(item, dest))
                else:
                    batch.append((item, dest, span))
            if batch:
                yield from launch(self._start_batch(batch))
                batch = []
            while pending:
                yield from land(pending.popleft())
        finally:
            runs = [run for run in pending if isinstance(run, _Read)]
            for run in runs:
                for f in run.futures:
                    f.cancel()
            cf.wait([f for run in runs for f in run.futures])

    def execute_read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read this rank's items (``source`` None or this rank) in the global order through
        ``read_stream`` (the one read loop, ``core.storage.read_items``)."""
        mine = [it for it in plan.items if it.source is None or it.source == self.rank]
        read_items(self, planner, self.sort_items(mine))
