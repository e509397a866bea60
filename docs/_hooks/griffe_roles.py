"""griffe extension: the docstrings' Sphinx roles become cross-reference links.

The code's docstrings write references the Sphinx way (``:class:`RaggedShard```,
``:func:`save```, ``:meth:`~Foo.bar```) — readable in ``help()`` and in an editor.
mkdocstrings renders docstrings as Markdown, where such a role would show as raw text.
Once the whole ``hyper_parallel_dcp`` tree is loaded, this extension resolves each role
the way Python would see the name from where the docstring is (the object's own members,
its class, its module — imported names included), then anywhere in the package when the
short name is unique, and rewrites it as an autorefs link to the documented object.  A
link to an object no page documents stays plain code (``optional``: no broken link); a
name outside the package (``Path``) becomes plain code.  The source is never modified.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Optional

import griffe

ROLE = re.compile(r":(?:py:)?(class|func|meth|data|exc|attr|mod|obj|const):`(~?)([\w.]+)(?:\(\))?`")


def _walk(obj: Any, seen: set[str]):
    if obj.path in seen:
        return
    seen.add(obj.path)
    yield obj
    for member in list(obj.members.values()):
        if member.is_alias:
            continue
        yield from _walk(member, seen)


def _target_path(obj: Any) -> Optional[str]:
    if obj.is_alias:
        try:
            return obj.final_target.path
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return obj.target_path
    return obj.path


class SphinxRolesToLinks(griffe.Extension):
    """Rewrite ``:role:`name``` in every docstring of a loaded package as an autorefs link."""

    def on_package(self, *, pkg: Any, loader: Any, **kwargs: Any) -> None:
        objects = list(_walk(pkg, set()))
        by_name: dict[str, set[str]] = {}
        for obj in objects:
            by_name.setdefault(obj.name, set()).add(obj.path)
        for obj in objects:
            if obj.docstring is not None and ":" in obj.docstring.value:
                link = functools.partial(self._link, obj=obj, loader=loader, by_name=by_name)
                obj.docstring.value = ROLE.sub(link, obj.docstring.value)

    def _resolve(self, name: str, where: Any, loader: Any, by_name: dict[str, set[str]]) -> Optional[str]:
        head, _, rest = name.partition(".")
        if head == "hyper_parallel_dcp":
            try:
                return _target_path(loader.modules_collection.get_member(name))
            except (KeyError, ValueError, AttributeError):
                return None
        scope = where
        while scope is not None:  # the object itself, its class, its module, its packages
            member = scope.members.get(head) if hasattr(scope, "members") else None
            if member is not None:
                found = member
                for part in rest.split(".") if rest else []:
                    found = found.members.get(part) if hasattr(found, "members") else None
                    if found is None:
                        break
                if found is not None:
                    try:
                        return _target_path(found)
                    except Exception:  # noqa: BLE001 - an alias to outside the package
                        return None
            scope = scope.parent
        last = name.rsplit(".", 1)[-1]
        candidates = by_name.get(last, set())
        return next(iter(candidates)) if len(candidates) == 1 else None

    def _link(self, match: re.Match, obj: Any, loader: Any, by_name: dict[str, set[str]]) -> str:
        role, tilde, name = match.groups()
        title = name.rsplit(".", 1)[-1] if tilde else name
        if role in ("func", "meth"):
            title += "()"
        path = self._resolve(name, obj, loader, by_name)
        if path is None or not path.startswith("hyper_parallel_dcp"):
            return f"`{title}`"
        return f'<autoref identifier="{path}" optional><code>{title}</code></autoref>'
