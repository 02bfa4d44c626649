"""plans: what the operator remembers of its own status writes until the watch shows them."""

from test_reconcile import observe_jobset

from trainingrun_operator import backends, plans, reconcile
from trainingrun_operator.indexes import merged_status


def test_a_jobset_runs_next_reconcile_before_the_watch_caught_up_still_reads_a_jobset_run():
    """The first attempt's status patch, remembered, with nothing of it watched yet: the run's backend must read as
    JobSet (its remembered jobName without its backend read as a PyTorchJob run from before status recorded one)."""
    first = reconcile.decide(observe_jobset())
    assert first.start_attempt == 1
    status = merged_status({}, plans.remembered(first.status))
    choice = backends.Choice(backends.PYTORCHJOB, (backends.PYTORCHJOB, backends.JOBSET))
    assert choice.of(None, status) is backends.JOBSET
    assert set(plans.remembered(first.status)) == set(first.status)  # every field it wrote
