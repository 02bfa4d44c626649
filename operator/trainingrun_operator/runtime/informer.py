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
"""

from __future__ import annotations

import asyncio
import logging
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
    ):
        self.client, self.path, self.on_event, self.label_selector = client, path, on_event, label_selector
        #: uid -> what a DELETED told after a relist needs of an object (its name, namespace, uid and labels)
        self.known: dict[str, dict[str, Any]] = {}

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
            except (ApiError, OSError, ValueError) as error:  # OSError: the connection; ValueError: a bad line
                log.warning("watching %s failed, trying again in %.1f s: %s", self.path, backoff, error)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    def _tell(self, type_: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        uid = meta.get("uid")
        if type_ == "DELETED":
            self.known.pop(str(uid), None)
        elif uid:
            self.known[uid] = {"metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "labels")}}
        self.on_event(type_, obj)

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
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if type_ in ("ADDED", "MODIFIED", "DELETED"):
                self._tell(type_, obj)
        return version
