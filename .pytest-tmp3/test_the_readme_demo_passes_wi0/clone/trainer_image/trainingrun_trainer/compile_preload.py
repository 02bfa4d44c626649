"""Imported by the launcher's forkserver when the run will compile its model, so every worker it forks (the first
group and each group restarted in place) starts with torch.compile's per-process costs already paid.

Importing this module does the work, because a forkserver preloads module names, not calls:
- inductor's compiler modules (`torch.compile` itself imported them in each worker: 0.85 s on the 2-core VM);
- the hash of torch's own sources that keys inductor's caches (0.26 s);
- on CPUs, the probe of the CPU's vector instructions, which builds and runs test programs with the C++ compiler
  (1.2 s); it is cached per process, so a forked worker that inherits it skips it.
A warm compile cache then makes a restarted worker's first step the graph lookup and load alone (on the 2-core
VM an in-place restart with compile on trained again 1.1 s after the kill, against 3.65 s without this).

The forkserver dies on any error but an ImportError while it preloads, and every worker with it, so an error here
is reported and swallowed: the workers then pay these costs themselves. Nothing here may start a thread, since the
forkserver forks after it (tests/unit/trainer/test_launch.py checks).
"""

import sys

from .preloading import node_has_gpus

try:
    from .torch_internals import preload_compile

    preload_compile(probe_cpu=not node_has_gpus())
except Exception as error:  # noqa: BLE001  (see above: never stop the forkserver)
    print(
        f"trainingrun launch: preloading torch.compile failed ({type(error).__name__}: {error}); each worker "
        "compiles without it",
        file=sys.stderr,
        flush=True,
    )
