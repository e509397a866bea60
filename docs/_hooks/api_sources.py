"""mkdocs hook: one source tree of the whole ``hyper_parallel_dcp`` namespace for mkdocstrings.

The namespace is shared by six distributions (the umbrella's ``src/`` plus
``packages/*/src/``); the static analyser (griffe) reads a package from one directory
only.  Before the build this hook assembles ``build/docs-api-src/hyper_parallel_dcp/`` out
of symbolic links to the real modules, which is the path mkdocs.yml gives mkdocstrings.
Nothing is imported, so building the docs needs no torch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TREE = Path("build") / "docs-api-src"


def assemble(root: Path) -> Path:
    """(Re)build the linked tree under ``root``; returns the directory to search."""
    tree = root / TREE / "hyper_parallel_dcp"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    sources = [root / "src" / "hyper_parallel_dcp", *sorted((root / "packages").glob("*/src/hyper_parallel_dcp"))]
    for source in sources:
        for entry in source.iterdir():
            if entry.name == "__pycache__" or (tree / entry.name).exists():
                continue
            os.symlink(entry.resolve(), tree / entry.name)
    return root / TREE


def on_startup(command, dirty):
    # Before any on_config: mkdocstrings drops search paths that do not exist yet.
    assemble(Path(__file__).resolve().parents[2])
