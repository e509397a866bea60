"""``metadata_to_json`` writes a columnar tensor stored the common way through whole-column
operations; the JSON must be the one the per-chunk path writes, byte for byte, and every
uncommon case (a key that is not derived, a length that is not the chunk's bytes, a
missing or non-hex checksum, an unknown file, a chunk not stored) must fall back to it.
"""

from __future__ import annotations

import pytest
import torch

from hyper_parallel_dcp.core import metadata as M
from hyper_parallel_dcp.core.metadata import (
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    chunk_key,
    metadata_from_json,
    tensor_metadata_from_columns,
)


def _general(md: Metadata, monkeypatch: pytest.MonkeyPatch) -> str:
    return M._metadata_to_json(md, columnar=False)


def _columnar(fqn: str, count: int, dtype: torch.dtype = torch.bfloat16, stored_as=None) -> Metadata:
    md = tensor_metadata_from_columns(fqn, TensorProperties(dtype, stored_as), torch.Size([2 * count, 3]), count, 2,
                                      [v for i in range(count) for v in (2 * i, 0)], [2, 3] * count, ascending=True)
    itemsize = (stored_as or dtype).itemsize
    storage = {MetadataIndex(fqn, (2 * i, 0)): StorageInfo(f"_rank{i % 2}_.safetensors", 64 + 6 * itemsize * i,
                                                           6 * itemsize, f"{i:016x}", chunk_key(fqn, (2 * i, 0)))
               for i in range(count)}
    return Metadata({fqn: md}, storage_data=storage,
                    files={"_rank0_.safetensors": 1000, "_rank1_.safetensors": 900})


def _merge(*parts: Metadata) -> Metadata:
    out = Metadata({}, storage_data={}, files={})
    for p in parts:
        out.state_dict_metadata.update(p.state_dict_metadata)
        out.storage_data.update(p.storage_data)  # type: ignore[union-attr]
        out.files.update(p.files)
    return out


def _changed(md: Metadata, fqn: str, **change) -> Metadata:
    from dataclasses import replace

    storage = dict(md.storage_data or {})
    first = next(k for k in storage if k.fqn == fqn)
    storage[first] = replace(storage[first], **change)
    return Metadata(dict(md.state_dict_metadata), storage_data=storage, files=dict(md.files))


@pytest.mark.parametrize("case", ["common", "key", "length", "no_checksum", "not_hex", "file", "unstored", "stray",
                                  "stray_same_fqn", "one_length", "one_no_checksum", "one_short_checksum", "one_file",
                                  "one_unstored", "one_escaped_key", "few_key", "few_not_hex", "few_short_checksum",
                                  "many_key", "many_length", "many_no_checksum", "many_not_hex", "many_file",
                                  "many_unstored"])
def test_columnar_entries_write_what_the_per_chunk_path_writes(case, monkeypatch):
    # "lr%s%%": the derived keys are %-formatted, the name's own "%" must stay text;
    # "one", "sp ace" and "f8one": one chunk each (their own path, _one_chunk_entry);
    # "a b", "f8" and "lr%s%%": a few chunks (_few_chunks_entry); "many a" and "f8 many":
    # more (the whole-column operations)
    md = _merge(_columnar("a b", 3), _columnar("one", 1), _columnar("f8", 2, torch.float8_e8m0fnu, torch.uint8),
                _columnar("lr%s%%", 2), _columnar("sp ace", 1), _columnar("f8one", 1, torch.float8_e8m0fnu, torch.uint8),
                _columnar("many a", 5), _columnar("f8 many", 6, torch.float8_e8m0fnu, torch.uint8))
    if case.startswith("many_"):
        fqn = "f8 many" if case in ("many_length", "many_file") else "many a"
        md = _changed(md, fqn, **{"key": {"key": "many a custom"}, "length": {"length": 7},
                                  "no_checksum": {"checksum": None}, "not_hex": {"checksum": "XYZXYZXYZXYZXYZX"},
                                  "file": {"relative_path": "elsewhere.safetensors"}, "unstored": {}}[case[5:]])
        if case == "many_unstored":
            md.storage_data = {k: v for k, v in md.storage_data.items() if k != MetadataIndex("many a", (4, 0))}
    elif case == "few_key":  # the derived key's prefix, another offset
        md = _changed(md, "lr%s%%", key=chunk_key("lr%s%%", (9, 0)))
    elif case == "few_not_hex":
        md = _changed(md, "a b", checksum="000000000000000G")
    elif case == "few_short_checksum":
        md = _changed(md, "f8", checksum="0" * 15)
    if case == "one_length":
        md = _changed(md, "f8one", length=7)
    elif case == "one_no_checksum":
        md = _changed(md, "one", checksum=None)
    elif case == "one_short_checksum":
        md = _changed(md, "one", checksum="abc")
    elif case == "one_file":
        md = _changed(md, "sp ace", relative_path="elsewhere.safetensors")
    elif case == "one_unstored":
        md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "one"}
    elif case == "one_escaped_key":  # the key as written unescaped: not the derived one
        md = _changed(md, "sp ace", key="sp ace 000000000000_000000000000")
    elif case == "key":
        md = _changed(md, "one", key="one custom")
    elif case == "length":
        md = _changed(md, "a b", length=5)
    elif case == "no_checksum":
        md = _changed(md, "a b", checksum=None)
    elif case == "not_hex":
        md = _changed(md, "one", checksum="XYZXYZXYZXYZXYZX")
    elif case == "file":
        md = _changed(md, "f8", relative_path="elsewhere.safetensors")
    elif case == "unstored":
        md.storage_data = {k: v for k, v in md.storage_data.items() if k != MetadataIndex("a b", (2, 0))}
    elif case == "stray":
        md.storage_data[MetadataIndex("gone", (0,))] = StorageInfo("_rank0_.safetensors", 0, 4, "0" * 16)
    elif case == "stray_same_fqn":  # an entry of a stored tensor that is none of its chunks stays "other"
        md.storage_data[MetadataIndex("one", (7, 0))] = StorageInfo("_rank0_.safetensors", 0, 4, "0" * 16)
    text = M.metadata_to_json(md)
    assert text == _general(md, monkeypatch)
    assert ("other_storage" in text) == case.startswith("stray")
    assert metadata_from_json(text) == md
    again = metadata_from_json(text)  # parsed metadata is columnar too: the same text again
    assert M.metadata_to_json(again) == text == _general(again, monkeypatch)


@pytest.mark.parametrize("count, path", [(1, "_one_chunk_entry"), (2, "_few_chunks_entry"), (3, "_few_chunks_entry"),
                                         (4, None), (9, None)])
def test_the_columnar_path_is_taken_for_the_common_case(count, path, monkeypatch):
    md = _columnar("w", count)
    calls = []
    taken = []
    fast = M._columnar_entry
    def spy(*a):
        calls.append((a[0], fast(*a)))
        return calls[-1][1]

    monkeypatch.setattr(M, "_columnar_entry", spy)
    for name in ("_one_chunk_entry", "_few_chunks_entry"):
        monkeypatch.setattr(M, name, lambda *a, _f=getattr(M, name), _n=name: taken.append(_n) or _f(*a))
    M.metadata_to_json(md)
    assert [fqn for fqn, _ in calls] == ["w"] and isinstance(calls[0][1], dict)
    assert taken == ([path] if path else [])
    assert fast("w", md.state_dict_metadata["w"], {}, {}) is None  # nothing stored: the general path


def _saved_again(md: Metadata, checksum_base: int, **change) -> Metadata:
    """The metadata of a later save with the same plan: the same tensor metadata objects,
    new storage entries (new checksums; ``change`` applied to the first chunk of "a b")."""
    from dataclasses import replace

    storage = {}
    for i, (index, info) in enumerate((md.storage_data or {}).items()):
        info = replace(info, checksum=f"{checksum_base + i:016x}")
        if change and index == MetadataIndex("a b", (0, 0)):
            info = replace(info, **change)
        storage[index] = info
    return Metadata(md.state_dict_metadata, storage_data=storage, files=dict(md.files))


@pytest.mark.parametrize("change", [{}, {"offset": 4096}, {"length": 5}, {"key": "a b custom"},
                                    {"relative_path": "_rank1_.safetensors"}, {"checksum": "XYZXYZXYZXYZXYZX"},
                                    {"checksum": None}])
def test_a_later_save_reuses_each_tensors_text_up_to_its_checksums(change, monkeypatch):
    md = _merge(_columnar("a b", 3), _columnar("one", 1), _columnar("lr%s%%", 2))
    calls = []
    entry = M._columnar_entry
    monkeypatch.setattr(M, "_columnar_entry", lambda *a: calls.append(a[0]) or entry(*a))
    assert M.metadata_to_json(md) == _general(md, monkeypatch)
    second = _saved_again(md, 1 << 30)
    assert M.metadata_to_json(second) == _general(second, monkeypatch)
    # each entry made the first time, and the second, when its text is kept
    assert calls == ["a b", "one", "lr%s%%"] * 2
    calls.clear()
    later = _saved_again(md, 1 << 40, **change)
    text = M.metadata_to_json(later)
    assert text == _general(later, monkeypatch)
    assert metadata_from_json(text) == later
    # the unchanged tensors' texts are reused; a changed chunk makes its tensor's text again
    assert calls == ([] if not change else ["a b"])
    if not change:
        assert f"{(1 << 40) + 5:016x}" in text  # the new checksums are written


def test_a_tensors_text_is_made_again_when_the_file_table_moves(monkeypatch):
    md = _merge(_columnar("a b", 3), _columnar("one", 1))
    M.metadata_to_json(md)
    M.metadata_to_json(_saved_again(md, 3))  # the texts are kept from the second time
    # a file listed first moves every chunk's file index
    later = _saved_again(md, 7)
    later.files = {"_extra_.bin": 5, **later.files}
    assert M.metadata_to_json(later) == _general(later, monkeypatch)
    # a file named only by an entry outside the tensors' chunks, grouped with theirs
    stray = _saved_again(md, 9)
    stray.storage_data[MetadataIndex("gone", (0,))] = StorageInfo("_rank2_.safetensors", 0, 4, "0" * 16)
    assert M.metadata_to_json(stray) == _general(stray, monkeypatch)
    assert metadata_from_json(M.metadata_to_json(stray)) == stray
    # ... and one that groups with a file listed before the chunks' files: those move
    moved = _saved_again(md, 11)
    moved.files = {"_a1.bin": 5, **moved.files}
    M.metadata_to_json(moved)
    moved.storage_data[MetadataIndex("gone", (0,))] = StorageInfo("_a2.bin", 0, 4, "0" * 16)
    text = M.metadata_to_json(moved)
    assert text == _general(moved, monkeypatch)
    assert metadata_from_json(text) == moved
