"""listing: what `trainingrun checkpoints URI` prints: a table whose headings line up with their values and that says
why an invalid checkpoint is, and JSON with every CheckpointInfo field."""

from __future__ import annotations

import dataclasses
import json

from trainingrun_trainer.checkpoint.layout import CheckpointInfo
from trainingrun_trainer.checkpoint.listing import format_table, to_json

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


def test_the_table_lines_headings_up_with_values_and_gives_the_reason_for_an_invalid_one():
    header, good, torn = format_table([GOOD, TORN]).splitlines()
    assert header.split() == ["STEP", "VALID", "TIME", "SIZE", "MODEL", "URI", "/", "REASON"]
    for heading in ("VALID", "TIME", "SIZE", "MODEL"):
        column = header.index(heading)
        assert good[column] != " " and good[column - 1] == " ", heading
    assert good.split()[:6] == ["1200", "yes", "2026-12-01T10:00:00Z", "5.0", "GiB", "0123456789ab"]
    assert torn.split()[:4] == ["7", "NO", "-", "512"]
    assert torn.endswith("s3://b/run/step-00000007  (no manifest (partial save))")


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
