"""``gc_paused(promote=True)``: the block's survivors go to the oldest generation without a
young collection over them; an application's own frozen objects stay frozen."""

from __future__ import annotations

import gc

from hyper_parallel_dcp.core.gc_pause import gc_paused


def _young_collections_during(fn) -> list[int]:
    generations: list[int] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            generations.append(info["generation"])

    gc.callbacks.append(callback)
    try:
        fn()
    finally:
        gc.callbacks.remove(callback)
    return generations


def test_survivors_are_promoted_without_a_collection():
    gc.collect()
    kept = []

    def work(promote: bool) -> None:
        with gc_paused(promote=promote):
            kept.append([[i] for i in range(50_000)])
        kept.append([[i] for i in range(10)])  # the first allocations after the pause

    assert gc.isenabled()
    assert _young_collections_during(lambda: work(True)) == []
    assert gc.isenabled() and gc.get_count()[0] < 100
    assert _young_collections_during(lambda: work(False)) == [0]  # the plain pause collects them
    assert gc.isenabled()


def test_an_applications_frozen_objects_stay_frozen():
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused(promote=True):
            junk = [[i] for i in range(5_000)]
        assert gc.get_freeze_count() == frozen
        del junk
    finally:
        gc.unfreeze()


def test_a_disabled_collector_stays_disabled():
    gc.disable()
    try:
        with gc_paused(promote=True):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
