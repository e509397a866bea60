"""mkdocs hook: the built pages show what a reader should see, or the build fails.

Checked on every page after rendering (so ``mkdocs build --strict`` and the docs test
both fail):

- no raw Sphinx role (``:class:`X```, ``:func:`save```...) is left in the HTML: the
  docstrings' roles are turned into links by ``griffe_roles.py``;
- no Mermaid diagram is left as a code block: a ```` ```mermaid ```` fence must reach the
  page as a ``<pre class="mermaid">`` for mkdocs-material to draw it, and the page must
  load the vendored ``mermaid.min.js`` (``assets/javascripts/``, Mermaid 11.17.2, MIT), so
  the diagrams render without a network (mkdocs-material would otherwise fetch Mermaid
  from a CDN, and an offline reader would see the source).
"""

from __future__ import annotations

import re
from typing import Any

from mkdocs.exceptions import PluginError

RAW_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|data|exc|attr|mod|obj|const):(?:`|<code>)")
RAW_MERMAID = re.compile(r'class="[^"]*language-mermaid')
MERMAID_SCRIPT = "assets/javascripts/mermaid.min.js"


def problems(html: str) -> list[str]:
    """What a reader would see raw in ``html`` (empty when the page is clean)."""
    found = []
    for match in RAW_ROLE.finditer(html):
        found.append(f"raw Sphinx role {html[match.start():match.end() + 40]!r}")
    if RAW_MERMAID.search(html):
        found.append("a mermaid diagram left as a code block")
    if 'class="mermaid"' in html and MERMAID_SCRIPT not in html:
        found.append(f"a mermaid diagram on a page that does not load {MERMAID_SCRIPT}")
    return found


def on_post_page(output: str, page: Any, config: Any, **kwargs: Any) -> str:
    found = problems(output)
    if found:
        raise PluginError(f"{page.file.src_uri}: " + "; ".join(found[:5]))
    return output
