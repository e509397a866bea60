"""The documentation builds in strict mode, and its examples are valid input.

``mkdocs build --strict`` (warnings fail: broken links, missing pages, docstrings that
cannot be collected) is the same command CI runs.  The target-spec examples printed in the
docs are parsed with the parser ``hp-dcp explain`` uses, so they cannot drift from it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="docs dependencies (mkdocs, mkdocs-material, mkdocstrings[python]) not installed")
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for page in ("quickstart", "user-guide", "user-guide.zh", "cli", "format", "architecture", "migration",
                 "tuning", "benchmarks", "api/api"):
        assert (site / page / "index.html").is_file(), page
    api = (site / "api" / "api" / "index.html").read_text()
    assert "broadcast_replicated_tensors" in api  # signatures and docstrings were collected
    assert 'class="mermaid"' in (site / "architecture" / "index.html").read_text()


def _json_blocks(page: str) -> list[dict]:
    text = (ROOT / "docs" / page).read_text()
    return [json.loads(b) for b in re.findall(r"```json\n(.*?)\n```", text, re.S)]


def test_target_spec_examples_parse() -> None:
    from hyper_parallel_dcp.cli.target_spec import parse_target_spec

    specs = [b for page in ("cli.md", "quickstart.md") for b in _json_blocks(page) if "mesh" in b]
    assert len(specs) >= 2
    for doc in specs:
        spec = parse_target_spec(doc)
        assert spec.coordinate(spec.world_size - 1) == tuple(n - 1 for n in spec.mesh_shape)
        assert len(spec.default) == len(spec.mesh_shape)
    # the one in cli.md: dp=2 x tp=4, a rule by mesh-dim name becomes (Replicate, Shard(1))
    big = parse_target_spec(next(s for s in specs if s.get("mesh") == {"dp": 2, "tp": 4}))
    assert big.world_size == 8 and big.coordinate(5) == (1, 1)
    placements, rule = big.placements_for("model.layers.0.self_attn.o_proj.weight", 2)
    assert rule == "*.o_proj.weight" and [str(p) for p in placements] == ["R", "S(1)"]
    assert not big.wants("optim.state.x")
