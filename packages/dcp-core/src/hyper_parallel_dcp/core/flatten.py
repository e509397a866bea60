"""Nested state dicts ⇄ flat ``{dotted_fqn: leaf}`` maps.

Dicts are walked key by key; a list or tuple element-wise (``key.0``, ...) only when it
holds a tensor, else it is one leaf.  Each FQN's path is kept so a load writes back into
the caller's containers in place.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

__all__ = [
    "FlatStateDict",
    "Path",
    "Position",
    "flatten_state_dict",
    "match_stored_keys",
    "torch_style_leaves",
    "set_by_path",
    "unflatten_state_dict",
]

Path = tuple[Any, ...]
FlatStateDict = dict[str, Any]


class Position(int):
    """A list/tuple position on a path: an ``int`` that remembers the sequence type (a dict
    keyed by ints and a list give the same FQNs; :func:`unflatten_state_dict` must tell)."""

    container: type

    def __new__(cls, index: int, container: type = list) -> Position:
        obj = super().__new__(cls, index)
        obj.container = container
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (Position, (int(self), self.container))


def _contains(obj: Any, is_tensor: Callable[[Any], bool]) -> bool:
    if is_tensor(obj):
        return True
    if isinstance(obj, Mapping):
        return any(_contains(v, is_tensor) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_contains(v, is_tensor) for v in obj)
    return False


def flatten_state_dict(
    state_dict: Mapping[str, Any], is_tensor: Callable[[Any], bool]
) -> tuple[FlatStateDict, dict[str, Path]]:
    """Flatten ``state_dict``; returns the flat map and each FQN's path of keys.

    Raises ``ValueError`` when two different paths produce the same dotted FQN.
    """
    flat: FlatStateDict = {}
    paths: dict[str, Path] = {}

    def visit(obj: Any, path: Path, fqn: str) -> None:
        if not is_tensor(obj):
            if isinstance(obj, Mapping) and obj:
                for key, value in obj.items():
                    visit(value, path + (key,), fqn + "." + str(key))
                return
            if isinstance(obj, (list, tuple)) and obj and _contains(obj, is_tensor):
                for i, value in enumerate(obj):
                    visit(value, path + (Position(i, type(obj)),), fqn + "." + str(i))
                return
        if fqn in flat:
            raise ValueError(
                f"state dict paths {paths[fqn]!r} and {path!r} both flatten to the FQN {fqn!r}"
            )
        flat[fqn] = obj
        paths[fqn] = path

    try:
        for key, value in state_dict.items():
            visit(value, (key,), str(key))
    finally:
        # ``visit`` refers to itself: a cycle that would keep every tensor alive until a gc run
        visit = None  # type: ignore[assignment]
    return flat, paths


def _torch_walk(obj: Any, fqn: str, path: Path, flat: FlatStateDict, paths: dict[str, Path]) -> None:
    """torch.distributed.checkpoint's flattening: dicts, and lists holding a dict (or such a
    list), are walked; everything else is a leaf."""
    if isinstance(obj, Mapping) and obj:
        for key, value in obj.items():
            _torch_walk(value, f"{fqn}.{key}", path + (key,), flat, paths)
        return
    if isinstance(obj, list) and any(isinstance(v, Mapping) or (isinstance(v, list) and v) for v in obj):
        for i, value in enumerate(obj):
            _torch_walk(value, f"{fqn}.{i}", path + (Position(i, list),), flat, paths)
        return
    flat[fqn] = obj
    paths[fqn] = path


def torch_style_leaves(obj: Any, fqn: str) -> FlatStateDict:
    """The leaves ``torch.distributed.checkpoint`` stores for the value ``obj`` at ``fqn``
    (``{fqn: obj}`` itself unless it is a list that torch walks)."""
    flat: FlatStateDict = {}
    _torch_walk(obj, fqn, (), flat, {})
    return flat


def match_stored_keys(flat: FlatStateDict, paths: dict[str, Path],
                      stored: Mapping[str, Any]) -> tuple[FlatStateDict, dict[str, Path]]:
    """Re-flatten, torch's way, the list leaves a ``torch.distributed.checkpoint``
    checkpoint stored element-wise (``param_groups.0.lr``, ...): a leaf is expanded only
    when ``stored`` lacks its FQN but has keys below it (the same objects when none is)."""
    candidates = [fqn for fqn, leaf in flat.items() if isinstance(leaf, list) and leaf and fqn not in stored]
    if not candidates:
        return flat, paths
    prefixes = {k.rsplit(".", i)[0] for k in stored for i in range(1, k.count(".") + 1)}
    expand = [fqn for fqn in candidates if fqn in prefixes]
    if not expand:
        return flat, paths
    out: FlatStateDict = {}
    out_paths: dict[str, Path] = {}
    for fqn, leaf in flat.items():
        if fqn in expand:
            _torch_walk(leaf, fqn, paths[fqn], out, out_paths)
        else:
            out[fqn] = leaf
            out_paths[fqn] = paths[fqn]
    return out, out_paths


def set_by_path(root: Any, path: Path, value: Any) -> Any:
    """Set ``value`` at ``path`` inside nested containers; returns the (possibly new) root.

    Tuples are immutable, so a tuple on the path is rebuilt and put back into its parent.
    """
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(root, tuple):
        items = list(root)
        items[head] = set_by_path(items[head], rest, value)
        return _rebuilt(type(root), items)
    root[head] = set_by_path(root[head], rest, value)
    return root


def _rebuilt(container: type, items: list[Any]) -> Any:
    # a namedtuple takes its fields as arguments, any other sequence type an iterable
    return container(*items) if hasattr(container, "_fields") else container(items)


class _Mapping(dict):
    """A dict built by :func:`unflatten_state_dict`, not a leaf value."""


class _Sequence(dict):
    """A list or tuple under construction: position → value, plus the sequence type."""

    def __init__(self, container: type) -> None:
        super().__init__()
        self.container = container


def _finish(node: Any) -> Any:
    if isinstance(node, _Sequence):
        return _rebuilt(node.container, [_finish(node.get(i)) for i in range(max(node, default=-1) + 1)])
    if isinstance(node, _Mapping):
        return {k: _finish(v) for k, v in node.items()}
    return node  # a leaf value, returned as is


def unflatten_state_dict(flat: Mapping[str, Any], paths: Mapping[str, Path]) -> dict[str, Any]:
    """Rebuild a nested dict from a flat map and the paths :func:`flatten_state_dict` gave:
    a :class:`Position` rebuilds its list or tuple (unset positions ``None``), any other
    key is a dict key; an FQN missing from ``paths`` becomes a top-level key."""
    out = _Mapping()
    for fqn, value in flat.items():
        path = paths.get(fqn, (fqn,))
        node: Any = out
        for i, key in enumerate(path[:-1]):
            nxt = path[i + 1]
            child = node.get(key)
            if child is None:
                child = node[key] = _Sequence(nxt.container) if isinstance(nxt, Position) else _Mapping()
            node = child
        node[path[-1]] = value
    return _finish(out)
