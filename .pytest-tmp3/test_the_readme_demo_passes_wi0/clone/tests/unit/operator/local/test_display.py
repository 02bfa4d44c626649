"""local.display: the plain display prints a line per tenth of the run (and the last step), never a step twice, and
takes reports without loss or rate; the rich bar follows the step."""

from __future__ import annotations

import io
from types import SimpleNamespace

from trainingrun_operator.local.display import PlainDisplay, RichDisplay


class Runner:
    spec = SimpleNamespace(trainer=SimpleNamespace(max_steps=100))

    def attempt_label(self) -> str:
        return "attempt 1"


def status(step, total=100, **more):
    return {"progress": {"step": step, "totalSteps": total, **more}}


def test_plain_lines_come_per_tenth_of_the_run_and_for_the_last_step():
    out = io.StringIO()
    display = PlainDisplay(out)
    for step in [1, 2, 3, 11, 11, 12, 25, 100]:
        display(Runner(), status(step, loss=0.5, samplesPerSecond=12.25))
    lines = out.getvalue().splitlines()
    assert [line.split()[3] for line in lines] == ["1/100", "11/100", "25/100", "100/100"]
    assert lines[0] == "attempt 1 step 1/100 loss 0.5000 samples/s 12.2"


def test_a_report_without_figures_or_a_step_prints_dashes_or_nothing():
    out = io.StringIO()
    display = PlainDisplay(out)
    display(Runner(), {})
    display(Runner(), {"progress": {"totalSteps": 100}})
    assert out.getvalue() == ""
    display(Runner(), status(5))
    assert out.getvalue().strip() == "attempt 1 step 5/100 loss - samples/s -"


def test_the_rich_bar_shows_the_step_and_total_from_the_spec_until_a_report_has_one():
    out = io.StringIO()
    display = RichDisplay(out)
    display(Runner(), {"progress": {"step": 30, "loss": 1.25}})
    task = display.progress.tasks[0]
    assert (task.completed, task.total, task.fields["loss"], task.fields["rate"]) == (30, 100, "1.2500", "-")
    display(Runner(), status(60, total=120, samplesPerSecond=9.6))
    assert (task.completed, task.total, task.fields["rate"]) == (60, 120, "10")
    display.close()
