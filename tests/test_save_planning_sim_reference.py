"""The columnar save planning equals the item-by-item reference on the simulated layouts.

The simulated dense and MoE layouts live in the umbrella's benchmarks, so this check runs
here, where both packages are installed.
"""

from __future__ import annotations

import pytest

from hyper_parallel_dcp.benchmarks.planning_sim import LAYOUTS, _our_save_plans
from hyper_parallel_dcp.core.metadata import metadata_to_json
from hyper_parallel_dcp.core.save_planning import build_metadata, dedup_save_plans
from hyper_parallel_dcp.core.save_reference import build_metadata_items, dedup_items


@pytest.mark.parametrize("to_minimum", [False, True])
def test_simulated_layouts_equal_the_reference(to_minimum):
    for name in ("dense", "moe"):
        layout = LAYOUTS[name]
        plans = _our_save_plans(layout.specs()[:30], layout.save_mesh(128), 128)
        fast = dedup_save_plans(plans, to_minimum)
        assert fast == dedup_items(plans, to_minimum)
        assert metadata_to_json(build_metadata(fast)) == metadata_to_json(build_metadata_items(fast))
