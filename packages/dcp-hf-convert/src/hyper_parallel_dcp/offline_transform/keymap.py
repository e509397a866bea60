"""Renaming tensors in a conversion: ``None`` (keep), a callable ``old -> new`` (``None``
drops), or prefix rules ``{old_prefix: new_prefix}`` applied in order, each at most once."""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional, Union

__all__ = ["KeyMapping", "map_keys", "only_prefixes", "prefix_rules", "resolve_key_mapping", "strip_prefixes"]

KeyMapping = Union[None, Callable[[str], Optional[str]], Mapping[str, str]]


def prefix_rules(rules: Mapping[str, str]) -> Callable[[str], str]:
    """A mapping that replaces each matching prefix, rules tried in their order."""
    ordered = list(rules.items())

    def apply(key: str) -> str:
        for old, new in ordered:
            key = new + key[len(old):] if key.startswith(old) else key
        return key

    return apply


def strip_prefixes(*prefixes: str) -> Callable[[str], str]:
    """A mapping that removes each of ``prefixes`` (in order) where a key starts with it."""
    return prefix_rules({p: "" for p in prefixes})


def only_prefixes(prefixes: Iterable[str], then: KeyMapping = None) -> Callable[[str], Optional[str]]:
    """A mapping that drops every key not starting with one of ``prefixes``, then applies
    ``then`` to the keys it keeps (``hp-dcp-convert dcp-to-hf --only model.``)."""
    kept = tuple(prefixes)
    rest = resolve_key_mapping(then)

    def apply(key: str) -> Optional[str]:
        return rest(key) if key.startswith(kept) else None

    return apply


def resolve_key_mapping(mapping: KeyMapping) -> Callable[[str], Optional[str]]:
    """The callable form of ``mapping``; raises ``TypeError`` for anything else."""
    if mapping is None:
        return lambda key: key
    if isinstance(mapping, Mapping):
        return prefix_rules(mapping)
    if callable(mapping):
        return mapping
    raise TypeError(f"key_mapping must be None, a callable or a dict of prefix rules, got {type(mapping).__name__}")


def map_keys(keys: Iterable[str], mapping: KeyMapping) -> dict[str, str]:
    """``{old: new}`` for every key the mapping keeps, in the order of ``keys``; ``ValueError``
    naming both when two keys map to one name, or for a result that is not a non-empty string."""
    fn = resolve_key_mapping(mapping)
    out: dict[str, str] = {}
    source_of: dict[str, str] = {}
    for key in keys:
        new = fn(key)
        if new is None:
            continue
        if not isinstance(new, str) or not new:
            raise ValueError(f"key mapping turned {key!r} into {new!r}; expected a non-empty string or None")
        if new in source_of:
            raise ValueError(f"key mapping sends both {source_of[new]!r} and {key!r} to {new!r}")
        source_of[new] = key
        out[key] = new
    return out
