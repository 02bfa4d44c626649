"""records: a save's handle tells its outcome once the save ends, and the records ranks send one another (each rank's
part of a save, rank 0's decision) arrive whole."""

import pickle
from concurrent.futures import Future

from trainingrun_trainer.checkpoint.records import CheckpointInfo, CommitOutcome, PendingSave, RankPart


def info(step: int) -> CheckpointInfo:
    return CheckpointInfo(step=step, uri=f"file:///c/step-{step:08d}", time="t", size_bytes=10, valid=True)


def test_a_pending_save_calls_back_when_it_ends_and_at_once_when_it_has():
    future: Future = Future()
    pending = PendingSave(7, future, blocking_seconds=0.25)
    heard: list = []
    pending.when_done(heard.append)
    assert (pending.done(), heard) == (False, [])
    future.set_result(info(7))
    assert heard == [info(7)] and pending.result() == info(7)
    pending.when_done(heard.append)  # already done: called now, on this thread
    assert heard == [info(7), info(7)]
    assert repr(pending) == "PendingSave(step=7, done=True)"


def test_a_failed_save_is_none_not_an_error():
    future: Future = Future()
    future.set_result(None)
    assert PendingSave(3, future, 0.0).result(timeout=0) is None


def test_what_ranks_send_each_other_arrives_whole():
    """RankPart goes to rank 0 and CommitOutcome back to every rank through torch's object collectives (pickle)."""
    part = RankPart(
        error=None, record={"__1_0.distcp": {"size": 4}}, sent=None, short_of_room=True, part_done=(20, True)
    )
    outcome = CommitOutcome(info=info(30), manifest=b"{}", metadata=b"m", copy_part=info(20))
    assert pickle.loads(pickle.dumps(part)) == part
    assert pickle.loads(pickle.dumps(outcome)) == outcome
    failed = CommitOutcome(info=None, error="rank 1: OSError: x")
    assert (failed.manifest, failed.metadata, failed.copy_part) == (b"", None, None)
