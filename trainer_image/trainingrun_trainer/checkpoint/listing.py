"""What `trainingrun checkpoints URI [--json]` prints."""

from __future__ import annotations

import dataclasses
import json
from typing import Iterable

from .records import CheckpointInfo


def human_bytes(size: int) -> str:
    """`size` bytes as people read them: 512 B, 2.0 KiB, 5.4 MiB..."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def format_table(infos: Iterable[CheckpointInfo]) -> str:
    """A fixed-width table of checkpoints (step, valid, time, size, model digest prefix, and the
    URI or, for an invalid one, the reason), one per line, with a header."""
    rows = [("STEP", "VALID", "TIME", "SIZE", "MODEL", "URI / REASON")]
    for info in infos:
        rows.append(
            (
                str(info.step),
                "yes" if info.valid else "NO",
                info.time or "-",
                human_bytes(info.size_bytes),
                (info.model_digest or "-")[:12],
                info.uri if info.valid else f"{info.uri}  ({info.reason})",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        # Left-justified but the step: a heading starts where its column's values start (a right-justified SIZE
        # stood three characters right of its values).
        cells = [cell.rjust(w) if i == 0 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
    return "\n".join(lines)


def to_json(infos: Iterable[CheckpointInfo]) -> str:
    """A JSON array of checkpoints, one object per :class:`CheckpointInfo` with all its fields."""
    return json.dumps([dataclasses.asdict(info) for info in infos], indent=2)
