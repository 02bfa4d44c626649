"""The `trainingrun` command: one entry point, a subcommand per job.

Exit codes: 0 success, 1 invalid input (one line per problem on stderr), 2 usage errors.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from . import __version__, backends, cli_local, crd, validation
from .settings import Settings

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"


def write_files(root: str, files: dict[str, str]) -> None:
    """Generated files (relative path -> content) below `root`."""
    for relative, content in files.items():
        target = Path(root) / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
        print(f"wrote {target}")


def cmd_crd(args: argparse.Namespace) -> int:
    text = crd.crd_yaml()
    if not args.write:
        sys.stdout.write(text)
        return 0
    write_files(args.write, {relative: text for relative in crd.CRD_PATHS})
    return 0


#: Allocations between young-generation garbage collections (Python's default: 700): with the default, collections
#: took 0.3 ms of CPU a run (a twentieth) in a burst of 2,000 runs, walking over everything the operator keeps.
GC_YOUNG_THRESHOLD = 50_000


def _collect_garbage_less_often() -> None:
    """Collect rarely, and never look at what exists before the first watch (modules, classes): it lives for ever."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def cmd_operator(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses
    import logging

    from .handlers import run_operator
    from .state import OperatorState

    try:
        settings = Settings.from_env()
    except ValueError as error:
        print(f"trainingrun operator: {error}", file=sys.stderr)
        return 2
    overrides: dict = {}
    if args.namespace:
        overrides["namespaces"] = tuple(args.namespace)
    if args.all_namespaces:
        overrides["namespaces"] = ()
    if args.peering is not None:
        overrides["peering"] = args.peering
    if args.standalone:
        overrides["peering"] = ""
    for name in ("metrics_port", "health_port"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    settings = dataclasses.replace(settings, **overrides)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not args.verbose:
        # kopf says "Handler ... succeeded" for every event of every object; the operator's own
        # log (trainingrun.operator) already tells each decision once.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    state = OperatorState(settings)
    _collect_garbage_less_often()
    try:
        asyncio.run(run_operator(state))
    except Exception as error:  # noqa: BLE001 - kopf re-raises what made it stop; say it in one line when we know why
        if not state.fatal and isinstance(error, OSError):  # kopf gave up on the API server after ~1 minute of retries
            state.fatal = f"cannot reach the Kubernetes API at {state.api_server}: {error}"
        if not state.fatal:
            raise
    if state.fatal:
        print(f"trainingrun operator: {state.fatal}", file=sys.stderr)
        return 1
    return 0


def cmd_monitoring(args: argparse.Namespace) -> int:
    from . import monitoring

    generated = monitoring.files()
    if not args.write:
        for path in generated:
            print(path)
        return 0
    write_files(args.write, generated)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    failed = False
    if os.getcwd() not in sys.path:  # a class of the user's own module, as `trainingrun local` (python -m) imports it
        sys.path.insert(0, os.getcwd())
    for path in args.files:
        try:
            runs = validation.load_runs(path, import_classes=True)
        except validation.InvalidTrainingRun as error:
            failed = True
            error.print_to_stderr(path)
            continue
        for run in runs:
            print(f"{path}: TrainingRun {run.metadata.namespace}/{run.metadata.name} is valid")
            for deprecation in run.spec.checkpoint.deprecated_fields():
                print(f"  {deprecation}")
            for field, class_path in validation.unchecked_classes(run.spec.trainer, import_classes=True):
                print(
                    f"  {field}.classPath {class_path} is not importable here: the trainer checks it and its "
                    "initArgs when the run starts"
                )
    return 1 if failed else 0


def cmd_render(args: argparse.Namespace) -> int:
    try:
        runs = validation.load_runs(args.file)
    except validation.InvalidTrainingRun as error:
        error.print_to_stderr(args.file)
        return 1
    settings = Settings.from_env()
    documents = []
    for run in runs:
        if not run.metadata.uid:
            # Only the API server assigns uids; the preview uses a placeholder so it stays complete.
            print(
                f"note: {run.metadata.name} has no metadata.uid (the API server assigns one); "
                f"ownerReferences and rdzvId use {PLACEHOLDER_UID}",
                file=sys.stderr,
            )
            run = run.model_copy(update={"metadata": run.metadata.model_copy(update={"uid": PLACEHOLDER_UID})})
        backend = backends.BACKENDS[run.spec.backend or args.backend or "PyTorchJob"]
        documents += backend.children(run, args.attempt, settings, args.resume_from)
    sys.stdout.write("".join("---\n" + crd.to_yaml(d) for d in documents))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from . import follow

    def show(source: "follow.KubeSource") -> int:
        print("\n".join(follow.status_lines(source.run())))
        return 0

    return _on_the_cluster(args, "read", show)


def cmd_logs(args: argparse.Namespace) -> int:
    from . import follow

    return _on_the_cluster(
        args,
        "read the logs of",
        lambda source: (
            follow.last_hang(source)
            if args.hang
            else follow.follow_logs(source, pod_index=args.pod, attempt=args.attempt, follow=args.follow)
        ),
    )


def _on_the_cluster(args: argparse.Namespace, doing: str, action: Callable[[Any], int]) -> int:
    """`action` with the run's cluster (args.run, namespace, kubeconfig, context); a failure is one line, never a
    traceback."""
    from . import follow

    try:
        return action(follow.KubeSource(args.run, args.namespace, args.kubeconfig, args.context))
    except ImportError:
        print(follow.CLIENT_MISSING, file=sys.stderr)
        return 2
    except (follow.RunNotFound, follow.NothingToShow) as error:
        print(error, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # no kubeconfig, unreachable server, denied
        print(
            f"cannot {doing} TrainingRun {args.run}: {type(error).__name__}: {str(error).splitlines()[0][:300]}",
            file=sys.stderr,
        )
        return 1


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _shard_mb(value: str) -> int:
    try:
        megabytes = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of MiB") from None
    if megabytes <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return max(1, int(megabytes * (1 << 20)))


#: One argument: its flags (or name) and add_argument's keywords.
Argument = tuple[tuple[str, ...], dict[str, Any]]


def arg(*flags: str, **options: Any) -> Argument:
    return flags, options


#: Which cluster and namespace, as kubectl takes them.
CLUSTER = (
    arg("-n", "--namespace", help="default: the kubeconfig context's namespace, else 'default'"),
    arg("--kubeconfig", help="default: $KUBECONFIG, else ~/.kube/config"),
    arg("--context", help="kubeconfig context (default: the current one)"),
)
ENDPOINT = arg("--endpoint-url", help="S3-compatible endpoint (default: $AWS_ENDPOINT_URL)")


@dataclass(frozen=True)
class Command:
    """A subcommand: `trainingrun <path...>`, what `--help` says of it, what runs it, and its arguments."""

    path: tuple[str, ...]
    help: str
    description: str
    run: Callable[[argparse.Namespace], int]
    arguments: tuple[Argument, ...] = ()
    #: Groups of arguments of which at most one may be given.
    exclusive: tuple[tuple[Argument, ...], ...] = ()


COMMANDS = (
    Command(
        ("crd",),
        "print the TrainingRun CustomResourceDefinition",
        "Print the TrainingRun CRD generated from the API model.",
        cmd_crd,
        (
            arg(
                "--write",
                metavar="REPO_ROOT",
                help="write it to manifests/crds/ and the chart's crds/ under REPO_ROOT instead",
            ),
        ),
    ),
    Command(
        ("operator",),
        "run the operator (kopf) against the current cluster",
        "Run the TrainingRun operator: reconcile TrainingRuns into PyTorchJob attempts with recovery, status and "
        "Events. Logs in with the pod's service account, else the kubeconfig. Flags override the TRAININGRUN_* "
        "environment (see settings.py).",
        cmd_operator,
        (
            arg("--metrics-port", type=int, help="port of /metrics and /readyz (default 9090, 0 = off)"),
            arg("--health-port", type=int, help="port of kopf's liveness /healthz (default 8081, 0 = off)"),
            arg("-v", "--verbose", action="store_true", help="debug logging"),
        ),
        exclusive=(
            (
                arg(
                    "-n",
                    "--namespace",
                    action="append",
                    metavar="NS",
                    help="watch only this namespace (repeatable; env TRAININGRUN_NAMESPACES=a,b)",
                ),
                arg("-A", "--all-namespaces", action="store_true", help="watch the whole cluster (the default)"),
            ),
            (
                arg(
                    "--peering",
                    metavar="NAME",
                    help="kopf peering object: of several replicas, one acts (env TRAININGRUN_PEERING)",
                ),
                arg("--standalone", action="store_true", help="no peering: the only replica (the default)"),
            ),
        ),  # fmt: skip
    ),
    Command(
        ("monitoring",),
        "list (or write) the alert rules, monitors and Grafana dashboards",
        "Generate manifests/monitoring/: the PrometheusRule (and the same rules as a plain rules file), the "
        "trainers' PodMonitor, the operator's ServiceMonitor and the TrainingRun and fleet dashboards (JSON, and as "
        "ConfigMaps labelled grafana_dashboard=1), from operator/trainingrun_operator/monitoring.py.",
        cmd_monitoring,
        (arg("--write", metavar="REPO_ROOT", help="write the files below this directory"),),
    ),
    Command(
        ("validate",),
        "check TrainingRun files",
        "Check TrainingRun files. Exit 0 when all are valid; exit 1 with one line per problem naming the field, what "
        "is wrong and the fix.",
        cmd_validate,
        (arg("files", nargs="+", metavar="FILE", help="YAML file with one or more TrainingRuns"),),
    ),
    Command(
        ("render",),
        "print the Kubernetes objects a TrainingRun becomes",
        "Print, as multi-document YAML, the objects the operator creates for one attempt of each TrainingRun in "
        "FILE: the rendezvous Service (runs of more than one pod) and the PyTorchJob or JobSet (spec.backend, else "
        "--backend; an operator's default may differ: its setting TRAININGRUN_BACKEND).",
        cmd_render,
        (
            arg("file", metavar="FILE", help="YAML file with one or more TrainingRuns"),
            arg(
                "--backend",
                choices=tuple(backends.BACKENDS),
                help="what an attempt becomes when the run has no spec.backend (default PyTorchJob)",
            ),
            arg("--attempt", type=positive_int, default=1, help="attempt number (default 1)"),
            arg("--resume-from", metavar="URI", help="checkpoint the attempt resumes from (TRAININGRUN_RESUME_FROM)"),
        ),
    ),
    Command(
        ("local",),
        "run a TrainingRun on this machine, with recovery and fault injection",
        "Run the TrainingRun in FILE on this machine (CPU gloo, or local GPUs) with the same trainer, environment "
        "and recovery as in a cluster. Secrets the file references are read from same-named environment variables "
        "or a .env file. Ends with a line `result: steps=... goodput=...`.",
        cli_local.cmd_local,
        (
            arg("file", metavar="FILE", help="TrainingRun YAML (the same file you kubectl apply)"),
            arg("--nproc", type=positive_int, help="processes (default: spec.nprocPerNode)"),
            arg(
                "--nodes",
                type=positive_int,
                default=1,
                help="simulate this many nodes (pods): one launcher each with its own node memory, c10d rendezvous "
                "on 127.0.0.1 (default 1)",
            ),
            arg(
                "--checkpoint-uri",
                metavar="URI",
                help="override spec.checkpoint.uri (default when the file has none: file://./runs/<name>/checkpoints)",
            ),
            arg("--max-steps", type=positive_int, help="override spec.trainer.maxSteps"),
            arg(
                "--chaos-kill-step",
                type=positive_int,
                action="append",
                metavar="STEP",
                help="SIGKILL one worker when the run reaches STEP (repeatable)",
            ),
            arg("--chaos-kill-every", type=float, metavar="SECONDS", help="SIGKILL a random worker every SECONDS"),
            arg(
                "--chaos-lose-node",
                type=positive_int,
                metavar="STEP",
                help="with --nodes: after STEP, SIGKILL every process of the last node, empty its node memory and "
                "start a replacement (a node failure)",
            ),
            arg(
                "--chaos-hang",
                metavar="KIND:STEP[:RANK]",
                help="after STEP one rank (default: the last) hangs: stop (SIGSTOP), block (for ever, before the next "
                "collective) or data (its data loader blocks); spec.recovery.hangTimeoutSeconds finds it",
            ),
            arg(
                "--chaos-slow-rank",
                metavar="FACTOR[:RANK]",
                help="one rank (default: the last) takes FACTOR times as long on each step's part before its first "
                "collective, in the first worker group; spec.recovery.slowRankFactor names it",
            ),
            arg("--metrics-port", type=positive_int, help="serve the trainer's metrics on this port (default off)"),
            arg("--env-file", default=".env", help="file with secret values, KEY=VALUE lines (default .env)"),
            arg("--runs-dir", default="runs", help="where configs, logs and default checkpoints go (default runs/)"),
        ),  # fmt: skip
    ),
    Command(
        ("status",),
        "where a run on the cluster stands",
        "Phase, attempt, step and loss with an estimate of the time left, goodput and restarts, the newest "
        "checkpoint and every condition of one TrainingRun, read with your kubeconfig.",
        cmd_status,
        (arg("run", metavar="RUN", help="the TrainingRun's name"), *CLUSTER),
    ),
    Command(
        ("logs",),
        "a run's trainer log, followed across pod restarts and attempts",
        "The trainer log of one Worker pod, of the current attempt (or --attempt N). With -f it follows the pod's "
        "restarts and each next attempt until the run ends; a line starting with '==>' marks each pod shown.",
        cmd_logs,
        (
            arg("run", metavar="RUN", help="the TrainingRun's name"),
            arg("-f", "--follow", action="store_true", help="follow across restarts and attempts until the run ends"),
            arg(
                "--pod",
                type=int,
                default=0,
                metavar="INDEX",
                help="Worker pod index (default 0). Ranks are assigned anew at each restart and can move between "
                "pods; every log line names its rank",
            ),
            arg("--attempt", type=positive_int, help="this attempt only (default: the current one, then the next)"),
            arg(
                "--hang",
                action="store_true",
                help="print the whole diagnosis of the run's last hang (status.lastHang) from the pod that logged it",
            ),
            *CLUSTER,
        ),  # fmt: skip
    ),
    Command(
        ("checkpoints",),
        "list the checkpoints under a URI",
        "List the checkpoints under a run's checkpoint URI, newest first, verifying each against its manifest; "
        "invalid ones are marked with the reason.",
        cli_local.cmd_checkpoints,
        (
            arg("uri", metavar="URI", help="gs://, s3:// or file:// URI of a run's checkpoints"),
            arg("--json", action="store_true", help="print a JSON list (step, valid, model_digest, uri, time, ...)"),
            ENDPOINT,
        ),
    ),
    Command(
        ("data", "prepare"),
        "turn a folder of text files or images into shards and upload them",
        "Join the .txt files below SRC (in path order) into shards of about --shard-mb for "
        "trainingrun_trainer.shards.TextBytes, or pack its images into WebDataset tar shards for "
        "trainingrun_trainer.shards.ImageShards (--kind images), and upload them to DEST (gs://, s3://, file:// or "
        "a path).",
        cli_local.cmd_data_prepare,
        (
            arg("src", metavar="SRC", help="a local folder; every *.txt (or image) below it is read"),
            arg("dest", metavar="DEST", help="where the shards go, e.g. gs://bucket/datasets/mytext"),
            arg("--shard-mb", type=_shard_mb, default=64 << 20, help="shard size in MiB (default 64)"),
            arg("--kind", choices=("text", "images"), default="text", help="what SRC holds (default text)"),
            arg("--overwrite", action="store_true", help="replace shards DEST already holds"),
            ENDPOINT,
        ),
    ),
)
#: What a group of commands (`trainingrun data ...`) says of itself.
GROUPS = {"data": "prepare training data in object storage"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainingrun",
        description="Fault-tolerant PyTorch training on Kubernetes from one TrainingRun resource.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, Any] = {}
    for command in COMMANDS:
        *group, name = command.path
        subparsers = top
        if group:
            if group[0] not in groups:
                groups[group[0]] = top.add_parser(group[0], help=GROUPS[group[0]]).add_subparsers(
                    dest=f"{group[0]}_command", required=True, metavar="COMMAND"
                )
            subparsers = groups[group[0]]
        p = subparsers.add_parser(name, help=command.help, description=command.description)
        for flags, options in command.arguments:
            p.add_argument(*flags, **options)
        for exclusive in command.exclusive:
            one_of = p.add_mutually_exclusive_group()
            for flags, options in exclusive:
                one_of.add_argument(*flags, **options)
        p.set_defaults(func=command.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
