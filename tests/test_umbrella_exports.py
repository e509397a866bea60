"""The umbrella's lazy export table and ``--version``: every promised name really resolves."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib import metadata

import pytest

import hyper_parallel_dcp as dcp
from hyper_parallel_dcp.core.testing import run_console_script


def _exports() -> dict[str, str]:
    return dict(dcp._EXPORTS)  # the table itself: each entry is a promise checked below


@pytest.mark.parametrize("name", sorted(_exports()))
def test_every_exported_name_resolves_to_its_module_attribute(name: str) -> None:
    module = importlib.import_module(_exports()[name])
    assert hasattr(module, name), f"{_exports()[name]} has no {name!r}"
    assert getattr(dcp, name) is getattr(module, name)
    assert name in dir(dcp) and name in dcp.__all__


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        dcp.not_a_name  # noqa: B018


def test_importing_the_umbrella_imports_nothing_heavy() -> None:
    code = ("import sys, hyper_parallel_dcp as d; heavy = [m for m in ('torch', 'safetensors') if m in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_hp_dcp_version_is_the_installed_distributions() -> None:
    version = metadata.version("hyper-parallel-dcp")
    assert dcp.__version__ == version
    out = run_console_script("hp-dcp", "hyper_parallel_dcp.cli", "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"hp-dcp {version}"
