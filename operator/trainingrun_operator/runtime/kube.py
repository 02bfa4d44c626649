"""A small async Kubernetes API client for the operator's own calls (kopf keeps its own for logging in and peering).

Only what the operator does: create, patch (merge or JSON), delete, list, watch and discover, over aiohttp's
client (which kopf brings; keep-alive connections). It connects with the same
credentials kopf logged in with (`kopf.ConnectionInfo`), retries throttling and server errors with
backoff (honouring Retry-After), and raises `ApiError` with the status code for everything else,
so callers can treat 409 on create as "already there" and 404 on delete as "already gone".
Every error is counted by status code in the operator metrics. Everything else that goes wrong between the operator
and the server (no connection, a timeout, bytes that are not HTTP, an answer too long) is an OSError
(`ApiUnreachable`, `AnswerTooLarge`), which every caller already treats as "the API server could not be reached".

Requests go out at most `in_flight` at a time, the waiting ones by priority: what starts training (an
attempt's children) before status, status before Events. In a burst of new runs the API server is the
bottleneck; without an order every run's status and Event write delayed every other run's PyTorchJob.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from typing import Any, AsyncIterator, Callable, Optional
from urllib.parse import urlencode

import aiohttp
import orjson

from trainingrun_api import nesting

log = logging.getLogger("trainingrun.operator")

#: The most bytes of one page of a list the operator reads: objects others write (an Event's message has no limit but
#: the object's, about 1.5 MiB) must not make it hold gigabytes; 500 ordinary Warning Events take about 0.5 MiB.
MAX_PAGE_BYTES = 16 << 20
#: The most bytes of any other answer: one object (etcd holds at most ~1.5 MiB) or a discovery document.
MAX_ANSWER_BYTES = 16 << 20
#: Seconds to open a connection (TCP and TLS handshake), and a whole request and its answer at most.
CONNECT_TIMEOUT_SECONDS = 30.0
REQUEST_TIMEOUT_SECONDS = 300.0
#: Connections to the API server at once (the gate lets fewer requests through; watches have their own).
CONNECTIONS_MAX = 64

#: (apiVersion, kind) -> plural, for the kinds the operator writes or watches.
PLURALS = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Event"): "events",
    ("v1", "Pod"): "pods",
    ("v1", "Node"): "nodes",
    ("discovery.k8s.io/v1", "EndpointSlice"): "endpointslices",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjobs",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobsets",
    ("batch/v1", "Job"): "jobs",
    ("trainingrun.dev/v1alpha1", "TrainingRun"): "trainingruns",
}
RETRIED_STATUSES = (429, 500, 502, 503, 504)
#: Who the API server's managedFields say wrote what the operator applies server-side.
FIELD_MANAGER = "trainingrun-operator"
#: Priorities of requests, most urgent first: creating, changing and deleting children; a run's status;
#: Events (kubectl describe), which nothing waits for; TokenReviews of report tokens the operator has not seen
#: (anyone who reaches the report endpoint can send one, so they never go ahead of the operator's own work).
ACT, STATUS, EVENT, REVIEW = 0, 1, 2, 3


#: Requests in flight at once by default (settings.Settings.api_requests_in_flight, which the operator passes).
REQUESTS_IN_FLIGHT = 32


class PriorityGate:
    """At most `limit` holders at a time; waiters are let in by priority (lowest first), then in order."""

    def __init__(self, limit: int):
        self.limit, self.holders = limit, 0
        self._waiting: list[tuple[int, int, asyncio.Future]] = []
        self._order = itertools.count()

    async def __call__(self, priority: int) -> "PriorityGate":
        if self.holders < self.limit and not self._waiting:
            self.holders += 1
            return self
        turn = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._order), turn))
        try:
            await turn  # the releaser counted this holder in already
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # let in, then cancelled before it could use its turn
            raise
        return self

    def release(self) -> None:
        self.holders -= 1
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():  # skip waiters that were cancelled
                self.holders += 1
                turn.set_result(None)
                return


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


class AnswerTooLarge(OSError):
    """The server's answer was longer than its reader would hold."""


class ApiUnreachable(OSError):
    """The request got no answer the operator can read: no connection, a timeout, or bytes that are not HTTP."""


def _unreachable(where: str, error: BaseException) -> ApiUnreachable:
    return ApiUnreachable(f"{where}: {type(error).__name__}: {str(error)[:300]}")


class WatchGone(Exception):
    """A watch's resourceVersion is too old (410 Gone): list again."""


#: The longest watch event read (bytes): etcd holds objects of at most ~1.5 MiB, the API server takes 3 MiB requests.
MAX_WATCH_LINE_BYTES = 16 << 20
#: A watch with nothing to read for this long is taken as dropped (the server sends bookmarks about every minute).
WATCH_READ_TIMEOUT_SECONDS = 600


#: How deep an answer's JSON is kept: arrays and objects deeper than this (orjson refuses past 1024, and writes at most
#: 254) are cut to CUT_MARKER. The API server stores whatever nesting its own decoder takes in free-form fields (a
#: run's `initArgs`), and one such object made every list page holding it unreadable, for ever.
MAX_DECODED_DEPTH = 128
CUT_MARKER = b'"<cut: nested too deep>"'


def _decoded(raw: bytes | bytearray) -> Any:
    """An answer's JSON (orjson: a third of the standard library's CPU, a depth limit, and a ValueError for whatever
    it refuses); an empty answer is an empty dict. Past orjson's depth limit, the JSON with what nests deeper than
    MAX_DECODED_DEPTH cut (whoever reads an object checks its depth: indexes.slim_run)."""
    if not raw.strip():
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        if "depth" not in str(error) and "recursion" not in str(error):
            raise
    cut, cuts = nesting.cut_deeper_than(raw, MAX_DECODED_DEPTH, CUT_MARKER)
    log.warning("an answer of %d bytes nests deeper than JSON is read here: %d values cut", len(raw), cuts)
    return orjson.loads(cut)


def collection_path(api_version: str, kind: str, namespace: Optional[str]) -> str:
    plural = PLURALS[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"


def object_path(api_version: str, kind: str, namespace: Optional[str], name: str, subresource: str = "") -> str:
    path = f"{collection_path(api_version, kind, namespace)}/{name}"
    return f"{path}/{subresource}" if subresource else path


class Kube:
    """API calls with kopf's credentials. `on_error(status)` is told about every failed call."""

    def __init__(
        self,
        info: Any,
        *,
        on_error: Callable[[int], None] = lambda status: None,
        retries: int = 4,
        backoff_seconds: float = 0.2,
        in_flight: int = REQUESTS_IN_FLIGHT,
    ):
        self.server = info.server.rstrip("/")
        self.gate = PriorityGate(in_flight)
        self.on_error = on_error
        self.retries, self.backoff_seconds = retries, backoff_seconds
        from .. import __version__

        headers = {
            "Accept": "application/json",
            "Accept-Encoding": "identity",  # the API server gzips large answers when asked: CPU on both sides for nothing
            "User-Agent": f"trainingrun-operator/{__version__}",
            **info.as_http_headers(),
        }  # bearer token or basic auth
        self._headers = headers
        self._ssl = info.as_ssl_context() if self.server.startswith("https:") else False  # kopf's: CA, client cert
        self._session: Optional[aiohttp.ClientSession] = None

    def session(self) -> aiohttp.ClientSession:
        """The connections' pool, made on first use (aiohttp wants a running loop)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(ssl=self._ssl, limit=CONNECTIONS_MAX),
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS, connect=CONNECT_TIMEOUT_SECONDS),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        priority: int = ACT,
        answer: bool = True,
        max_bytes: Optional[int] = None,
    ) -> dict[str, Any]:
        """The server's answer as a dict; with `answer=False` an empty one, unread: a write's answer is the whole
        object written, and decoding what no caller used was a tenth of the operator's CPU in a burst of runs.
        `max_bytes`: a longer answer is not read (`AnswerTooLarge`): what others wrote (Events) may be large."""
        data = None if body is None else orjson.dumps(body)  # once, however often the request is tried
        headers = {} if data is None else {"Content-Type": content_type}
        for attempt in range(self.retries + 1):
            await self.gate(priority)
            try:
                status, reason, retry_after, raw = await self._exchange(
                    method, path, headers, data, max_bytes or MAX_ANSWER_BYTES
                )
            finally:
                self.gate.release()
            if status < 400:
                return (_decoded(raw) or {}) if answer else {}
            self.on_error(status)
            try:
                payload = _decoded(raw)
                payload = payload if isinstance(payload, dict) else {}
            except ValueError:
                payload = {}
            if status in RETRIED_STATUSES and attempt < self.retries:
                delay = (
                    float(retry_after)
                    if retry_after.isascii() and retry_after.isdigit() and len(retry_after) < 6
                    else self.backoff_seconds * 2**attempt
                )
                await asyncio.sleep(min(delay, 10.0))  # outside the gate: a throttled call holds no place
                continue
            raise ApiError(status, str(payload.get("reason") or reason), str(payload.get("message") or ""))
        raise AssertionError("unreachable")

    async def _exchange(
        self, method: str, path: str, headers: dict[str, str], data: Optional[bytes], max_bytes: int
    ) -> tuple[int, str, str, bytes]:
        """(status, reason, Retry-After, body) of one request; the body read only while it is at most `max_bytes`."""
        where = f"{method} {path.split('?')[0][:200]}"
        try:
            async with self.session().request(method, self.server + path, data=data, headers=headers) as response:
                pieces, size = [], 0
                while piece := await response.content.read(1 << 20):
                    size += len(piece)
                    if size > max_bytes:
                        response.close()  # never kept: the rest of the answer is still on its way
                        raise AnswerTooLarge(f"{where}: the answer is longer than {max_bytes} bytes")
                    pieces.append(piece)
                return response.status, response.reason or "", response.headers.get("Retry-After", ""), b"".join(pieces)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
            raise _unreachable(where, error) from error

    async def create(self, obj: dict[str, Any], priority: int = ACT, answer: bool = False) -> dict[str, Any]:
        """POST with strict field validation: a field the server does not know is an error (400), never
        silently dropped (the PyTorchJob CRD would prune it without a word). With `answer`, the object created."""
        meta = obj["metadata"]
        path = collection_path(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        return await self.request("POST", path + "?fieldValidation=Strict", obj, priority=priority, answer=answer)

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Any,
        subresource: str = "",
        json_patch: bool = False,
        priority: int = ACT,
    ) -> None:
        """A merge patch (a dict), or with `json_patch` a JSON patch (a list of operations, all or none)."""
        path = object_path(api_version, kind, namespace, name, subresource)
        content_type = "application/json-patch+json" if json_patch else "application/merge-patch+json"
        await self.request("PATCH", path, patch, content_type=content_type, priority=priority, answer=False)

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any]:
        return await self.request("GET", object_path(api_version, kind, namespace, name))

    async def apply(self, obj: dict[str, Any], priority: int = ACT) -> None:
        """Server-side apply as FIELD_MANAGER, taking over conflicting fields: creates the object, or makes the fields
        `obj` names what it says (a no-op, which writes nothing, when they already are)."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        query = urlencode({"fieldManager": FIELD_MANAGER, "force": "true", "fieldValidation": "Strict"})
        await self.request(
            "PATCH",
            f"{path}?{query}",
            obj,
            content_type="application/apply-patch+yaml",
            priority=priority,
            answer=False,
        )

    async def delete(self, api_version: str, kind: str, namespace: str, name: str, uid: Optional[str] = None) -> None:
        """Delete (background propagation); with `uid`, only that object (409 when the name is another's now)."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self.request("DELETE", object_path(api_version, kind, namespace, name), body, answer=False)
        except ApiError as error:
            if error.status != 404:
                raise

    async def list(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        *,
        page_size: int = 500,
        most: int = 2000,
        page_bytes: int = MAX_PAGE_BYTES,
        pages: int = 0,
        **params: str,
    ) -> tuple[list[dict[str, Any]], bool]:
        """The items of a collection (selectors as keyword arguments), `page_size` a request, following the server's
        continue token up to `most` items and `pages` requests (0: four times the pages `most` fills); whether that
        was all of them (a namespace may hold more than a page, and more than is worth holding). The API may answer
        a page with fewer items than asked, even none, and a continue token (a server that filters by a field
        selector after reading a page from etcd); v1.36 serving from its watch cache filters first
        (test_kube_real), but the number of requests is bounded either way. A page longer than `page_bytes` raises
        `AnswerTooLarge`."""
        items: list[dict[str, Any]] = []
        path, token = collection_path(api_version, kind, namespace), ""
        requests = pages or 4 * -(-most // page_size)
        while len(items) < most and requests > 0:
            requests -= 1
            query = {**params, "limit": str(min(page_size, most - len(items)))}
            if token:
                query["continue"] = token
            found = await self.request("GET", f"{path}?{urlencode(query)}", max_bytes=page_bytes)
            items.extend(found.get("items") or [])
            token = (found.get("metadata") or {}).get("continue") or ""
            if not token:
                return items, True
        return items, False

    async def watch(self, path: str, max_line_bytes: int = MAX_WATCH_LINE_BYTES) -> AsyncIterator[dict[str, Any]]:
        """The events of a watch request, as dicts, until the server ends it. Outside the gate: a watch stays open.
        `WatchGone` on 410 (the resourceVersion is too old: list again), ApiError on other refusals; a line longer than
        `max_line_bytes` is a ValueError."""
        timeout = aiohttp.ClientTimeout(
            total=None, connect=CONNECT_TIMEOUT_SECONDS, sock_read=WATCH_READ_TIMEOUT_SECONDS
        )
        try:
            async with self.session().get(self.server + path, timeout=timeout) as response:
                async for event in self._events(path, response, max_line_bytes):
                    yield event
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            raise _unreachable(f"GET {path.split('?')[0][:200]}", error) from error

    async def _events(
        self, path: str, response: aiohttp.ClientResponse, max_line_bytes: int
    ) -> AsyncIterator[dict[str, Any]]:
        if response.status == 410:
            raise WatchGone(path.split("?")[0])
        if response.status >= 400:
            text = (await response.content.read(1000)).decode("utf-8", "replace")
            self.on_error(response.status)
            raise ApiError(response.status, response.reason or "", text[:1000])
        pending, start = bytearray(), 0
        async for piece in response.content.iter_any():
            pending += piece
            # Every whole line of what arrived, then one cut: cutting after each line moved the rest each time,
            # and in a burst a piece holds hundreds of events.
            while (end := pending.find(b"\n", start)) >= 0:
                line = pending[start:end]
                start = end + 1
                if line.strip():
                    event = _decoded(line)
                    if (event.get("object") or {}).get("code") == 410 and event.get("type") == "ERROR":
                        raise WatchGone(path.split("?")[0])
                    yield event
            del pending[:start]
            start = 0
            if len(pending) > max_line_bytes:
                raise ValueError(f"GET {path.split('?')[0]}: a watch event longer than {max_line_bytes} bytes")

    async def serves(self, api_version: str, plural: str) -> bool:
        """Whether the API server serves this resource (e.g. a CRD is installed)."""
        try:
            found = await self.request("GET", f"/apis/{api_version}")
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in found.get("resources", []))
