"""local.summary: the lines a finished local run prints (result, the start-up term broken down, the average throughput
with model FLOP/s and MFU when reported, the last evaluation)."""

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


def test_each_straggler_named_is_a_line_and_counted_in_the_result():
    words = "rank 1 (pod localhost) takes 2.81x the other ranks' time before each step's collectives"
    figures = summary(slow_ranks=[words])
    assert figures.slow_rank_lines() == [f"slow rank 1 of 1: {words}"]
    assert figures.result_line().endswith(" slow_ranks=1")
    assert summary().slow_rank_lines() == [] and "slow_ranks" not in summary().result_line()


def test_the_startup_line_breaks_down_the_time_lines_start_up_term():
    phases = {"imports": 2.0, "init": 0.25, "model": 0.5, "data": 0.25, "prepare": 0.5}
    figures = summary(
        startup={**phases, "restore": 0.25, "first_step": 1.0},
        breakdown={"productive": 4.0, "startup": 5.5, "restore": 0.25},
        process_starts=2,
    )
    # The time line and the start-up line name the same term the same way, with the same figure.
    assert "+ start-up 5.5 s +" in figures.breakdown_line()
    assert figures.startup_line() == (
        "start-up 5.5 s = outside the training processes 2.0 s (launching, rendezvous, ending) + imports 2.0 s "
        "+ init 0.2 s + model 0.5 s + data 0.2 s + prepare 0.5 s (rank 0's, 2 worker group starts); then restore 0.2 s and first "
        "steps 1.0 s, in the time line's restore and productive"
    )


def test_the_throughput_line_gives_the_average_and_the_last_reading():
    assert summary().throughput_line() is None  # nothing reported
    # Model FLOPs and MFU follow samples/s: at the average, half the last reading's here.
    cpu = summary(samples_per_second=320.0, model_flops_per_second=2.5e9, average_samples_per_second=160.0)
    assert cpu.throughput_line() == (
        "throughput: 160.0 samples/s, 0.00125 TFLOP/s, MFU - (no GPU peak) on average; last reading 320.0 samples/s"
    )
    gpu = summary(samples_per_second=320.0, model_flops_per_second=4.2e14, mfu=0.4123, average_samples_per_second=320.0)
    assert (
        gpu.throughput_line()
        == "throughput: 320.0 samples/s, 420 TFLOP/s, MFU 41.2% on average; last reading 320.0 samples/s"
    )
    # A loop of one's own reports samples/s and counts no samples: its last reading, said to be one.
    own = summary(samples_per_second=320.0)
    assert own.throughput_line() == "throughput: 320.0 samples/s (the last reading)"


def test_the_eval_line_gives_the_last_evaluation():
    assert summary().eval_line() is None
    assert summary(eval_loss=2.31449, eval_step=120).eval_line() == (
        "eval loss: 2.3145 at step 120 (the held-out split's mean)"
    )
