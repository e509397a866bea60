"""Every distribution builds a wheel that ships only its own subpackage.

Only the umbrella may ship ``hyper_parallel_dcp/__init__.py``; otherwise partial installs
(e.g. the HF converter alone) would shadow each other.  Dependencies between the
distributions follow the table of SPEC §2.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# distribution → (source folder, its subpackage or None for the umbrella, allowed project deps)
DISTRIBUTIONS = {
    "hyper_parallel_dcp_core": ("packages/dcp-core", "core", set()),
    "hyper_parallel_dcp_storage_fs": ("packages/dcp-storage-fs", "storage_fs", {"hyper-parallel-dcp-core"}),
    "hyper_parallel_dcp_async": ("packages/dcp-async", "async_persist",
                                 {"hyper-parallel-dcp-core", "hyper-parallel-dcp-storage-fs"}),
    "hyper_parallel_dcp_broadcast": ("packages/dcp-broadcast", "broadcast", {"hyper-parallel-dcp-core"}),
    "hyper_parallel_dcp_hf_convert": ("packages/dcp-hf-convert", "offline_transform",
                                      {"hyper-parallel-dcp-core", "hyper-parallel-dcp-storage-fs"}),
    "hyper_parallel_dcp_storage_object": ("packages/dcp-storage-object", "storage_object",
                                          {"hyper-parallel-dcp-core", "hyper-parallel-dcp-storage-fs"}),
    "hyper_parallel_dcp": (".", None, {
        "hyper-parallel-dcp-core", "hyper-parallel-dcp-storage-fs", "hyper-parallel-dcp-async",
        "hyper-parallel-dcp-broadcast", "hyper-parallel-dcp-hf-convert",
    }),
}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation"]
    folders = [str(ROOT / folder) for folder, _, _ in DISTRIBUTIONS.values()]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation, "-w", str(out), *folders],
        check=True,
    )
    built = {p.name.split("-")[0]: p for p in out.glob("*.whl")}
    assert set(built) == set(DISTRIBUTIONS), f"built {sorted(built)}"
    return built


def _requirements(whl: zipfile.ZipFile) -> set[str]:
    meta_name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(whl.read(meta_name).decode())
    names = set()
    for req in meta.get_all("Requires-Dist") or []:
        if "extra ==" in req:
            continue
        name = req.split(";")[0].strip()
        for sep in "<>=!~[ (":
            name = name.split(sep)[0]
        names.add(name.strip().lower())
    return names


@pytest.mark.parametrize("dist_name", sorted(DISTRIBUTIONS))
def test_wheel_ships_only_its_subpackage(wheels: dict[str, Path], dist_name: str) -> None:
    folder, subpackage, allowed = DISTRIBUTIONS[dist_name]
    with zipfile.ZipFile(wheels[dist_name]) as whl:
        files = [n for n in whl.namelist() if n.startswith("hyper_parallel_dcp/")]
        assert files, f"{dist_name} ships no code"
        has_top_init = "hyper_parallel_dcp/__init__.py" in files
        if subpackage is None:
            assert has_top_init
            assert not any(n.startswith(("hyper_parallel_dcp/core/", "hyper_parallel_dcp/storage_fs/")) for n in files)
        else:
            assert not has_top_init, f"{dist_name} must not ship hyper_parallel_dcp/__init__.py"
            outside = [n for n in files if not n.startswith(f"hyper_parallel_dcp/{subpackage}/")]
            assert outside == [], f"{dist_name} ships files outside its subpackage: {outside}"
            assert f"hyper_parallel_dcp/{subpackage}/__init__.py" in files
            assert f"hyper_parallel_dcp/{subpackage}/py.typed" in files
        project_deps = {r for r in _requirements(whl) if r.startswith("hyper-parallel-dcp")}
        assert project_deps == allowed, f"{dist_name} depends on {sorted(project_deps)}"
        assert "torch" in _requirements(whl)


@pytest.mark.parametrize("dist_name,scheme", [("hyper_parallel_dcp_storage_fs", "file"),
                                              ("hyper_parallel_dcp_storage_object", "s3")])
def test_storage_wheels_register_their_url_scheme(wheels: dict[str, Path], dist_name: str, scheme: str) -> None:
    with zipfile.ZipFile(wheels[dist_name]) as whl:
        name = next(n for n in whl.namelist() if n.endswith(".dist-info/entry_points.txt"))
        text = whl.read(name).decode()
    section = text.split("[hyper_parallel_dcp.storage]", 1)[1].split("[", 1)[0]
    assert any(line.split("=")[0].strip() == scheme for line in section.splitlines() if "=" in line), text
