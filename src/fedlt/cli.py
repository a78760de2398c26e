"""The ``fedlt`` command line.

User errors (bad config, missing data, impossible partitions) print one line and exit with
code 2; nothing is left half-written because every check runs before the run directory exists.
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, List, Optional


def _stopped_while_loading(signum: int, _frame) -> None:
    """Ctrl-C while the command line loads (typer, pydantic: a fraction of a second) ended in a traceback
    of the import it cut short; nothing has started, so the command only says so."""
    os.write(2, b"fedlt: interrupted while starting; nothing was done\n")
    os._exit(130)


# not where SIGINT is ignored (a command started with `&` by a script), nor outside the main thread
_LOADING = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) not in (
    signal.SIG_IGN, None)
_BEFORE_LOADING = signal.signal(signal.SIGINT, _stopped_while_loading) if _LOADING else None

import typer  # noqa: E402
from typer.core import TyperArgument, TyperGroup  # noqa: E402

from fedlt.errors import FedltError, Terminated, one_line, terminate_as_interrupt  # noqa: E402


def _keeping_argument_help(init: Callable) -> Callable:
    """TyperArgument sets its help before calling click's Argument, which from click 8.5 takes a help
    of its own and resets it to None: every command's positional arguments lost their help in --help."""
    def keep(self, *args, help: Optional[str] = None, **kwargs) -> None:
        init(self, *args, help=help, **kwargs)
        self.help = help
    return keep


TyperArgument.__init__ = _keeping_argument_help(TyperArgument.__init__)


class _SuiteGroup(TyperGroup):
    """``fedlt bench NAME ...`` means ``fedlt bench run NAME ...`` for any NAME that is not a
    subcommand, so built-in suites and suite files run by name (``fedlt bench demo``)."""

    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().resolve_command(ctx, args)


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Federated learning on long-tailed data.")
bench_app = typer.Typer(cls=_SuiteGroup, no_args_is_help=True,
                        help="Benchmarks: `fedlt bench SUITE` runs a suite (built-in name or YAML file); "
                             "`fedlt bench list`; `fedlt bench speed`; `fedlt bench profile`; `fedlt bench paper-rounds`; "
                             "`fedlt bench engines`.")
app.add_typer(bench_app, name="bench")
data_app = typer.Typer(no_args_is_help=True, help="Inspect a federation's data without training.")
app.add_typer(data_app, name="data")


#: an OSError with one of these on a named path is the system refusing the user's path, not a bug (a name
#: longer than the file system allows too: ``Path.is_dir`` and ``exists`` raise that one instead of saying no)
REFUSED_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG}


#: what an interrupted command says where it has nothing of its own to resume from
RERUN_HINT = "what it had written may be incomplete; run the same command again"
#: what an interrupted new run says where it set no line of its own (Flower's runtime carries none)
NOT_STARTED_HINT = "there is nothing to resume (the run had not started, or ran on Flower); run the same command again"
BENCH_HINT = "the same `fedlt bench` command runs the suite's unfinished cells again"


def _guard(fn: Callable[[], None], run_hint: bool = False, hint: str = RERUN_HINT) -> None:
    """Run ``fn``; a FedltError becomes one line on stderr and exit code 2, no traceback. An interrupt
    names how the work goes on: with ``run_hint`` (one run's command) as the run's own folder says, where
    the run set that line, else ``hint``."""
    try:
        with terminate_as_interrupt():
            fn()
    except FedltError as err:
        typer.echo(f"fedlt: error: {one_line(str(err))}", err=True)
        raise typer.Exit(2)
    except KeyboardInterrupt as stop:
        by = " by SIGTERM" if isinstance(stop, Terminated) else ""
        if run_hint:
            hint = getattr(stop, "resume_hint", None) or hint
        else:  # a bench's names the cells it stopped (a run's own resume_hint is not this command's)
            hint = getattr(stop, "bench_hint", None) or hint
        typer.echo(f"fedlt: interrupted{by}; {hint}", err=True)
        raise typer.Exit(143 if by else 130)
    except OSError as err:  # a path the system refused (read-only, permissions, a full disk): the user's to fix
        if err.filename is None or err.errno not in REFUSED_PATH_ERRNOS:
            raise
        typer.echo(f"fedlt: error: {err.strerror or err}: {one_line(str(err.filename))}; choose a path fedlt can read "
                   "and write (and room on its disk)", err=True)
        raise typer.Exit(2)


@app.command("run")
def run_cmd(
    args: Optional[List[str]] = typer.Argument(None, help="\\[CONFIG.yaml] \\[key=value ...], e.g. data.alpha=0.1 "
                                               "fl.rounds=50"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="continue RUN_DIR from its last checkpoint (with "
                                          "key=value only for run.*, data.root, eval.batch_size)"),
    data_root: Optional[str] = typer.Option(None, "--data-root", help="dataset folder (same as data.root=DIR)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output and no note: lines (unread settings, risky pairings)"),
) -> None:
    """Run one experiment and write its run directory (config, metrics, summary, report, plot)."""
    args = list(args or [])

    def go() -> None:
        from fedlt import api
        from fedlt.errors import ConfigError

        if resume is not None:
            if args and "=" not in args[0]:
                raise ConfigError(f"--resume continues a run with its saved config; drop {args[0]} (only run.*, "
                                  "data.root and eval.batch_size may be given, as key=value)")
            result = api.resume(resume, overrides=args + ([f"data.root={data_root}"] if data_root else []), quiet=quiet)
        else:
            config = args.pop(0) if args and "=" not in args[0] else None
            overrides = args + ([f"data.root={data_root}"] if data_root else [])
            result = api.run(config, overrides=overrides, quiet=quiet)
        f = result.summary["final"]
        parts = [f"{k} {f[k]:.2f}" for k in ("acc", "many_acc", "medium_acc", "few_acc", "pm_acc") if f.get(k) is not None]
        typer.echo(f"{result.run_dir}: round {f['round']}: " + ", ".join(parts))
        from fedlt.results import model_notes

        for line in model_notes(result.summary):
            typer.echo(f"note: {line}", err=True)

    # a resume stopped before the run set its line (importing torch, reading the data) left the folder as it was
    _guard(go, run_hint=True, hint=NOT_STARTED_HINT if resume is None else
           f"`fedlt run --resume {shlex.quote(str(resume))}` goes on from its checkpoint")


@app.command("deploy")
def deploy_cmd(
    args: Optional[List[str]] = typer.Argument(None, help="CONFIG.yaml \\[key=value ...], e.g. "
                                               "configs/synthetic_smoke.yaml fl.rounds=2 (none with --resume)"),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="SuperNodes to start, each serving partition I of N "
                                        "(default 3; with --node-data: one per site folder)"),
    node_data: Optional[Path] = typer.Option(None, "--node-data", metavar="DIR", help="one SuperNode per subfolder "
                                             "of DIR, each training on its own folder (flower.node_data=true)"),
    server_test: Optional[Path] = typer.Option(None, "--server-test", metavar="DIR", help="with --node-data: the "
                                               "server's test set, an image-folder tree (eval.test_data)"),
    tls: bool = typer.Option(False, "--tls", help="TLS with a throw-away CA made by openssl (default: --insecure)"),
    auth: bool = typer.Option(False, "--auth", help="with --tls: SuperNode authentication, each SuperNode with its "
                              "own key pair registered with the SuperLink"),
    workdir: Path = typer.Option(Path("runs/deploy"), "--workdir", help="logs, certificates, keys, Flower state"),
    timeout: float = typer.Option(3600, "--timeout", help="seconds before the run is abandoned"),
    resume: Optional[Path] = typer.Option(None, "--resume", metavar="RUN_DIR", help="go on with a deployed run from "
                                          "its last checkpoint, on new SuperNodes (clients without state between "
                                          "rounds); its own config, no CONFIG"),
) -> None:
    """Run a config on a real Flower deployment on this machine (a SuperLink and N SuperNodes on 127.0.0.1), then stop every process: exit 0 finished, 1 failed, 2 refused, 128+N on signal N."""
    from fedlt.deploy import deploy

    args = args or []
    if resume is None and args:
        _guard(lambda: _require_config_file(args[0], "fedlt deploy"))  # the rest checks deploy's own plan
    raise typer.Exit(deploy(args[0] if args else None, args[1:], nodes=nodes, tls=tls, auth=auth, node_data=node_data,
                            server_test=server_test, workdir=workdir, timeout=timeout, resume=resume))


@app.command("methods")
def methods_cmd(name: Optional[str] = typer.Argument(None, help="a method: print its knobs")) -> None:
    """List the methods, one line each (a plug-in's names its package); with NAME, that method's knobs
    (method_args.KNOB=VALUE), their defaults and what each does."""
    from fedlt.methods.registry import get_method, list_methods

    def go() -> None:  # guarded: a broken plug-in or an unknown name is one line, exit 2
        if name is None:
            for method, desc in list_methods():
                typer.echo(f"{method:14s} {desc}")
            return
        spec = get_method(name)
        typer.echo(f"{name}: {spec.description}")
        typer.echo("knobs (method_args.NAME=VALUE):" if spec.args.model_fields else "no knobs of method_args")
        _echo_knobs(spec.args.model_fields)
        if spec.calibration:  # CReFF, SFD, the calibration methods: tuned through their calibration's knobs
            from fedlt.calibration.calibrators import CalibrationArgs
            from fedlt.calibration.wrapper import reads_knob

            own = {k: f for k, f in CalibrationArgs.model_fields.items() if reads_knob(spec.calibration, k)}
            typer.echo(f"knobs of its calibration {', '.join(spec.calibration)} (calibration_args.NAME=VALUE):"
                       if own else f"its calibration {', '.join(spec.calibration)} has no knobs")
            _echo_knobs(own)

    _guard(go)


def _echo_knobs(fields: dict) -> None:
    """A knob table: each pydantic field's name, its default as a config writes it, and its description."""
    shown = {}
    for key, field in fields.items():
        default = field.default if field.default_factory is None else field.default_factory()
        shown[key] = "(required)" if field.is_required() else "null" if default is None \
            else str(default).lower() if isinstance(default, bool) \
            else f"{default:.4g}" if isinstance(default, float) else str(default)
    width = max(map(len, shown.values()), default=0)
    for key, field in fields.items():
        typer.echo(f"  {key:26s} {shown[key]:{width}s}  {field.description or ''}")


@app.command("calibrations")
def calibrations_cmd() -> None:
    """List the classifier calibrations (calibration=NAME or a list; knobs in calibration_args.*)."""
    from fedlt.calibration.calibrators import CalibrationArgs, list_calibrations

    def go() -> None:  # guarded: a broken plug-in is one line, exit 2
        for name, desc in list_calibrations():
            typer.echo(f"{name:14s} {desc}")

    _guard(go)
    typer.echo("\nknobs (calibration_args.NAME=VALUE):")
    _echo_knobs(CalibrationArgs.model_fields)


@app.command("datasets")
def datasets_cmd() -> None:
    """List the datasets, one line each."""
    from fedlt.data.registry import list_datasets

    for name, desc in list_datasets():
        typer.echo(f"{name:14s} {desc}")


@app.command("models")
def models_cmd() -> None:
    """List the models, one line each (a plug-in's names its package)."""
    from fedlt.models import list_models

    def go() -> None:  # guarded: a broken plug-in is one line, exit 2
        for name, desc in list_models():
            typer.echo(f"{name:14s} {desc}")

    _guard(go)


def _distinct_names(run_dirs: List[Path]) -> List[str]:
    """Each run's folder name, with as many parent folders as it takes to tell the runs apart (a bench's
    cells are all ``seed<S>``: ``runs/main/*/*/seed0`` is named ``<setting>/<method>/seed0``)."""
    parts = [d.resolve().parts for d in run_dirs]
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(d) for d in run_dirs]


@app.command("table")
def table_cmd(run_dirs: List[Path] = typer.Argument(..., help="run directories to compare")) -> None:
    """Print a markdown table comparing finished runs (final round; best round labelled)."""

    def go() -> None:
        from fedlt.reporting.comparison import comparison_table
        from fedlt.results import read_summary

        summaries = []
        for d in run_dirs:
            if not (d / "summary.json").is_file():
                raise FedltError(f"{d} has no summary.json; pass directories of finished runs")
            summaries.append((d, read_summary(d)))
        typer.echo(comparison_table(list(zip(_distinct_names([d for d, _ in summaries]),
                                             (s for _, s in summaries)))))

    _guard(go)


def _check_out(path: Optional[Path], folder: bool, flag: str = "--out", writes: bool = True) -> None:
    """Refuse an output path that cannot be written, before any work starts
    (:func:`fedlt.results.check_output_path`)."""
    from fedlt.results import check_output_path

    if path is not None:
        check_output_path(path, folder, flag, writes)


def _check_at_least_one(value: int, flag: str, what: str) -> None:
    from fedlt.errors import ConfigError

    if value < 1:
        raise ConfigError(f"{flag} {value}: use 1 or more {what}")


def _require_config_file(first: str, command: str) -> None:
    """Commands that measure or deploy one config file: a missing one is named with that fix."""
    from fedlt.errors import ConfigError

    if "=" in first or not Path(first).is_file():
        what = "an override" if "=" in first else f"{first}, which is no file"
        raise ConfigError(f"{command} needs a config file first, got {what}; pass one, e.g. "
                          "configs/synthetic_smoke.yaml")


def _check_synthetic_size(size: int) -> None:
    """The ResNets' synthetic image side, refused before the first table is timed."""
    from fedlt.errors import ConfigError
    from fedlt.models.registry import MIN_IMAGE_SIZE

    if size < MIN_IMAGE_SIZE:
        raise ConfigError(f"--synthetic-size {size}: use {MIN_IMAGE_SIZE} or more (32: CIFAR-shaped)")


def _print_and_save(text: str, out: Optional[Path]) -> None:
    """A benchmark's Markdown: printed, and written to ``out`` when given."""
    typer.echo(text)
    if out is not None:
        from fedlt.results import write_atomic

        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, text + "\n")


@bench_app.command("speed")
def bench_speed_cmd(
    args: Optional[List[str]] = typer.Argument(None, help="\\[CONFIG.yaml] \\[key=value ...] for the measured config"),
    rounds: int = typer.Option(3, help="rounds to time (after one warm-up round)"),
    out: Optional[Path] = typer.Option(None, help="also write the results as markdown to this file"),
    backends: bool = typer.Option(False, "--backends", help="compare run.backend sequential/parallel/vectorized/graphed with a "
                                  "peer-style reference loop and the limit of one model at batch K x B (CNN and "
                                  "ResNet-8, 10/20 clients; K=10 vs 1,000)"),
    models: str = typer.Option("cnn,resnet8", help="--backends: models to measure (ResNets on synthetic data)"),
    sampled: str = typer.Option("10,20", help="--backends: sampled clients per round to measure"),
    synthetic_size: int = typer.Option(16, help="--backends: image side of the ResNets' synthetic data (32: CIFAR-shaped)"),
    k_table: bool = typer.Option(True, "--k-table/--no-k-table", help="--backends: also K=10 vs K=1,000 clients"),
    compare: Optional[str] = typer.Option(None, help="--backends: the run.backend values timed beside the reference "
                                          "loop and the limit, e.g. sequential,graphed (default: every one that "
                                          "applies on the device)"),
) -> None:
    """Images/s of local training, seconds per round and achieved GFLOP/s vs. a measured matmul peak."""
    args = list(args or [])

    def go() -> None:
        from fedlt.bench.speed import run_backend_bench, run_speed_bench
        from fedlt.config import load_config
        from fedlt.errors import ConfigError

        _check_at_least_one(rounds, "--rounds", "rounds to time")
        _check_synthetic_size(synthetic_size)
        _check_out(out, folder=False)
        if compare is not None and not backends:
            raise ConfigError(f"--compare {compare} picks the rows of the backends table; add --backends")
        chosen = _backend_list(compare, auto=False, option="--compare") if compare is not None else None
        config = args.pop(0) if args and "=" not in args[0] else None
        load_config(config, args)  # as given: the bench's own fl.rounds would hide a bad one
        if backends:
            text = run_backend_bench(config, args, rounds=rounds, echo=lambda line: typer.echo(line, err=True),
                                     models=_model_list(models), sampled_counts=_client_counts(sampled),
                                     synthetic_size=synthetic_size, k_table=k_table, compare=chosen)
        else:
            text = run_speed_bench(config, args, rounds=rounds)
        _print_and_save(text, out)

    _guard(go)


def _model_list(models: str) -> tuple[str, ...]:
    from fedlt.errors import ConfigError
    from fedlt.models.registry import MODELS

    names = tuple(m.strip() for m in models.split(",") if m.strip())
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        raise ConfigError(f"unknown model '{unknown[0] if unknown else models}' in --models; use a comma-separated "
                          f"list of {', '.join(MODELS)}")
    return names


def _client_counts(sampled: str) -> tuple[int, ...]:
    from fedlt.errors import ConfigError

    try:
        counts = tuple(int(s) for s in sampled.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise ConfigError(f"--sampled {sampled}: give comma-separated client counts >= 1, e.g. 10,40")
    return counts


@bench_app.command("profile")
def bench_profile_cmd(
    args: Optional[List[str]] = typer.Argument(None, help="\\[CONFIG.yaml] \\[key=value ...] for the measured config"),
    models: str = typer.Option("cnn,resnet8", help="models to profile (ResNets on synthetic data)"),
    sampled: str = typer.Option("10", help="sampled clients per round to profile"),
    backends: str = typer.Option("sequential,vectorized", help="run.backend values to profile"),
    synthetic_size: int = typer.Option(16, help="image side of the ResNets' synthetic data (32: CIFAR-shaped)"),
    out: Optional[Path] = typer.Option(None, help="also write the table as markdown to this file"),
) -> None:
    """Where a local training step's time goes: batch, forward, backward, optimizer, host syncs (and kernels on a GPU)."""
    args = list(args or [])

    def go() -> None:
        from fedlt.bench.profile import run_profile_bench
        from fedlt.config import load_config
        from fedlt.errors import ConfigError

        _check_out(out, folder=False)
        _check_synthetic_size(synthetic_size)
        config = args.pop(0) if args and "=" not in args[0] else None
        load_config(config, args)
        chosen = _backend_list(backends, auto=False)
        if "parallel" in chosen:  # its clients train in worker processes, which this process's profiler cannot see
            raise ConfigError("--backends parallel: its clients train in worker processes, out of sight of the "
                              "profiler and the host-synchronisation count of this one; profile sequential instead "
                              "(what each worker runs), or time parallel with fedlt bench speed --backends")
        text = run_profile_bench(config, args, models=_model_list(models), sampled_counts=_client_counts(sampled),
                                 backends=chosen, synthetic_size=synthetic_size,
                                 echo=lambda line: typer.echo(line, err=True))
        _print_and_save(text, out)

    _guard(go)


def _backend_list(backends: str, auto: bool, option: str = "--backends") -> tuple[str, ...]:
    from fedlt.config import RunConfig
    from fedlt.errors import ConfigError

    allowed = [b for b in RunConfig.model_fields["backend"].annotation.__args__ if auto or b != "auto"]
    chosen = tuple(b.strip() for b in backends.split(",") if b.strip())
    if not chosen or any(b not in allowed for b in chosen):
        raise ConfigError(f"{option} {backends}: give a comma-separated list of {', '.join(allowed)}")
    return chosen


@bench_app.command("paper-rounds")
def bench_paper_rounds_cmd(
    args: Optional[List[str]] = typer.Argument(None, help="\\[SUITE ...] \\[key=value ...]: paper suites (default: "
                                               "every paper-* suite) and overrides for every round"),
    backends: str = typer.Option("sequential,auto", help="run.backend values to time"),
    rows: Optional[int] = typer.Option(None, help="time each suite's first N rows (default: all)"),
    row: Optional[List[str]] = typer.Option(None, "--row", help="time only this row (ROW in every suite, SUITE:ROW in "
                                            "one; repeatable)"),
    out: Optional[Path] = typer.Option(None, help="also write the tables as markdown to this file"),
) -> None:
    """A round of each paper suite's rows on synthetic data of its CIFAR size, and the full protocol's projected hours."""
    args = list(args or [])

    def go() -> None:
        from fedlt.bench.paper_rounds import not_projected, run_paper_rounds, unknown_pick
        from fedlt.errors import ConfigError
        from fedlt.bench.suite import builtin_suites, load_suite
        from fedlt.config import load_config

        _check_out(out, folder=False)
        if rows is not None:
            _check_at_least_one(rows, "--rows", "rows")
        overrides = [a for a in args if "=" in a]
        suites = [a for a in args if "=" not in a] or [n for n in builtin_suites() if n.startswith("paper-")]
        why = next((why for name in suites if (why := not_projected(name))), None) or \
            unknown_pick([load_suite(name).spec for name in suites], list(row or []))
        if why is not None:
            raise ConfigError(why)
        load_config(None, overrides)
        text = run_paper_rounds(suites, _backend_list(backends, auto=True), rows=rows, extra=overrides,
                                echo=lambda line: typer.echo(line, err=True), picks=list(row or []))
        _print_and_save(text, out)

    _guard(go)


@bench_app.command("engines")
def bench_engines_cmd(
    args: List[str] = typer.Argument(..., help="CONFIG.yaml \\[key=value ...] for the measured config"),
    nodes: Optional[int] = typer.Option(None, help="SuperNodes of the loopback deployment (default 3); node-data "
                                        "and plain-flower start one per client"),
    engines: str = typer.Option("inprocess,flower,deployment", help="comma-separated engines to measure, of "
                                "inprocess, flower, deployment, node-data, plain-flower"),
    secagg: bool = typer.Option(False, "--secagg", help="run each engine again with secagg.enabled=true"),
    out: Optional[Path] = typer.Option(None, help="also write the results as markdown to this file"),
) -> None:
    """Seconds per round of one config in-process, on Flower's simulation engine, on loopback deployments and
    against a plain-Flower FedAvg app on the same exported nodes."""
    args = list(args)

    def go() -> None:
        from fedlt.bench.engines import ENGINES, run_engine_bench
        from fedlt.errors import ConfigError

        if nodes is not None:
            _check_at_least_one(nodes, "--nodes", "SuperNodes")
        _check_out(out, folder=False)
        _require_config_file(args[0], "fedlt bench engines")
        chosen = tuple(e.strip() for e in engines.split(",") if e.strip())
        unknown = [e for e in chosen if e not in ENGINES]
        if unknown or not chosen:
            raise ConfigError(f"unknown engine '{unknown[0] if unknown else engines}' in --engines; use a comma-separated "
                              f"list of {', '.join(ENGINES)}")
        text = run_engine_bench(args[0], args[1:], nodes=nodes, engines=chosen, secagg=secagg,
                                echo=lambda line: typer.echo(line, err=True))
        _print_and_save(text, out)

    _guard(go)


@bench_app.command("run")
def bench_run_cmd(
    suite: str = typer.Argument(..., help="a built-in suite (fedlt bench list) or a suite YAML file"),
    overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides for every cell, e.g. data.root=/data"),
    workers: int = typer.Option(1, "--workers", "-j", help="cells run in parallel processes (torch threads = cores / N each)"),
    out: Optional[Path] = typer.Option(None, "--out", help="output folder (default runs/bench/<suite name>)"),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="comma-separated seeds replacing the suite's, e.g. 0,1"),
    rows: Optional[List[str]] = typer.Option(None, "--row", help="run only this row: its label in the suite's table, e.g. "
                                                                 "'FedAvg (CE)', or a variant's, e.g. CCVR (repeat for "
                                                                 "several; a wrong one lists them)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="validate every cell and list them; train nothing"),
    report: bool = typer.Option(True, "--report/--no-report", help="write tables and plots to OUT/report at the end"),
    mixed_machines: bool = typer.Option(False, "--mixed-machines", help="add cells to a folder whose finished cells "
                                        "ran on another machine type (CPU capability, GPU, torch version)"),
    mixed_code: bool = typer.Option(False, "--mixed-code", help="add cells to a row whose finished cells ran other "
                                    "fedlt code (another source hash or commit, or uncommitted changes)"),
) -> None:
    """Run a suite: each (setting, method, seed) cell is a run directory; finished cells are skipped, failed ones are listed in OUT/failed.json while the others go on (exit code 1)."""

    def go() -> None:
        from fedlt.bench.suite import load_suite, run_suite
        from fedlt.errors import ConfigError

        loaded = load_suite(suite)
        parts = None if seeds is None else [x.strip() for x in seeds.split(",")]
        if parts is not None and not all(x.isascii() and x.isdigit() for x in parts):  # int() also reads 0_1, ٣
            raise ConfigError(f"--seeds {seeds!r}: give whole numbers >= 0 separated by commas, e.g. 0,1,2")
        seed_list = None if parts is None else [int(x) for x in parts]
        if seed_list is not None and (len(set(seed_list)) != len(seed_list) or min(seed_list) < 0):
            raise ConfigError(f"--seeds {seeds}: give distinct seeds >= 0, e.g. 0,1,2")
        folder = out or Path("runs/bench") / loaded.spec.name
        _check_out(folder, folder=True, writes=not dry_run)  # a dry run only reads a kept folder
        result = run_suite(loaded, folder, seeds=seed_list, workers=workers, dry_run=dry_run,
                           echo=lambda line: typer.echo(line, err=not dry_run), overrides=list(overrides or []),
                           rows=list(rows or []) or None, mixed_machines=mixed_machines,
                           mixed_code=mixed_code)
        if dry_run:
            return
        if report:
            from fedlt.reporting import write_report

            written = write_report(folder)
            typer.echo(written.markdown)
            typer.echo(f"report: {written.out} ({len(written.files)} files)", err=True)
        if result.failed or result.diverged_before:  # the same exit code for the same folder, whichever call
            raise typer.Exit(1)

    _guard(go, hint=BENCH_HINT)


@bench_app.command("list")
def bench_list_cmd() -> None:
    """List the built-in suites: name, cells, title."""

    def go() -> None:
        from fedlt.bench.suite import list_suites

        for name, title, cells in list_suites():
            typer.echo(f"{name:16s} {cells:4d} cells  {title}")

    _guard(go)


@app.command("report")
def report_cmd(
    path: Path = typer.Argument(..., help="a `fedlt bench` output folder, a run directory, or a folder of runs"),
    out: Optional[Path] = typer.Option(None, "--out", help="output folder (default PATH/report)"),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="also draw the PNG figures"),
) -> None:
    """Tables (Markdown, CSV, LaTeX: mean ± std and 95% CI over seeds, paired difference against a reference row;
    bold/underlined only where the order is resolved) and PNG plots."""

    def go() -> None:
        from fedlt.reporting import write_report

        if out is not None:
            _check_out(out, folder=True)
        elif path.is_dir():
            _check_out(path / "report", folder=True, flag="the report folder")
        written = write_report(path, out, with_plots=plots)
        typer.echo(written.markdown)
        typer.echo(f"report: {written.out} ({len(written.files)} files)", err=True)

    _guard(go)


@data_app.command("describe")
def data_describe_cmd(
    args: Optional[List[str]] = typer.Argument(None, help="\\[CONFIG.yaml] \\[key=value ...]"),
    out: Path = typer.Option(Path("runs/describe"), "--out", help="folder for the heatmap PNG and partition.json"),
) -> None:
    """Print the partition (class counts, shot groups, per-client sizes and classes) and draw its client x class heatmap, without training."""
    args = list(args or [])

    def go() -> None:
        from fedlt.reporting.describe import describe_data

        _check_out(out, folder=True)
        config = args.pop(0) if args and "=" not in args[0] else None
        text, files = describe_data(config, args, out)
        typer.echo(text)
        for f in files:
            typer.echo(f"wrote {f}", err=True)

    _guard(go)


@data_app.command("export")
def data_export_cmd(
    args: Optional[List[str]] = typer.Argument(None, help="\\[CONFIG.yaml] \\[key=value ...]: the federation, as "
                                               "`fedlt run` takes it"),
    out: Path = typer.Option(..., "--out", help="new or empty folder: nodes/<client>/{train,test}/<class>/*.png, "
                             "server/{test,val}/<class>/*.png, federation.yaml"),
) -> None:
    """Write the seeded federation as one image folder per node, the server's test (and validation) set and the federation.yaml to deploy with (flower.node_data), as a run would draw it."""
    args = list(args or [])

    def go() -> None:
        from fedlt.config import load_config
        from fedlt.data.export import FEDERATION_FILE, check_export_folder, export_federation
        from fedlt.deploy import check_deployable

        _check_out(out, folder=True)
        check_export_folder(out)
        config = args.pop(0) if args and "=" not in args[0] else None
        cfg = load_config(config, args)
        # what its deployment will refuse (pooled training, options a node cannot serve), refused before writing
        check_deployable(config, [*args, "flower.node_data=true", "data.val_per_class=0"])
        try:
            folder = export_federation(cfg, out, progress=lambda line: typer.echo(line, err=True))
        except KeyboardInterrupt as stop:
            by = " by SIGTERM" if isinstance(stop, Terminated) else ""
            done = (out / FEDERATION_FILE).is_file()  # written last: stopped once the export was complete
            typer.echo(f"fedlt: interrupted{by}; " + (f"the export in {out} is complete" if done else
                                                      f"nothing was written to {out}"), err=True)
            raise typer.Exit(143 if by else 130) from None
        val = folder / "server" / "val"
        typer.echo(f"wrote {folder} ({cfg.data.num_clients} nodes); deploy it with: fedlt deploy --node-data "
                   f"{folder / 'nodes'} --server-test {folder / 'server' / 'test'} {folder / 'federation.yaml'}"
                   + (f" eval.val_data={val}" if val.is_dir() else ""))

    _guard(go)


def _click_exceptions():
    """The module of the usage errors typer raises: click's, or the copy of click that newer typer
    releases vendor (installed where Flower does not pin typer), whose classes click's miss."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    return exceptions


#: the options that take a path, which the command line would read "" as the working directory
PATH_OPTIONS = ("--out", "--resume", "--data-root", "--server-test", "--workdir", "--node-data")


def main() -> None:
    """Usage errors (unknown option, missing argument, bad option value) are user input too: one
    line, exit code 2, like every other error; running with no arguments prints the help."""
    click = _click_exceptions()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    args = sys.argv[1:]
    for flag, following in zip(args, [*args[1:], None]):
        name, eq, value = flag.partition("=")  # --out=VALUE, or --out VALUE
        if name in PATH_OPTIONS and (value if eq else following) == "":  # "" would mean the working directory
            typer.echo(f"fedlt: error: option {name} was given an empty value; give it one (e.g. a folder's path)",
                       err=True)
            sys.exit(2)
    try:
        code = app(standalone_mode=False, prog_name="fedlt")
    except click.NoArgsIsHelpError as help_request:
        text = help_request.format_message()  # rich help was printed while the error was built
        if text:
            typer.echo(text)
        code = 0
    except click.UsageError as err:
        hint = f"; see `{err.ctx.command_path} --help`" if err.ctx else ""
        # typer and click each append their "Did you mean ...?" to an unknown command: keep one
        message = re.sub(r"( Did you mean [^?]*\?)(\1)+", r"\1", err.format_message()).rstrip(".")
        typer.echo(f"fedlt: error: {one_line(message)}{hint}", err=True)
        code = 2
    except typer.Abort:  # click's Abort in older typer, typer's own in newer
        typer.echo("fedlt: interrupted", err=True)
        code = 130
    sys.exit(code if isinstance(code, int) else 0)


if _LOADING:  # loaded: from here a Ctrl-C is the commands' to handle (and an importer's, such as a test's)
    signal.signal(signal.SIGINT, _BEFORE_LOADING)

if __name__ == "__main__":
    main()
