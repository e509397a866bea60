"""``save`` when one rank's ``Stateful.state_dict()`` raises, on real gloo ranks.

The leaves are asked for their state inside the save's first collective step, so the error
is raised on every rank by that call, naming the failing rank, and a trainer that catches it
and goes on can save again: the next save and a load work, with the values of that save.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed


class _Counter:
    """A ``Stateful`` whose ``state_dict()`` fails on rank 1 when its value is 2."""

    def __init__(self, rank: int, value: int):
        self.rank, self.value = rank, value

    def state_dict(self) -> dict:
        if self.rank == 1 and self.value == 2:
            raise RuntimeError(f"counter of rank 1 cannot be read at value {self.value}")
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, sd: dict) -> None:
        self.value = int(sd["value"])


def _worker(rank: int, world_size: int, root: str) -> dict:
    import hyper_parallel_dcp as hp

    errors: dict[int, str] = {}
    for step in (1, 2, 3):
        state = {"w": torch.full((4, 3), float(step)), "counter": _Counter(rank, step)}
        try:
            hp.save(state, checkpoint_id=f"{root}/step_{step}")
        except Exception as exc:  # noqa: BLE001 - the trainer goes on
            errors[step] = f"{type(exc).__name__}: {exc}"
    target = {"w": torch.zeros(4, 3), "counter": _Counter(rank, 0)}
    hp.load(target, checkpoint_id=f"{root}/step_3")
    return {"errors": errors, "w": target["w"].tolist(), "counter": target["counter"].value}


@pytest.mark.distributed
def test_a_stateful_failing_on_one_rank_is_raised_on_every_rank_and_the_next_save_works(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a rank left waiting in a collective fails after this instead of 30 minutes
    monkeypatch.setenv("HP_DCP_COLLECTIVE_TIMEOUT", "60")
    out = run_distributed(_worker, 2, str(tmp_path), timeout=240)
    for rank, result in enumerate(out):
        assert list(result["errors"]) == [2], (rank, result["errors"])
        assert "cannot be read at value 2" in result["errors"][2], result["errors"][2]
        assert "rank 1" in result["errors"][2] or "rank=1" in result["errors"][2] or "1" in result["errors"][2]
        assert result["w"] == torch.full((4, 3), 3.0).tolist() and result["counter"] == 3
    assert not (tmp_path / "step_2" / ".metadata").exists()
    assert (tmp_path / "step_3" / ".metadata").is_file()
