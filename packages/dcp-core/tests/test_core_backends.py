"""Storage backends by URL scheme: only the asked scheme's entry point is imported."""

from __future__ import annotations

import sys
import types
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Iterator

import pytest

from hyper_parallel_dcp.core import backends
from hyper_parallel_dcp.core.backends import StorageBackend, UnknownSchemeError, backend_for, register_backend

_MODULES = {
    "hpdcp_test_file_backend": "from hyper_parallel_dcp.core.backends import StorageBackend\n"
                               "BACKEND = StorageBackend('file', writer=print, reader=print)\n",
    "hpdcp_test_other_backend": "from hyper_parallel_dcp.core.backends import StorageBackend\n"
                                "BACKEND = StorageBackend('other', writer=print, reader=print)\n",
    "hpdcp_test_broken_backend": "raise RuntimeError('built against another client library')\n",
}


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Three installed backends (as entry points of the group), none imported yet; yields
    the groups listed so far."""
    for name, source in _MODULES.items():
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    points = [EntryPoint(scheme, f"{module}:BACKEND", backends.ENTRY_POINT_GROUP) for scheme, module in (
        ("file", "hpdcp_test_file_backend"), ("Other", "hpdcp_test_other_backend"),
        ("broken", "hpdcp_test_broken_backend"))]
    listed = []

    def entry_points(*, group: str) -> list[EntryPoint]:
        listed.append(group)
        return points if group == backends.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(backends, "importlib_metadata", types.SimpleNamespace(entry_points=entry_points))
    monkeypatch.setattr(backends, "_registry", {})
    monkeypatch.setattr(backends, "_entry_points", None)
    monkeypatch.setattr(backends, "_failures", {})
    monkeypatch.setattr(backends, "_BUNDLED", {})
    yield listed
    assert len(listed) <= 1  # listed once at most, however many lookups


def test_a_path_imports_only_the_file_backend(installed: list[str]) -> None:
    assert backend_for("/ckpt/step_1") is sys.modules["hpdcp_test_file_backend"].BACKEND
    assert backend_for("file:///ckpt/step_2") is sys.modules["hpdcp_test_file_backend"].BACKEND
    assert "hpdcp_test_other_backend" not in sys.modules
    assert "hpdcp_test_broken_backend" not in sys.modules
    # entry-point names are schemes, matched without regard to case
    assert backend_for("OTHER://bucket/x").scheme == "other"
    assert installed == [backends.ENTRY_POINT_GROUP]


def test_a_backend_that_fails_to_import_breaks_only_its_scheme(installed: list[str]) -> None:
    with pytest.raises(UnknownSchemeError, match=r"'broken://'.*failed to import.*hpdcp_test_broken_backend:BACKEND"
                                                 r".*RuntimeError: built against another client library"):
        backend_for("broken://bucket/run")
    assert backend_for("/ckpt").scheme == "file"


def test_a_registered_backend_wins_over_the_installed_one(installed: list[str]) -> None:
    mine = StorageBackend("file", writer=print, reader=print)
    register_backend(mine)
    assert backend_for("/ckpt") is mine
    assert "hpdcp_test_file_backend" not in sys.modules


def test_a_scheme_nobody_installed_names_what_to_install(installed: list[str]) -> None:
    with pytest.raises(UnknownSchemeError, match=r"'s3://' is installed; install hyper-parallel-dcp-storage-object"):
        backend_for("s3://bucket/run")


def test_the_bundled_file_backend_is_imported_without_listing_entry_points(
        installed: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert "hpdcp_test_other_backend" not in sys.modules
    monkeypatch.setattr(backends, "_BUNDLED", {"file": ("hpdcp_test_other_backend", "BACKEND"),
                                               "nope": ("hpdcp_test_not_installed", "BACKEND")})
    assert backend_for("/ckpt").scheme == "other"  # the bundled module's backend, not the entry point's
    assert installed == []  # no distribution's entry points were listed
    # a bundled module that is not installed: the entry points decide
    with pytest.raises(UnknownSchemeError, match="'nope://' is installed"):
        backend_for("nope://x")
    assert installed == [backends.ENTRY_POINT_GROUP]
