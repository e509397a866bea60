"""Chunk keys sort exactly like ``(fqn, offsets)`` tuples (SPEC §4), for any FQN.

FQNs may hold spaces and characters below ``"0"`` (``"a !"``, ``"x\\t"``): the strategy
reaches them on purpose, since a separator that only sorts low for "usual" names breaks
the file order for the others.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.core.metadata import chunk_key

# Low characters (controls, space, "!", '"', "#", ".", "/") next to ordinary ones, and
# now and then any code point at all.
FQN = st.one_of(
    st.text(alphabet="\x00\x01\t !\"#$./09_abcz~\x7f\u00e9\u4e2d", min_size=1, max_size=8),
    st.text(min_size=1, max_size=6),
)
OFFSETS = st.lists(st.integers(0, 10**6), min_size=2, max_size=2).map(tuple)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(FQN, OFFSETS), min_size=2, max_size=30, unique=True))
def test_string_order_of_keys_is_the_tuple_order(chunks):
    assert sorted(chunks, key=lambda c: chunk_key(*c)) == sorted(chunks)


@settings(max_examples=300, deadline=None)
@given(FQN, FQN, OFFSETS, OFFSETS)
def test_distinct_chunks_have_distinct_keys(a, b, off_a, off_b):
    assert (chunk_key(a, off_a) == chunk_key(b, off_b)) == ((a, off_a) == (b, off_b))


def test_the_reported_counterexample_sorts_right():
    # ("a", (0, 0)) < ("a !", (0, 0)) as tuples; the old key "a 0..." sorted after "a ! 0..."
    assert chunk_key("a", (0, 0)) < chunk_key("a !", (0, 0))
    assert chunk_key("a !", (0, 0)) == "a!20!21 000000000000_000000000000"


def test_prefix_names_sort_first():
    names = ["opt.m.10", "opt.m.1", "opt.m.2", "opt.m.1.x", "opt.m"]
    keys = sorted(chunk_key(n, (0,)) for n in names)
    assert [k.rsplit(" ", 1)[0] for k in keys] == sorted(names)  # usual names appear unchanged
