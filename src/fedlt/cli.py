"""The ``fedlt`` command line.

User errors (bad config, missing data, impossible partitions) print one line and exit with
code 2; nothing is left half-written because every check runs before the run directory exists.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional

import typer

from fedlt.errors import FedltError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Federated learning on long-tailed data.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: speed, calibration.")
app.add_typer(bench_app, name="bench")


def _guard(fn: Callable[[], None]) -> None:
    """Run ``fn``; a FedltError becomes one line on stderr and exit code 2, no traceback."""
    try:
        fn()
    except FedltError as err:
        typer.echo(f"fedlt: error: {err}", err=True)
        raise typer.Exit(2)
    except KeyboardInterrupt:
        typer.echo("fedlt: interrupted; resume with `fedlt run --resume RUN_DIR` from the last checkpoint", err=True)
        raise typer.Exit(130)


@app.command("run")
def run_cmd(
    args: Optional[List[str]] = typer.Argument(None, help="[CONFIG.yaml] [key=value ...], e.g. data.alpha=0.1 fl.rounds=50"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="continue RUN_DIR from its last checkpoint"),
    data_root: Optional[str] = typer.Option(None, "--data-root", help="dataset folder (same as data.root=DIR)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output"),
) -> None:
    """Run one experiment and write its run directory (config, metrics, summary, report, plot)."""
    args = list(args or [])

    def go() -> None:
        from fedlt import api
        from fedlt.errors import ConfigError

        if resume is not None:
            if args or data_root:
                raise ConfigError("--resume continues a run with its saved config; drop the other arguments")
            result = api.resume(resume, quiet=quiet)
        else:
            config = args.pop(0) if args and "=" not in args[0] else None
            overrides = args + ([f"data.root={data_root}"] if data_root else [])
            result = api.run(config, overrides=overrides, quiet=quiet)
        f = result.summary["final"]
        parts = [f"{k} {f[k]:.2f}" for k in ("acc", "many_acc", "medium_acc", "few_acc", "pm_acc") if f.get(k) is not None]
        typer.echo(f"{result.run_dir}: round {f['round']}: " + ", ".join(parts))

    _guard(go)


@app.command("methods")
def methods_cmd() -> None:
    """List the methods, one line each."""
    from fedlt.methods.registry import list_methods

    for name, desc in list_methods():
        typer.echo(f"{name:14s} {desc}")


@app.command("calibrations")
def calibrations_cmd() -> None:
    """List the classifier calibrations (calibration=NAME or a list; knobs in calibration_args.*)."""
    from fedlt.methods.calibrators import CALIBRATION_DESCRIPTIONS

    from fedlt.methods.calibrators import CalibrationArgs

    for name, desc in CALIBRATION_DESCRIPTIONS.items():
        typer.echo(f"{name:14s} {desc}")
    typer.echo("\nknobs (calibration_args.NAME=VALUE):")
    for key, field in CalibrationArgs.model_fields.items():
        typer.echo(f"  {key:26s} {field.default!s:8s} {field.description}")


@app.command("datasets")
def datasets_cmd() -> None:
    """List the datasets, one line each."""
    from fedlt.data.registry import list_datasets

    for name, desc in list_datasets():
        typer.echo(f"{name:14s} {desc}")


@app.command("models")
def models_cmd() -> None:
    """List the models, one line each."""
    from fedlt.models import list_models

    for name, desc in list_models():
        typer.echo(f"{name:14s} {desc}")


@app.command("table")
def table_cmd(run_dirs: List[Path] = typer.Argument(..., help="run directories to compare")) -> None:
    """Print a markdown table comparing finished runs (final round; best round labelled)."""

    def go() -> None:
        from fedlt.report import comparison_table

        summaries = []
        for d in run_dirs:
            path = d / "summary.json"
            if not path.is_file():
                raise FedltError(f"{d} has no summary.json; pass directories of finished runs")
            summaries.append((d.name, json.loads(path.read_text())))
        typer.echo(comparison_table(summaries))

    _guard(go)


@bench_app.command("speed")
def bench_speed_cmd(
    args: Optional[List[str]] = typer.Argument(None, help="[CONFIG.yaml] [key=value ...] for the measured config"),
    rounds: int = typer.Option(3, help="rounds to time (after one warm-up round)"),
    out: Optional[Path] = typer.Option(None, help="also write the results as markdown to this file"),
) -> None:
    """Images/s of local training, seconds per round and achieved GFLOP/s vs. a measured matmul peak."""
    args = list(args or [])

    def go() -> None:
        from fedlt.bench.speed import run_speed_bench

        config = args.pop(0) if args and "=" not in args[0] else None
        text = run_speed_bench(config, args, rounds=rounds)
        typer.echo(text)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text + "\n")

    _guard(go)


@bench_app.command("calibration")
def bench_calibration_cmd(
    args: Optional[List[str]] = typer.Argument(None, help="[CONFIG.yaml] [key=value ...] (default: configs/fmnist_lt.yaml)"),
    alphas: str = typer.Option("0.5,0.1", help="Dirichlet alphas, comma-separated"),
    seeds: str = typer.Option("0,1,2", help="seeds, comma-separated"),
    out: Path = typer.Option(Path("docs/results/calibration.md"), help="markdown table written here"),
    runs: str = typer.Option("runs/bench-calibration", help="where the run directories go"),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
) -> None:
    """FedAvg, CReFF, CCVR, FedNCM, Fed3R, tau-norm and the real-feature oracle, mean ± std over seeds."""
    args = list(args or [])

    def go() -> None:
        from fedlt.bench.calibration import run_calibration_bench, write
        from fedlt.errors import ConfigError

        config = args.pop(0) if args and "=" not in args[0] else "configs/fmnist_lt.yaml"
        try:
            alpha_list = [float(a) for a in alphas.split(",")]
            seed_list = [int(s) for s in seeds.split(",")]
        except ValueError:
            raise ConfigError("--alphas takes numbers like 0.5,0.1 and --seeds integers like 0,1,2") from None
        text = run_calibration_bench(config, args, alpha_list, seed_list, runs, quiet=quiet)
        write(text, out)
        typer.echo(text)

    _guard(go)


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(app())


if __name__ == "__main__":
    main()
