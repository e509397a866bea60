"""docs/format.md describes the files a save really writes.

A real save (one process; a ragged leaf gives several chunks per tensor) is checked
against the page: ``.metadata`` validates against the format-2 JSON schema printed there
(and the schema rejects broken documents), chunk keys follow the documented rule (escaped
FQN, space, padded offsets; derived, not stored), chunks lie in each safetensors file in
``(fqn, offset)`` order with no holes, and every recorded byte range, checksum (xxh3-64)
and file size matches the bytes on disk — all read from the JSON as the page describes it,
without the library.  The checked-in format-1 checkpoint validates against the format-1
schema.
"""

from __future__ import annotations

import copy
import json
import math
import re
import struct
from pathlib import Path

import pytest
import torch
import xxhash

jsonschema = pytest.importorskip("jsonschema")

DOC = Path(__file__).resolve().parents[1] / "docs" / "format.md"
V1_CHECKPOINT = Path(__file__).resolve().parent / "fixtures" / "format_v1"
KEY = re.compile(r"^(?P<name>[^ ]+) (?P<offsets>\d{12}(?:_\d{12})*)?$")


def documented_key(fqn: str, offsets: list[int]) -> str:
    """The key rule of the page, written from its text: escape U+0000..U+0021 as "!xx"."""
    name = "".join(f"!{ord(c):02x}" if ord(c) <= 0x21 else c for c in fqn)
    return name + " " + "_".join(f"{o:012d}" for o in offsets)


def documented_schema(marker: str = "test_docs_format.py validates real") -> dict:
    text = DOC.read_text()
    start = text.index(marker)
    block = re.search(r"```json\n(.*?)\n```", text[start:], re.S)
    assert block is not None, "no JSON schema block after the marker in docs/format.md"
    return json.loads(block.group(1))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    import hyper_parallel_dcp as dcp
    from hyper_parallel_dcp import RaggedShard

    gen = torch.Generator().manual_seed(5)
    full = torch.randn(4, 5, generator=gen)
    sd = {
        "layer.w": torch.randn(6, 5, generator=gen),
        "layer.ragged": RaggedShard(full.reshape(-1)[3:17].clone(), (4, 5), [(3, 17)]),  # 3 boxes
        "layer.bf": torch.randn(3, 2, generator=gen).to(torch.bfloat16),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "name with space!": torch.arange(4, dtype=torch.int32),
        "extra": {"epoch": 2, "name": "x"},
    }
    path = tmp_path_factory.mktemp("format") / "ckpt"
    dcp.save(sd, checkpoint_id=path, no_dist=True)
    return path


def test_metadata_validates_against_the_documented_schema(checkpoint: Path) -> None:
    schema = documented_schema()
    validator = jsonschema.Draft202012Validator(schema)
    doc = json.loads((checkpoint / ".metadata").read_text())
    validator.validate(doc)
    assert doc["format_version"] == 2
    assert doc["tensors"]["layer.ragged"]["count"] == 3
    # the schema is not vacuous: each of these breaks it
    broken = []
    for mutate in (
        lambda d: d.update(format_version=3),
        lambda d: d["tensors"]["layer.w"].update(checksum=d["tensors"]["layer.w"]["checksum"].upper()),
        lambda d: d["files"].append(["../escape", 1]),
        lambda d: d["files"].append({"prefix": "_rank", "suffix": "_.bytes", "numbers": [-1], "sizes": [1]}),
        lambda d: d["tensors"]["layer.w"].update(type="array"),
        lambda d: d["tensors"]["layer.w"]["offsets"].__setitem__(0, -1),
        lambda d: d["tensors"]["layer.w"].pop("offset"),
        lambda d: d["tensors"]["layer.w"].update(length=[-1]),
        lambda d: d["objects"]["extra.epoch"].update(file="_rank0_.bytes"),
        lambda d: d.pop("files"),
    ):
        bad = copy.deepcopy(doc)
        mutate(bad)
        broken.append(not validator.is_valid(bad))
    assert all(broken), broken
    grouped = copy.deepcopy(doc)  # a group of numbered names, as a multi-rank save writes
    grouped["files"].append({"prefix": "_rank", "suffix": "_.safetensors", "numbers": [1, 2], "sizes": [10, None]})
    validator.validate(grouped)


def test_incremental_metadata_validates_against_the_documented_schema(tmp_path: Path) -> None:
    import hyper_parallel_dcp as dcp

    validator = jsonschema.Draft202012Validator(documented_schema())
    dcp.save({"a": torch.ones(3), "b": torch.zeros(2)}, checkpoint_id=tmp_path / "step_1", no_dist=True)
    dcp.save({"a": torch.ones(3), "b": torch.ones(2)}, checkpoint_id=tmp_path / "step_2", no_dist=True,
             incremental_from=tmp_path / "step_1")
    doc = json.loads((tmp_path / "step_2" / ".metadata").read_text())
    validator.validate(doc)
    assert ["../step_1/_rank0_.safetensors", (tmp_path / "step_1" / "_rank0_.safetensors").stat().st_size] \
        in doc["files"]
    for name in ("../../x/y", "../x/y/z", "../../y", "../x/..", "../x/"):
        bad = copy.deepcopy(doc)
        bad["files"].append([name, 1])
        assert not validator.is_valid(bad), name


def _safetensors_entries(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    assert header.pop("__metadata__") == {"format": "pt"}
    return 8 + header_len, header


def _file_table(doc: dict) -> list[tuple[str, int]]:
    """(name, size) of every file, groups expanded in order, as the page describes them."""
    out = []
    for entry in doc["files"]:
        if isinstance(entry, dict):
            out += [(f"{entry['prefix']}{n}{entry['suffix']}", size) for n, size in zip(entry["numbers"], entry["sizes"])]
        else:
            out.append((entry[0], entry[1]))
    return out


def _stored_items(doc: dict) -> list[dict]:
    """Every stored chunk and object, read from the format-2 columns as the page describes them."""
    names = [name for name, _ in _file_table(doc)]
    itemsize = {"float32": 4, "bfloat16": 2, "int64": 8, "int32": 4}
    out = []
    for fqn, t in doc["tensors"].items():
        ndim = len(t["size"])
        sizes = t["sizes"] * t["count"] if len(t["sizes"]) == ndim else t["sizes"]
        checksums = t["checksum"]
        if isinstance(checksums, str):
            checksums = [checksums[i:i + 16] for i in range(0, len(checksums), 16)]
        lengths = t.get("length") or [math.prod(sizes[i * ndim:(i + 1) * ndim]) * itemsize[t.get("stored_as", t["dtype"])]
                                      for i in range(t["count"])]
        assert len(t["offsets"]) == len(sizes) == t["count"] * ndim
        for i in range(t["count"]):
            offsets = t["offsets"][i * ndim:(i + 1) * ndim]
            out.append({"fqn": fqn, "offsets": offsets, "file": names[t["file"][i]], "offset": t["offset"][i],
                        "length": lengths[i], "checksum": checksums[i],
                        "key": t.get("keys", {}).get(str(i), documented_key(fqn, offsets))})
    for fqn, o in doc["objects"].items():
        out.append({"fqn": fqn, "file": names[o["file"]], "offset": o["offset"], "length": o["length"],
                    "checksum": o["checksum"]})
    return out


def test_files_ordering_offsets_and_checksums(checkpoint: Path) -> None:
    doc = json.loads((checkpoint / ".metadata").read_text())
    on_disk = {p.name: p.stat().st_size for p in checkpoint.iterdir() if p.name != ".metadata"}
    assert dict(_file_table(doc)) == on_disk
    assert set(on_disk) == {"_rank0_.safetensors", "_rank0_.bytes"}
    assert "keys" not in doc["tensors"]["name with space!"]  # derivable, so not stored
    data_start, header = _safetensors_entries(checkpoint / "_rank0_.safetensors")
    by_offset = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    keys = [k for k, _ in by_offset]
    items = {item["key"]: item for item in _stored_items(doc) if "key" in item}
    assert sorted(items) == sorted(keys)
    assert "name!20with!20space!21 000000000000" in keys
    order = [(items[k]["fqn"], tuple(items[k]["offsets"])) for k in keys]
    assert all(KEY.match(k) for k in keys), keys
    assert order == sorted(order) and keys == sorted(keys)  # string order = (fqn, offsets) order = file order
    position = 0
    for _, entry in by_offset:  # back to back, no holes
        assert entry["data_offsets"][0] == position
        position = entry["data_offsets"][1]
    assert data_start + position == on_disk["_rank0_.safetensors"]
    raw = {name: (checkpoint / name).read_bytes() for name in on_disk}
    for item in _stored_items(doc):
        blob = raw[item["file"]][item["offset"]:item["offset"] + item["length"]]
        assert len(blob) == item["length"]
        assert xxhash.xxh3_64_hexdigest(blob) == item["checksum"], item
        if "key" in item:
            entry = header[item["key"]]
            assert item["offset"] == data_start + entry["data_offsets"][0]
            assert item["length"] == entry["data_offsets"][1] - entry["data_offsets"][0]
    assert sorted(doc["objects"]) == ["extra.epoch", "extra.name"]


def test_format_1_fixture_validates_against_the_format_1_schema() -> None:
    validator = jsonschema.Draft202012Validator(documented_schema("test_docs_format.py validates the format-1"))
    doc = json.loads((V1_CHECKPOINT / ".metadata").read_text())
    validator.validate(doc)
    assert doc["format_version"] == 1
    v2 = copy.deepcopy(doc)
    v2["format_version"] = 2
    assert not validator.is_valid(v2)
