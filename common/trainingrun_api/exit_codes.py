"""Exit codes, following PyTorchJob `restartPolicy: ExitCode`: 1-127 permanent, 128-255 retryable."""

OK = 0
#: Bad config, missing class, unsupported precision: retrying cannot help.
CONFIG_ERROR = 2
#: The non-finite policy gave up after its rollbacks.
DIVERGED = 3
#: The newest committed checkpoint holds what may not be loaded (code, not plain values): a person must look.
CHECKPOINT_REFUSED = 4
#: SIGTERM (preemption, node drain): an emergency checkpoint was written; resume elsewhere.
PREEMPTED = 128 + 15
#: A failure that may pass (storage down at start, rendezvous lost): retry.
RETRYABLE = 128 + 10
#: The run made no progress for spec.recovery.hangTimeoutSeconds and the rank that found it said who held it up
#: (`hang diagnosis:` in the log): the worker group restarts in place, charged as a failure.
HUNG = 128 + 14


#: What an exit code means to recovery (`classify`).
SUCCEEDED, PERMANENT, PREEMPTION, FAILURE = "succeeded", "permanent", "preemption", "failure"


def is_permanent(code: int) -> bool:
    return 1 <= code <= 127


def classify(code: int, stopping: bool = False) -> str:
    """The one table of what an attempt's exit code means, used by the operator and `trainingrun local`.

    0 succeeded. 143 is the trainer's exit after its emergency checkpoint on SIGTERM: a preemption. 137 (SIGKILL)
    and 130 (SIGINT) are preemptions only while the process was being stopped (`stopping`: its pod was being
    deleted, the local run interrupted), when the kill came after or instead of SIGTERM; otherwise they are failures
    (the OOM killer, a crash). 1-127 are the trainer's permanent verdicts (bad config, divergence). Anything else
    (138 RETRYABLE, 128 + another signal) is a failure: retried, charged to spec.recovery.maxFailures.
    """
    if code == OK:
        return SUCCEEDED
    if code == PREEMPTED or (stopping and code in (128 + 9, 128 + 2)):
        return PREEMPTION
    if is_permanent(code):
        return PERMANENT
    return FAILURE
