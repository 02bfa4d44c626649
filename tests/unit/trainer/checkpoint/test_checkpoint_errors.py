"""errors: what a save or a load raises, told in one line that names each failing rank's own error."""

import traceback

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from trainingrun_trainer.checkpoint.errors import SAVE_ERRORS, describe_error


def test_a_plain_error_is_its_type_and_message():
    assert describe_error(OSError("disk full")) == "OSError: disk full"


def test_dcps_exception_names_each_failing_ranks_own_error_in_rank_order():
    wrapped = (ValueError("bad shape"), traceback.extract_stack())  # as DCP keeps one: with its traceback
    failures = {2: wrapped, 0: OSError("no space left")}
    error = CheckpointException("CheckpointException ranks:dict_keys([0, 2])", failures)
    assert describe_error(error) == "rank 0: OSError: no space left; rank 2: ValueError: bad shape"


def test_dcps_exception_is_caught_though_it_is_no_exception():
    assert not issubclass(CheckpointException, Exception)  # why SAVE_ERRORS names it
    with pytest.raises(ZeroDivisionError):  # and nothing wider than an Exception: not SystemExit, KeyboardInterrupt
        try:
            raise CheckpointException("x", {})
        except SAVE_ERRORS:
            raise ZeroDivisionError from None
    assert not issubclass(KeyboardInterrupt, SAVE_ERRORS)
