"""Sessions for every package of hyper-parallel-dcp.

``nox -s tests``        each package alone, in its own venv (package + siblings + torch)
``nox -s integration``  everything installed together + the top-level tests
``nox -s docs``         the documentation, built strictly (warnings fail)
``nox -s lint``         ruff over the repository, mypy per package
``nox -s demo``         the end-to-end CPU demo (``python -m hyper_parallel_dcp``)
``nox -s bench``        benchmarks against torch.distributed.checkpoint

torch is pinned for development and CI (the packages only declare a lower bound): an
unpinned torch would make pip pull a multi-GB CUDA build.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "integration", "docs", "lint", "demo"]

TORCH = "torch==2.13.0"
PYTHON = "3.11"
# torch and what it pulls in, unpacked once per checkout into this folder, which every
# session's venv reads through a .pth file: pip unpacks the 900 MB wheel in ~40 s, and
# CI's nine sessions did it nine times (about 6 of its 34 minutes).  Each venv still holds
# only its own packages; pip sees the shared torch as installed and leaves it alone.
# The build backend lies there too: every session then installs the local packages with
# --no-build-isolation, where pip would otherwise create a fresh build environment and
# install hatchling into it once per package (7 times in integration, lint and demo each:
# 20-26 s against 7-10 s of CPU for the seven editable installs on this 2-core machine).
BUILD_BACKEND = ["hatchling>=1.21", "editables>=0.5"]  # editables: hatchling's editable wheels
SHARED_TORCH = Path(".nox", "_shared", TORCH.replace("==", "-") + "+hatchling")
LOCAL = "--no-build-isolation"

# package → (folder, local siblings it depends on, local siblings its tests also need)
PACKAGES: dict[str, tuple[str, list[str], list[str]]] = {
    "core": ("packages/dcp-core", [], []),
    "storage-fs": ("packages/dcp-storage-fs", ["core"], []),
    "async": ("packages/dcp-async", ["core", "storage-fs"], []),
    "broadcast": ("packages/dcp-broadcast", ["core"], ["storage-fs"]),  # tests read real files
    "hf-convert": ("packages/dcp-hf-convert", ["core", "storage-fs"], []),
    # its tests start a real S3 server (moto[server], the package's `test` extra)
    "storage-object": ("packages/dcp-storage-object", ["core", "storage-fs"], []),
}
TEST_TOOLS = ["pytest>=8", "pytest-timeout", "hypothesis>=6.100"]
PYTEST = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=900", "-ra", "--durations=12"]
DOCS_DEPS = ["mkdocs>=1.6,<2", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"]
# the top-level tests also check the docs build, the .metadata JSON schema and YAML target specs
# the framework integrations' pinned versions (the umbrella's [lightning] / [accelerate] /
# [torchtitan] extras); torchtitan's checkpoint component imports only tyro and spmd_types
# of its dependencies, so it comes without the rest (datasets, wandb, tensorboard, ...)
INTEGRATION_FRAMEWORKS = ["pytorch-lightning==2.6.6", "accelerate==1.16.0", "tyro==1.0.17", "spmd_types==0.2.3"]
TORCHTITAN = "torchtitan==0.3.0"
# compressed checkpoints: storage-fs's [zstd] extra, pinned as tested; zipnn for the compression
# benchmark section's own test
INTEGRATION_DEPS = ["jsonschema>=4", "pyyaml>=6", "matplotlib", "zstandard==0.25.0", "cffi>=1.16", "zipnn==0.5.4", *DOCS_DEPS,
                    *INTEGRATION_FRAMEWORKS]


def _install_torch(session: nox.Session) -> None:
    """Make the shared torch and build backend (``SHARED_TORCH``) importable in the session's
    venv, unpacking them first if no earlier session has."""
    folder = SHARED_TORCH.resolve()
    complete = folder / ".complete"
    if not complete.exists():
        shutil.rmtree(folder, ignore_errors=True)
        session.run("python", "-m", "pip", "install", "--quiet", "--target", str(folder), TORCH, *BUILD_BACKEND)
        complete.touch()
    purelib = session.run("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                          silent=True)
    assert isinstance(purelib, str)
    Path(purelib.strip(), "_hp_dcp_shared_torch.pth").write_text(f"{folder}\n", encoding="utf-8")


def _siblings(name: str) -> list[str]:
    _, deps, test_deps = PACKAGES[name]
    return [PACKAGES[d][0] for d in [*deps, *test_deps]]


def _has_test_extra(folder: str) -> bool:
    with open(f"{folder}/pyproject.toml", encoding="utf-8") as f:
        return "\ntest = [" in f.read()


@nox.session(python=PYTHON)
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One package alone: only it, its local siblings and torch are installed."""
    folder = PACKAGES[package][0]
    _install_torch(session)
    target = f"./{folder}[test]" if _has_test_extra(folder) else f"./{folder}"
    session.install(LOCAL, *[f"./{s}" for s in _siblings(package)], target, *TEST_TOOLS, TORCH)
    session.run(*PYTEST, f"{folder}/tests", *session.posargs)


def _install_everything(session: nox.Session, *extra: str, tests: bool = True) -> None:
    """Every package, editable; with ``tests`` also their test extras (transformers,
    moto[server]: 25 s more of pip) and the test tools."""
    _install_torch(session)
    targets = []
    for folder, _, _ in PACKAGES.values():
        targets.append(f"-e./{folder}[test]" if tests and _has_test_extra(folder) else f"-e./{folder}")
    session.install(LOCAL, *targets, "-e.", *(TEST_TOOLS if tests else []), *extra, TORCH)


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    """All packages together: the top-level cross-package, multi-process, end-to-end tests."""
    _install_everything(session, *INTEGRATION_DEPS)
    session.install("--no-deps", TORCHTITAN)
    session.run(*PYTEST, "tests", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation strictly: a warning fails the build (no torch needed)."""
    session.install(*DOCS_DEPS)
    session.run("mkdocs", "build", "--strict", "--site-dir", f"{session.create_tmp()}/site",
                env={"NO_MKDOCS_2_WARNING": "1"})


# mypy targets, one run per distribution: the installed (editable) modules, not file paths,
# since path mode cannot tell which of the six source trees owns the shared namespace
MYPY_TARGETS: dict[str, list[str]] = {
    "core": ["-p", "hyper_parallel_dcp.core"],
    "storage-fs": ["-p", "hyper_parallel_dcp.storage_fs"],
    "async": ["-p", "hyper_parallel_dcp.async_persist"],
    "broadcast": ["-p", "hyper_parallel_dcp.broadcast"],
    "hf-convert": ["-p", "hyper_parallel_dcp.offline_transform"],
    "storage-object": ["-p", "hyper_parallel_dcp.storage_object"],
    "umbrella": ["-m", "hyper_parallel_dcp", "-m", "hyper_parallel_dcp.api", "-m", "hyper_parallel_dcp.demo",
                 "-m", "hyper_parallel_dcp.manager", "-m", "hyper_parallel_dcp.retention",
                 "-m", "hyper_parallel_dcp.step_storage", "-p", "hyper_parallel_dcp.cli", "-p", "hyper_parallel_dcp.benchmarks",
                 "-m", "hyper_parallel_dcp.torch_compat", "-p", "hyper_parallel_dcp.integrations"],
}


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over the repository, mypy over each installed package."""
    _install_everything(session, "ruff", "mypy", tests=False)
    session.run("ruff", "check", ".")
    config = str(Path("pyproject.toml").resolve())
    # run outside the checkout: from its root, ./src would shadow the installed namespace
    with session.chdir(session.create_tmp()):
        for args in MYPY_TARGETS.values():
            session.run("mypy", "--config-file", config, *args)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The end-to-end CPU demo: training loops on CheckpointManager (sync, async), resharded restore, HF export."""
    _install_everything(session, tests=False)
    session.run("python", "-m", "hyper_parallel_dcp", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks side by side with torch.distributed.checkpoint (results in docs/benchmarks/)."""
    # zstandard, zipnn: the compression section's codecs (bench-only, pinned)
    _install_everything(session, "matplotlib", "zstandard==0.25.0", "cffi>=1.16", "zipnn==0.5.4")
    session.run("python", "-m", "hyper_parallel_dcp.benchmarks", *session.posargs)


@nox.session(python=PYTHON, venv_params=["--system-site-packages"])
def accelerator(session: nox.Session) -> None:
    """save / async_save / load of accelerator DTensor state, with GB/s next to plain copies.

    Uses the machine's own torch build (CUDA, or NPU through torch_npu): the venv sees the
    system site-packages and the project is installed without dependencies, so nothing
    replaces that torch. Results: ``docs/benchmarks/accelerator.md``.  Then a training loop
    on the devices, killed and resumed under torchrun (``tools/train_resume_check.py``).
    """
    targets = [f"./{folder}" for folder, _, _ in PACKAGES.values()]
    session.install("--no-deps", *targets, ".")
    session.run("python", "tools/accelerator_check.py", "--out", "docs/benchmarks/accelerator.md", *session.posargs)
    session.run("python", "tools/train_resume_check.py")
