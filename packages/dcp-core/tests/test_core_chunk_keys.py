"""Chunk keys sort exactly like ``(fqn, offsets)`` tuples (SPEC §4), prefix names included."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.core.metadata import chunk_key

FQN = st.text(alphabet="abcxyz019._", min_size=1, max_size=8)
OFFSETS = st.lists(st.integers(0, 10**6), min_size=2, max_size=2).map(tuple)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(FQN, OFFSETS), min_size=2, max_size=30, unique=True))
def test_string_order_of_keys_is_the_tuple_order(chunks):
    assert sorted(chunks, key=lambda c: chunk_key(*c)) == sorted(chunks)


def test_prefix_names_sort_first():
    names = ["opt.m.10", "opt.m.1", "opt.m.2", "opt.m.1.x", "opt.m"]
    keys = sorted(chunk_key(n, (0,)) for n in names)
    assert [k.rsplit(" ", 1)[0] for k in keys] == sorted(names)
