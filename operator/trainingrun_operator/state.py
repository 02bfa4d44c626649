"""What one operator process keeps in memory (`OperatorState`), shared by the handlers, the reconcile workers and the
servers; all of it can be rebuilt from the cluster.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable, Optional

import kopf

from . import backends, builders
from .metrics import OperatorMetrics
from .runtime import leadership
from .runtime.informer import BLIND_AFTER_SECONDS, Informer
from .runtime.kube import Kube
from .runtime.rechecks import WARNING_EVENTS_READ, Key, Rechecks
from .settings import Settings

log = logging.getLogger("trainingrun.operator")


NO_CREDENTIALS = (
    "no Kubernetes credentials: no service account token in this pod "
    "(/var/run/secrets/kubernetes.io/serviceaccount/token) and no kubeconfig ($KUBECONFIG or "
    "~/.kube/config); run it in a pod with a ServiceAccount, or point KUBECONFIG at a cluster"
)


async def default_login(**kwargs: Any) -> Optional[kopf.ConnectionInfo]:
    """In a pod: the service account; elsewhere: the kubeconfig (as kopf itself would)."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is None:
        log.error(NO_CREDENTIALS)
        raise kopf.PermanentError(NO_CREDENTIALS)  # no retries: nothing will change by waiting
    return info


EVENTS_QUEUED_MAX = 10_000


@dataclass
class Reconciled:
    """What a run's last complete reconcile saw and left: a watch event that shows just that needs no reconcile
    (reconcile.decide is idempotent on its own plan)."""

    run: int  #: the run as it read it, status merged with its own writes (indexes.view)
    #: Each of the run's jobs as it left them (indexes.job_view), the job it created as it sent it. A job it
    #: deleted or suspended is left out: its events are reconciled.
    jobs: dict[str, int]


@dataclass
class Rejection:
    generation: Optional[int]  #: the spec generation whose children were refused
    retry_at: float  #: time.monotonic() of the next try
    delay: float


@dataclass
class OperatorState:
    """What one operator process keeps in memory; all of it can be rebuilt from the cluster."""

    settings: Settings
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    login: Callable[..., Awaitable[Optional[kopf.ConnectionInfo]]] = default_login
    clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)
    connection: Optional[kopf.ConnectionInfo] = None
    kube: Optional[Kube] = None
    ready: bool = False
    logged_in: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set while this replica acts: always when standalone, else when kopf's peering lets it (leadership.py).
    acting: asyncio.Event = field(default_factory=asyncio.Event)
    identity: str = field(default_factory=leadership.identity)
    priority: int = field(default_factory=leadership.start_priority)
    #: Operator-owned status as last written, until the watch shows it: no double charging.
    written: dict[Key, dict[str, Any]] = field(default_factory=dict)
    locks: dict[Key, asyncio.Lock] = field(default_factory=lambda: collections.defaultdict(asyncio.Lock))
    #: Runs waiting in `work` for a reconcile worker, each once however often it was triggered meanwhile.
    queued: set[Key] = field(default_factory=set)
    work: asyncio.Queue = field(default_factory=asyncio.Queue)
    #: Events waiting to be posted: a reconcile never waits for one (they have the lowest priority of all
    #: requests, and a reconcile waiting for its Event held up the runs behind it).
    events: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(EVENTS_QUEUED_MAX))
    #: When runs are reconciled without an event (rechecks.py).
    rechecks: Rechecks = field(init=False)
    #: Runs whose children the API server refused, until when they wait (see _children_refused).
    rejections: dict[Key, Rejection] = field(default_factory=dict)
    #: Jobs created by this process that the watch may not have shown yet: not created twice.
    created_jobs: set[tuple[str, str]] = field(default_factory=set)
    #: uids of the jobs this process created: a run's own from their creation on, before their signature
    #: (naming.job_signature, which needs the uid the creation gave) shows in the watch (indexes.run_owns_job).
    made_jobs: set[str] = field(default_factory=set)
    tasks: list[asyncio.Task] = field(default_factory=list)
    #: Every run as its last watch event showed it, slimmed (indexes.slim_run), kept by handlers.run_event.
    runs: dict[Key, dict[str, Any]] = field(default_factory=dict)
    #: What each run's last reconcile saw and left: a watch event showing just that is not queued.
    reconciled: dict[Key, Reconciled] = field(default_factory=dict)
    #: The jobs of each backend (by kind), their parts ("parts") and pods ("pods") of each run (informer.Index), kept by
    #: handlers.job_event, part_event and pod_event.
    indexes: Optional[dict[str, Any]] = None
    #: Which backends this operator runs (backends.choose), decided at start from the settings and the CRDs served.
    backends: backends.Choice = field(default_factory=lambda: backends.choose(Settings(backend="PyTorchJob"), ()))
    #: Set once `backends` is chosen (handlers._inform).
    backends_chosen: asyncio.Event = field(default_factory=asyncio.Event)
    #: When this process started: jobs its status named before then are the run's even unsigned (run_owns_job).
    started: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    #: Why the operator gave up (e.g. no credentials); the CLI exits 1 with it.
    fatal: Optional[str] = None
    stop: Optional[asyncio.Future] = None
    #: Set once runs, jobs and pods were each listed (handlers._inform): reconciles wait for it.
    informed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Each informer and the task running it (handlers._inform), for the liveness probe (`blind_watches`).
    watches: list[tuple[Informer, asyncio.Task]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rechecks = Rechecks(
            enqueue=self.enqueue,
            list_warnings=self._list_warnings,
            settings=self.settings,
            clock=lambda: self.clock(),  # looked up at each call: a test may set another
        )

    async def _list_warnings(self, namespace: str) -> tuple[list[dict[str, Any]], bool]:
        return await self.client().list(
            "v1", "Event", namespace, most=WARNING_EVENTS_READ, fieldSelector="type=Warning"
        )

    def recheck_ready(self) -> bool:
        """Whether the rechecks act: this replica has seen the runs and acts (leads)."""
        return self.indexes is not None and self.acting.is_set()

    def blind_watches(self) -> list[str]:
        """What makes this operator blind: a watch task that ended, or one the server has not answered for
        informer.BLIND_AFTER_SECONDS (it keeps failing to list or watch). Empty while it sees."""
        blind = []
        for informer, task in self.watches:
            if task.done():
                blind.append(f"the watch of {informer.path} ended")
            elif informer.blind_for() > BLIND_AFTER_SECONDS:
                blind.append(f"no answer to the watch of {informer.path} for {informer.blind_for():.0f} s")
        return blind

    @property
    def api_server(self) -> str:
        """The API server's address, for messages (never the credentials)."""
        return self.connection.server if self.connection is not None else "?"

    def client(self) -> Kube:
        if self.kube is None:
            assert self.connection is not None, "no login yet"
            self.kube = Kube(
                self.connection,
                on_error=lambda code: self.metrics.api_errors.labels(str(code)).inc(),
                in_flight=self.settings.api_requests_in_flight,
            )
        return self.kube

    def enqueue(self, key: Key) -> None:
        if key not in self.queued:
            self.queued.add(key)
            self.work.put_nowait(key)

    def queue_event(self, body: dict[str, Any], note: builders.Note) -> None:
        try:
            self.events.put_nowait(builders.event_object(body, note, self.clock()))
        except asyncio.QueueFull:
            self.metrics.events_dropped.inc()
            meta = body.get("metadata") or {}
            log.warning(
                "%s/%s: %s: %s (not posted as an Event: %d are waiting to be posted)",
                meta.get("namespace"),
                meta.get("name"),
                note.reason,
                note.message,
                EVENTS_QUEUED_MAX,
            )

    def acting_changed(self, acting: bool) -> None:
        """This replica starts or stops acting (leadership.follow). Standing by, it forgets what it wrote and decided:
        another replica writes meanwhile, and when this one acts again the server's status is the truth (a full
        sweep reconciles every run then, and due times come again)."""
        self.metrics.acting.set(1 if acting else 0)
        if not acting:
            self.written.clear()
            self.reconciled.clear()
            self.rechecks.clear()

    def forget(self, key: Key) -> None:
        self.runs.pop(key, None)
        self.reconciled.pop(key, None)
        self.written.pop(key, None)
        self.rechecks.forget(key)
        self.rejections.pop(key, None)
        self.metrics.phases.pop(key, None)
        self.metrics.time_breakdowns.pop(key, None)
        self.locks.pop(key, None)
        self.queued.discard(key)
        self.metrics.forget_run(*key)
