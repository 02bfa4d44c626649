"""Prints the commands of one of the README's marked steps (a ```sh block right after `<!-- steps: NAME -->`), one
per line, so that CI runs exactly what the README tells a user to run: `python3 scripts/readme_steps.py e2e`.
Standard library only: it runs before anything is installed."""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
MARKED = re.compile(r"<!-- steps: ([a-z0-9-]+) -->\n```sh\n(.*?)```", re.S)


def all_steps(text: str) -> dict[str, list[str]]:
    """{name: [command, ...]} of every marked block, comments and blank lines left out."""
    found: dict[str, list[str]] = {}
    for name, block in MARKED.findall(text):
        commands = [line.split(" #", 1)[0].rstrip() for line in block.splitlines()]
        found[name] = [c for c in commands if c and not c.startswith("#")]
    return found


def steps(name: str, text: str = "") -> list[str]:
    found = all_steps(text or README.read_text(encoding="utf-8"))
    if name not in found:
        raise SystemExit(f"README.md has no steps named {name!r} (it has {', '.join(sorted(found)) or 'none'})")
    return found[name]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} NAME   (the README's `<!-- steps: NAME -->` blocks)")
    print("\n".join(steps(sys.argv[1])))
