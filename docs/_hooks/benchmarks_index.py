"""mkdocs hook: give ``benchmarks/index.md`` a page even before the benchmarks have run.

``docs/benchmarks/`` is written by the benchmark tool (``nox -s bench``).  When it holds
no ``index.md``, this hook generates one that links to whatever result pages and plots
are there (or says how to produce them), so the navigation and the links from the tuning
page never dangle and ``mkdocs build --strict`` passes either way.
"""

from __future__ import annotations

from mkdocs.structure.files import File

INDEX = "benchmarks/index.md"


def on_files(files, config):
    if files.get_file_from_path(INDEX) is not None:
        return files
    readme = files.get_file_from_path("benchmarks/README.md")
    if readme is not None:
        # the benchmark tool's own report becomes the section's page (same folder, so its
        # relative links to the plots stay valid)
        content = readme.content_string
        files.remove(readme)
        files.append(File.generated(config, INDEX, content=content))
        return files
    pages = sorted(f.src_uri for f in files if f.src_uri.startswith("benchmarks/") and f.src_uri.endswith(".md"))
    plots = sorted(f.src_uri for f in files if f.src_uri.startswith("benchmarks/") and f.src_uri.endswith(".png"))
    lines = ["# Benchmarks", ""]
    if pages or plots:
        lines.append("Results written by the benchmark tool (`nox -s bench`):")
        lines.append("")
        lines += [f"- [{p.removeprefix('benchmarks/')}]({p.removeprefix('benchmarks/')})" for p in pages]
        lines += ["", *[f"![{p}]({p.removeprefix('benchmarks/')})" for p in plots]]
    else:
        lines += [
            "No benchmark results in this build yet.  Run `nox -s bench` (or the benchmark script of the",
            "repository) to measure save, load, async save and read-once + broadcast against",
            "`torch.distributed.checkpoint` and the raw disk; the results land in `docs/benchmarks/`.",
        ]
    files.append(File.generated(config, INDEX, content="\n".join(lines) + "\n"))
    return files
