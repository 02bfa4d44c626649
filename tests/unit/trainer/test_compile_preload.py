"""compile_preload: importing it pays torch.compile's per-process costs in the forkserver and starts no thread (a
forked worker inherits the caches, not threads), and a failure is reported without stopping the forkserver."""

import subprocess
import sys
from pathlib import Path

import pytest

PRELOADED = """
import threading
import trainingrun_trainer.compile_preload
from torch._inductor import codecache, cpu_vec_isa
try:
    codecache.torch_key.set(b"")  # refused once the key is computed
    torch_key_cached = 0
except RuntimeError:
    torch_key_cached = 1
print(threading.active_count(), torch_key_cached, cpu_vec_isa.valid_vec_isa_list.cache_info().currsize)
"""


@pytest.mark.slow
def test_the_compile_preload_leaves_its_costs_paid_and_no_thread_behind():
    # A forked worker inherits what this process cached; a thread would not survive the fork (and may deadlock it).
    done = subprocess.run([sys.executable, "-c", PRELOADED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    threads, torch_key_cached, isa_probed = done.stdout.split()
    assert (threads, torch_key_cached) == ("1", "1")
    assert isa_probed == ("0" if Path("/dev/nvidia0").exists() else "1")


@pytest.mark.slow
def test_a_failing_compile_preload_is_reported_and_leaves_the_forkserver_running():
    # The forkserver dies on any preload error but an ImportError; so would every worker it forks.
    script = (
        "from torch._inductor import codecache\n"
        "def fails(): raise RuntimeError('no sources')\n"
        "codecache.torch_key = fails\n"
        "import trainingrun_trainer.compile_preload"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "preloading torch.compile failed (RuntimeError: no sources)" in done.stderr
        and "each worker compiles without it" in done.stderr
    )
