"""Load planning: one :class:`ReadItem` per target piece ∩ stored chunk (the pieces covered
exactly), and the default load planner :class:`StandardLoadPlanner`."""

from __future__ import annotations

import bisect
import math
from operator import add, mul, sub
from typing import Any, Iterator, Mapping, Optional

import torch

from .errors import MismatchError, MissingKeyError, MissingRegionError
from .layout import TensorShards, is_tensor_leaf, to_tensor_shards
from .metadata import Metadata, MetadataIndex, TensorStorageMetadata, chunk_columns
from .planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

__all__ = ["StandardLoadPlanner", "create_local_load_plan"]


class _ChunkIndex:
    """Stored chunks of one tensor (from the chunk columns, sorted by offsets), found by
    bisecting their starts on dims 0 and 1: a piece visits only the chunks that can meet it."""

    def __init__(self, md: TensorStorageMetadata):
        self.ndim, self.offsets, self.sizes, ascending = chunk_columns(md)
        ndim = self.ndim
        self.count = len(self.offsets) // ndim if ndim else len(md.chunks)
        self.order: Optional[list[int]] = None
        if not ndim:
            return
        if not ascending:  # chunks visited in (offsets) order
            keys = list(zip(*[iter(self.offsets)] * ndim))
            self.order = sorted(range(self.count), key=keys.__getitem__)
        self.starts = self._column(0)
        self.max_len = max(self.sizes[::ndim], default=0)
        if ndim > 1:
            self.starts1 = self._column(1)
            self.max_len1 = max(self.sizes[1::ndim], default=0)

    def _column(self, dim: int) -> list[int]:
        values = self.offsets[dim::self.ndim]
        return values if self.order is None else [values[i] for i in self.order]

    def _box(self, i: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        pos = i if self.order is None else self.order[i]
        at = pos * self.ndim
        return pos, tuple(self.offsets[at:at + self.ndim]), tuple(self.sizes[at:at + self.ndim])

    def overlapping(self, offsets: tuple[int, ...], sizes: tuple[int, ...]
                    ) -> Iterator[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """``(position in md.chunks, offsets, sizes)`` of every chunk that may overlap the box."""
        if self.ndim == 0 or not offsets:
            yield from ((pos, (), ()) for pos in range(self.count))
            return
        starts = self.starts
        lo = bisect.bisect_left(starts, offsets[0] - self.max_len + 1)
        hi = bisect.bisect_left(starts, offsets[0] + sizes[0])
        while lo < hi:
            # chunks with one dim-0 start ascend on dim 1: bisect there too
            end = bisect.bisect_right(starts, starts[lo], lo, hi)
            first, last = lo, end
            if self.ndim > 1:
                first = bisect.bisect_left(self.starts1, offsets[1] - self.max_len1 + 1, lo, end)
                last = bisect.bisect_left(self.starts1, offsets[1] + sizes[1], first, end)
            yield from map(self._box, range(first, last))
            lo = end


# a tensor with at most this many chunk offsets and sizes shares its pieces' reads with
# every tensor of the same chunk layout
_SHARED_MAX_INTS = 64

# (chunk position, chunk offsets, dest_offsets, storage_offsets, lengths) of one read
_PieceRead = tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _piece_reads(cindex: _ChunkIndex, b_off: tuple[int, ...], b_size: tuple[int, ...]
                 ) -> tuple[tuple[_PieceRead, ...], int]:
    """The reads that fill the piece ``b_off+b_size`` (target box ∩ stored chunks, in chunk
    order) and the elements of the piece they cover."""
    reads = []
    covered = 0
    b_end = tuple(map(add, b_off, b_size))
    for pos, c_off, c_size in cindex.overlapping(b_off, b_size):
        lo = tuple(map(max, b_off, c_off))
        sizes = tuple(map(sub, map(min, b_end, map(add, c_off, c_size)), lo))
        if all(n > 0 for n in sizes):
            covered += math.prod(sizes)
            reads.append((pos, c_off, tuple(map(sub, lo, b_off)), tuple(map(sub, lo, c_off)), sizes))
    return tuple(reads), covered


def create_local_load_plan(
    flat: dict[str, Any], metadata: Metadata, shards: Optional[dict[str, TensorShards]] = None,
    allow_partial_load: bool = False,
) -> tuple[LoadPlan, dict[str, TensorShards]]:
    """Read items for every target leaf: target pieces ∩ stored chunks.  Raises
    :class:`MissingKeyError` for a key the checkpoint lacks (unless ``allow_partial_load``),
    :class:`MismatchError` for a shape or kind mismatch and :class:`MissingRegionError` when
    stored chunks do not cover a target piece."""
    items: list[ReadItem] = []
    shards = {} if shards is None else shards
    # the overlap arithmetic runs once per (chunk layout, piece) pair
    reads_of: dict[Any, tuple[tuple[_PieceRead, ...], int]] = {}
    indexes: dict[Any, _ChunkIndex] = {}
    layouts: dict[Any, Any] = {}  # see to_tensor_shards
    TENSOR = LoadItemType.TENSOR
    sd_md = metadata.state_dict_metadata
    missing: list[str] = []
    for fqn, leaf in flat.items():
        md = sd_md.get(fqn)
        if md is None:
            # an empty dict (a fresh optimizer's ``state``) holds no key to load
            if not (allow_partial_load or (isinstance(leaf, dict) and not leaf)):
                missing.append(fqn)
            continue
        if not is_tensor_leaf(leaf):
            if isinstance(md, TensorStorageMetadata):
                raise MismatchError(f"{fqn!r} is stored as a tensor but the target is a {type(leaf).__name__}")
            index = MetadataIndex(fqn)
            items.append(ReadItem(LoadItemType.BYTE_IO, index, (), index, (), ()))
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise MismatchError(f"{fqn!r} is stored as an object but the target is a tensor")
        target = to_tensor_shards(leaf, fqn, layouts=layouts)
        shards[fqn] = target
        if tuple(md.size) != target.global_shape:
            raise MismatchError(
                f"{fqn!r}: shape mismatch: checkpoint has {list(md.size)}, target expects {list(target.global_shape)}"
            )
        ndim, flat_off, flat_size, _ = chunk_columns(md)
        # the chunk count too: 0-d tensors have empty columns with one chunk or none
        layout = ((len(flat_off) // ndim if ndim else len(md.chunks), tuple(flat_off), tuple(flat_size))
                  if len(flat_off) <= _SHARED_MAX_INTS else fqn)
        for box, _view in target.pieces:
            b_off, b_size = box.offsets, box.sizes
            if 0 in b_size:
                continue
            found = reads_of.get((layout, b_off, b_size))
            if found is None:
                cindex = indexes.get(layout)
                if cindex is None:
                    cindex = indexes[layout] = _ChunkIndex(md)
                found = reads_of[(layout, b_off, b_size)] = _piece_reads(cindex, b_off, b_size)
            reads, covered = found
            if covered != math.prod(b_size):
                raise MissingRegionError(
                    f"{fqn!r}: the checkpoint does not cover the requested region offsets={list(b_off)} "
                    f"sizes={list(b_size)} ({covered} of {math.prod(b_size)} elements stored)"
                )
            dest = MetadataIndex(fqn, b_off)
            for pos, c_off, dest_offsets, storage_offsets, sizes in reads:
                items.append(ReadItem(TENSOR, dest, dest_offsets, MetadataIndex(fqn, c_off, pos), storage_offsets,
                                      sizes))
    if missing:
        raise MissingKeyError(missing_keys_message(missing, sd_md))
    return LoadPlan(tuple(items)), shards


#: Module names that wrappers put into FQNs: DDP and FSDP1 (``module``), ``torch.compile``
#: (``_orig_mod``), FSDP1 and activation checkpointing wrappers.
_WRAPPER_PARTS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module",
                            "_forward_module"})

_SHOWN_KEYS = 8


def missing_keys_message(missing: list[str], stored: Mapping[str, Any]) -> str:
    """The message of :class:`MissingKeyError`: the ``missing`` keys counted, the first few
    named, and a ``stored`` key one of them matches but for a prefix (:func:`_near_miss`)."""
    count = len(missing)
    stored_text = f"{len(stored)} key{'' if len(stored) == 1 else 's'} stored"
    if count == 1:
        text = f"key {missing[0]!r} is not in the checkpoint ({stored_text}); remove it from the state dict"
    else:
        shown = ", ".join(map(repr, missing[:_SHOWN_KEYS]))
        more = f" and {count - _SHOWN_KEYS} more" if count > _SHOWN_KEYS else ""
        text = (f"{count} keys are not in the checkpoint ({stored_text}): {shown}{more}; remove them from the "
                "state dict")
    return text + ", or pass allow_partial_load=True, to load the rest" + _near_miss(missing[:_SHOWN_KEYS], stored)


def _near_miss(missing: list[str], stored: Mapping[str, Any]) -> str:
    """``""``, or a sentence naming a stored key that one of ``missing`` matches once wrapper
    module names (``module.``, ``_orig_mod.``) or leading components are dropped."""
    unwrapped = {_unwrapped(key): key for key in stored}
    for key in missing:
        found = unwrapped.get(_unwrapped(key))
        if found is not None:
            return (f". The checkpoint has {found!r} for {key!r}: the two differ by a wrapper's module name "
                    "(DDP's 'module.', torch.compile's '_orig_mod.', ...); build the state dict with "
                    "torch.distributed.checkpoint.state_dict.get_state_dict, which leaves them out, or from "
                    "the same wrapping as at save time")
    lacking: dict[str, list[tuple[str, str]]] = {}  # prefix -> [(stored key, missing key)]
    for key in missing:
        parts = key.split(".")
        rest = next((i for i in range(1, len(parts)) if ".".join(parts[i:]) in stored), None)
        if rest is not None:
            lacking.setdefault(".".join(parts[:rest]) + ".", []).append((".".join(parts[rest:]), key))
    by_suffix: dict[str, str] = {}
    for name in stored:
        parts = name.split(".")
        for i in range(1, min(len(parts), _PREFIX_PARTS + 1)):
            by_suffix.setdefault(".".join(parts[i:]), name)
    carrying: dict[str, list[tuple[str, str]]] = {}
    for key in missing:
        found = by_suffix.get(key)
        if found is not None:
            carrying.setdefault(found[:-len(key)], []).append((found, key))
    for pairs_by_prefix, hint in ((lacking, _LACKS_PREFIX), (carrying, _CARRIES_PREFIX)):
        if not pairs_by_prefix:
            continue
        # the prefix that explains the most keys, when it explains half of them at least:
        # a model that grew a layer lacks 'model.3.weight', not 'weight' under 'model.3.'
        prefix, pairs = max(pairs_by_prefix.items(), key=lambda entry: len(entry[1]))
        if 2 * len(pairs) >= len(missing):
            found, key = pairs[0]
            return hint.format(found=found, key=key, prefix=prefix, top=prefix.split(".")[0], bare=prefix[:-1])
    return ""


_LACKS_PREFIX = (". The checkpoint has {found!r} for {key!r}: its keys lack the prefix {prefix!r}; load into a state "
                 "dict without it (e.g. the module's own state_dict(), not nested under {top!r})")
_CARRIES_PREFIX = (". The checkpoint has {found!r} for {key!r}: its keys carry the prefix {prefix!r}; nest the state "
                   "dict under it ({{{bare!r}: ...}}), or leave the prefix out of the checkpoint (hp-dcp-convert "
                   "hf-to-dcp --strip-prefix {prefix})")


#: Leading components a stored key may have that the target's lacks (``model.``, ``model.module.``)
_PREFIX_PARTS = 3


def _unwrapped(fqn: str) -> str:
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_PARTS)


# a target piece as reads resolve into it: (view, shape, strides, storage offset, root for
# as_strided); strides None for a view that is not plain strided
_Piece = tuple[torch.Tensor, tuple[int, ...], Optional[tuple[int, ...]], int, torch.Tensor]


def _view_root(view: torch.Tensor) -> torch.Tensor:
    """``view``'s base where that is an equivalent plain tensor (same dtype, no autograd,
    conjugate or negative bit), else ``view``: what ``as_strided`` makes partial destinations of."""
    root = view._base
    if (root is None or type(root) is not torch.Tensor or root.layout is not torch.strided or root.dtype != view.dtype
            or root.requires_grad or view.requires_grad or view.is_conj() or view.is_neg()
            or root.is_conj() or root.is_neg()):
        return view
    return root


class StandardLoadPlanner(LoadPlanner):
    """Default load planner: exact-cover reads into views of the caller's tensors.
    ``allow_partial_load``: keys the checkpoint lacks are left untouched.  ``fills_regions``
    (False for a subclass overriding ``resolve_tensor`` or ``commit_tensor`` unless declared):
    :meth:`resolve_region` may hand the reader raw memory."""

    fills_regions = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if ("resolve_tensor" in vars(cls) or "commit_tensor" in vars(cls)) and "fills_regions" not in vars(cls):
            cls.fills_regions = False

    def __init__(self, allow_partial_load: bool = False) -> None:
        self.allow_partial_load = allow_partial_load
        self.metadata: Optional[Metadata] = None
        self._set_up({}, True, 0, 1)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata, *,
                       is_coordinator: bool, rank: int = 0, world_size: int = 1) -> None:
        self.metadata = metadata
        self._set_up(state_dict, is_coordinator, rank, world_size)

    def _set_up(self, state_dict: dict[str, Any], is_coordinator: bool, rank: int, world_size: int) -> None:
        self.flat: dict[str, Any] = state_dict
        self.is_coordinator, self.rank, self.world_size = is_coordinator, rank, world_size
        self.shards: dict[str, TensorShards] = {}
        # (fqn, offsets) -> the piece (see _Piece)
        self._pieces: dict[tuple[str, Any], _Piece] = {}
        self.loaded_objects: dict[str, Any] = {}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        plan, self.shards = create_local_load_plan(self.flat, self.metadata,
                                                   allow_partial_load=self.allow_partial_load)
        pieces = self._pieces
        for fqn, shard in self.shards.items():
            for box, view in shard.pieces:
                if type(view) is torch.Tensor and view.layout is torch.strided:
                    pieces[(fqn, box.offsets)] = (view, tuple(view.shape), view.stride(), int(view.storage_offset()),
                                                  _view_root(view))
                else:
                    pieces[(fqn, box.offsets)] = (view, tuple(view.shape), None, 0, view)
        return plan

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        return new_plan

    def resolve_shard(self, dest_index: MetadataIndex) -> torch.Tensor:
        return self._pieces[(dest_index.fqn, dest_index.offset)][0]

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = read_item.dest_index
        view, shape, strides, storage_offset, root = self._pieces[(dest.fqn, dest.offset)]
        lengths = read_item.lengths
        offsets = read_item.dest_offsets
        if lengths == shape and not any(offsets):
            return view
        if strides is not None:
            # one as_strided of the view's root instead of a narrow per dim
            return root.as_strided(lengths, strides, storage_offset + sum(map(mul, offsets, strides)))
        for d, (off, length) in enumerate(zip(offsets, lengths)):
            if off or length != shape[d]:
                view = view.narrow(d, off, length)
        return view

    def resolve_region(self, read_item: ReadItem) -> tuple[torch.Tensor, Optional[int], tuple[int, ...]]:
        if not self.fills_regions:
            return self.resolve_tensor(read_item), None, ()
        dest = read_item.dest_index
        view, shape, strides, storage_offset, root = self._pieces[(dest.fqn, dest.offset)]
        offsets = read_item.dest_offsets
        if read_item.lengths == shape and not any(offsets):
            return view, None, ()  # the whole piece (a same-layout load)
        if strides is None:
            return self.resolve_tensor(read_item), None, ()
        return root, storage_offset + sum(map(mul, offsets, strides)), strides

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # targets are views of the caller's tensors, already written in place

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.loaded_objects[read_item.dest_index.fqn] = value
