"""``dcp``-like names for this package's tests: ``import async_test_api as dcp``.

The package's test venv holds only this package and its siblings (core, storage-fs), not
the umbrella; ``save``/``load`` come from the shared test support of storage-fs.
"""

from __future__ import annotations

from hyper_parallel_dcp.async_persist import async_save
from hyper_parallel_dcp.core.standard_planner import StandardSavePlanner
from hyper_parallel_dcp.storage_fs.testing import load, save

__all__ = ["StandardSavePlanner", "async_save", "load", "save"]
