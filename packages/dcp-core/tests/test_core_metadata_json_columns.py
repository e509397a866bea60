"""``metadata_to_json`` writes the same text whatever form the metadata is in: chunk lists
and a dict of storage entries (what user code builds, the reference here), the planner's
chunk tables, parsed or unpacked storage tables, a later save's new entries for the same
tensor metadata.  Every uncommon case (a key that is not derived, a length that is not
the chunk's bytes, a missing or non-hex checksum, an unknown file, a chunk not stored) is
written as the format says, and each text is pinned by the digest of what the format-2
writer wrote before its fast paths were merged into one (``GOLDEN``).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from hyper_parallel_dcp.core import metadata as M


def _plain(md: M.Metadata) -> M.Metadata:
    """``md`` with every tensor's chunks as a list and the storage entries as a dict."""
    sd = {fqn: M.TensorStorageMetadata(t.properties, t.size, list(t.chunks))
          if isinstance(t, M.TensorStorageMetadata) else t for fqn, t in md.state_dict_metadata.items()}
    return replace(md, state_dict_metadata=sd, storage_data=dict(md.storage_data or {}))


def _digest(text: str) -> str:
    return json.loads(text)["metadata_digest"]


def _columnar(fqn: str, count: int, dtype: torch.dtype = torch.bfloat16, stored_as=None) -> M.Metadata:
    md = M.tensor_metadata_from_columns(fqn, M.TensorProperties(dtype, stored_as), torch.Size([2 * count, 3]), count,
                                        2, [v for i in range(count) for v in (2 * i, 0)], [2, 3] * count,
                                        ascending=True)
    itemsize = (stored_as or dtype).itemsize
    storage = {M.MetadataIndex(fqn, (2 * i, 0)): M.StorageInfo(f"_rank{i % 2}_.safetensors", 64 + 6 * itemsize * i,
                                                               6 * itemsize, f"{i:016x}", M.chunk_key(fqn, (2 * i, 0)))
               for i in range(count)}
    return M.Metadata({fqn: md}, storage_data=storage, files={"_rank0_.safetensors": 1000, "_rank1_.safetensors": 900})


def _merge(*parts: M.Metadata) -> M.Metadata:
    out = M.Metadata({}, storage_data={}, files={})
    for p in parts:
        out.state_dict_metadata.update(p.state_dict_metadata)
        out.storage_data.update(p.storage_data)  # type: ignore[union-attr]
        out.files.update(p.files)
    return out


def _changed(md: M.Metadata, fqn: str, **change) -> M.Metadata:
    storage = dict(md.storage_data or {})
    first = next(k for k in storage if k.fqn == fqn)
    storage[first] = replace(storage[first], **change)
    return M.Metadata(dict(md.state_dict_metadata), storage_data=storage, files=dict(md.files))


def _case(case: str) -> M.Metadata:
    # "lr%s%%": the derived keys are %-formatted, the name's own "%" must stay text;
    # "one", "sp ace" and "f8one": one chunk each; "a b", "f8" and "lr%s%%": a few chunks;
    # "many a" and "f8 many": more
    f8 = (torch.float8_e8m0fnu, torch.uint8)
    md = _merge(_columnar("a b", 3), _columnar("one", 1), _columnar("f8", 2, *f8), _columnar("lr%s%%", 2),
                _columnar("sp ace", 1), _columnar("f8one", 1, *f8), _columnar("many a", 5),
                _columnar("f8 many", 6, *f8))
    if case.startswith("many_"):
        fqn = "f8 many" if case in ("many_length", "many_file") else "many a"
        md = _changed(md, fqn, **{"key": {"key": "many a custom"}, "length": {"length": 7},
                                  "no_checksum": {"checksum": None}, "not_hex": {"checksum": "XYZXYZXYZXYZXYZX"},
                                  "file": {"relative_path": "elsewhere.safetensors"}, "unstored": {}}[case[5:]])
        if case == "many_unstored":
            md.storage_data = {k: v for k, v in md.storage_data.items() if k != M.MetadataIndex("many a", (4, 0))}
    changes = {"few_key": ("lr%s%%", {"key": M.chunk_key("lr%s%%", (9, 0))}),  # the derived prefix, another offset
               "few_not_hex": ("a b", {"checksum": "000000000000000G"}),
               "few_short_checksum": ("f8", {"checksum": "0" * 15}),
               "one_length": ("f8one", {"length": 7}), "one_no_checksum": ("one", {"checksum": None}),
               "one_short_checksum": ("one", {"checksum": "abc"}),
               "one_file": ("sp ace", {"relative_path": "elsewhere.safetensors"}),
               # the key as written unescaped: not the derived one
               "one_escaped_key": ("sp ace", {"key": "sp ace 000000000000_000000000000"}),
               "key": ("one", {"key": "one custom"}), "length": ("a b", {"length": 5}),
               "no_checksum": ("a b", {"checksum": None}), "not_hex": ("one", {"checksum": "XYZXYZXYZXYZXYZX"}),
               "file": ("f8", {"relative_path": "elsewhere.safetensors"})}
    if case in changes:
        fqn, change = changes[case]
        md = _changed(md, fqn, **change)
    elif case == "one_unstored":
        md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "one"}
    elif case == "unstored":
        md.storage_data = {k: v for k, v in md.storage_data.items() if k != M.MetadataIndex("a b", (2, 0))}
    elif case == "stray":
        md.storage_data[M.MetadataIndex("gone", (0,))] = M.StorageInfo("_rank0_.safetensors", 0, 4, "0" * 16)
    elif case == "stray_same_fqn":  # an entry of a stored tensor that is none of its chunks stays "other"
        md.storage_data[M.MetadataIndex("one", (7, 0))] = M.StorageInfo("_rank0_.safetensors", 0, 4, "0" * 16)
    return md


# metadata_digest of each case's text as the writer before this one wrote it
GOLDEN = {
    "common": "ead093e44d012382",
    "key": "7b0fe0be52b17f27",
    "length": "fa30d7468b619f69",
    "no_checksum": "4ea34363c0cfa928",
    "not_hex": "5432a4663909521f",
    "file": "f96e9447fc30cc1c",
    "unstored": "c07034c3bf2a5e8c",
    "stray": "16adaf450f7130a3",
    "stray_same_fqn": "4706112ba0eaebb3",
    "one_length": "6903c871ec0d2049",
    "one_no_checksum": "337282b68b590e6c",
    "one_short_checksum": "a60f9e73901286d1",
    "one_file": "c574493e69fc33b8",
    "one_unstored": "c48d2f347ab66127",
    "one_escaped_key": "19240e4ab7055449",
    "few_key": "5fc649381c2f660f",
    "few_not_hex": "b57b4f037d30d2c6",
    "few_short_checksum": "16ac886279d1485d",
    "many_key": "3ad0b0d9e2583363",
    "many_length": "2eed599ca0976a75",
    "many_no_checksum": "114b7695e633a556",
    "many_not_hex": "c4b90febc90900bf",
    "many_file": "75343314cfc02a7c",
    "many_unstored": "60a8016c4956b91e",
    "count_1": "ce5bc54018e2a172",
    "count_2": "a49a5703e3eab19d",
    "count_3": "100de614c817be4a",
    "count_4": "2c5b4b8a7b084514",
    "count_9": "691a178fd319c373",
    "moved": "2bcb2636ca710bdd",
}
CASES = ["common", "key", "length", "no_checksum", "not_hex", "file", "unstored", "stray", "stray_same_fqn",
         "one_length", "one_no_checksum", "one_short_checksum", "one_file", "one_unstored", "one_escaped_key",
         "few_key", "few_not_hex", "few_short_checksum", "many_key", "many_length", "many_no_checksum", "many_not_hex",
         "many_file", "many_unstored"]


@pytest.mark.parametrize("case", CASES)
def test_every_form_of_the_metadata_writes_the_same_text(case):
    md = _case(case)
    text = M.metadata_to_json(md)
    assert text == M.metadata_to_json(_plain(md))
    assert _digest(text) == GOLDEN[case]
    assert ("other_storage" in text) == case.startswith("stray")
    assert M.metadata_from_json(text) == md
    again = M.metadata_from_json(text)  # parsed: storage as a table
    assert M.metadata_to_json(again) == text == M.metadata_to_json(M.unpack_metadata(M.pack_metadata(md)))


@pytest.mark.parametrize("count", [1, 2, 3, 4, 9])
def test_a_tensor_of_any_chunk_count_writes_the_reference_text(count):
    md = _columnar("w", count)
    text = M.metadata_to_json(md)
    assert text == M.metadata_to_json(_plain(md))
    assert _digest(text) == GOLDEN[f"count_{count}"]


def _saved_again(md: M.Metadata, checksum_base: int, **change) -> M.Metadata:
    """The metadata of a later save with the same plan: the same tensor metadata objects,
    new storage entries (new checksums; ``change`` applied to the first chunk of "a b")."""
    storage = {}
    for i, (index, info) in enumerate((md.storage_data or {}).items()):
        info = replace(info, checksum=f"{checksum_base + i:016x}")
        if change and index == M.MetadataIndex("a b", (0, 0)):
            info = replace(info, **change)
        storage[index] = info
    return M.Metadata(md.state_dict_metadata, storage_data=storage, files=dict(md.files))


@pytest.mark.parametrize("change", [{}, {"offset": 4096}, {"length": 5}, {"key": "a b custom"},
                                    {"relative_path": "_rank1_.safetensors"}, {"checksum": "XYZXYZXYZXYZXYZX"},
                                    {"checksum": None}])
def test_a_later_save_writes_its_own_entries(change):
    md = _merge(_columnar("a b", 3), _columnar("one", 1), _columnar("lr%s%%", 2))
    assert M.metadata_to_json(md) == M.metadata_to_json(_plain(md))
    second = _saved_again(md, 1 << 30)
    assert M.metadata_to_json(second) == M.metadata_to_json(_plain(second))
    later = _saved_again(md, 1 << 40, **change)
    text = M.metadata_to_json(later)
    assert text == M.metadata_to_json(_plain(later))
    assert M.metadata_from_json(text) == later
    if not change:
        assert f"{(1 << 40) + 5:016x}" in text  # the new checksums are written


def test_a_moved_file_table_moves_every_chunks_file():
    md = _merge(_columnar("a b", 3), _columnar("one", 1))
    # a file listed first moves every chunk's file index
    later = _saved_again(md, 7)
    later.files = {"_extra_.bin": 5, **later.files}
    assert M.metadata_to_json(later) == M.metadata_to_json(_plain(later))
    # a file named only by an entry outside the tensors' chunks, grouped with theirs
    stray = _saved_again(md, 9)
    stray.storage_data[M.MetadataIndex("gone", (0,))] = M.StorageInfo("_rank2_.safetensors", 0, 4, "0" * 16)
    assert M.metadata_to_json(stray) == M.metadata_to_json(_plain(stray))
    assert M.metadata_from_json(M.metadata_to_json(stray)) == stray
    # ... and one that groups with a file listed before the chunks' files: those move
    moved = _saved_again(md, 11)
    moved.files = {"_a1.bin": 5, **moved.files}
    moved.storage_data[M.MetadataIndex("gone", (0,))] = M.StorageInfo("_a2.bin", 0, 4, "0" * 16)
    text = M.metadata_to_json(moved)
    assert text == M.metadata_to_json(_plain(moved))
    assert _digest(text) == GOLDEN["moved"]
    assert M.metadata_from_json(text) == moved
    # parsed, then given a file listed first: the table's file indices are written anew
    parsed = M.metadata_from_json(text)
    parsed.files = {"_first_.bin": 1, **parsed.files}
    assert M.metadata_to_json(parsed) == M.metadata_to_json(_plain(parsed))


def test_a_parsed_table_changed_under_its_metadata_is_written_from_its_entries():
    md = _merge(_columnar("a b", 3), _columnar("one", 1))
    md.state_dict_metadata["obj"] = M.BytesStorageMetadata()
    md.storage_data[M.MetadataIndex("obj")] = M.StorageInfo("_rank0_.bytes", 0, 9, None)
    # chunks replaced by an equal list, a tensor's chunks reordered, an object dropped
    for change in ("relist", "reorder", "drop"):
        parsed = M.metadata_from_json(M.metadata_to_json(md))
        tensor = parsed.state_dict_metadata["a b"]
        if change == "relist":
            tensor.chunks = list(tensor.chunks)
        elif change == "reorder":
            tensor.chunks = list(reversed(tensor.chunks))
        else:
            del parsed.state_dict_metadata["obj"]
        text = M.metadata_to_json(parsed)
        assert text == M.metadata_to_json(_plain(parsed)), change
        assert ("other_storage" in text) == (change == "drop")
