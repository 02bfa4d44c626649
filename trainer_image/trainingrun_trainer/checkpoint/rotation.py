"""`Rotation`: what a store deletes below its uri, rotating after a commit and clearing a step directory that a save
overwrites; both never touch another run's checkpoints."""

from __future__ import annotations

from typing import Optional

from .context import StoreContext
from .layout import MANIFEST_NAME, join_uri, logger
from .manifest import inspect_step, list_step_dirs
from .records import CheckpointInfo
from .storage import is_plain_dir


class Rotation:
    """Keeps the ``keep`` newest valid checkpoints and the milestones (valid, step % ``keep_every`` == 0)."""

    def __init__(self, context: StoreContext, keep: int = 3, keep_every: Optional[int] = None):
        self.check(keep, keep_every)
        self._context = context
        self.keep = keep
        self.keep_every = keep_every
        # Verdicts on milestones found valid: their number grows with the run, and every save's rotation would read
        # each one's manifest and listing again. The `keep` newest are few and judged afresh, so one that lost its
        # manifest since is removed as before; a milestone damaged after this process found it valid is left for a
        # later process to judge. Dropped when the directory leaves the listing or is overwritten.
        self._valid_before: dict[str, CheckpointInfo] = {}

    @staticmethod
    def check(keep: int, keep_every: Optional[int]) -> None:
        """Raise ValueError for a `keep` or `keep_every` no rotation can follow."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be at least 1 or None, got {keep_every}")

    def rotate(self) -> list[str]:
        """Delete checkpoints that are neither among the ``keep`` newest valid ones nor milestones, and invalid
        directories older than the newest valid checkpoint (they can never be resumed from). Never deletes the newest
        valid checkpoint (verified by re-hash unless this process wrote it) or anything newer than it. Only rank 0
        deletes; other ranks return []. Returns the deleted URIs.

        Checkpoints older than the newest valid one are judged by presence and size only, to avoid reading every
        checkpoint on every save. A manifest is deleted before its files, so an interrupted deletion leaves a
        directory that reads as a partial save."""
        context = self._context
        if context.ranks.rank != 0:
            return []
        dirs = list_step_dirs(context.storage, context.uri)
        listed = {uri for _, uri in dirs}
        self._valid_before = {uri: info for uri, info in self._valid_before.items() if uri in listed}
        newest_valid: Optional[int] = None
        verdicts: list[tuple[int, str, bool]] = []
        for step, uri in dirs:
            if newest_valid is None:
                info = inspect_step(
                    context.storage, uri, step, deep=True, trusted=context.trusted, owner=context.run_uid
                )
                if info.valid:
                    newest_valid = step
                    context.trust(info)
            else:
                info = self._valid_before.get(uri) or inspect_step(
                    context.storage, uri, step, deep=False, owner=context.run_uid
                )
            if info.valid and self.keep_every and step % self.keep_every == 0:
                self._valid_before[uri] = info
            if context.another_runs(info):
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
                context.storage.rm_file(join_uri(uri, MANIFEST_NAME))
            except FileNotFoundError:
                pass
            self._forget(uri)
            context.storage.rm_tree(uri)
            logger.info("rotated out checkpoint %s", uri)
        return doomed

    def rotate_logging_errors(self) -> None:
        """`rotate`, for after a commit: a failure is logged, never raised into the save that committed."""
        try:
            self.rotate()
        except Exception as exc:
            logger.error("checkpoint rotation below %s failed: %s", self._context.uri, exc, exc_info=True)

    def clear_step_dir(self, step_uri: str, step: int) -> None:
        """Remove what an earlier save of `step` left in its directory, before a save writes there (manifest first, so
        the directory is never a committed checkpoint with new data). Raises FileExistsError for a checkpoint of
        another run."""
        context = self._context
        listing = self.drop_manifest(step_uri, step)
        for name, entry in listing.items():
            if name == MANIFEST_NAME:
                continue
            if is_plain_dir(entry):
                context.storage.rm_tree(join_uri(step_uri, name))
            else:  # a file, or a link: the link goes, never what it points at
                context.storage.rm_file(join_uri(step_uri, name))

    def drop_manifest(self, step_uri: str, step: int) -> dict:
        """Uncommit what an earlier save of `step` left in its directory (its manifest deleted), before files of a new
        save of it go there; its files stay (a pod copying its part of a checkpoint leaves the other pods' parts).
        The directory's listing. Raises FileExistsError for a checkpoint of another run."""
        context = self._context
        listing = context.storage.listing(step_uri)
        if MANIFEST_NAME in listing and context.run_uid:
            found = inspect_step(context.storage, step_uri, step, deep=False)
            if context.another_runs(found):
                raise FileExistsError(
                    f"{step_uri} is a checkpoint of another run (uid {found.run_uid}): two runs "
                    "name the same checkpoint.uri; give each run its own"
                )
        if MANIFEST_NAME in listing:
            logger.warning("overwriting the committed checkpoint %s", step_uri)
            context.storage.rm_file(join_uri(step_uri, MANIFEST_NAME))
            self._forget(step_uri)
        return listing

    def _forget(self, uri: str) -> None:
        self._context.trusted.pop(uri, None)
        self._valid_before.pop(uri, None)
