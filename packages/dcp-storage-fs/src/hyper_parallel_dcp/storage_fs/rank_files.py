"""What one rank writes for a save, on every backend: :func:`write_rank_files` (its
safetensors file and its objects file) and :func:`with_stored_as` (the metadata committed)."""

from __future__ import annotations

import copy
import functools
from dataclasses import replace
from operator import itemgetter
from typing import Any, BinaryIO, Callable, Optional

import torch
import xxhash

from hyper_parallel_dcp.core.metadata import Metadata, StorageInfo, TensorStorageMetadata, chunk_key
from hyper_parallel_dcp.core.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from hyper_parallel_dcp.core.storage import WriteResult

from .compression import encode_chunk, zstd_module
from .incremental import ReferenceBase, map_in_order
from .layout import compressed_file_name, objects_file_name, tensors_file_name
from .safetensors_header import header_digest, stored_layout, to_stored
from .safetensors_stream import LateDigests, TensorEntry, encode_header, write_safetensors

__all__ = ["WriteFile", "with_stored_as", "write_rank_files"]

#: ``write_file(name, data_writer)``: write ``name`` through ``data_writer(f)``, return its size.
WriteFile = Callable[[str, Callable[[BinaryIO], Any]], int]


@functools.cache
def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _fetcher(resolve: Callable[[WriteItem], Any], item: WriteItem) -> Callable[[], torch.Tensor]:
    return lambda: to_stored(resolve(item))


def _labeller(item: WriteItem) -> Callable[[], str]:  # built only when an error is raised
    return lambda: f"{item.index.fqn!r} chunk at {list(item.index.offset or ())}"


def write_rank_files(plan: SavePlan, planner: SavePlanner, rank: int, write_file: WriteFile, *,
                     files_written: Optional[Callable[[], None]] = None,
                     base: Optional[ReferenceBase] = None, compression: Optional[str] = None) -> list[WriteResult]:
    """Write ``plan``'s tensor chunks (``(fqn, offset)`` order, hashed) and pickled objects
    through ``write_file(name, data_writer) -> size``; one :class:`WriteResult` per item.

    ``files_written()`` is called once both files are written (a ``resolved_data_stable``
    planner's chunks are hashed after it).  With ``base``, a chunk the base holds equal is
    not written; ``compression="zstd"`` writes ``_rank{r}_.zstd`` instead.  Errors of
    ``write_file`` and ``planner.resolve_data`` propagate unchanged.
    """
    # the storage key sorts in (fqn, offset) order: the sort key and the safetensors key
    keyed = sorted(((chunk_key(it.index.fqn, it.index.offset or ()), it) for it in plan.items
                    if it.type is WriteItemType.TENSOR), key=itemgetter(0))
    tensors = [it for _, it in keyed]
    objects = sorted((it for it in plan.items if it.type is WriteItemType.BYTE_IO), key=lambda it: it.index.fqn)
    results: list[WriteResult] = []
    referenced: list[WriteResult] = []
    if base is not None:
        keyed, referenced = base.split(keyed, planner.resolve_data)
        tensors = [it for _, it in keyed]
    if tensors and compression is not None:
        results += _write_compressed(tensors, keyed, planner, rank, write_file, compression)
        tensors = []
    if tensors:
        tensors_name = tensors_file_name(rank)
        entries = []
        resolve = planner.resolve_data
        stable = planner.resolved_data_stable  # the writer may then hold chunks for aligned writes
        for key, it in keyed:
            assert it.sizes is not None and it.dtype is not None and it.index.offset is not None
            stored_dtype, stored_shape = stored_layout(_dtype(it.dtype), it.sizes)
            entries.append(TensorEntry(key, stored_dtype, stored_shape, _fetcher(resolve, it), label=_labeller(it),
                                       stable=stable))
        placed: list[tuple[int, int, str]] = []
        header = encode_header(entries)
        late = LateDigests() if files_written is not None else None

        def write_tensors(f: BinaryIO) -> None:
            placed.extend(write_safetensors(f, entries, header, late=late))

        tensors_size = write_file(tensors_name, write_tensors)
    if objects:
        name = objects_file_name(rank)
        placed_objs: list[tuple[int, int, str]] = []

        def write_objects(f: BinaryIO) -> None:
            for it in objects:
                blob = planner.object_bytes(it)
                placed_objs.append((f.tell(), len(blob), xxhash.xxh3_64_hexdigest(blob)))
                f.write(blob)

        size = write_file(name, write_objects)
        for it, (offset, length, digest) in zip(objects, placed_objs):
            results.append(WriteResult(it.index, StorageInfo(name, offset, length, digest), size))
    if files_written is not None:
        files_written()
    if tensors:
        if late is not None:
            late.fill(placed)
        header_xxh3 = header_digest(header.raw, tensors_size)
        results[:0] = [WriteResult(it.index, StorageInfo(tensors_name, offset, length, digest, tensor_entry.key),
                                   tensors_size, header_xxh3)
                       for it, tensor_entry, (offset, length, digest) in zip(tensors, entries, placed)]
    return referenced + results


def _write_compressed(tensors: list[WriteItem], keyed: list[tuple[str, WriteItem]], planner: SavePlanner, rank: int,
                      write_file: WriteFile, compression: str) -> list[WriteResult]:
    """The chunks ``tensors`` compressed into the rank's ``.zstd`` file, a window of chunks at a
    time on a thread pool (zstd releases the GIL), written in order; their results."""
    if compression != "zstd":
        raise ValueError(f"compression={compression!r}: the codecs are 'zstd' (or None)")
    zstd = zstd_module("save(compression='zstd')")
    name = compressed_file_name(rank)
    placed: list[tuple[int, int, str]] = []

    def encode(item: WriteItem) -> tuple[bytes, str]:  # on the pool: hashed there too, not in the writing thread
        tensor = to_stored(planner.resolve_data(item)).detach().to("cpu").contiguous()
        payload = encode_chunk(tensor.view(-1).view(torch.uint8), tensor.element_size(), zstd)
        return payload, xxhash.xxh3_64_hexdigest(payload)

    def write_payloads(f: BinaryIO) -> None:  # the next chunks compress while one is written
        for _, (payload, digest) in map_in_order(encode, tensors, "hp-dcp-zstd"):
            placed.append((f.tell(), len(payload), digest))
            f.write(payload)

    size = write_file(name, write_payloads)
    return [WriteResult(it.index, StorageInfo(name, offset, length, digest, key), size)
            for (key, it), (offset, length, digest) in zip(keyed, placed)]


def with_stored_as(metadata: Metadata) -> Metadata:
    """``metadata`` with ``properties.stored_as`` set for each tensor whose dtype the files
    hold as another; what every backend commits as ``.metadata``."""
    out = None
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            stored, _ = stored_layout(md.properties.dtype, ())
            if stored != md.properties.dtype and md.properties.stored_as != stored:
                if out is None:
                    out = copy.copy(metadata)
                    out.state_dict_metadata = dict(metadata.state_dict_metadata)
                out.state_dict_metadata[fqn] = replace(md, properties=replace(md.properties, stored_as=stored))
    return metadata if out is None else out
