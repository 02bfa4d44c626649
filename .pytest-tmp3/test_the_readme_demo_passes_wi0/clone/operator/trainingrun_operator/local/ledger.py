"""What one local run keeps between invocations of `trainingrun local`."""

from __future__ import annotations

import hashlib
import json
import math
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trainingrun_api import contract


def run_directory(runs_dir: Path, name: str, checkpoint_uri: str) -> Path:
    """Where a local run keeps its run.json and attempt logs: runs/<name>/ for the checkpoint URI that name first ran
    with, runs/<name>/uri-<12 hex digits of the URI's sha256>/ for any other, so that a run with another
    --checkpoint-uri (a new run) never overwrites the logs and ledger of the one before."""
    base = runs_dir / name
    try:
        first = json.loads((base / "run.json").read_text(encoding="utf-8")).get("checkpointUri")
    except (OSError, ValueError, AttributeError):
        first = None
    if first is None or first == checkpoint_uri:
        return base
    return base / f"uri-{hashlib.sha256(checkpoint_uri.encode()).hexdigest()[:12]}"


def _seconds(value: object) -> float:
    """A wall time as saved: a finite, non-negative number, else 0 (a hand-edited file must not make goodput up)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return 0.0
    return float(value)


@dataclass
class RunLedger:
    """What one local run keeps between invocations of `trainingrun local` (runs/<name>/run.json): its uid, so a
    rerun resumes as the same run, and the wall and productive time so far, for goodput over every invocation. The cluster
    has both in the TrainingRun itself (metadata.uid, status.startTime). A new checkpoint URI is a new run."""

    path: Path
    uid: str
    checkpoint_uri: str
    wall_seconds: float = 0.0  #: of the earlier invocations
    #: The run's productive seconds at the end of the last invocation (progress.productiveSeconds): goodput's
    #: numerator when an invocation's processes report none.
    productive_seconds: float = 0.0

    @classmethod
    def load(cls, run_dir: Path, checkpoint_uri: str, uid: Optional[str] = None) -> "RunLedger":
        """The saved one for this checkpoint URI, else a new one (with `uid`, else a fresh uid), not saved yet."""
        path = run_dir / "run.json"
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            saved = None  # none yet, or unreadable: a new run
        if (
            isinstance(saved, dict)
            and saved.get("checkpointUri") == checkpoint_uri
            and isinstance(saved.get("uid"), str)
            and re.fullmatch(contract.RUN_KEY_PATTERN, saved["uid"], re.ASCII)  # it names node memory's folders
        ):
            return cls(
                path,
                saved["uid"],
                checkpoint_uri,
                _seconds(saved.get("wallSeconds")),
                _seconds(saved.get("productiveSeconds")),
            )
        return cls(path, uid or str(uuid.uuid4()), checkpoint_uri)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(
            json.dumps(
                {
                    "uid": self.uid,
                    "checkpointUri": self.checkpoint_uri,
                    "wallSeconds": round(self.wall_seconds, 3),
                    "productiveSeconds": round(self.productive_seconds, 3),
                }
            ),
            encoding="utf-8",
        )
