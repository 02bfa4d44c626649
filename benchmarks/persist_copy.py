"""Persisting behind: the cost of copying a memory checkpoint's file to file:// storage while checking it against the
manifest's xxh3_128 as it streams (`Storage.upload`, issue 77 item 2), against the unchecked kernel copy it replaced
(`shutil.copyfile`, sendfile on Linux) plus the same fsync.

What is measured
    One file of `--mib` MiB of random bytes in /dev/shm, copied to a temp folder on this machine's disk (`--target`,
    default /tmp) `--repeats` times, the two sides alternating: wall and CPU seconds (this process) of each copy,
    fsync included. The first copy of each side is reported but left out of the medians (it pays the disk's first
    allocation).

Run by hand, never by the test suite:
    .venv/bin/python benchmarks/persist_copy.py          # ~10 s on the 2-core VM
The last line is `result: checked_wall_s=<x> unchecked_wall_s=<x> ratio=<x> checked_cpu_s=<x> unchecked_cpu_s=<x>`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import xxhash

from trainingrun_trainer.checkpoint.storage import Storage


def unchecked(source: str, target: str) -> None:
    shutil.copyfile(source, target)
    written = os.open(target, os.O_RDONLY)
    try:
        os.fsync(written)
    finally:
        os.close(written)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="size of the file copied (MiB)")
    parser.add_argument("--repeats", type=int, default=5, help="copies of each side, alternating")
    parser.add_argument("--target", default=tempfile.gettempdir(), help="a folder on the disk storage is on")
    args = parser.parse_args()
    data = os.urandom(args.mib << 20)
    source = os.path.join("/dev/shm", f"persist-copy-{os.getpid()}.bin")
    target = tempfile.mkdtemp(dir=args.target)
    try:
        with open(source, "wb") as out:
            out.write(data)
        digest = xxhash.xxh3_128(data).hexdigest()
        storage = Storage(f"file://{target}", {})
        times: dict[str, list[tuple[float, float]]] = {"checked": [], "unchecked": []}
        for repeat in range(args.repeats + 1):
            for side in ("unchecked", "checked"):
                path = os.path.join(target, side)
                wall, cpu = time.perf_counter(), time.process_time()
                if side == "checked":
                    storage.upload(source, f"file://{path}", "xxh3_128", digest)
                else:
                    unchecked(source, path)
                taken = (time.perf_counter() - wall, time.process_time() - cpu)
                os.remove(path)
                print(f"repeat {repeat} {side:9s} wall {taken[0]:.3f} s cpu {taken[1]:.3f} s")
                if repeat:
                    times[side].append(taken)
        median = {side: [statistics.median(t[i] for t in found) for i in (0, 1)] for side, found in times.items()}
        print(
            f"result: checked_wall_s={median['checked'][0]:.3f} unchecked_wall_s={median['unchecked'][0]:.3f} "
            f"ratio={median['checked'][0] / median['unchecked'][0]:.2f} checked_cpu_s={median['checked'][1]:.3f} "
            f"unchecked_cpu_s={median['unchecked'][1]:.3f}"
        )
    finally:
        if os.path.exists(source):
            os.remove(source)
        shutil.rmtree(target, ignore_errors=True)


if __name__ == "__main__":
    main()
