"""docs/format.md describes the files a save really writes.

A real save (one process; a ragged leaf gives several chunks per tensor) is checked
against the page: ``.metadata`` validates against the JSON schema printed there (and the
schema rejects broken documents), chunk keys have the documented form, chunks lie in each
safetensors file in ``(fqn, offset)`` order with no holes, and every recorded byte range,
checksum (xxh3-64) and file size matches the bytes on disk.
"""

from __future__ import annotations

import copy
import json
import re
import struct
from pathlib import Path

import pytest
import torch
import xxhash

jsonschema = pytest.importorskip("jsonschema")

DOC = Path(__file__).resolve().parents[1] / "docs" / "format.md"
KEY = re.compile(r"^(?P<fqn>.+) (?P<offsets>\d{12}(?:_\d{12})*)?$")


def documented_schema() -> dict:
    text = DOC.read_text()
    start = text.index("test_docs_format.py validates")
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
    assert len(doc["state_dict_metadata"]["layer.ragged"]["chunks"]) == 3
    # the schema is not vacuous: each of these breaks it
    broken = []
    for mutate in (
        lambda d: d.update(format_version=2),
        lambda d: d["storage_data"][0].update(checksum=d["storage_data"][0]["checksum"].upper()),
        lambda d: d["storage_data"][0].update(file="../escape"),
        lambda d: d["state_dict_metadata"]["layer.w"].update(type="array"),
        lambda d: d["state_dict_metadata"]["layer.w"]["chunks"][0].update(offsets=[-1, 0]),
        lambda d: d.pop("files"),
    ):
        bad = copy.deepcopy(doc)
        mutate(bad)
        broken.append(not validator.is_valid(bad))
    assert all(broken), broken


def _safetensors_entries(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    assert header.pop("__metadata__") == {"format": "pt"}
    return 8 + header_len, header


def test_files_ordering_offsets_and_checksums(checkpoint: Path) -> None:
    doc = json.loads((checkpoint / ".metadata").read_text())
    on_disk = {p.name: p.stat().st_size for p in checkpoint.iterdir() if p.name != ".metadata"}
    assert doc["files"] == on_disk
    assert set(on_disk) == {"_rank0_.safetensors", "_rank0_.bytes"}
    data_start, header = _safetensors_entries(checkpoint / "_rank0_.safetensors")
    by_offset = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    keys = [k for k, _ in by_offset]
    parsed = [KEY.match(k) for k in keys]
    assert all(parsed), keys
    order = [(m.group("fqn"), tuple(int(o) for o in (m.group("offsets") or "").split("_") if o)) for m in parsed]
    assert order == sorted(order) and keys == sorted(keys)  # string order = (fqn, offsets) order = file order
    position = 0
    for _, entry in by_offset:  # back to back, no holes
        assert entry["data_offsets"][0] == position
        position = entry["data_offsets"][1]
    assert data_start + position == on_disk["_rank0_.safetensors"]
    raw = {name: (checkpoint / name).read_bytes() for name in on_disk}
    for item in doc["storage_data"]:
        blob = raw[item["file"]][item["offset"]:item["offset"] + item["length"]]
        assert len(blob) == item["length"]
        assert xxhash.xxh3_64_hexdigest(blob) == item["checksum"], item
        if "key" in item:
            entry = header[item["key"]]
            assert item["offset"] == data_start + entry["data_offsets"][0]
            assert item["length"] == entry["data_offsets"][1] - entry["data_offsets"][0]
            assert KEY.match(item["key"]).group("fqn") == item["fqn"]
    objects = sorted(item["fqn"] for item in doc["storage_data"] if "key" not in item)
    assert objects == ["extra.epoch", "extra.name"]
