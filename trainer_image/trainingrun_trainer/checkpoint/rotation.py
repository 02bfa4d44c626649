"""Rotation: which checkpoints below a store's uri are deleted after a commit (a part of `CheckpointStore`)."""

from __future__ import annotations

from typing import Optional

from .layout import (
    MANIFEST_NAME,
    _join,
    logger,
)
from .manifest import _inspect, _step_dirs


class Rotating:
    """CheckpointStore's rotation (`rotate`). State lives in `CheckpointStore.__init__`."""

    def rotate(self) -> list[str]:
        """Delete checkpoints that are neither among the ``keep`` newest valid ones nor milestones
        (valid, step % keep_every == 0), and invalid directories older than the newest valid
        checkpoint (they can never be resumed from). Never deletes the newest valid checkpoint
        (verified by re-hash unless this process wrote it) or anything newer than it. Only rank
        0 deletes; other ranks return []. Returns the deleted URIs. Runs after every commit.

        Checkpoints older than the newest valid one are judged by presence and size only, to
        avoid reading every checkpoint on every save. A manifest is deleted before its files, so
        an interrupted deletion leaves a directory that reads as a partial save.
        """
        self.wait()
        self.wait_persisted()
        return self._rotate()

    def _rotate(self) -> list[str]:
        if self.rank != 0:
            return []
        dirs = _step_dirs(self._storage, self.uri)
        listed = {uri for _, uri in dirs}
        self._valid_before = {uri: info for uri, info in self._valid_before.items() if uri in listed}
        newest_valid: Optional[int] = None
        verdicts: list[tuple[int, str, bool]] = []
        for step, uri in dirs:
            if newest_valid is None:
                info = _inspect(self._storage, uri, step, deep=True, trusted=self._trusted, owner=self.run_uid)
                if info.valid:
                    newest_valid = step
                    self._trusted[uri] = info.manifest_sha256
            else:
                info = self._valid_before.get(uri) or _inspect(self._storage, uri, step, deep=False, owner=self.run_uid)
            if info.valid and self.keep_every and step % self.keep_every == 0:
                self._valid_before[uri] = info
            if self._another_runs(info):
                continue  # never counted, never deleted
            verdicts.append((step, uri, info.valid))
        if newest_valid is None:
            return []
        kept = 0
        doomed = []
        for step, uri, valid in verdicts:
            if step > newest_valid:
                continue  # newer than the newest valid: maybe a save in progress elsewhere
            if valid:
                kept += 1
                if kept <= self.keep or (self.keep_every and step % self.keep_every == 0):
                    continue
            doomed.append(uri)
        for uri in doomed:
            try:
                self._storage.rm_file(_join(uri, MANIFEST_NAME))
            except FileNotFoundError:
                pass
            self._trusted.pop(uri, None)
            self._valid_before.pop(uri, None)
            self._storage.rm_tree(uri)
            logger.info("rotated out checkpoint %s", uri)
        return doomed


# --------------------------------------------------------------------------------------------
