"""How deep JSON nests, for text and values others wrote: parsers and serialisers recurse once per level (orjson parses
1024 levels and writes 254, Python's json about 1000), so a deep enough value written by anyone who may create a
TrainingRun or send a report would make them raise where nobody expects it. Both sides check with these first.
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Optional, Union

_SPECIAL = re.compile(rb'["\[\]{}]')
#: The rest of a JSON string after its opening quote (escapes included).
_STRING_REST = re.compile(rb'(?:[^"\\]|\\.)*"', re.DOTALL)
_OPENING = frozenset(b"[{")


def _brackets(raw: bytes | bytearray) -> Iterator[tuple[int, bool]]:
    """(offset, whether it opens) of each bracket outside strings. A string left open ends the scan: nothing after
    its quote is read twice, so text full of escaped quotes stays linear."""
    position = 0
    while (found := _SPECIAL.search(raw, position)) is not None:
        first = raw[found.start()]
        if first == 0x22:
            rest = _STRING_REST.match(raw, found.end())
            if rest is None:
                return
            position = rest.end()
            continue
        yield found.start(), first in _OPENING
        position = found.end()


Path = list[Union[str, int]]


def text_depth(raw: bytes | bytearray, stop_above: Optional[int] = None) -> int:
    """How deep a JSON text's arrays and objects nest, without parsing it; with `stop_above`, the first depth past it
    (the rest is not read)."""
    depth = deepest = 0
    for _, opening in _brackets(raw):
        if opening:
            depth += 1
            deepest = max(deepest, depth)
            if stop_above is not None and deepest > stop_above:
                break
        else:
            depth -= 1
    return deepest


def cut_deeper_than(raw: bytes | bytearray, depth: int, marker: bytes) -> tuple[bytes, int]:
    """The JSON text with every array or object nested deeper than `depth` replaced by `marker` (a JSON value), and
    how many were cut. A value from it nests at most `depth` levels, so any parser reads it; what was cut is meant to
    be refused by whoever reads it (`deeper_than` finds it), never trusted as written."""
    pieces, level, cut_from, kept_to, cuts = [], 0, -1, 0, 0
    for offset, opening in _brackets(raw):
        if opening:
            level += 1
            if level == depth + 1:
                cut_from = offset
        else:
            if level == depth + 1 and cut_from >= 0:
                pieces += [raw[kept_to:cut_from], marker]
                kept_to, cut_from, cuts = offset + 1, -1, cuts + 1
            level -= 1
    pieces.append(raw[kept_to:])
    return b"".join(pieces), cuts


def deeper_than(value: Any, limit: int) -> Optional[Path]:
    """The path of the first array or object in `value` (itself at level 1) nested deeper than `limit` levels, or
    None. Iterative: it never recurses, however deep `value` is."""
    pending: list[tuple[Any, int, Path]] = [(value, 1, [])]
    while pending:
        item, level, path = pending.pop()
        if isinstance(item, dict):
            children: Any = item.items()
        elif isinstance(item, list):
            children = enumerate(item)
        else:
            continue
        if level > limit:
            return path
        pending.extend((child, level + 1, [*path, key]) for key, child in children)
    return None


def dotted(path: Path, most: int = 8) -> str:
    """`spec.trainer.loggers[0].kind`, the first `most` parts of a path (then `...`)."""
    text = ""
    for part in path[:most]:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text + ("..." if len(path) > most else "")
