"""Fixtures shared by this package's tests (plain helpers live in ``hf_convert_helpers``,
which spawned worker processes import by name)."""

from __future__ import annotations

import pytest
from hf_convert_helpers import tiny_llama


@pytest.fixture(scope="session")
def model():
    """The tiny local Llama (seed 0, eval mode); tests must not modify it."""
    return tiny_llama()
