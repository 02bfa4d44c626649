"""hang_analysis: the collective waited for and the ranks that held it up, from the dumps of the ranks that answered;
dumps from other processes are parsed with caps."""

import json

import pytest

from trainingrun_trainer.hang_analysis import (
    MAX_DUMP_BYTES,
    Collective,
    DumpError,
    GroupState,
    RankDump,
    diagnose,
)

ALL_REDUCE = "gloo:all_reduce"


def waiting(rank: int, seq: int = 125, sizes: str = "[[3]]", op: str = ALL_REDUCE, **kw) -> RankDump:
    """A rank inside collective `seq` of the default group, not completed."""
    return RankDump(
        rank=rank,
        step=40,
        pod=f"pod-{rank}",
        node=f"node-{rank}",
        frames=("trainer.py:270 in _train_step", "torch/nn/parallel/distributed.py:1 in forward"),
        groups={"0": GroupState(seq, seq - 1)},
        in_flight=(Collective("0", seq, op, sizes),),
        **kw,
    )


def behind(rank: int, last: int = 124, frame: str = "trainer_setup.py:183 in batches") -> RankDump:
    return RankDump(
        rank=rank,
        step=40,
        pod=f"pod-{rank}",
        node=f"node-{rank}",
        frames=(frame,),
        groups={"0": GroupState(last, last)},
    )


def test_a_rank_that_did_not_answer_is_named_with_its_pod_and_node():
    found = diagnose(2, {0: waiting(0)}, {1: ("run-a1-worker-1", "gpu-node-7")}, timeout_seconds=31)

    assert found.waited_for == (1,)
    assert found.collective == Collective("0", 125, ALL_REDUCE, "[[3]]")
    assert "all_reduce #125 of process group 0" in found.summary
    assert "rank 1 (pod run-a1-worker-1, node gpu-node-7), which did not answer" in found.summary
    assert "hang after step 40: no progress for 31 s" in found.summary
    assert found.nodes == ("gpu-node-7",)  # from what it said at start: the operator avoids a repeat offender


def test_a_rank_that_never_entered_the_collective_is_named_with_where_it_was():
    found = diagnose(3, {0: waiting(0), 1: behind(1), 2: waiting(2)})

    assert found.waited_for == (1,)
    assert "waited for rank 1 (pod pod-1, node node-1), at trainer_setup.py:183 in batches" in found.summary
    assert any("never entered it (its last was #124)" in line for line in found.details)
    assert sum("waiting in it" in line for line in found.details) == 2
    assert found.nodes == ("node-1",)  # the node of the rank named, not of those that waited


def test_a_rank_ahead_with_async_collectives_does_not_hide_the_one_behind():
    ahead = RankDump(
        rank=0,
        step=40,
        groups={"0": GroupState(126, 124)},  # entered 125 and 126, neither completed
        in_flight=(Collective("0", 125, ALL_REDUCE, "[[3]]"), Collective("0", 126, ALL_REDUCE, "[[9]]")),
    )
    found = diagnose(2, {0: ahead, 1: behind(1)})

    assert found.collective is not None and found.collective.seq == 125  # the oldest not completed
    assert found.waited_for == (1,)


def test_every_rank_in_the_same_collective_blames_the_transport_not_a_rank():
    found = diagnose(2, {0: waiting(0), 1: waiting(1)})
    assert found.nodes == ()  # no rank named, no node to avoid

    assert found.waited_for == ()
    assert "every rank entered all_reduce #125" in found.summary and "network or transport" in found.summary


def test_mismatched_sizes_are_named():
    found = diagnose(2, {0: waiting(0, sizes="[[3]]"), 1: waiting(1, sizes="[[4]]")})

    assert "mismatched collective: rank 0 entered gloo:all_reduce sizes [[3]], rank 1 gloo:all_reduce sizes [[4]]" in (
        found.summary
    )


def test_no_rank_in_a_collective_and_one_silent():
    found = diagnose(2, {0: behind(0)})

    assert found.waited_for == (1,)
    assert "no collective in flight; rank 1 did not answer" in found.summary


def test_without_a_flight_recorder_the_silent_ranks_are_still_named():
    only_stack = RankDump(rank=0, step=9, frames=("a.py:1 in f",), recorder=False)
    found = diagnose(2, {0: only_stack})

    assert found.waited_for == (1,)
    assert "rank 1 did not answer (no flight recorder)" in found.summary
    assert "rank 0: at a.py:1 in f (no flight recorder)" in found.text()


def test_a_dump_survives_the_store_as_written():
    dump = waiting(3)
    assert RankDump.parse(dump.as_json()) == dump


@pytest.mark.parametrize(
    "raw, words",
    [
        ("x" * (MAX_DUMP_BYTES + 1), "over the"),
        ("[1, 2]", "not a JSON object"),
        ("{not json", "not JSON"),
        (json.dumps({"rank": 0, "groups": {"0": [1]}}), "wrong shape"),
        (json.dumps({"rank": 0, "frames": ["f"] * 100}), "more groups, collectives or frames"),
        (json.dumps({"rank": "zero"}), "not a whole number"),
    ],
)
def test_a_malformed_dump_is_refused_with_what_is_wrong(raw, words):
    with pytest.raises(DumpError, match=words):
        RankDump.parse(raw)


def test_text_from_another_process_is_printable_and_capped():
    dump = RankDump.parse(json.dumps({"rank": 1, "pod": "a\x1b[31mb", "frames": ["f" * 1000]}))

    assert dump.pod == "a?[31mb"
    assert len(dump.frames[0]) == 300 and dump.frames[0].endswith("...")


def test_the_recorders_entries_win_over_a_completed_count_that_lags():
    lagging_count = RankDump(
        rank=0,
        step=25,
        groups={"0": GroupState(57, 54)},  # 55 retired already, its completion not counted yet
        in_flight=(Collective("0", 56, ALL_REDUCE, "[[3]]"), Collective("0", 57, ALL_REDUCE, "[[7664]]")),
    )
    found = diagnose(2, {0: lagging_count})

    assert found.collective == Collective("0", 56, ALL_REDUCE, "[[3]]")


def test_a_rank_whose_count_lags_behind_an_async_collective_it_left_is_not_taken_as_waiting():
    """Seen on CI (2 nodes, rank 1 blocked after its step): rank 1 had gone on from the step's async all_reduce #57,
    whose completion its recorder had not counted yet, and rank 0 waited in #58; #57 alone read as "every rank
    entered it: the transport hangs"."""
    waiting_in_58 = waiting(0, seq=58, sizes="[[5]]")
    went_on = RankDump(
        rank=1,
        step=25,
        pod="pod-1",
        node="node-1",
        frames=("trainingrun_trainer/chaos.py:85 in after_step", "trainingrun_trainer/chaos.py:27 in block_forever"),
        groups={"0": GroupState(57, 56)},  # #57 retired from its entries, its completion not counted yet
    )
    found = diagnose(2, {0: waiting_in_58, 1: went_on})

    assert found.collective == Collective("0", 58, ALL_REDUCE, "[[5]]")
    assert found.waited_for == (1,)
    assert "waited for rank 1 (pod pod-1, node node-1), at trainingrun_trainer/chaos.py:27 in block_forever" in (
        found.summary
    )
