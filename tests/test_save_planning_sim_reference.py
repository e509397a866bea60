"""The column-based save planning equals the per-item reference on the simulated layouts.

The reference implementations live in dcp-core's own test module (the library keeps only
the fast path); the simulated dense and MoE layouts live in the umbrella's benchmarks, so
this check runs here, where both packages are installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hyper_parallel_dcp.benchmarks.planning_sim import LAYOUTS, _our_save_plans
from hyper_parallel_dcp.core import save_planning
from hyper_parallel_dcp.core.metadata import metadata_to_json
from hyper_parallel_dcp.core.save_planning import build_metadata, dedup_save_plans

_REFERENCE = Path(__file__).parents[1] / "packages/dcp-core/tests/test_save_planning_columns.py"


def _reference_module():
    spec = importlib.util.spec_from_file_location("save_planning_reference", _REFERENCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("few_chunks", [save_planning._FEW_CHUNKS, 0], ids=["python-few", "torch-columns"])
@pytest.mark.parametrize("to_minimum", [False, True])
def test_simulated_layouts_equal_the_reference(to_minimum, few_chunks, monkeypatch):
    ref = _reference_module()
    monkeypatch.setattr(save_planning, "_FEW_CHUNKS", few_chunks)
    for name in ("dense", "moe"):
        layout = LAYOUTS[name]
        plans = _our_save_plans(layout.specs()[:30], layout.save_mesh(128), 128)
        fast = dedup_save_plans(plans, to_minimum)
        assert fast == ref._ref_dedup(plans, to_minimum)
        assert metadata_to_json(build_metadata(fast)) == metadata_to_json(ref._ref_build_metadata(fast))
