"""What a hang was: from what each rank said when it stopped making progress, the collective that did not complete
and the ranks that held it up.

Each rank that can still run writes a `RankDump` (hangs.py): its step, what its training thread was doing (the
innermost frames of its stack) and its flight recorder's view of every process group: the newest collective it
enqueued and the newest that completed, and the collectives still in flight with their op and sizes. A rank that
wrote nothing did not answer (a stopped or frozen process, a lost machine). `diagnose` reads the dumps of one
worker group and names:

- the collective still waited for: the newest one enqueued on a process group by some rank and not completed;
- the ranks that never entered it: those behind it (with their training thread's frame: a data loader, user code)
  and those that did not answer;
- or, when every rank entered it and none saw it complete, that the transport hangs, not a rank;
- and collectives whose op or sizes differ between the ranks that entered them (a mismatch deadlocks too).

Dumps come from other processes through the rendezvous store: they are untrusted, and `RankDump.parse` reads only
the fields below, capped in count and length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Optional

#: Caps on what one rank's dump may hold (it travels through the store and into logs and status).
MAX_DUMP_BYTES = 64 * 1024
MAX_FRAMES = 12
MAX_GROUPS = 64
MAX_IN_FLIGHT = 32
MAX_TEXT = 300


class DumpError(ValueError):
    """A dump that is not what a rank writes: too large, not JSON, or of the wrong shape."""


def _text(value: Any, limit: int = MAX_TEXT) -> str:
    text = str(value)
    text = "".join(c if c.isprintable() and c.isascii() else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _count(value: Any) -> int:
    """A sequence number or step: the flight recorder writes them as numbers or strings, -1 for none."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise DumpError(f"{_text(value, 40)!r} is not a whole number") from None
    return max(-1, number)


@dataclass(frozen=True)
class Collective:
    """One collective as one rank's flight recorder saw it."""

    group: str  #: process group id ("0": the default group)
    seq: int  #: its sequence number in that group
    op: str  #: e.g. "nccl:all_reduce", "gloo:broadcast"
    sizes: str = ""  #: input sizes, as the recorder wrote them

    def words(self) -> str:
        op = self.op.split(":", 1)[-1] or "collective"
        sizes = f", sizes {self.sizes}" if self.sizes else ""
        return f"{op} #{self.seq} of process group {self.group}{sizes}"


@dataclass(frozen=True)
class GroupState:
    """Where one rank stands in one process group."""

    enqueued: int  #: the newest collective it entered (-1: none)
    completed: int  #: the newest it saw complete (-1: none)


@dataclass(frozen=True)
class RankDump:
    """What one rank said when it found the run hung."""

    rank: int
    step: int  #: the last step it completed
    pod: str = ""
    node: str = ""
    phase: str = ""  #: a long phase it was in (checkpoint, eval, restore), "" when training
    frames: tuple[str, ...] = ()  #: its training thread's stack, innermost last ("file:line in function")
    groups: dict[str, GroupState] = field(default_factory=dict)
    in_flight: tuple[Collective, ...] = ()  #: collectives it entered that had not completed
    recorder: bool = True  #: False: no flight recorder (disabled, or not in this torch)

    def as_json(self) -> str:
        return json.dumps(
            {
                "rank": self.rank,
                "step": self.step,
                "pod": self.pod,
                "node": self.node,
                "phase": self.phase,
                "frames": list(self.frames),
                "groups": {name: [g.enqueued, g.completed] for name, g in self.groups.items()},
                "inFlight": [[c.group, c.seq, c.op, c.sizes] for c in self.in_flight],
                "recorder": self.recorder,
            }
        )

    @classmethod
    def parse(cls, raw: bytes | str) -> "RankDump":
        if len(raw) > MAX_DUMP_BYTES:
            raise DumpError(f"a dump of {len(raw)} bytes is over the {MAX_DUMP_BYTES} a rank writes")
        try:
            data = json.loads(raw)
        except ValueError as error:
            raise DumpError(f"a dump is not JSON: {error}") from None
        if not isinstance(data, dict):
            raise DumpError("a dump is not a JSON object")
        try:
            groups = data.get("groups") or {}
            in_flight = data.get("inFlight") or []
            frames = data.get("frames") or []
            if not isinstance(groups, dict) or not isinstance(in_flight, list) or not isinstance(frames, list):
                raise DumpError("a dump's groups, inFlight or frames has the wrong type")
            if len(groups) > MAX_GROUPS or len(in_flight) > MAX_IN_FLIGHT or len(frames) > MAX_FRAMES:
                raise DumpError("a dump lists more groups, collectives or frames than a rank writes")
            return cls(
                rank=_count(data["rank"]),
                step=_count(data.get("step", -1)),
                pod=_text(data.get("pod", ""), 253),
                node=_text(data.get("node", ""), 253),
                phase=_text(data.get("phase", ""), 20),
                frames=tuple(_text(frame) for frame in frames),
                groups={_text(name, 64): GroupState(_count(s[0]), _count(s[1])) for name, s in groups.items()},
                in_flight=tuple(
                    Collective(_text(c[0], 64), _count(c[1]), _text(c[2], 64), _text(c[3], 200)) for c in in_flight
                ),
                recorder=data.get("recorder", True) is True,
            )
        except (KeyError, IndexError, TypeError, AttributeError) as error:
            raise DumpError(f"a dump has the wrong shape ({type(error).__name__}: {error})") from None


@dataclass(frozen=True)
class Diagnosis:
    """What held the run up: one line for status and the summary, the whole for `trainingrun logs`."""

    summary: str
    details: tuple[str, ...]
    waited_for: tuple[int, ...]  #: the ranks named as holding it up (none: the transport, or unknown)
    collective: Optional[Collective] = None
    nodes: tuple[str, ...] = ()  #: the nodes of the ranks named, where known (the operator avoids a repeat offender)

    def text(self) -> str:
        return "\n".join((self.summary, *("  " + line for line in self.details)))


def _where(dump: Optional[RankDump], rank: int, identities: dict[int, tuple[str, str]]) -> str:
    pod, node = (dump.pod, dump.node) if dump else identities.get(rank, ("", ""))
    place = ", ".join(part for part in (f"pod {pod}" if pod else "", f"node {node}" if node else "") if part)
    return f"rank {rank}" + (f" ({place})" if place else "")


def _frame(dump: RankDump) -> str:
    """Where its training thread was: the innermost two frames, innermost first."""
    return " < ".join(reversed(dump.frames[-2:])) if dump.frames else "no frame"


def _pending(dumps: dict[int, RankDump]) -> Optional[Collective]:
    """The collective waited for: the oldest one that some rank entered and did not see complete, on the default
    group ("0") when there is one there, else on the group that sorts first. The recorder's entries in flight win
    over a group's counts: a rank's completed count may lag behind an entry it retired (an async collective it went
    on from), and that count alone would point at a collective every rank is past."""
    recorded: dict[str, int] = {}
    counted: dict[str, int] = {}
    for dump in dumps.values():
        for collective in dump.in_flight:
            if collective.seq > 0:
                recorded[collective.group] = min(recorded.get(collective.group, collective.seq), collective.seq)
        for name, state in dump.groups.items():
            if state.enqueued > state.completed:
                counted[name] = min(counted.get(name, state.completed + 1), state.completed + 1)
    oldest = {**counted, **recorded}
    if not oldest:
        return None
    group = min(oldest, key=lambda name: (name != "0", name))
    seq = oldest[group]
    entries = (c for dump in dumps.values() for c in dump.in_flight if c.group == group and c.seq == seq)
    return next(entries, None) or Collective(group, seq, "collective")


def diagnose(
    world_size: int,
    dumps: dict[int, RankDump],
    identities: Optional[dict[int, tuple[str, str]]] = None,
    timeout_seconds: float = 0.0,
) -> Diagnosis:
    """The diagnosis of a hang from the dumps of the ranks that answered (`identities`: rank -> (pod, node), as each
    rank said when it started, for those that did not answer)."""
    identities = identities or {}
    found = _diagnose(world_size, dumps, identities, timeout_seconds)
    nodes = {dumps[rank].node if rank in dumps else identities.get(rank, ("", ""))[1] for rank in found.waited_for}
    return replace(found, nodes=tuple(sorted(node for node in nodes if node)))


def _diagnose(
    world_size: int, dumps: dict[int, RankDump], identities: dict[int, tuple[str, str]], timeout_seconds: float
) -> Diagnosis:
    silent = [rank for rank in range(world_size) if rank not in dumps]
    step = max((d.step for d in dumps.values()), default=-1)
    waited = f"no progress for {timeout_seconds:.0f} s" if timeout_seconds else "no progress"
    head = f"hang after step {step}: {waited}" if step >= 0 else f"hang: {waited}"
    details: list[str] = []
    for rank in silent:
        details.append(f"{_where(None, rank, identities)}: did not answer (stopped, frozen or gone)")
    if not dumps:
        return Diagnosis(f"{head}; no rank answered", tuple(details), tuple(silent))
    if not any(d.recorder for d in dumps.values()):
        lagging = silent
        for rank, dump in sorted(dumps.items()):
            details.append(f"{_where(dump, rank, identities)}: at {_frame(dump)} (no flight recorder)")
        names = ", ".join(_where(None, r, identities) for r in lagging)
        return Diagnosis(
            f"{head}; {names + ' did not answer' if lagging else 'every rank answered'} (no flight recorder)",
            tuple(details),
            tuple(lagging),
        )
    pending = _pending(dumps)
    if pending is None:
        for rank, dump in sorted(dumps.items()):
            details.append(f"{_where(dump, rank, identities)}: in no collective, at {_frame(dump)}")
        blame = ", ".join(_where(None, r, identities) for r in silent)
        summary = (
            f"{head}; no collective in flight; {blame} did not answer"
            if silent
            else f"{head}; no collective in flight: every rank is stuck outside collectives"
        )
        return Diagnosis(summary, tuple(details), tuple(silent))
    behind = [
        rank
        for rank, dump in sorted(dumps.items())
        if dump.groups.get(pending.group, GroupState(-1, -1)).enqueued < pending.seq
    ]
    entered = {rank: dump for rank, dump in dumps.items() if rank not in behind}
    for rank in behind:
        dump = dumps[rank]
        state = dump.groups.get(pending.group, GroupState(-1, -1))
        details.append(
            f"{_where(dump, rank, identities)}: never entered it (its last was #{state.enqueued}), at {_frame(dump)}"
        )
    for rank, dump in sorted(entered.items()):
        details.append(f"{_where(dump, rank, identities)}: waiting in it")
    mismatch = _mismatch(pending, entered)
    if mismatch:
        details.append(mismatch)
    held_up_by = [*behind, *silent]
    if held_up_by:
        named = "; ".join(
            f"{_where(dumps.get(r), r, identities)}, "
            + ("which did not answer" if r in silent else f"at {_frame(dumps[r])}")
            for r in sorted(held_up_by)
        )
        summary = f"{head}; {pending.words()} waited for {named}"
    elif mismatch:
        summary = f"{head}; {pending.words()}: {mismatch}"
    else:
        summary = (
            f"{head}; every rank entered {pending.words()} and none saw it complete: the network or transport hangs"
        )
    return Diagnosis(summary, tuple(details), tuple(sorted(held_up_by)), pending)


def _mismatch(pending: Collective, entered: dict[int, RankDump]) -> str:
    """The ranks that entered the pending collective with another op or other sizes than the lowest rank did."""
    seen: dict[int, Collective] = {}
    for rank, dump in entered.items():
        match = next((c for c in dump.in_flight if c.group == pending.group and c.seq == pending.seq), None)
        if match:
            seen[rank] = match
    if len(seen) < 2:
        return ""
    first_rank = min(seen)
    first = seen[first_rank]
    odd = [rank for rank, c in sorted(seen.items()) if (c.op, c.sizes) != (first.op, first.sizes)]
    if not odd:
        return ""
    other = seen[odd[0]]
    return (
        f"mismatched collective: rank {first_rank} entered {first.op} sizes {first.sizes or '?'}, "
        f"rank {odd[0]} {other.op} sizes {other.sizes or '?'}" + (f" (and {len(odd) - 1} more)" if len(odd) > 1 else "")
    )
