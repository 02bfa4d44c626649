"""Every script in benchmarks/ starts: its imports resolve and its arguments parse. The benchmarks are not part of
the suite (they load the machine); a rename in the packages must still not leave one broken until someone runs it
(report_endpoint.py imported Progress from where it no longer lived)."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_the_benchmark_starts_and_describes_its_arguments(script):
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
