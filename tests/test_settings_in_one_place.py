"""One place per setting: only ``core/settings.py`` reads the library's environment
variables, every setting is documented, and a setting really changes what the code does."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core import settings

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_PY = ROOT / "packages/dcp-core/src/hyper_parallel_dcp/core/settings.py"


def test_only_the_settings_module_reads_our_variables() -> None:
    offenders = []
    for path in sorted([*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("src/**/*.py")]):
        if path == SETTINGS_PY:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"(environ|getenv)\b.*[\"'](HP_DCP_|HP_LOG_CONFIG)", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_every_setting_is_in_the_tuning_guide_and_the_readme() -> None:
    tuning = (ROOT / "docs/tuning.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for s in settings.SETTINGS:
        assert f"`{s.name}" in tuning, s.name
        assert s.name in readme, s.name


def test_a_setting_is_read_when_the_reader_is_made_and_a_bad_one_fails_the_load(tmp_path, monkeypatch) -> None:
    from hyper_parallel_dcp import FileSystemReader, load, save

    save({"w": torch.arange(4.0)}, checkpoint_id=tmp_path / "ck", no_dist=True)
    monkeypatch.setenv("HP_DCP_FILES_KEPT", "1")
    assert FileSystemReader(tmp_path / "ck").files_kept == 1
    monkeypatch.setenv("HP_DCP_FILES_KEPT", "many")
    target = {"w": torch.zeros(4)}
    with pytest.raises(ValueError, match="HP_DCP_FILES_KEPT='many'"):
        load(target, checkpoint_id=tmp_path / "ck", no_dist=True)
    monkeypatch.delenv("HP_DCP_FILES_KEPT")
    load(target, checkpoint_id=tmp_path / "ck", no_dist=True)
    assert torch.equal(target["w"], torch.arange(4.0))


def test_missing_master_addr_is_an_assertion_error_even_under_python_O(tmp_path) -> None:
    code = textwrap.dedent(f"""
        import os, torch
        os.environ.pop("MASTER_ADDR", None); os.environ.pop("MASTER_PORT", None)
        import hyper_parallel_dcp as dcp
        try:
            dcp.async_save({{"w": torch.ones(2)}}, checkpoint_id={str(tmp_path / "ck")!r}, use_gloo=True)
        except AssertionError as exc:
            print("AssertionError", "MASTER_ADDR" in str(exc))
    """)
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "AssertionError True", out.stdout + out.stderr
    assert not (tmp_path / "ck").exists()


def test_a_bad_async_setting_fails_the_call_before_anything_is_written(tmp_path, monkeypatch) -> None:
    import hyper_parallel_dcp as dcp

    monkeypatch.setenv("HP_DCP_ASYNC_TIMEOUT", "half an hour")
    with pytest.raises(ValueError, match="HP_DCP_ASYNC_TIMEOUT='half an hour' is not a number of seconds"):
        dcp.async_save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "ck", no_dist=True)
    assert not (tmp_path / "ck").exists()
