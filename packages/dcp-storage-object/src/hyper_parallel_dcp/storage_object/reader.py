"""``ObjectStoreReader``: ranged GETs of exactly the bytes a load needs, many in flight.

Small reads back to back in one object share a GET, long ranges are split over
``read_concurrency`` threads; a piece lands in the destination when it is a contiguous CPU
tensor of the stored dtype, else in a staging buffer.  Object sizes are checked against
``.metadata``.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Sequence, Union

import torch
import xxhash

from hyper_parallel_dcp.core.chunks import row_major_strides, slice_span
from hyper_parallel_dcp.core.errors import CheckpointNotFoundError, CorruptCheckpointError
from hyper_parallel_dcp.core.metadata import Metadata, MetadataIndex, StorageInfo, referenced_checkpoint
from hyper_parallel_dcp.core.objects import deserialize_object
from hyper_parallel_dcp.core.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from hyper_parallel_dcp.core.storage import StorageReader, read_items
from hyper_parallel_dcp.storage_fs.host_memory import accelerator_available
from hyper_parallel_dcp.storage_fs.incremental import missing_file_error
from hyper_parallel_dcp.storage_fs.metadata_io import check_region, chunk_sizes, load_checkpoint_metadata, storage_entry
from hyper_parallel_dcp.storage_fs.posix import tensor_bytes
from hyper_parallel_dcp.storage_fs.sinks import copy_into

from .client import ObjectStore, ObjectStoreSettings
from .files import ObjectFiles

__all__ = ["READ_OVERHEAD", "ObjectStoreReader", "byte_runs"]

#: Extra bytes a read may fetch (as a fraction of the bytes it needs) to merge the runs
#: of a strided slice into fewer requests (S3 serves one range per GET).
READ_OVERHEAD = 0.1
#: Staging bytes of reads in flight in ``read_stream`` before the oldest is awaited.
_WINDOW_BYTES = 512 << 20


def byte_runs(chunk_sizes: Sequence[int], offsets: Sequence[int], lengths: Sequence[int],
              itemsize: int, overhead: float = READ_OVERHEAD) -> list[tuple[int, int]]:
    """``(start, length)`` byte ranges (relative to the chunk), in order, covering the box
    ``offsets + lengths`` of a row-major chunk: one per contiguous run, the smallest gaps
    merged while the bytes fetched stay within ``1 + overhead`` times those needed."""
    if not lengths:
        return [(0, itemsize)]
    if any(n == 0 for n in lengths):
        return []
    strides = row_major_strides(chunk_sizes)
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


class _Slice(NamedTuple):
    """A read item's slice of its stored chunk."""

    info: StorageInfo
    dtype: torch.dtype
    chunk_sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    first: int  # elements, as core.chunks.slice_span
    span: int
    contiguous: bool
    where: str  # names the chunk in errors


@dataclass(slots=True)
class _Read:
    """GETs in flight for one or a batch of reads; ``targets``: ``(item, destination, staging view)``."""

    targets: list[tuple[ReadItem, torch.Tensor, Optional[torch.Tensor]]] = field(default_factory=list)
    futures: list[cf.Future] = field(default_factory=list)
    nbytes: int = 0
    check: Optional[Callable[[], None]] = None


class ObjectStoreReader(StorageReader):
    """Reads a checkpoint from ``s3://bucket/prefix`` with ranged GETs; ``verify`` checks the
    xxh3 of each chunk a read touches.  ``bytes_read`` counts the bytes fetched, ``requests`` the GETs."""

    collectives_required = True  # False once the metadata came from per-rank files

    def __init__(self, url: Union[str, None] = None, *, verify: bool = False,
                 settings: Optional[ObjectStoreSettings] = None) -> None:
        self.settings = settings or ObjectStoreSettings()
        self.verify = verify
        self.files: Optional[ObjectFiles] = None
        self.rank = 0
        self._pool: Optional[cf.ThreadPoolExecutor] = None
        self.reset(url)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pool"] = None
        return state

    def reset(self, checkpoint_id: Union[str, Any, None] = None) -> None:
        if checkpoint_id is not None:
            self.files = ObjectFiles(str(checkpoint_id), self.settings)
        self.metadata: Optional[Metadata] = None
        self._verified: set[MetadataIndex] = set()
        self.bytes_read = 0
        self.requests = 0

    @property
    def url(self) -> Optional[str]:
        return None if self.files is None else str(self.files.target)

    def location(self) -> Optional[str]:
        return self.url

    def _files(self) -> ObjectFiles:
        if self.files is None:
            raise ValueError("ObjectStoreReader has no checkpoint URL: pass checkpoint_id or a URL")
        return self.files

    def load_metadata(self) -> Metadata:
        """``.metadata``, or every ``{rank}.metadata`` merged; :class:`CheckpointNotFoundError`
        naming the URL when there is neither."""
        self.metadata, self.collectives_required = load_checkpoint_metadata(self._files())
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, *, is_coordinator: bool, rank: int = 0) -> None:
        self.metadata = metadata
        self.rank = rank

    def _slice(self, item: ReadItem) -> _Slice:
        """Where ``item``'s slice lies; :class:`CheckpointFormatError` for one outside its chunk."""
        assert self.metadata is not None
        index = item.storage_index
        info = storage_entry(self.metadata, index, self.url)
        sizes = chunk_sizes(self.metadata, index)
        dtype = self.metadata.state_dict_metadata[index.fqn].properties.dtype  # type: ignore[union-attr]
        where = f"{self.url}/{info.relative_path}: {index.fqn!r} chunk at offsets {list(index.offset or ())}"
        if item.lengths:
            check_region(where, item.storage_offsets, item.lengths, sizes)
        lengths = tuple(item.lengths) if item.lengths else sizes
        offsets = tuple(item.storage_offsets) if item.lengths else (0,) * len(sizes)
        first, span, contiguous = slice_span(sizes, offsets, lengths)
        return _Slice(info, dtype, sizes, offsets, lengths, first, span, contiguous, where)

    def _fetch(self, name: str, start: int, dest: memoryview) -> None:
        """One ranged GET into ``dest``; checks the object's size against the metadata."""
        files = self._files()
        expected = (self.metadata.files if self.metadata else {}).get(name)
        try:
            total = files.store.get_range_into(files.key(name), start, dest)
        except CheckpointNotFoundError:
            if referenced_checkpoint(name) is None:
                raise
            raise missing_file_error(f"{self.url}/{name}", name) from None
        if expected is not None and total != expected:
            raise CorruptCheckpointError(f"{self.url}/{name} has {total} bytes but the metadata records "
                                         f"{expected} (truncated or replaced)")

    def _pieces(self, name: str, start: int, dest: memoryview) -> list[tuple[str, int, memoryview]]:
        step = self.settings.range_size
        return [(name, start + i, dest[i:i + step]) for i in range(0, len(dest), step)]

    def _start(self, item: ReadItem, dest: torch.Tensor) -> _Read:
        """Plan ``item``'s GETs into ``dest`` and submit them to the pool."""
        part = self._slice(item)
        info, dtype, itemsize = part.info, part.dtype, part.dtype.itemsize
        run = _Read()
        source: Optional[torch.Tensor] = None
        pieces: list[tuple[str, int, memoryview]] = []
        name = info.relative_path
        if part.span == 0:
            pass
        elif self.verify and item.storage_index not in self._verified:
            if info.checksum is None:
                raise CorruptCheckpointError(f"{part.where} has no recorded checksum; load with verify=False "
                                             "to read it unverified")
            whole = torch.empty(info.length, dtype=torch.uint8)
            pieces = self._pieces(name, info.offset, tensor_bytes(whole))

            def check(whole: torch.Tensor = whole, index: MetadataIndex = item.storage_index) -> None:
                digest = xxhash.xxh3_64_hexdigest(tensor_bytes(whole))
                if digest != info.checksum:
                    raise CorruptCheckpointError(f"checksum mismatch in {part.where} (key {info.key!r}): xxh3 "
                                                 f"{digest}, metadata records {info.checksum}")
                self._verified.add(index)

            run.check = check
            elements = whole.view(dtype) if info.length else whole
            source = elements.as_strided(part.lengths, row_major_strides(part.chunk_sizes), part.first)
        elif part.contiguous and dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype:
            pieces = self._pieces(name, info.offset + part.first * itemsize, tensor_bytes(dest))
        else:
            pin = dest.device.type not in ("cpu", "meta") and accelerator_available()
            staging = torch.empty(part.span * itemsize, dtype=torch.uint8, pin_memory=pin)
            buf = tensor_bytes(staging)
            base = part.first * itemsize
            for start, length in byte_runs(part.chunk_sizes, part.offsets, part.lengths, itemsize):
                pieces += self._pieces(name, info.offset + start, buf[start - base:start - base + length])
            source = staging.view(dtype).as_strided(part.lengths, row_major_strides(part.chunk_sizes))
        run.targets.append((item, dest, source))
        self._submit(run, pieces)
        return run

    def _submit(self, run: _Read, pieces: list[tuple[str, int, memoryview]]) -> None:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self.settings.read_concurrency, thread_name_prefix="hp-dcp-get")
        for piece in pieces:
            run.nbytes += len(piece[2])
            run.futures.append(self._pool.submit(self._fetch, *piece))

    def _batchable(self, item: ReadItem) -> Optional[_Slice]:
        """The slice of a small contiguous read that can share a GET with its neighbours, else ``None``."""
        if self.verify or item.type is LoadItemType.BYTE_IO:
            return None
        part = self._slice(item)
        nbytes = part.span * part.dtype.itemsize
        return part if part.contiguous and 0 < nbytes < self.settings.range_size else None

    def _start_batch(self, batch: list[tuple[ReadItem, torch.Tensor, _Slice]]) -> _Read:
        """One GET for several small reads lying back to back in one object."""
        if len(batch) == 1:
            return self._start(batch[0][0], batch[0][1])
        begin, end = _byte_range(batch[0][2])[0], _byte_range(batch[-1][2])[1]
        staging = torch.empty(end - begin, dtype=torch.uint8)
        run = _Read()
        for item, dest, part in batch:
            start, stop = _byte_range(part)
            run.targets.append((item, dest, staging[start - begin:stop - begin].view(part.dtype).view(part.lengths)))
        self._submit(run, [(batch[0][2].info.relative_path, begin, tensor_bytes(staging))])
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
                copy_into(dest, source)

    def read_into(self, item: ReadItem, dest: torch.Tensor) -> None:
        """Fill ``dest`` (shape ``item.lengths``) with the stored slice; its ranges are
        fetched in parallel.  Raises :class:`CorruptCheckpointError` for a size or checksum
        mismatch, :class:`ObjectStoreError` naming bucket and key when a request fails."""
        self._finish(self._start(item, dest))

    def read_object(self, item: ReadItem) -> Any:
        """A pickled object, fetched with one ranged GET of exactly its bytes."""
        assert self.metadata is not None
        info = storage_entry(self.metadata, item.storage_index, self.url)
        if self.metadata.rank_objects:  # per-rank save: this rank's copy (SPEC §4)
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
        """``(item, destination filled)`` or ``(item, object)`` for each ``(item, destination or
        None)``, in order, with the GETs ahead in flight (~512 MiB or ``4 * read_concurrency``)."""
        pending: collections.deque[Any] = collections.deque()
        batch: list[tuple[ReadItem, torch.Tensor, _Slice]] = []
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
                part = None if dest is None else self._batchable(item)
                if batch and (part is None or part.info.relative_path != batch[-1][2].info.relative_path
                              or _byte_range(part)[0] != _byte_range(batch[-1][2])[1]
                              or _byte_range(part)[1] - _byte_range(batch[0][2])[0] > self.settings.range_size):
                    yield from launch(self._start_batch(batch))
                    batch = []
                if dest is None:
                    yield from launch((item, self.read_object(item)))
                elif part is None:
                    yield from launch(self._start(item, dest))
                else:
                    batch.append((item, dest, part))
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

    @property
    def store(self) -> Optional[ObjectStore]:
        return None if self.files is None else self.files.store


def _byte_range(part: _Slice) -> tuple[int, int]:
    """``[start, end)`` in its object of a contiguous slice."""
    start = part.info.offset + part.first * part.dtype.itemsize
    return start, start + part.span * part.dtype.itemsize
