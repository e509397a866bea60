"""``sort_read_items`` compares ``(fqn, offsets)`` tuples; the order must stay the chunk
keys' order (``order_key``, the file order), for any FQN and any mix of items."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.core.metadata import MetadataIndex
from hyper_parallel_dcp.core.planner import LoadItemType, ReadItem, order_key, sort_read_items

FQN = st.one_of(
    st.text(alphabet="\x00\x01\t !\"#$./09_abcz~\x7f\u00e9\u4e2d", min_size=1, max_size=6),
    st.text(min_size=1, max_size=4),
)
OFFSETS = st.lists(st.integers(0, 10**6), min_size=2, max_size=2).map(tuple)


@st.composite
def read_items(draw):
    fqns = draw(st.lists(FQN, min_size=1, max_size=5, unique=True))
    objects = set(draw(st.lists(st.sampled_from(fqns), max_size=2)))
    items = []
    for _ in range(draw(st.integers(1, 25))):
        fqn = draw(st.sampled_from(fqns))
        if fqn in objects:
            index = MetadataIndex(fqn)
            items.append(ReadItem(LoadItemType.BYTE_IO, index, (), index, (), ()))
            continue
        items.append(ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, draw(OFFSETS)), (0, 0),
                              MetadataIndex(fqn, draw(OFFSETS), draw(st.integers(0, 3))), draw(OFFSETS), (1, 1)))
    return items


@settings(max_examples=300, deadline=None)
@given(read_items(), st.randoms())
def test_read_order_is_the_chunk_key_order(items, rnd: random.Random):
    rnd.shuffle(items)
    by_keys = sorted(items, key=lambda it: (order_key(it.dest_index), order_key(it.storage_index), it.storage_offsets))
    assert sort_read_items(items) == by_keys
