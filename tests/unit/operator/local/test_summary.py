"""local.summary: the lines a finished local run prints (result, start-up phases adding up, throughput with model FLOP/s
and MFU when reported)."""

from trainingrun_operator import local


def summary(**figures) -> local.Summary:
    """A finished run's summary: one attempt, 5 steps, and `figures` over those."""
    base = dict(
        steps=5,
        final_loss=1.0,
        attempts=1,
        restarts_in_place=0,
        lost_steps=0,
        goodput=0.9,
        wall_seconds=10.0,
        outcome="succeeded",
    )
    return local.Summary(**{**base, **figures})


def test_result_line_format():
    figures = summary(
        final_loss=1.23456, attempts=2, restarts_in_place=1, lost_steps=3, goodput=0.91234, wall_seconds=12.34
    )
    assert figures.result_line() == (
        "result: steps=5 final_loss=1.2346 attempts=2 restarts_in_place=1 lost_steps=3 goodput=0.912 wall_seconds=12.3"
    )


def test_the_startup_line_adds_up_the_phases():
    phases = {"imports": 2.0, "init": 0.25, "model": 0.5, "data": 0.25, "prepare": 0.5, "restore": 0.25}
    assert summary(startup={**phases, "first_step": 1.0}).startup_line() == (
        "start-up: imports 2.0 s + init 0.2 s + model 0.5 s + data 0.2 s + prepare 0.5 s "
        "+ restore 0.2 s + first step 1.0 s = 4.8 s to the first steps of the training "
        "processes"
    )


def test_the_throughput_line_shows_model_flops_and_mfu_when_reported():
    assert summary().throughput_line() is None  # nothing reported
    cpu = summary(samples_per_second=320.0, model_flops_per_second=2.5e9)
    assert cpu.throughput_line() == "throughput: 320.0 samples/s, 0.0025 TFLOP/s, MFU - (no GPU peak)"
    gpu = summary(samples_per_second=320.0, model_flops_per_second=4.2e14, mfu=0.4123)
    assert gpu.throughput_line() == "throughput: 320.0 samples/s, 420 TFLOP/s, MFU 41.2%"
