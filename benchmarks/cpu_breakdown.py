"""Where a process's CPU goes, measured inside it: the thread CPU time (`time.thread_time`, about 1 us a call here)
spent in each of a few named functions, and in garbage collection, summed with their calls.

Why not only py-spy: it samples whatever the thread is doing when it is runnable, so time spent waiting for a core
(the API server shares them) lands on the line that was running, and its shares of the event loop's epoll came out
three times too large. Why not cProfile: it tripled the operator's CPU. These timers cost about 2 us a call.

`operator_reconcile.py` installs them in the operator when $OPERATOR_BREAKDOWN is set and prints, per run, each
function's calls and CPU beside what the same function costs in a loop (`baseline_costs`), warm and cold. In a
burst on the 2-core VM the same code took 4-13x longer a call than warm, and about as long as with none of it left in
any cache: parse 340-580 us in bursts, 560-590 after 16 or 64 MiB copied between the calls, 62-119 warm; building a
PyTorchJob 320-680, 620-770, 106-150. With 1 MiB copied (this VM's L2 caches) the calls took 1.2x warm: the burst
finds the operator evicted from the 32 MiB L3, which it shares with etcd, the API server and the host's other VMs.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

#: (module, attribute path, label) of each function timed. Nested ones overlap: "all event loop callbacks" holds the
#: rest but garbage collection outside them.
TIMED = [
    ("asyncio.events", "Handle._run", "all event loop callbacks"),
    ("selectors", "EpollSelector.select", "epoll (waiting excluded: CPU only)"),
    ("asyncio.selector_events", "_SelectorSocketTransport._read_ready", "socket reads (TLS, HTTP, what they wake)"),
    ("asyncio.sslproto", "SSLProtocol.buffer_updated", "TLS decrypt and the protocol's data_received"),
    ("asyncio.sslproto", "_SSLProtocolTransport.write", "TLS encrypt and send"),
    ("trainingrun_operator.validation", "parse", "validation.parse (pydantic)"),
    ("trainingrun_operator.validation", "credential_problems", "validation.credential_problems"),
    ("trainingrun_operator.validation", "component_problems", "validation.component_problems"),
    ("trainingrun_operator.pytorchjob", "children", "pytorchjob.children"),
    ("trainingrun_operator.builders", "event_object", "builders.event_object"),
    ("trainingrun_operator.reconcile", "decide", "reconcile.decide"),
    ("trainingrun_operator.handlers", "run_event", "handlers.run_event"),
    ("trainingrun_operator.handlers", "job_event", "handlers.job_event"),
    ("trainingrun_operator.handlers", "slim_run", "indexes.slim_run"),
    ("trainingrun_operator.handlers", "slim_job", "indexes.slim_job"),
    ("trainingrun_operator.handlers", "merged_status", "indexes.merged_status"),
    ("trainingrun_operator.handlers", "run_document", "indexes.run_document"),
    ("trainingrun_operator.indexes", "view", "indexes.view"),
    ("trainingrun_operator.indexes", "jobs_view", "indexes.jobs_view"),
    ("trainingrun_operator.indexes", "run_owns_job", "indexes.run_owns_job"),
    ("trainingrun_operator.runtime.kube", "PriorityGate.release", "kube.PriorityGate.release"),
    ("logging", "StreamHandler.emit", "logging (a line written)"),
    ("prometheus_client.metrics", "Histogram.observe", "prometheus Histogram.observe"),
    ("orjson", "loads", "orjson.loads (answers, watch events)"),
    ("orjson", "dumps", "orjson.dumps"),
]
GC_LABEL = "garbage collection"


def _timed(function: Callable, totals: list) -> Callable:
    clock = time.thread_time

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return function(*args, **kwargs)
        finally:
            totals[0] += 1
            totals[1] += clock() - started

    return timed


def install(output: str) -> None:
    """Time the TIMED functions and garbage collection in this process, writing the totals to `output` (JSON:
    label -> [calls, seconds]) every half second. orjson's functions are C: the modules that call them get a timed
    copy of the module."""
    totals: dict[str, list] = {}
    for module_name, path, label in TIMED:
        if module_name == "orjson":
            continue
        owner: Any = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        setattr(owner, name, _timed(getattr(owner, name), totals.setdefault(label, [0, 0.0])))
    _time_orjson(totals)
    collecting = totals.setdefault(GC_LABEL, [0, 0.0])
    started = [0.0]

    def on_collection(phase: str, _: dict) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            collecting[0] += 1
            collecting[1] += time.thread_time() - started[0]

    gc.callbacks.append(on_collection)

    def write() -> None:
        while True:
            time.sleep(0.5)
            Path(output + ".tmp").write_text(json.dumps(totals))
            os.replace(output + ".tmp", output)

    threading.Thread(target=write, daemon=True, name="cpu-breakdown").start()


def _time_orjson(totals: dict[str, list]) -> None:
    import types

    import orjson

    copy = types.ModuleType("orjson")
    copy.__dict__.update(orjson.__dict__)
    for module_name, name, label in TIMED:
        if module_name == "orjson":
            setattr(copy, name, _timed(getattr(orjson, name), totals.setdefault(label, [0, 0.0])))
    for module_name in ("trainingrun_operator.runtime.kube", "trainingrun_operator.runtime.informer"):
        module = importlib.import_module(module_name)
        if getattr(module, "orjson", None) is orjson:
            module.orjson = copy  # type: ignore[attr-defined]


def read(output: str) -> dict[str, list]:
    try:
        return json.loads(Path(output).read_text())
    except (OSError, ValueError):
        return {}


def table(
    before: dict[str, list], after: dict[str, list], runs: int, baseline: dict[str, tuple[float, float]]
) -> list[str]:
    """One line per timed function, largest first: calls and CPU per run between `before` and `after`, CPU per call,
    and the same function's CPU per call warm and cold (`baseline_costs`), where measured."""
    lines = [f"    {'ms/run':>7} {'calls/run':>9} {'us/call':>8} {'warm us':>8} {'cold us':>8}  function"]
    rows = []
    for label, (calls, seconds) in after.items():
        calls -= before.get(label, [0, 0.0])[0]
        seconds -= before.get(label, [0, 0.0])[1]
        if calls:
            rows.append((seconds * 1000 / runs, calls / runs, seconds * 1e6 / calls, label))
    for ms, calls, us, label in sorted(rows, reverse=True):
        bounds = " ".join(f"{us:8.1f}" for us in baseline[label]) if label in baseline else f"{'':17}"
        lines.append(f"    {ms:7.3f} {calls:9.2f} {us:8.1f} {bounds}  {label}")
    return lines


def last_level_cache_bytes() -> int:
    """The largest CPU cache of CPU 0 (sysfs: "32768K" here, an L3), 32 MiB where it says nothing readable."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        if text[:-1].isdigit() and text[-1:] in ("K", "M"):
            sizes.append(int(text[:-1]) << (10 if text.endswith("K") else 20))
    return max(sizes, default=32 << 20)


#: Calls `baseline_costs` times each function, warm and again cold.
BASELINE_REPEATS = 200


def baseline_costs(document: dict[str, Any], repeats: int = BASELINE_REPEATS) -> dict[str, tuple[float, float]]:
    """CPU us a call of the operator's own functions on the TrainingRun `document`, each `repeats` times in a loop: warm
    (nothing between the calls), and cold (a copy of `last_level_cache_bytes` before each, which leaves none of the
    function's code or data in any cache): the bounds to read a burst's figures against. orjson's: a watch event of
    the run's PyTorchJob."""
    import copy
    import datetime

    import orjson

    from trainingrun_operator import builders, pytorchjob, validation

    document = copy.deepcopy(document)
    document["metadata"].update(uid="0000", generation=1, resourceVersion="1")
    run = validation.parse(copy.deepcopy(document), from_server=True)
    job = pytorchjob.children(run)[-1]
    event = orjson.dumps({"type": "ADDED", "object": job})
    note = builders.Note("Normal", "AttemptStarted", "attempt 1 started")
    now = datetime.datetime.now(datetime.timezone.utc)
    copies = [copy.deepcopy(document) for _ in range(2 * repeats)]
    calls: dict[str, Callable[[int], Any]] = {
        "validation.parse (pydantic)": lambda i: validation.parse(copies[i], from_server=True),
        "validation.credential_problems": lambda i: validation.credential_problems(run.spec.trainer),
        "validation.component_problems": lambda i: validation.component_problems(run.spec.trainer),
        "pytorchjob.children": lambda i: pytorchjob.children(run),
        "builders.event_object": lambda i: builders.event_object(document, note, now),
        "orjson.loads (answers, watch events)": lambda i: orjson.loads(event),
        "orjson.dumps": lambda i: orjson.dumps(job),
    }
    cache = last_level_cache_bytes()
    source, evicted = os.urandom(cache), bytearray(cache)
    costs = {}
    for label, call in calls.items():
        for i in range(min(50, repeats)):
            call(i)
        started = time.thread_time()
        for i in range(repeats):
            call(i)
        warm = (time.thread_time() - started) * 1e6 / repeats
        cold = 0.0
        for i in range(repeats, 2 * repeats):
            evicted[:] = source
            started = time.thread_time()
            call(i)
            cold += time.thread_time() - started
        costs[label] = (warm, cold * 1e6 / repeats)
    return costs


def main() -> int:
    import argparse

    import yaml

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trainingrun", type=Path, help="a TrainingRun file (e.g. manifests/examples/minimal-cpu.yaml)")
    args = parser.parse_args()
    document = yaml.safe_load(args.trainingrun.read_text())
    document.setdefault("metadata", {}).setdefault("namespace", "default")
    cache_mib = last_level_cache_bytes() >> 20
    print(
        f"CPU us a call, each function {BASELINE_REPEATS} times in a loop: warm, and cold ({cache_mib} MiB copied before each)"
    )
    for label, (warm, cold) in baseline_costs(document).items():
        print(f"  {warm:8.1f} {cold:8.1f}  {label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
