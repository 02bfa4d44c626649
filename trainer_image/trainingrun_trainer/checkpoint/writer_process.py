"""A rank's checkpoint files written by a separate process (`checkpoint.writerProcess`).

Serialising, hashing, uploading and the memory tier's copy run in the writer, at a low CPU priority, so they neither
hold the training process's GIL nor, while cores are free, take them from its next steps. The training process keeps everything collective (DCP's planning, the
gathering of write results, `.metadata`, the manifest): only DCP's `write_data` goes to the writer. Staged tensors
travel as handles to shared memory (the store stages into /dev/shm buffers that every save reuses); the plan and
small values are pickled. The writer answers with DCP's write results and the files' manifest entries (sizes, hashes).

A writer that dies (killed, out of memory) fails that save like any storage error: no manifest, one log record,
training goes on, and the next save starts a new writer.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from torch.multiprocessing import reductions

from .layout import logger

reductions.init_reductions()  # tensors go through pipes as handles to shared memory, not as copies


#: The writer's nice value: training threads take the cores first (about 10 times the writer's share when they
#: compete) and the writer uses what they leave. On a 2-core CPU benchmark the steps beside a 258 MB write lost 0.20 s
#: instead of 0.77 s with an in-process writer thread, whose GIL a lower priority would only make the steps wait for;
#: the write took 2.4 s instead of 1.1 s. At 19 (1.5% of a core under contention) a writer started beside CPU-bound
#: training did not finish importing torch in a minute.
WRITER_NICE = 10


class WriterDied(OSError):
    """The writer process ended before it answered."""


@dataclass
class WriteRequest:
    uri: str  #: the step directory
    options: dict  #: fsspec storage options
    sync_files: bool
    tier_root: Optional[str]  #: the memory tier (None: no copy)
    tier_dir: Optional[str]
    plan: Any  #: this rank's DCP SavePlan
    data: dict  #: {MetadataIndex: tensor (shared memory) or io.BytesIO}, as the planner resolved them
    die_after_items: Optional[int] = None  #: fault injection (tests): SIGKILL itself after writing this many items
    segments: bool = False  #: also record each file's segment digests (files written into the memory tier itself)


class WriterProcess:
    """One writer process, started on first use and kept for the next saves. Used from one thread at a time."""

    def __init__(self) -> None:
        self._process: Any = None
        self._conn: Any = None
        self._ready = False
        # Before multiprocessing's own exit handler (atexit runs the last registered first), which would wait for
        # a writer that ignores SIGTERM and waits on its pipe.
        atexit.register(self._discard)

    @property
    def pid(self) -> Optional[int]:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Start the writer (it imports torch meanwhile; the first write waits for it)."""
        if self._process is not None and self._process.is_alive():
            return
        self._discard()
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(target=_serve, args=(theirs,), name="checkpoint-writer", daemon=True)
        with _without_main():
            process.start()
        try:
            os.setpriority(os.PRIO_PROCESS, process.pid or 0, WRITER_NICE)  # before it even imports torch
        except OSError as error:
            logger.info("the checkpoint writer keeps the trainer's priority: %s", error)
        theirs.close()
        self._process, self._conn = process, ours

    def ready(self) -> bool:
        """Whether the writer has started and can take a save now (it starts at the lowest priority, so under a busy
        training loop its imports take a while: until then saves are written in-process rather than wait)."""
        self.start()
        if not self._ready and self._conn.poll(0):
            try:
                self._ready = self._conn.recv() == "ready"
            except (EOFError, OSError):
                self._discard()
        return self._ready

    def wait_ready(self, timeout: float) -> bool:
        """Wait (bounded) until the writer has started; whether it has."""
        self.start()
        if not self._ready and self._conn.poll(timeout):
            return self.ready()
        return self._ready

    def write(self, request: WriteRequest) -> tuple[list, dict]:
        """(DCP write results, {file name: its manifest entry}) of the request's files."""
        if not self.ready():
            self._ready = self._conn.recv() == "ready"  # a caller that did not ask: wait for it
        try:
            self._conn.send(request)
            status, result, record = self._conn.recv()
        except (EOFError, OSError) as error:
            process = self._process
            process.join(5)
            self._discard()
            raise WriterDied(
                f"the checkpoint writer process (pid {process.pid}) ended with exit code "
                f"{process.exitcode} before it answered ({type(error).__name__})"
            ) from None
        if status != "ok":
            raise OSError(result)
        return result, record

    def close(self) -> None:
        """End the writer. Called with no write in flight, so it holds nothing: it is killed rather than asked, since
        a writer still importing (at the lowest priority) would answer only seconds later."""
        self._discard()

    def _discard(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None
        self._ready = False


@contextmanager
def _without_main() -> Iterator[None]:
    """Spawn the writer without importing the parent's __main__ in it: a training script without an
    `if __name__ == "__main__"` guard would otherwise start training again in the writer."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class _Resolved:
    """The planner's `resolve_data` in the writer: what the training process resolved."""

    def __init__(self, data: dict, die_after_items: Optional[int]):
        self._data, self._die_after, self._given = data, die_after_items, 0

    def resolve_data(self, item: Any) -> Any:
        if self._die_after is not None and self._given >= self._die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        self._given += 1
        return self._data[item.index]


def _die_with_the_trainer() -> None:
    """Linux: the kernel kills the writer when the training process that started it dies (a SIGKILLed trainer never
    closes its end of the pipe for a writer that is still starting to notice)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve(conn: Any) -> None:
    from ..torch_internals import FsspecWriter
    from .hashing_fs import HashingFileSystem
    from .memory_tier import MemoryTier
    from .tensor_files import write_rank_file

    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s checkpoint-writer %(levelname)s %(name)s: %(message)s",
    )
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        # Ctrl-C or a SIGTERM for the whole process group: the trainer writes its emergency checkpoint through this
        # process, and the writer ends when the trainer does (its end of the pipe closes).
        signal.signal(stop, signal.SIG_IGN)
    _die_with_the_trainer()
    try:
        conn.send("ready")
    except OSError:
        return  # the training process ended while this one started
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return  # the training process is gone
        if request is None:
            return
        record: dict = {}
        try:
            writer = FsspecWriter(request.uri, sync_files=request.sync_files, overwrite=True, **request.options)
            tier = MemoryTier(request.tier_root) if request.tier_root else None
            fs = HashingFileSystem(writer.fs, record, tier, request.tier_dir, request.segments)
            results = write_rank_file(
                fs.create_stream,
                fs.concat_path,
                writer.path,
                request.plan,
                _Resolved(request.data, request.die_after_items).resolve_data,
                request.sync_files,
            )
            reply: tuple = ("ok", results, record)
        except Exception as error:  # noqa: BLE001 - every failure goes back to the save it belongs to
            logger.debug("writing %s failed", request.uri, exc_info=True)
            reply = ("error", f"{type(error).__name__}: {error}", {})
        del request  # drop the shared tensors before answering: the next save reuses them
        conn.send(reply)
