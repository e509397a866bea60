"""CI runs exactly the README's test command, and that command runs every check session."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _nox_commands(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if re.search(r"\bnox -s tests\b", line)]


def test_ci_runs_the_readme_test_command() -> None:
    readme = _nox_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    ci = _nox_commands((ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert len(ci) == 1 and ci[0] in readme, (ci, readme)
    sessions = ci[0].split("nox -s", 1)[1].split()
    # every package alone, everything together, the docs, ruff + mypy, the README's demo
    assert sessions == ["tests", "integration", "docs", "lint", "demo"], sessions
