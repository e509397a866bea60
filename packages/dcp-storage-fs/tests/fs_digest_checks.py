"""The state dict, load target and header-parse counter shared by the digest tests
(``test_fs_header_digest``, ``test_fs_metadata_digest``): ``import fs_digest_checks``."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel_dcp.storage_fs import reader


def state() -> dict:
    return {
        "a": torch.arange(32, dtype=torch.float32),
        "b": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "c": (torch.arange(24, dtype=torch.float64) / 3).reshape(2, 3, 4),
        "step": 5,
    }


def blank() -> dict:
    return {"a": torch.zeros(32), "b": torch.zeros(3, 4, dtype=torch.bfloat16),
            "c": torch.zeros(2, 3, 4, dtype=torch.float64), "step": 0}


def assert_loaded(target: dict) -> None:
    ref = state()
    for key in ("a", "b", "c"):
        assert torch.equal(target[key], ref[key]), key
    assert target["step"] == ref["step"]


def count_parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the file size of every header the reader parses (the full check)."""
    parsed: list[int] = []
    real = reader.parse_header

    def counting(header: bytes, file_size: int):
        parsed.append(file_size)
        return real(header, file_size)

    monkeypatch.setattr(reader, "parse_header", counting)
    return parsed
