"""No package imports upward or sideways against SPEC §2.

Scans every module under ``packages/*/src`` (so a new package is covered the day it is
added) for imports of ``hyper_parallel_dcp.<sub>`` — ``import``, ``from ... import`` and
``importlib.import_module("...")`` with a literal name, at any depth (inside functions
too) — and fails on an import of a sibling the table below does not allow, or of the
umbrella (``hyper_parallel_dcp`` itself, ``api``, ``cli``, ``demo``, ``benchmarks``).
Every allowed sibling import must also be a declared dependency of the importing
package, so an install of that package alone has it; and a package's own tests import
only what its ``nox -s "tests(package=...)"`` session installs (never the umbrella).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"

# SPEC §2 "may depend on" (siblings only), by package folder.
MAY_DEPEND_ON: dict[str, set[str]] = {
    "dcp-core": set(),
    "dcp-storage-fs": {"dcp-core"},
    "dcp-storage-object": {"dcp-core", "dcp-storage-fs"},
    "dcp-async": {"dcp-core", "dcp-storage-fs"},
    "dcp-broadcast": {"dcp-core"},
    "dcp-hf-convert": {"dcp-core", "dcp-storage-fs"},
}


def _subpackages() -> dict[str, str]:
    """``{import name of the subpackage: package folder}`` of every package in the tree."""
    owners = {}
    for folder in sorted(PACKAGES.iterdir()):
        ns = folder / "src" / "hyper_parallel_dcp"
        if ns.is_dir():
            for sub in ns.iterdir():
                if sub.is_dir() and (sub / "__init__.py").exists():
                    owners[sub.name] = folder.name
    return owners


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ".".join(path.relative_to(_src_of(path)).parts[:-1])  # of a module and of an __init__
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            if module == "hyper_parallel_dcp":  # from hyper_parallel_dcp import core / save
                found += [(node.lineno, f"hyper_parallel_dcp.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def _src_of(path: Path) -> Path:
    for parent in path.parents:
        if parent.name == "src":
            return parent
    raise AssertionError(f"{path} is not under a src folder")


def _declared_siblings(folder: Path) -> set[str]:
    text = (folder / "pyproject.toml").read_text(encoding="utf-8")
    deps = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.S | re.M)
    names = re.findall(r'"hyper-parallel-dcp-([a-z-]+)', deps.group(1) if deps else "")
    return {f"dcp-{n}" for n in names}


def _violations(folder: Path, owners: dict[str, str]) -> list[str]:
    allowed = MAY_DEPEND_ON.get(folder.name)
    if allowed is None:
        return [f"{folder.name} is not in SPEC §2's table: add it there and to MAY_DEPEND_ON in {__file__}"]
    declared = _declared_siblings(folder)
    problems = []
    for path in sorted((folder / "src").rglob("*.py")):
        where = path.relative_to(folder.parent)
        for line, module in _imported_modules(path):
            parts = module.split(".")
            if parts[0] != "hyper_parallel_dcp":
                continue
            if len(parts) == 1:
                problems.append(f"{where}:{line}: imports the umbrella package hyper_parallel_dcp")
                continue
            owner = owners.get(parts[1])
            if owner is None:
                problems.append(f"{where}:{line}: imports {module}, which is the umbrella's, not a package's")
            elif owner == folder.name:
                continue
            elif owner not in allowed:
                problems.append(f"{where}:{line}: imports {module} ({owner}); {folder.name} may depend on "
                                f"{sorted(allowed) or 'no sibling'} only (SPEC §2)")
            elif owner not in declared:
                problems.append(f"{where}:{line}: imports {module} but {owner} is not in the dependencies of "
                                f"{folder.name}/pyproject.toml")
    return problems


@pytest.mark.parametrize("folder", sorted(p.name for p in PACKAGES.iterdir() if (p / "src").is_dir()))
def test_package_imports_only_what_spec_allows(folder: str) -> None:
    problems = _violations(PACKAGES / folder, _subpackages())
    assert not problems, "\n".join(problems)


def test_the_scan_sees_imports_against_the_rules(tmp_path: Path) -> None:
    """The check itself can fail: a fake core that imports a sibling and the umbrella."""
    fake = tmp_path / "dcp-core"
    (fake / "src" / "hyper_parallel_dcp" / "core").mkdir(parents=True)
    (fake / "pyproject.toml").write_text('dependencies = [\n  "torch>=2.6",\n]\n')
    (fake / "src" / "hyper_parallel_dcp" / "core" / "__init__.py").write_text("")
    (fake / "src" / "hyper_parallel_dcp" / "core" / "bad.py").write_text(
        "from . import chunks\n"
        "def f():\n"
        "    from hyper_parallel_dcp.storage_fs import FileSystemReader\n"
        "    import hyper_parallel_dcp\n"
        "    from hyper_parallel_dcp import api\n"
        "    importlib.import_module('hyper_parallel_dcp.broadcast.executor')\n"
    )
    owners = {"core": "dcp-core", "storage_fs": "dcp-storage-fs", "broadcast": "dcp-broadcast"}
    problems = _violations(fake, owners)
    assert len(problems) == 5, problems  # storage_fs; the umbrella: import, from-import, api; broadcast
    assert any("storage_fs" in p for p in problems) and any("broadcast" in p for p in problems)
    assert sum("umbrella" in p for p in problems) == 3


def _nox_test_siblings() -> dict[str, set[str]]:
    """``{package folder: sibling folders its nox test session installs}`` from noxfile.py."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    table = next(ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "PACKAGES")
    folders = {name: Path(folder).name for name, (folder, _, _) in table.items()}
    return {folders[name]: {folders[d] for d in (*deps, *test_deps)} for name, (_, deps, test_deps) in table.items()}


@pytest.mark.parametrize("folder", sorted(p.name for p in PACKAGES.iterdir() if (p / "tests").is_dir()))
def test_package_tests_import_only_what_their_nox_session_installs(folder: str) -> None:
    """``nox -s "tests(package=...)"`` installs the package and its listed siblings only."""
    installed = _nox_test_siblings().get(folder)
    assert installed is not None, f"{folder} has no entry in noxfile.py's PACKAGES"
    owners = _subpackages()
    problems = []
    for path in sorted((PACKAGES / folder / "tests").glob("*.py")):
        for line, module in _imported_modules_of_test(path):
            parts = module.split(".")
            if parts[0] != "hyper_parallel_dcp":
                continue
            owner = owners.get(parts[1]) if len(parts) > 1 else None
            if owner is None:
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {module} (the umbrella is not installed)")
            elif owner != folder and owner not in installed:
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {module}; the session installs "
                                f"{sorted(installed)} only")
    assert not problems, "\n".join(problems)


def _imported_modules_of_test(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.append((node.lineno, node.module or ""))
            if node.module == "hyper_parallel_dcp":
                found += [(node.lineno, f"hyper_parallel_dcp.{alias.name}") for alias in node.names]
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(_src_of(path)).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at any depth, but not under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return found


def _import_graph(src: Path, top: str) -> dict[str, set[str]]:
    """``{module: modules of the same package it imports}`` for the modules under ``src/<top>``
    (``from . import x`` depends on the module ``x``; ``from . import name`` on the package)."""
    paths = {_module_name(p): p for p in (src / top.replace(".", "/")).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _runtime_imports(path):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in paths else module for a in node.names]
            deps |= {t for t in targets if t in paths and t != name}
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                found.append(stack[stack.index(dep):] + [dep])
            elif not state.get(dep):
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node, [])
    return found


def _packages_with_modules() -> list[tuple[Path, str]]:
    """``(src folder, top package)`` of every package, and of the umbrella (its own modules)."""
    tops = [(folder / "src", f"hyper_parallel_dcp.{sub}") for folder, sub in
            ((PACKAGES / owner, name) for name, owner in _subpackages().items())]
    return [*sorted(tops), (ROOT / "src", "hyper_parallel_dcp")]


@pytest.mark.parametrize("src,top", _packages_with_modules(), ids=[t for _, t in _packages_with_modules()])
def test_no_import_cycle_between_the_modules_of_a_package(src: Path, top: str) -> None:
    """Inside each package the modules import top-down: no cycle, also not through an import
    inside a function (the way a cycle is usually hidden)."""
    cycles = _cycles(_import_graph(src, top))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle_through_a_function_and_the_package(tmp_path: Path) -> None:
    pkg = tmp_path / "src" / "hyper_parallel_dcp" / "fake"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"
                              "def f():\n    from .b import g\n    return g\n")
    (pkg / "b.py").write_text("from . import a\n")
    (pkg / "c.py").write_text("from .a import f\n")  # a imports c only for type checking: no cycle
    cycles = _cycles(_import_graph(tmp_path / "src", "hyper_parallel_dcp.fake"))
    assert sorted(map(tuple, cycles)) == [("hyper_parallel_dcp.fake.a", "hyper_parallel_dcp.fake.b",
                                          "hyper_parallel_dcp.fake.a")], cycles
