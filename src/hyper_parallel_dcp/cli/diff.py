"""``hp-dcp diff``: per-tensor differences between two checkpoints, streamed in row blocks of at
most ``block_bytes`` per side through the load path.  Exports :func:`diff_checkpoints`, its
result types and ``run``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.errors import CheckpointError, format_ranks
from hyper_parallel_dcp.core.metadata import TensorStorageMetadata, dtype_name
from hyper_parallel_dcp.offline_transform.blocks import CheckpointBlocks

from ._common import EXIT_OK, EXIT_PROBLEM, UsageError, existing_dir, print_json, print_table, progress

__all__ = ["DiffResult", "TensorDiff", "diff_checkpoints", "run"]

#: Default bytes per side read at once (a block is whole rows of dim 0).
DEFAULT_BLOCK_BYTES = 256 * 1024 * 1024


@dataclass
class TensorDiff:
    """Comparison of one key: ``max_abs``/``max_rel`` over all elements (``None``: not compared), an
    element's relative difference being ``|a-b| / max(|a|, |b|)`` (0 where both are 0; NaN equals
    NaN; NaN against a number is ``inf``); ``differing`` counts ``|a-b| > atol + rtol * |b|``."""

    fqn: str
    equal: bool
    reason: str = ""
    max_abs: Optional[float] = None
    max_rel: Optional[float] = None
    differing: int = 0
    numel: int = 0


@dataclass
class DiffResult:
    """Result of :func:`diff_checkpoints`."""

    a: Any  # a Path, or a URL (s3://...)
    b: Any
    keys: list[TensorDiff] = field(default_factory=list)
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.only_in_a and not self.only_in_b and all(k.equal for k in self.keys)


def _compare_blocks(a: Any, b: Any, atol: float, rtol: float) -> tuple[float, float, int]:
    """(max abs, max rel, differing elements) of two blocks of the same shape, not empty."""
    wide = torch.complex128 if (a.is_complex() or b.is_complex()) else torch.float64
    a, b = a.to(wide), b.to(wide)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    diff = torch.where(same, torch.zeros((), dtype=torch.float64), (a - b).abs().to(torch.float64))
    diff = torch.nan_to_num(diff, nan=math.inf)
    denom = torch.maximum(a.abs(), b.abs()).to(torch.float64)
    rel = torch.where(diff == 0, torch.zeros((), dtype=torch.float64), diff / denom)
    rel = torch.nan_to_num(rel, nan=math.inf)
    limit = atol + rtol * b.abs().to(torch.float64)
    return float(diff.max()), float(rel.max()), int(((diff > limit) & ~same).sum())


def _diff_tensor(fqn: str, sa: CheckpointBlocks, sb: CheckpointBlocks, atol: float, rtol: float,
                 block_bytes: int) -> TensorDiff:
    ma, mb = sa.tensor(fqn), sb.tensor(fqn)
    shape = tuple(ma.size)
    numel = math.prod(shape)
    if shape != tuple(mb.size):
        return TensorDiff(fqn, False, f"shape {list(shape)} vs {list(mb.size)}", numel=numel)
    da, db = ma.properties.dtype, mb.properties.dtype
    reason = "" if da == db else f"dtype {dtype_name(da)} vs {dtype_name(db)}"
    max_abs = max_rel = 0.0
    differing = 0
    if numel:
        rows = shape[0] if shape else 1
        row_bytes = max(1, (numel // rows) * max(da.itemsize, db.itemsize))
        step = max(1, block_bytes // row_bytes)
        for start in range(0, rows, step):
            n = min(step, rows - start)
            box = ChunkBox((start,) + (0,) * (len(shape) - 1), (n,) + shape[1:]) if shape else ChunkBox((), ())
            a, b = sa.read_block(fqn, box), sb.read_block(fqn, box)
            ba, br, bd = _compare_blocks(a, b, atol, rtol)
            max_abs, max_rel, differing = max(max_abs, ba), max(max_rel, br), differing + bd
            del a, b
    if differing:
        reason = "; ".join(filter(None, (reason, f"{differing} of {numel} elements differ")))
    return TensorDiff(fqn, not reason, reason, max_abs, max_rel, differing, numel)


def _objects_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object whose == does not give a truth value
        return False


def _diff_object(fqn: str, sa: CheckpointBlocks, sb: CheckpointBlocks) -> TensorDiff:
    """Equal when the copy every rank would load is equal (each rank's own copy of rank-local state)."""
    ranks = sorted(set(sa.metadata.rank_objects.get(fqn, {})) | set(sb.metadata.rank_objects.get(fqn, {}))) or [0]
    differing = []
    for rank in ranks:
        if sa.object_bytes(fqn, rank) == sb.object_bytes(fqn, rank):
            continue
        try:
            equal = _objects_equal(sa.read_object(fqn, rank), sb.read_object(fqn, rank))
        except CheckpointError as exc:  # e.g. a class that is not allow-listed: bytes differ, cannot say more
            return TensorDiff(fqn, False, f"object bytes differ (not loadable: {exc})")
        if not equal:
            differing.append(rank)
    if not differing:
        return TensorDiff(fqn, True, "object")
    if len(ranks) > 1:
        return TensorDiff(fqn, False, f"object differs (copy of rank(s) [{format_ranks(differing)}])")
    return TensorDiff(fqn, False, "object differs")


def diff_checkpoints(a: Any, b: Any, *, atol: float = 0.0, rtol: float = 0.0,
                     block_bytes: int = DEFAULT_BLOCK_BYTES, show_progress: bool = True) -> DiffResult:
    """Compare every key of the checkpoints at ``a`` and ``b``, reading at most ``block_bytes`` per
    side at a time.  Tensors are equal when shape and dtype match and every element satisfies
    ``|a-b| <= atol + rtol*|b|`` (NaN equal to NaN); objects when their stored bytes or loaded
    values are equal.  Raises the load path's errors for an unreadable checkpoint."""
    sa, sb = CheckpointBlocks(a), CheckpointBlocks(b)
    ka, kb = sa.metadata.state_dict_metadata, sb.metadata.state_dict_metadata
    result = DiffResult(a, b, only_in_a=sorted(set(ka) - set(kb)), only_in_b=sorted(set(kb) - set(ka)))
    common = sorted(set(ka) & set(kb))
    for fqn in progress(common, desc="diff", unit="key", enabled=show_progress):
        ta, tb = (isinstance(side[fqn], TensorStorageMetadata) for side in (ka, kb))
        if ta != tb:
            result.keys.append(TensorDiff(fqn, False, " vs ".join("tensor" if t else "object" for t in (ta, tb))))
        elif ta:
            result.keys.append(_diff_tensor(fqn, sa, sb, atol, rtol, block_bytes))
        else:
            result.keys.append(_diff_object(fqn, sa, sb))
    return result


def _num(x: Optional[float]) -> Any:
    """``x`` as JSON: ``inf``, ``-inf`` and ``nan`` as strings."""
    return x if x is None or math.isfinite(x) else str(x)


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.6g}"


def run(args: Any) -> int:
    """Print the differences; exit 1 when the checkpoints differ."""
    a = existing_dir(args.a, "checkpoint A")
    b = existing_dir(args.b, "checkpoint B")
    if args.atol < 0 or args.rtol < 0:
        raise UsageError("--atol and --rtol must not be negative")
    if args.block_mib <= 0:
        raise UsageError("--block-mib must be positive")
    result = diff_checkpoints(a, b, atol=args.atol, rtol=args.rtol, block_bytes=int(args.block_mib * 1024 * 1024),
                              show_progress=not args.json)
    if args.json:
        print_json({"a": str(a), "b": str(b), "identical": result.identical, "only_in_a": result.only_in_a,
                    "only_in_b": result.only_in_b,
                    "keys": {k.fqn: {f: _num(v) if isinstance(v, float) else v for f, v in asdict(k).items() if f != "fqn"}
                             for k in result.keys}})
    else:
        print(f"A  {a}\nB  {b}")
        shown = result.keys if args.all else [k for k in result.keys if not k.equal]
        if shown:
            print()
            print_table(["FQN", "equal", "max abs", "max rel", "differing", "note"],
                        [[k.fqn, "yes" if k.equal else "NO", _fmt(k.max_abs), _fmt(k.max_rel),
                          f"{k.differing}/{k.numel}" if k.max_abs is not None else "-", k.reason] for k in shown],
                        right=(2, 3, 4))
        for label, keys in (("only in A", result.only_in_a), ("only in B", result.only_in_b)):
            if keys:
                print(f"\n{label} ({len(keys)}): " + ", ".join(keys))
        differ = sum(not k.equal for k in result.keys)
        numel = sum(k.numel for k in result.keys)
        print(f"\n{len(result.keys)} common keys ({numel} elements), {differ} differ, "
              f"{len(result.only_in_a)} only in A, {len(result.only_in_b)} only in B: "
              f"{'identical' if result.identical else 'DIFFERENT'}")
    return EXIT_OK if result.identical else EXIT_PROBLEM
