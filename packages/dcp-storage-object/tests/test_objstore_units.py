"""One-process checks of the pure parts: URL parsing, byte runs of a slice, the scheme registry."""

from __future__ import annotations

import itertools

import pytest
import torch

from hyper_parallel_dcp.core.backends import UnknownSchemeError, backend_for, storage_writer_for, url_scheme
from hyper_parallel_dcp.storage_fs.sinks import byte_runs
from hyper_parallel_dcp.storage_object import ObjectStoreSettings, ObjectStoreWriter, parse_url


def test_parse_url():
    assert parse_url("s3://bkt/a/b/") == ("s3", "bkt", "a/b")
    assert parse_url("S3://bkt") == ("s3", "bkt", "")
    with pytest.raises(ValueError, match="names no bucket"):
        parse_url("s3:///x")


def _reference_runs(sizes, offsets, lengths, itemsize):
    """Every byte the slice needs, from an element-wise walk (independent of byte_runs)."""
    flat = torch.arange(torch.Size(sizes).numel()).reshape(sizes)
    sl = flat[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    return {int(e) * itemsize + b for e in sl.reshape(-1) for b in range(itemsize)}


@pytest.mark.parametrize("sizes,offsets,lengths", [
    ((8, 6), (2, 0), (3, 6)),       # row slice: one run
    ((8, 6), (0, 2), (8, 3)),       # column slice: a run per row
    ((4, 5, 6), (1, 2, 0), (2, 2, 6)),
    ((4, 5, 6), (0, 0, 1), (4, 5, 2)),
    ((10,), (3,), (4,)),
    ((3, 4), (0, 0), (3, 4)),
    ((6, 40, 2), (1, 3, 0), (4, 30, 2)),  # uneven gaps: rows within a block, blocks apart
])
@pytest.mark.parametrize("overhead", [0.0, 0.1, 1.0])
def test_byte_runs_cover_exactly_what_is_needed(sizes, offsets, lengths, overhead):
    itemsize = 4
    runs = byte_runs(sizes, offsets, lengths, itemsize, overhead=overhead)
    needed = _reference_runs(sizes, offsets, lengths, itemsize)
    fetched = {b for start, n in runs for b in range(start, start + n)}
    assert needed <= fetched
    assert len(fetched) <= (1 + overhead) * len(needed)
    assert all(a[0] + a[1] < b[0] for a, b in itertools.pairwise(runs))  # ordered, disjoint
    blocks = sum(1 for b in needed if b - 1 not in needed)  # maximal contiguous runs needed
    if overhead >= 1.0 and blocks > 1:
        assert len(runs) < blocks  # a budget that allows merging does merge


def test_schemes():
    assert url_scheme("s3://b/x") == "s3"
    assert url_scheme("/tmp/x") == "file"
    assert url_scheme("relative/dir") == "file"
    assert backend_for("s3://b/x").scheme == "s3"
    assert backend_for("file:///tmp/x").scheme == "file"
    with pytest.raises(UnknownSchemeError, match="'gopher://'"):
        storage_writer_for("gopher://b/x", None)
    w = storage_writer_for("s3://bkt/a/step_3", None)
    assert isinstance(w, ObjectStoreWriter) and w.store.bucket == "bkt" and w.prefix == "a/step_3"


def test_settings_validated():
    with pytest.raises(ValueError, match="5 MiB"):
        ObjectStoreSettings(part_size=1 << 20)
    with pytest.raises(ValueError, match="read_concurrency"):
        ObjectStoreSettings(read_concurrency=0)


def test_gs_and_az_urls_say_what_to_do_instead():
    with pytest.raises(UnknownSchemeError, match=r"'gs://'.*storage.googleapis.com.*s3://BUCKET.*untested"):
        storage_writer_for("gs://bkt/run/step_1", None)
    with pytest.raises(UnknownSchemeError, match=r"'az://'.*Azure Blob Storage.*mounted path"):
        backend_for("az://container/run")


def test_reader_pickles_without_its_threads():
    import pickle

    from hyper_parallel_dcp.storage_object import ObjectStoreReader

    settings = ObjectStoreSettings(read_concurrency=3)
    back = pickle.loads(pickle.dumps(ObjectStoreReader("s3://bkt/run/step_1", verify=True, settings=settings)))
    assert (back.url, back.verify, back.settings.read_concurrency) == ("s3://bkt/run/step_1", True, 3)
