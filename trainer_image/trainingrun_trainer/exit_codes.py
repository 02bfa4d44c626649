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


def is_permanent(code: int) -> bool:
    return 1 <= code <= 127
