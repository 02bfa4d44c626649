"""Every script in benchmarks/ starts: its imports resolve and its arguments parse. The benchmarks are not part of
the suite (they load the machine); a rename in the packages must still not leave one broken until someone runs it
(report_endpoint.py imported Progress from where it no longer lived)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_the_benchmark_starts_and_describes_its_arguments(script):
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


@pytest.mark.slow
def test_the_cpu_breakdown_times_the_operators_functions_and_garbage_collection(tmp_path):
    """cpu_breakdown's timers, installed in a process as operator_reconcile.py installs them in the operator: each
    timed function's calls are counted and its CPU summed, and the table puts the largest first."""
    output = tmp_path / "breakdown.json"
    code = f"""
import gc, sys, time
sys.path.insert(0, {str(BENCHMARKS)!r})
import cpu_breakdown
cpu_breakdown.install({str(output)!r})
from trainingrun_operator import validation
from trainingrun_operator.runtime import kube
for _ in range(3):
    validation.parse({{"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {{"name": "a"}},
                       "spec": {{"checkpoint": {{"uri": "s3://bucket/a"}}}}}})
kube.orjson.loads(b'{{"a": 1}}')
gc.collect()
before = cpu_breakdown.read({str(output)!r})
while cpu_breakdown.read({str(output)!r}) == before:
    time.sleep(0.1)
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import cpu_breakdown
    finally:
        sys.path.remove(str(BENCHMARKS))
    totals = cpu_breakdown.read(str(output))
    assert totals["validation.parse (pydantic)"][0] == 3
    assert totals["validation.parse (pydantic)"][1] > 0
    assert totals["orjson.loads (answers, watch events)"][0] == 1
    assert totals[cpu_breakdown.GC_LABEL][0] >= 1
    lines = cpu_breakdown.table({}, totals, 3, {"validation.parse (pydantic)": (50.0, 200.0)})
    per_run = [float(line.split()[0]) for line in lines[1:]]
    assert per_run == sorted(per_run, reverse=True)
    parse = next(line for line in lines if line.endswith("validation.parse (pydantic)"))
    assert parse.split()[1] == "1.00"  # one call a run
    assert parse.split()[3:5] == ["50.0", "200.0"]  # the warm and cold figures beside it


@pytest.mark.slow
def test_the_baseline_costs_are_of_timed_functions_so_each_lands_beside_its_burst_figure():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import cpu_breakdown
        from operator_reconcile import run_body
    finally:
        sys.path.remove(str(BENCHMARKS))
    costs = cpu_breakdown.baseline_costs(run_body("run-0000", "bench"), repeats=5)
    assert len(costs) == 7
    assert set(costs) <= {label for _, _, label in cpu_breakdown.TIMED}
    assert all(warm > 0 and cold > 0 for warm, cold in costs.values())


def test_the_fleet_suite_unpacks_what_a_device_call_carries_and_names_the_script_that_makes_it(tmp_path, monkeypatch):
    """The device machine has no Kubernetes: fleet_suite.py unpacks the xz'd binaries a call carries, executable,
    byte for byte; without them it says which script makes them. Where openssl is missing, the carried one is used."""
    import lzma

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import fleet_suite
    finally:
        sys.path.remove(str(BENCHMARKS))
    carried = tmp_path / "carried"
    carried.mkdir()
    originals = {name: f"#!/bin/sh\necho {name}\nexit\n".encode() + b"#" * 100_000 for name in fleet_suite.BINARIES}
    for name, content in originals.items():
        (carried / f"{name}.xz").write_bytes(lzma.compress(content))
    monkeypatch.setattr(fleet_suite, "COMPRESSED", carried)
    folder = fleet_suite.unpacked(tmp_path / "k8s")
    for name, content in originals.items():
        assert (folder / name).read_bytes() == content
        assert subprocess.run([str(folder / name)], capture_output=True, text=True).stdout == f"{name}\n"
    assert sorted(p.name for p in folder.iterdir()) == sorted(originals)  # no partial file left behind

    (carried / "kubectl.xz").unlink()
    with pytest.raises(SystemExit, match="fleet-device-assets.sh"):
        fleet_suite.unpacked(tmp_path / "elsewhere")

    (carried / "openssl").write_text("#!/bin/sh\necho carried openssl\n")  # as a transfer may leave it: no x bit
    monkeypatch.setenv("PATH", os.environ["PATH"])
    fleet_suite.use_carried_openssl(tmp_path / "bin")
    found = shutil.which("openssl")
    assert found == str(tmp_path / "bin" / "openssl")
    assert subprocess.run([found], capture_output=True, text=True).stdout == "carried openssl\n"
