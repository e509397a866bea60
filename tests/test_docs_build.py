"""The documentation builds in strict mode, and its examples are valid input.

``mkdocs build --strict`` (warnings fail: broken links, missing pages, docstrings that
cannot be collected) is the same command CI runs.  The target-spec examples printed in the
docs are parsed with the parser ``hp-dcp explain`` uses, so they cannot drift from it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """One strict build for the module's tests (a build takes tens of seconds): the site
    folder and the finished ``mkdocs build`` process, whose exit the tests check."""
    pytest.importorskip("mkdocs", reason="docs dependencies (mkdocs, mkdocs-material, mkdocstrings[python]) not installed")
    site = tmp_path_factory.mktemp("docs") / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    return site, out


def test_mkdocs_build_strict(built: tuple[Path, subprocess.CompletedProcess]) -> None:
    site, out = built
    assert out.returncode == 0, out.stdout + out.stderr
    for page in ("quickstart", "user-guide", "user-guide.zh", "cli", "format", "architecture", "migration",
                 "tuning", "benchmarks", "api/api"):
        assert (site / page / "index.html").is_file(), page
    api = (site / "api" / "api" / "index.html").read_text()
    assert "broadcast_replicated_tensors" in api  # signatures and docstrings were collected
    assert 'class="mermaid"' in (site / "architecture" / "index.html").read_text()
    _assert_reads_as_rendered(site)


def _assert_reads_as_rendered(site: Path) -> None:
    """What a reader sees: roles became links, diagrams are drawn (the script is there)."""
    pages = {p.relative_to(site).as_posix(): p.read_text(encoding="utf-8") for p in site.rglob("*.html")}
    for name, html in pages.items():
        assert not re.search(r":(class|func|meth|data|exc|attr|mod):(`|<code>)", html), f"raw Sphinx role in {name}"
        assert "language-mermaid" not in html, f"mermaid left as a code block in {name}"
    api = pages["api/api/index.html"]
    # ":class:`RaggedShard`" in save()'s docstring is a link to the class's entry
    assert re.search(r'<a class="autorefs autorefs-internal"[^>]*href="\.\./layout/#hyper_parallel_dcp\.core\.'
                     r'ragged\.RaggedShard"><code>RaggedShard</code></a>', api), "RaggedShard is not a link"
    arch = pages["architecture/index.html"]
    assert arch.count('<pre class="mermaid">') >= 3
    assert 'src="../assets/javascripts/mermaid.min.js"' in arch
    assert (site / "assets" / "javascripts" / "mermaid.min.js").stat().st_size > 1_000_000


def test_the_rendered_page_check_can_fail() -> None:
    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    try:
        import rendered_check
    finally:
        sys.path.pop(0)
    assert rendered_check.problems('<p>Returns a <code>x</code> and <a href="y">z</a>.</p>') == []
    assert rendered_check.problems("<p>See :class:`RaggedShard`.</p>")
    assert rendered_check.problems("<p>See :func:<code>save</code>.</p>")
    assert rendered_check.problems('<pre><code class="language-mermaid">flowchart TB</code></pre>')
    assert rendered_check.problems('<pre class="mermaid"><code>flowchart TB</code></pre>')  # no script
    assert not rendered_check.problems('<pre class="mermaid"><code>flowchart TB</code></pre>'
                                       '<script src="assets/javascripts/mermaid.min.js"></script>')


def test_the_diagrams_are_drawn_in_a_browser(request: pytest.FixtureRequest) -> None:
    """With a headless browser at hand, every diagram of the architecture page becomes an SVG
    offline (no network: the vendored Mermaid draws them)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no chromium on this machine (apt-get install chromium); the HTML checks above still ran")
    site, out = request.getfixturevalue("built")  # the strict build, only when a browser can draw it
    out.check_returncode()
    page = site / "architecture" / "index.html"
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                          "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=180).stdout
    diagrams = page.read_text(encoding="utf-8").count('<pre class="mermaid">')
    # mkdocs-material swaps each <pre class="mermaid"> for a <div class="mermaid"> holding the
    # drawn SVG (in a shadow root) once Mermaid has rendered it; unrendered, the source stays.
    assert diagrams >= 3 and dom.count('<div class="mermaid">') == diagrams, dom[:2000]
    assert '<pre class="mermaid">' not in dom


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
