"""The target layout that ``hp-dcp explain`` simulates: a small JSON or YAML document.

Example (JSON; the same keys in YAML)::

    {
      "world_size": 4,
      "mesh": {"dp": 2, "tp": 2},
      "default": ["Replicate", "Shard(0)"],
      "rules": [
        {"match": "*.norm.weight", "placements": ["Replicate", "Replicate"]},
        {"match": "*.weight", "placements": {"tp": "Shard(1)"}},
        {"match": "optim.*", "skip": true}
      ],
      "expect": {"model.embed.weight": {"shape": [32000, 4096], "dtype": "bfloat16"}}
    }

* ``mesh``: a list of sizes (``[2, 2]``, names from ``mesh_dim_names`` if given) or an
  object ``{name: size}`` in mesh order.  Default: ``[world_size]``.
* ``world_size``: defaults to the product of the mesh sizes; when both are given they
  must agree.  Rank ``r`` sits at the row-major mesh coordinate of ``r`` (as
  ``init_device_mesh`` places ranks).
* placements: one per mesh dimension, as a list of strings (``"Replicate"``,
  ``"Shard(d)"``, ``"_StridedShard(d, split_factor=k)"``) or an object
  ``{mesh_dim_name: placement}`` where dimensions left out are ``Replicate``.
* ``rules``: FQN patterns (``fnmatch`` syntax, ``*`` also matches dots), first match wins;
  ``"skip": true`` leaves the matching keys out of the load.  A rule's placements must fit
  every tensor it matches (``Shard(1)`` on a 1-D tensor is reported as a problem).
* ``default``: the placements of tensors no rule matches (default: all ``Replicate``).
  A ``Shard(d)`` of the default that does not fit a tensor with ``d`` or fewer dimensions
  (scalars, biases) falls back to ``Replicate`` on that mesh dimension.
* ``load``: FQN patterns of the checkpoint keys the target state dict holds (default
  every key, objects included).
* ``expect``: keys the target model has, with optional ``shape``/``dtype``; a key the
  checkpoint lacks is reported missing, a different shape or dtype as a mismatch.

Exports :func:`load_target_spec`, :func:`parse_target_spec`, :class:`TargetSpec`,
:func:`format_help` and the placement helpers.  Errors are :class:`UsageError` naming the file and the entry.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ._common import UsageError

__all__ = [
    "PlacementRule", "TargetSpec", "format_help", "load_target_spec", "parse_placement", "parse_target_spec",
    "placement_fits",
]

_SHARD = re.compile(r"^\s*(?:Shard|S)\s*\(\s*(-?\d+)\s*\)\s*$")
_STRIDED = re.compile(r"^\s*_?StridedShard\s*\(\s*(?:dim\s*=\s*)?(-?\d+)\s*,\s*(?:split_factor\s*=\s*)?(\d+)\s*\)\s*$")
_REPLICATE = re.compile(r"^\s*(?:Replicate|R)\s*(?:\(\s*\))?\s*$")
_PARTIAL = re.compile(r"^\s*(?:Partial|P)\b")
_KEYS = {"world_size", "mesh", "mesh_dim_names", "default", "rules", "load", "expect"}


def format_help() -> str:
    """The file format as this module's docstring states it, for ``hp-dcp explain --help``."""
    body = (__doc__ or "").split("\n", 1)[-1].split("\nExports", 1)[0]
    body = body.replace("``", "").replace("::", ":").strip()
    intro = "The target spec (--target) is a JSON or YAML (with PyYAML) file describing the layout to load into."
    return f"{intro}\n\n{body}\n\n"


def _replicate() -> Any:
    from torch.distributed.tensor.placement_types import Replicate

    return Replicate()


def parse_placement(text: Any) -> Any:
    """A torch placement from its written form (``"Shard(0)"``, ``"Replicate"``, ...); :class:`UsageError`
    for anything else, ``Partial`` included (a partial sum cannot be loaded from a checkpoint)."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if not isinstance(text, str):
        raise UsageError(f"a placement must be a string such as 'Shard(0)' or 'Replicate', got {text!r}")
    if _REPLICATE.match(text):
        return _replicate()
    if m := _SHARD.match(text):
        return Shard(int(m.group(1)))
    if m := _STRIDED.match(text):
        return _StridedShard(int(m.group(1)), split_factor=int(m.group(2)))
    if _PARTIAL.match(text):
        raise UsageError(f"placement {text!r}: Partial tensors cannot be loaded from a checkpoint")
    raise UsageError(f"unknown placement {text!r}: use 'Replicate', 'Shard(d)' or '_StridedShard(d, split_factor=k)'")


def placement_fits(placement: Any, ndim: int) -> bool:
    """Whether ``placement`` can apply to a tensor of ``ndim`` dims (a shard dim must exist)."""
    dim = getattr(placement, "dim", None)  # Shard and _StridedShard (not a Shard subclass in torch 2.13)
    return dim is None or -ndim <= dim < ndim


@dataclass(frozen=True)
class PlacementRule:
    """FQN pattern → placements (one per mesh dim), or ``skip`` (not loaded)."""

    pattern: str
    placements: Optional[tuple[Any, ...]]
    skip: bool = False


@dataclass
class TargetSpec:
    """A parsed target layout; see the module docstring for the file format."""

    world_size: int
    mesh_shape: tuple[int, ...]
    mesh_dim_names: Optional[tuple[str, ...]]
    default: tuple[Any, ...]
    rules: list[PlacementRule] = field(default_factory=list)
    load: tuple[str, ...] = ("*",)
    expect: dict[str, dict[str, Any]] = field(default_factory=dict)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Row-major mesh coordinate of ``rank`` (the order ``init_device_mesh`` uses)."""
        return tuple(rank // math.prod(self.mesh_shape[i + 1:]) % size for i, size in enumerate(self.mesh_shape))

    def rule_for(self, fqn: str) -> Optional[PlacementRule]:
        return next((rule for rule in self.rules if fnmatch.fnmatchcase(fqn, rule.pattern)), None)

    def wants(self, fqn: str) -> bool:
        """Whether the target state dict holds ``fqn`` (``load`` patterns, ``skip`` rules)."""
        rule = self.rule_for(fqn)
        return any(fnmatch.fnmatchcase(fqn, p) for p in self.load) and (rule is None or not rule.skip)

    def placements_for(self, fqn: str, ndim: int) -> tuple[tuple[Any, ...], Optional[str]]:
        """The placements of ``fqn`` (a tensor with ``ndim`` dims) and the rule pattern used: a default
        ``Shard(d)`` that does not fit becomes ``Replicate``, a rule's placements are as written."""
        rule = self.rule_for(fqn)
        if rule is not None and rule.placements is not None:
            return rule.placements, rule.pattern
        return tuple(p if placement_fits(p, ndim) else _replicate() for p in self.default), None

    def describe(self) -> str:
        """``world size 4, mesh dp=2 x tp=2``."""
        names = self.mesh_dim_names
        mesh = " x ".join(f"{n}={s}" for n, s in zip(names, self.mesh_shape)) if names else " x ".join(
            str(s) for s in self.mesh_shape)
        return f"world size {self.world_size}, mesh {mesh}"


def _placements(value: Any, mesh: tuple[int, ...], names: Optional[tuple[str, ...]], where: str) -> tuple[Any, ...]:
    if isinstance(value, dict):
        if names is None:
            raise UsageError(f"{where}: placements by mesh dimension name need named mesh dimensions "
                             "('mesh': {{'dp': 2, 'tp': 2}} or 'mesh_dim_names')")
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise UsageError(f"{where}: unknown mesh dimension(s) {unknown}; the mesh has {list(names)}")
        return tuple(parse_placement(value[n]) if n in value else _replicate() for n in names)
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list):
        raise UsageError(f"{where}: placements must be a list or an object, got {value!r}")
    if len(value) != len(mesh):
        raise UsageError(f"{where}: {len(value)} placement(s) for a mesh of {len(mesh)} dimension(s)")
    return tuple(parse_placement(v) for v in value)


def _positive_int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"{where} must be a positive integer, got {value!r}")
    return value


def _mesh(doc: dict[str, Any], source: str) -> tuple[tuple[int, ...], Optional[tuple[str, ...]]]:
    """The mesh sizes and dimension names of a spec document."""
    mesh_doc, names = doc.get("mesh"), None
    if isinstance(mesh_doc, dict):
        names = tuple(str(k) for k in mesh_doc)
        mesh = tuple(_positive_int(v, f"{source}: mesh size of {k!r}") for k, v in mesh_doc.items())
    elif isinstance(mesh_doc, list):
        mesh = tuple(_positive_int(v, f"{source}: mesh size") for v in mesh_doc)
    elif mesh_doc is None:
        if "world_size" not in doc:
            raise UsageError(f"{source}: give 'world_size' or 'mesh'")
        mesh = (_positive_int(doc["world_size"], f"{source}: world_size"),)
    else:
        raise UsageError(f"{source}: 'mesh' must be a list of sizes or an object {{name: size}}")
    if not mesh:
        raise UsageError(f"{source}: the mesh needs at least one dimension")
    dim_names = doc.get("mesh_dim_names")
    if dim_names is not None:
        if not isinstance(dim_names, list) or len(dim_names) != len(mesh) or len(set(map(str, dim_names))) != len(mesh):
            raise UsageError(f"{source}: mesh_dim_names must be {len(mesh)} distinct names, got {dim_names!r}")
        names = tuple(str(n) for n in dim_names)
    return mesh, names


def _rules(doc: dict[str, Any], mesh: tuple[int, ...], names: Optional[tuple[str, ...]],
           source: str) -> list[PlacementRule]:
    rules = []
    for i, rule in enumerate(doc.get("rules") or []):
        where = f"{source}: rules[{i}]"
        if not isinstance(rule, dict) or not isinstance(rule.get("match"), str):
            raise UsageError(f"{where} must be an object with a 'match' pattern")
        extra = sorted(set(rule) - {"match", "placements", "skip"})
        if extra:
            raise UsageError(f"{where}: unknown key(s) {extra}")
        if rule.get("skip"):
            rules.append(PlacementRule(rule["match"], None, True))
        elif "placements" in rule:
            rules.append(PlacementRule(rule["match"], _placements(rule["placements"], mesh, names, where)))
        else:
            raise UsageError(f"{where} needs 'placements' or 'skip': true")
    return rules


def _expect(doc: dict[str, Any], source: str) -> dict[str, dict[str, Any]]:
    from hyper_parallel_dcp.core.errors import CheckpointFormatError
    from hyper_parallel_dcp.core.metadata import dtype_from_name

    expect = doc.get("expect") or {}
    if not isinstance(expect, dict) or not all(isinstance(v, dict) for v in expect.values()):
        raise UsageError(f"{source}: 'expect' must map FQNs to {{'shape': [...], 'dtype': '...'}}")
    for fqn, entry in expect.items():
        shape = entry.get("shape")
        if shape is not None and (not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise UsageError(f"{source}: expect[{fqn!r}].shape must be a list of non-negative integers")
        if entry.get("dtype") is not None:
            try:
                dtype_from_name(str(entry["dtype"]))
            except CheckpointFormatError:
                raise UsageError(f"{source}: expect[{fqn!r}].dtype {entry['dtype']!r} is not a torch dtype") from None
    return dict(expect)


def parse_target_spec(doc: Any, *, source: str = "target spec") -> TargetSpec:
    """Validate a decoded spec document; raises :class:`UsageError` naming ``source``."""
    if not isinstance(doc, dict):
        raise UsageError(f"{source}: the target spec must be an object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - _KEYS)
    if unknown:
        raise UsageError(f"{source}: unknown key(s) {unknown}; known keys are {sorted(_KEYS)}")
    mesh, names = _mesh(doc, source)
    world_size = math.prod(mesh)
    if "world_size" in doc and _positive_int(doc["world_size"], f"{source}: world_size") != world_size:
        raise UsageError(f"{source}: world_size {doc['world_size']} differs from the mesh size {world_size} "
                         f"({' x '.join(map(str, mesh))})")
    default = (_placements(doc["default"], mesh, names, f"{source}: default") if "default" in doc
               else tuple(_replicate() for _ in mesh))
    load = doc.get("load", ["*"])
    load = [load] if isinstance(load, str) else load
    if not isinstance(load, list) or not all(isinstance(p, str) for p in load):
        raise UsageError(f"{source}: 'load' must be a list of FQN patterns")
    return TargetSpec(world_size, mesh, names, default, _rules(doc, mesh, names, source), tuple(load),
                      _expect(doc, source))


def load_target_spec(path: str | Path) -> TargetSpec:
    """Read and parse a spec file (``.json``, or ``.yaml``/``.yml`` with PyYAML installed);
    :class:`UsageError` for a missing file, a syntax error or an invalid spec."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read target spec {p}: {exc.strerror or exc}") from None
    kind, loads, syntax_error = "JSON", json.loads, ValueError
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            hint = "reading YAML needs PyYAML (pip install pyyaml); or write the spec as JSON"
            raise UsageError(f"{p}: {hint}") from None
        kind, loads, syntax_error = "YAML", yaml.safe_load, yaml.YAMLError
    try:
        doc = loads(text)
    except syntax_error as exc:
        raise UsageError(f"{p} is not valid {kind}: {exc}") from None
    return parse_target_spec(doc, source=str(p))
