"""What a command left outside the clone: `leftovers.py snapshot FILE` lists the entries of the folders a test run
must not change (the temporary folder, /dev/shm, the home folder and its usual cache and config folders) into
FILE; `leftovers.py compare FILE` lists them again and exits 1, naming each one, if any entry is new.

.ci/run runs `make test` between the two (docs/development.md: the tests change nothing outside the clone). An
entry that was there before and was changed is not reported: only what the run added.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

HOME = Path.home()
#: Folders listed one level deep; the home folder's caches and configs are where tools write unasked.
WATCHED = [
    Path(tempfile.gettempdir()),
    Path("/dev/shm"),
    HOME,
    HOME / ".cache",
    HOME / ".config",
    HOME / ".local" / "share",
]


def entries() -> list[str]:
    found = []
    for folder in WATCHED:
        try:
            found.extend(str(folder / name) for name in os.listdir(folder))
        except OSError:
            continue  # not there (yet): its own appearance is an entry of its parent
    return sorted(found)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("snapshot", "compare"):
        print(__doc__, file=sys.stderr)
        return 2
    listing = Path(argv[2])
    now = entries()
    if argv[1] == "snapshot":
        listing.write_text(json.dumps(now), encoding="utf-8")
        print(f"leftovers: {len(now)} entries before, in {', '.join(map(str, WATCHED))}")
        return 0
    before = set(json.loads(listing.read_text(encoding="utf-8")))
    new = [entry for entry in now if entry not in before]
    for entry in new:
        print(f"leftovers: new since the snapshot: {entry}", file=sys.stderr)
    if new:
        print(f"leftovers: {len(new)} new entries outside the clone (see above)", file=sys.stderr)
        return 1
    print("leftovers: nothing new outside the clone")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
