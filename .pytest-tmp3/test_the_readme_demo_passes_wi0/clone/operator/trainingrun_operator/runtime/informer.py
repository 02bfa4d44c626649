"""The operator's own list and watch of runs, jobs and pods, as any controller keeps its cache.

kopf's watching called every event through its per-event machinery (causes, handler kwargs, patches, an object
logger, a worker task per object): in a burst of 2,000 runs that was a third of the operator's CPU, and its
per-object state most of its memory. An `Informer` lists one collection page by page, then watches it from the
list's resourceVersion (with bookmarks, so a resumed watch rarely starts too far back); a watch the server ends or
drops resumes from the last resourceVersion seen; a 410 (too old) lists again and tells the objects gone since as
DELETED. Every event goes to one plain function (handlers.py). kopf still logs in, runs peering and the liveness
endpoint.

Standing by (another replica acts), the informers keep watching, so a replica that takes over knows every run at
once; only the reconcile workers wait (`OperatorState.acting`).

One object never stops a watch: an event whose handling raises is logged with the object's namespace and name, told to
`on_skipped` (a metric, and a condition on a run) and skipped; a watch that fails for any other reason lists and
watches again after a backoff. `blind_for` says how long an informer has had no answer from the server, which the
liveness probe reads: a watch that cannot list for longer than two watch periods is an operator that sees nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional
from urllib.parse import urlencode

from .kube import ApiError, Kube, WatchGone

log = logging.getLogger("trainingrun.operator")

Key = tuple[str, str]

#: Objects per page of a list, and the most bytes such a page is read at (an object is at most ~1.5 MiB in etcd; a
#: pod with the trainer config in its annotations about 0.3 MiB).
LIST_PAGE = 100
MAX_LIST_PAGE_BYTES = LIST_PAGE * (3 << 20)
#: How long the server keeps a watch open before the informer watches again (from the last resourceVersion).
WATCH_SECONDS = 300
#: Backoff after a failed list or watch (a missing CRD, RBAC, the server unreachable), doubling up to the second.
BACKOFF_SECONDS, MAX_BACKOFF_SECONDS = 0.5, 30.0
#: An informer that has had no list, watch event or watch end for this long is blind (a healthy one hears from the
#: server at least once a watch period: its bookmarks, its events, or the watch's end after WATCH_SECONDS).
BLIND_AFTER_SECONDS = 2 * WATCH_SECONDS + 60


class Index(dict):
    """(namespace, run name) -> {object name: the object as kept (indexes.slim_job, slim_pod)}."""

    def get(self, key: Any, default: Any = None) -> Any:  # type: ignore[override]
        """The objects kept for `key`, as a list (`default` or an empty list when there are none)."""
        found = dict.get(self, key)
        return list(found.values()) if found else ([] if default is None else default)

    def put(self, key: Key, name: str, obj: Optional[dict[str, Any]]) -> None:
        """Keep `obj` as `name` of `key`; None forgets it."""
        if obj is not None:
            self.setdefault(key, {})[name] = obj
        elif (found := dict.get(self, key)) is not None:
            found.pop(name, None)
            if not found:
                del self[key]


class Informer:
    """List and watch the collection at `path` (with `label_selector`), telling `on_event(type, object)` every
    ADDED, MODIFIED and DELETED; `listed` is set once the first list is told."""

    def __init__(
        self,
        client: Callable[[], Kube],
        path: str,
        on_event: Callable[[str, dict[str, Any]], None],
        label_selector: str = "",
        on_skipped: Callable[[dict[str, Any], Exception], None] = lambda obj, error: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.client, self.path, self.on_event, self.label_selector = client, path, on_event, label_selector
        self.on_skipped, self.clock = on_skipped, clock
        #: uid -> what a DELETED told after a relist needs of an object (its name, namespace, uid and labels)
        self.known: dict[str, dict[str, Any]] = {}
        #: clock() of the last answer from the server: a list told, a watch event (bookmarks too), a watch's end
        self.heard_at = clock()

    def blind_for(self) -> float:
        """Seconds since the server last answered this informer."""
        return self.clock() - self.heard_at

    async def run(self, listed: asyncio.Event) -> None:
        backoff = BACKOFF_SECONDS
        while True:
            try:
                version = await self._list()
                listed.set()
                while True:
                    version = await self._watch(version)
                    backoff = BACKOFF_SECONDS
            except WatchGone:
                log.info("watching %s: the resourceVersion is too old, listing again", self.path)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - whatever it was, watching again is the way on
                log.warning("watching %s failed, trying again in %.1f s: %s", self.path, backoff, error)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    def _tell(self, type_: str, obj: dict[str, Any]) -> None:
        """Tell one event; an event whose handling raises is skipped, said and counted: it must not end the watch of
        every other object."""
        meta = obj.get("metadata") or {}
        uid = meta.get("uid")
        try:
            if type_ == "DELETED":
                self.known.pop(str(uid), None)
            elif uid:
                self.known[uid] = {"metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "labels")}}
            self.on_event(type_, obj)
        except Exception as error:  # noqa: BLE001 - one object's fault, whatever it is
            log.warning(
                "watching %s: skipped %s of %s/%s: %s: %s",
                self.path,
                type_,
                str(meta.get("namespace"))[:253],
                str(meta.get("name"))[:253],
                type(error).__name__,
                str(error)[:300],
            )
            self.on_skipped(obj, error)

    def _query(self, **params: str) -> str:
        selector = {"labelSelector": self.label_selector} if self.label_selector else {}
        return f"{self.path}?{urlencode({**params, **selector})}"

    async def _list(self) -> str:
        """Tell every object listed (and the ones gone since the last list, as DELETED); the list's resourceVersion."""
        kube, token, seen = self.client(), "", set()
        while True:
            query = self._query(limit=str(LIST_PAGE), **({"continue": token} if token else {}))
            page = await kube.request("GET", query, max_bytes=MAX_LIST_PAGE_BYTES)
            for item in page.get("items") or []:
                uid = (item.get("metadata") or {}).get("uid")
                self._tell("MODIFIED" if uid in self.known else "ADDED", item)
                seen.add(uid)
            self.heard_at = self.clock()
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token:
                for uid in [uid for uid in self.known if uid not in seen]:
                    self._tell("DELETED", self.known[uid])
                return str((page.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, version: str) -> str:
        """Tell the events of one watch from `version`; the last resourceVersion seen."""
        query = self._query(
            watch="true", allowWatchBookmarks="true", resourceVersion=version, timeoutSeconds=str(WATCH_SECONDS)
        )
        async for event in self.client().watch(query):
            type_, obj = event.get("type"), event.get("object") or {}
            if type_ == "ERROR":
                raise ApiError(int(obj.get("code") or 500), str(obj.get("reason") or ""), str(obj.get("message") or ""))
            self.heard_at = self.clock()
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if type_ in ("ADDED", "MODIFIED", "DELETED"):
                self._tell(type_, obj)
        self.heard_at = self.clock()
        return version
