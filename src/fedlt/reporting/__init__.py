"""``fedlt report``: tables (Markdown, CSV, LaTeX) and figures (PNG) from finished runs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedlt.errors import DataError
from fedlt.reporting import plots
from fedlt.reporting.collect import Collection, Setting, collect
from fedlt.reporting.tables import build_table, csv_text, latex, markdown
from fedlt.results import ARTIFACTS_FILE, PARTITION_FILE, write_atomic


@dataclass
class Report:
    out: Path
    markdown: str
    files: list[Path]


def _slug(text: str) -> str:
    from fedlt.bench.suite import slug

    return slug(text)


def write_report(path: str | Path, out: str | Path | None = None, with_plots: bool = True) -> Report:
    """Write ``tables.md``, ``tables.csv``, ``tables.tex`` and the PNGs of ``path`` into ``out``
    (default ``path/report``)."""
    collection = collect(Path(path))
    partitions = {s.name: _partition_record(s) for s in collection.settings} if with_plots else {}
    features = _feature_artifacts(collection) if with_plots else {}
    if with_plots:  # the curves read every metrics file: a damaged one is refused before anything is written
        for run in {run.path: run for s in collection.settings for row in s.rows for run in row.runs}.values():
            run.curve()
    out = Path(out) if out is not None else Path(path) / "report"
    out.mkdir(parents=True, exist_ok=True)
    tables = [build_table(s) for s in collection.settings]
    text = markdown(collection, tables)
    files = []
    for name, content in (("tables.md", text), ("tables.csv", csv_text(tables)), ("tables.tex", latex(collection, tables))):
        write_atomic(out / name, content)
        files.append(out / name)
    if with_plots:
        files += write_plots(collection, out, partitions, features)
        _remove_stale_plots(out, collection)
    return Report(out, text, files)


def _remove_stale_plots(out: Path, collection: Collection) -> None:
    """Delete the features plots of the folder's settings whose row is gone (renamed or removed). A plot
    of a current row is kept even when this report could not redraw it (its runs' saved features are
    not kept), and plots of other settings stay: another suite may report into the same folder."""
    current = {f"features-{_slug(s.name)}-{_slug(row.label)}.png" for s in collection.settings for row in s.rows}
    for setting in collection.settings:
        for path in out.glob(f"features-{_slug(setting.name)}-*.png"):
            if path.name not in current:
                path.unlink()


def _partition_record(setting: Setting) -> dict | None:
    """The partition a setting's first run trained on (its heatmap), read before anything is
    written: a damaged file is one error naming it, not a report cut off halfway."""
    first = setting.first_run()
    if first is None or not (first.path / PARTITION_FILE).is_file():
        return None
    path = first.path / PARTITION_FILE
    try:
        record = json.loads(path.read_bytes())
        counts = np.asarray(record["counts"], dtype=float)
        fine = (counts.ndim == 2 and isinstance(record["dataset"], str) and float(record["imbalance_factor"]) > 0
                and isinstance(record.get("alpha"), (int, float, type(None))))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError, ValueError):
        fine = False
    if not fine:
        raise DataError(f"{path} is not a partition record (a JSON object with a clients x classes 'counts' table, "
                        "'dataset' and 'imbalance_factor'); restore it from the run, or delete it to leave the heatmap out")
    return record


def _feature_artifacts(collection: Collection) -> dict[tuple[str, str], dict[str, np.ndarray]]:
    """The features a row's first run saved (``artifacts.pt``), by (setting, row), read before anything
    is written: a damaged file is one error naming it."""
    import torch

    out = {}
    for setting in collection.settings:
        for row in setting.rows:
            path = row.runs[0].path / ARTIFACTS_FILE if row.variant is None and row.runs else None
            if path is None or not path.is_file():
                continue
            try:
                artifacts = torch.load(path, map_location="cpu", weights_only=True)
                out[(setting.name, row.label)] = {k: v.numpy() for k, v in artifacts.items()}
            except Exception as err:  # noqa: BLE001 - torch reports a damaged file with many exception types
                raise DataError(f"{path} is not a saved-features file ({type(err).__name__}); delete it to leave "
                                "the features plot out, or re-run that run") from None
    return out


def write_plots(collection: Collection, out: Path, partitions: dict[str, dict | None],
                features: dict[tuple[str, str], dict[str, np.ndarray]] | None = None) -> list[Path]:
    files = []
    for setting in collection.settings:
        s = _slug(setting.name)
        files += [plots.plot_curves(setting, out / f"curves-{s}.png"), plots.plot_shot_bars(setting, out / f"shots-{s}.png"),
                  plots.plot_per_class(setting, out / f"per-class-{s}.png"),
                  plots.plot_diagnostics(setting, out / f"diagnostics-{s}.png")]
        if partitions.get(setting.name) is not None:
            files.append(plots.plot_partition(partitions[setting.name], out / f"partition-{s}.png"))
        for row in setting.rows:
            artifacts = (features or {}).get((setting.name, row.label))
            if artifacts is not None:
                title = f"{setting.name} / {row.label} (seed {row.runs[0].seed}): real vs synthetic features, PCA"
                files.append(plots.plot_features(artifacts, out / f"features-{s}-{_slug(row.label)}.png", title,
                                                 row.runs[0].summary.get("class_names")))
    return [f for f in files if f is not None]
