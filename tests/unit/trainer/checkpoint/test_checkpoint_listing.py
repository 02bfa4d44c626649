"""listing: what `trainingrun checkpoints URI` prints: a table whose headings line up with their values and that says
why an invalid checkpoint is, and JSON with every CheckpointInfo field."""

from __future__ import annotations

import dataclasses
import json
import os

from checkpoint_states import make_model, root, store  # noqa: F401 - fixtures

from trainingrun_trainer.checkpoint import MANIFEST_NAME, model_digest
from trainingrun_trainer.checkpoint.listing import format_table, to_json
from trainingrun_trainer.checkpoint.records import CheckpointInfo

GOOD = CheckpointInfo(
    step=1200,
    uri="s3://b/run/step-00001200",
    time="2026-12-01T10:00:00Z",
    size_bytes=5 * 1024**3 + 1,
    valid=True,
    model_digest="0123456789abcdef",
    world_size=8,
    manifest_sha256="ab" * 32,
)
TORN = CheckpointInfo(
    step=7, uri="s3://b/run/step-00000007", time="", size_bytes=512, valid=False, reason="no manifest (partial save)"
)


def test_cli_helpers(store):
    model = make_model()
    store.save(5, {"model": model.state_dict()}, model_digest=model_digest(model.state_dict()))
    store.save(6, {"model": model.state_dict()})
    store.wait()
    os.remove(store.list()[0].uri[len("file://") :] + "/" + MANIFEST_NAME)
    infos = store.list()
    table = format_table(infos).splitlines()
    assert table[0].split() == ["STEP", "VALID", "TIME", "SIZE", "MODEL", "URI", "/", "REASON"]
    assert table[1].split()[:2] == ["6", "NO"] and "(no manifest (partial save))" in table[1]
    assert table[2].split()[:2] == ["5", "yes"] and infos[1].model_digest[:12] in table[2]
    valid = infos[1]
    for heading, value in (("VALID", "yes"), ("TIME", valid.time), ("MODEL", valid.model_digest[:12])):
        start = table[0].index(heading)  # each heading starts where its values start
        assert table[2][start : start + len(value)] == value, (heading, table)
    size = table[0].index("SIZE")
    assert table[2][size] != " " and table[2][size - 1] == " ", table
    data = json.loads(to_json(infos))
    assert [d["step"] for d in data] == [6, 5]
    for d, info in zip(data, infos):
        assert CheckpointInfo(**d) == info
        assert {"step", "valid", "model_digest", "uri", "time", "size_bytes", "reason"} <= d.keys()
    assert data[1]["time"].endswith("Z") and data[1]["size_bytes"] > 0


def test_sizes_are_human_from_bytes_to_tebibytes():
    sizes = [format_table([CheckpointInfo(1, "u", "t", size, True)]).splitlines()[1] for size in (0, 2048, 3 * 1024**5)]
    assert "0 B" in sizes[0] and "2.0 KiB" in sizes[1] and "3072.0 TiB" in sizes[2]


def test_json_holds_every_field():
    rows = json.loads(to_json([GOOD, TORN]))
    assert set(rows[0]) == {field.name for field in dataclasses.fields(CheckpointInfo)}
    assert (
        rows[0].items()
        >= {
            "step": 1200,
            "uri": GOOD.uri,
            "time": GOOD.time,
            "size_bytes": GOOD.size_bytes,
            "valid": True,
            "reason": None,
            "model_digest": GOOD.model_digest,
            "world_size": 8,
            "manifest_sha256": GOOD.manifest_sha256,
        }.items()
    )
    assert rows[1]["reason"] == "no manifest (partial save)"
    assert to_json([]) == "[]"
