"""Nested state dicts ⇄ flat ``{dotted_fqn: leaf}`` maps.

Dicts are walked key by key; a list or tuple is walked element-wise (``key.0``,
``key.1``, ...) only when it holds a tensor somewhere inside, otherwise it is one leaf (an
optimizer's ``param_groups`` entries stay whole).  The path of each FQN is kept so a load
can write results back into the caller's nested containers in place.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

__all__ = ["FlatStateDict", "Path", "flatten_state_dict", "set_by_path", "unflatten_state_dict"]

Path = tuple[Any, ...]
FlatStateDict = dict[str, Any]


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

    def visit(obj: Any, path: Path) -> None:
        if isinstance(obj, Mapping) and obj and not is_tensor(obj):
            for key, value in obj.items():
                visit(value, path + (key,))
            return
        if isinstance(obj, (list, tuple)) and obj and _contains(obj, is_tensor):
            for i, value in enumerate(obj):
                visit(value, path + (i,))
            return
        fqn = ".".join(str(p) for p in path)
        if fqn in flat:
            raise ValueError(
                f"state dict paths {paths[fqn]!r} and {path!r} both flatten to the FQN {fqn!r}"
            )
        flat[fqn] = obj
        paths[fqn] = path

    for key, value in state_dict.items():
        visit(value, (key,))
    return flat, paths


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
        return type(root)(items) if type(root) is tuple else type(root)(*items)
    root[head] = set_by_path(root[head], rest, value)
    return root


def unflatten_state_dict(flat: Mapping[str, Any], paths: Mapping[str, Path]) -> dict[str, Any]:
    """Rebuild a nested dict from a flat map and its paths (lists for integer keys)."""
    out: dict[str, Any] = {}
    for fqn, value in flat.items():
        path = paths.get(fqn, (fqn,))
        node: Any = out
        for i, key in enumerate(path[:-1]):
            nxt = path[i + 1]
            if isinstance(node, list):
                while len(node) <= key:
                    node.append(None)
                if node[key] is None:
                    node[key] = [] if isinstance(nxt, int) else {}
                node = node[key]
            else:
                node = node.setdefault(key, [] if isinstance(nxt, int) else {})
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
            node[last] = value
        else:
            node[last] = value
    return out
