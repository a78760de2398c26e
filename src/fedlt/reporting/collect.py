"""What a results folder holds, as settings x rows x seeds of run directories.

Three kinds of folder are understood: a suite output (``suite.yaml`` written by ``fedlt bench``),
a single run directory (``summary.json``), or a folder of run directories (e.g. the main job's
``runs/fmnist_lt/``). Each becomes a :class:`Collection`; tables and plots read only that.
Each setting names the row its differences are taken against: the suite's ``reference`` where
that row is in the setting, else the setting's first row.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlt.bench.selection import AS_RUN, Selection, candidate_label, candidates, select
from fedlt.config import (
    DIRICHLET_PARTITIONS, FLConfig, config_difference, file_config, partition_label, read_yaml_mapping,
)
from fedlt.errors import FedltError
from fedlt.reporting.cost import suite_cost
from fedlt.results import (ENGINE_KEYS, PM_VARIANTS, SUMMARY_FILE, chance_models, counted, nonfinite_models, nonfinite_personal,
                           nonfinite_variants, personal_nan_label, read_metrics, read_summary, unevaluated_note)

if TYPE_CHECKING:
    from fedlt.bench.suite import MethodRow, SuiteSpec
    from fedlt.reporting.claims import ClaimSpec

#: the personalized model's figures, which a chosen personal reading (``select_personal``) supplies
PM_METRICS = ("pm_acc", "val_pm_acc")


@dataclass
class Run:
    """One finished run directory (one seed of one row)."""

    path: Path
    seed: int
    summary: dict[str, Any]

    def final(self, variant: str | None) -> dict[str, Any] | None:
        """Final-round GM metrics of the headline model, or of one variant (None if absent)."""
        final = self.summary.get("final") or {}
        if variant is None:
            return final
        return (final.get("variants") or {}).get(variant)

    def personal(self, reading: str) -> dict[str, Any] | None:
        """Final-round PM figures of the run's own personalized model (``AS_RUN``), or of one of
        its other readings (a key of ``final.pm_variants``; None if absent)."""
        final = self.summary.get("final") or {}
        if reading == AS_RUN:
            return final
        return (final.get(PM_VARIANTS) or {}).get(reading)

    def curve(self) -> list[dict[str, Any]]:
        return [r for r in read_metrics(self.path) if r.get("acc") is not None]

    def damage(self) -> str:
        """A warning naming the unreadable lines in the middle of this run's metrics file (the rounds
        its curves then lack), or ``""``."""
        damaged: list[int] = []
        read_metrics(self.path, damaged=damaged, finished=True)  # a Run has its summary: nothing was torn
        if not damaged:
            return ""
        return (f"{self.path / 'metrics.jsonl'}: line(s) {', '.join(map(str, damaged[:5]))} unreadable; its curves "
                "lack those rounds (its final figures come from summary.json)")

    def diagnostics(self) -> list[dict[str, Any]]:
        """Every round's own numbers of the method (``Server.metrics()``: the keys the engine does
        not write), e.g. FedYoYo's distance between its estimated and the true global prior."""
        return [{"round": r["round"], **{k: v for k, v in r.items() if k not in ENGINE_KEYS
                                         and isinstance(v, (int, float)) and not isinstance(v, bool)}}
                for r in read_metrics(self.path)]


@dataclass
class Row:
    label: str
    variant: str | None  # None: the run's headline model; else a key of final.variants
    runs: list[Run]
    ranked: bool = True
    expected: int = 0  # seeds the suite asked for (0: unknown)
    caption_seeds: int = 0  # seeds the tables' caption names (0: unknown); a row averaging another number says so
    #: where the PM figures come from when a personal reading was chosen (``select_personal``):
    #: ``AS_RUN`` or a key of ``final.pm_variants``; None: from the same figures as the GM's
    personal: str | None = None
    #: what was chosen on validation data for the row: the grid candidate whose cells it reads (e.g.
    #: ``fl.lr=0.05``) and the personal reading of its PM (``PM: NAME``), joined by ``; ``; None: neither
    chosen: str | None = None

    def by_seed(self, metric: str) -> dict[int, float]:
        """Final value of ``metric`` per seed, for the seeds that report it (pairing is by seed)."""
        out = {}
        for run in self.runs:
            final = run.personal(self.personal) if self.personal and metric in PM_METRICS else run.final(self.variant)
            if final is not None and final.get(metric) is not None:
                out[run.seed] = float(final[metric])
        return out

    def values(self, metric: str) -> list[float]:
        return list(self.by_seed(metric).values())


@dataclass
class Setting:
    name: str
    rows: list[Row]
    warnings: list[str] = field(default_factory=list)
    reference: str | None = None  # label of the row differences are taken against; None: the first row

    def first_run(self) -> Run | None:
        return next((r.runs[0] for r in self.rows if r.runs), None)

    def reference_index(self) -> int:
        return next((i for i, r in enumerate(self.rows) if r.label == self.reference), 0)

    def all_runs(self) -> list[Run]:
        """Every run of the setting once (variant rows share their method's runs)."""
        return list({str(run.path): run for row in self.rows for run in row.runs}.values())


@dataclass
class Collection:
    title: str
    description: str
    settings: list[Setting]
    seeds: list[int]
    notes: str = ""
    report_messages: bool = False
    reference: str | None = None  # the suite's ``reference`` row label; None: each setting's first row
    cost: str = ""  # what the suite's own bench-log measured (wall, CPU); empty outside a suite
    claims: list[ClaimSpec] = field(default_factory=list)  # the suite's papers' claims
    selections: list[Selection] = field(default_factory=list)  # what each grid row chose on validation data


def _run_config(path: Path) -> dict[str, Any] | None:
    """The settings a run directory's config.yaml gives, validated as any config file is (a key it lacks at its
    default; a value no run takes is one ConfigError naming the file); None where it has none or it is empty."""
    cfg_path = path / "config.yaml"
    tree = read_yaml_mapping(cfg_path, "run config") if cfg_path.is_file() else None
    return file_config(cfg_path, tree).dump() if tree else None


def _load_run(path: Path, seed: int) -> Run | None:
    if not (path / SUMMARY_FILE).is_file():
        return None
    return Run(path, seed, read_summary(path))


def _is_upper_bound(run: Run, variant: str | None) -> bool:
    """Rows that are references, not competitors: the centralized oracle, real-feature heads."""
    return variant == "oracle" or (variant is None and run.summary.get("method") == "centralized")


def _aborted(run: Run) -> str:
    """`` (aborted after N rounds)`` for a run that stopped early, else ``""``."""
    s = run.summary
    if s.get("status") != "aborted":
        return ""
    return f" (aborted after {s.get('rounds_done', '?')} of {counted(s.get('rounds', '?'), 'round')})"


def _diverged(run: Run) -> str:
    """`` diverged in round N ...`` for a run whose model went NaN, else ``""``: its cell stays in the
    tables with what the method delivered (the NaN model's accuracy: one class predicted everywhere,
    chance level on the balanced test set, that class's share on a client's local test set)."""
    if run.summary.get("status") != "diverged":
        return ""
    reason = str(run.summary.get("reason") or "")
    what = "NaN test loss" if "test loss" in reason else "NaN training loss"
    return (f" diverged in round {run.summary.get('diverged_round', '?')} ({what}); its cell counts with the NaN "
            "model's accuracy")


def _run_rows(label: str, run: Run) -> list[Row]:
    """A run's rows in a report of single runs; one that diverged or aborted says so in its label."""
    diverged = run.summary.get("status") == "diverged"
    label += _aborted(run) + (f" (diverged in round {run.summary.get('diverged_round', '?')})" if diverged else "")
    label += unevaluated_note(run.summary)
    final = run.final(None) or {}
    pm_nan = nonfinite_personal(final).get(None)
    rows = [Row(label + (f" ({personal_nan_label(pm_nan)})" if pm_nan else ""), None, [run],
                ranked=not _is_upper_bound(run, None) and not _aborted(run))]
    nan = nonfinite_variants(final)
    for key in final.get("variants") or {}:
        rows.append(Row(f"{label} [{key}]" + (" (non-finite model)" if key in nan else ""), key, [run],
                        ranked=not _is_upper_bound(run, key)))
    return rows


def _run_label(run: Run) -> str:
    s = run.summary
    calibration = s.get("calibration") or []
    return s["method"] + (f" + {calibration[0]}" if calibration and calibration[0] != s["method"] else "")


def setting_label(summary: dict[str, Any], cfg: dict[str, Any] | None) -> str:
    if not cfg:
        return summary.get("dataset", "run")
    from fedlt.data.registry import lt_name, tail_label

    d = cfg["data"]
    part = (partition_label(d["partition"], d["alpha"], d.get("classes_per_client"))
            if d["partition"] in (*DIRICHLET_PARTITIONS, "pathological") else d["partition"])
    label = (f"{lt_name(d['dataset'])}, {tail_label(d['dataset'], d['imbalance_factor'])}, {part}, "
             f"{d['num_clients']} clients, {counted(cfg['fl']['rounds'], 'round')}")
    # what else makes another federation or other shot groups: its runs are another table, never one mixed
    e, fl = cfg.get("eval") or {}, cfg.get("fl") or {}
    default = FLConfig.model_fields["participation"].default
    other = [f"train_fraction {d['train_fraction']:g}" if d.get("train_fraction", 1) != 1 else "",
             "equal-size clients" if d.get("equal_size") else "",
             f"{d['rounding'].replace('_', '-')} rounding" if d.get("rounding", "floor") != "floor" else "",
             f"min_client_size {d['min_client_size']}" if d.get("min_client_size") else "",
             f"class order {d['class_order']}" if d.get("class_order", "natural") != "natural" else "",
             f"data.seed {d['seed']}" if d.get("seed") is not None else "",
             f"{d['val_per_class']} validation images a class from {d.get('val_from', 'auto')}"
             if d.get("val_per_class") else "",
             f"{d['image_size']} px" if d.get("image_size") is not None else "",
             f"participation {fl['participation']:g}" if fl.get("participation", default) != default else "",
             f"{e['accuracy']} accuracy" if e.get("accuracy", "class_mean") != "class_mean" else "",
             f"shot rule {e.get('shot_rule', 'count')}" + "".join(
                 f", {k} {e[k]}" for k in ("many_threshold", "few_threshold") if e.get(k) is not None)
             if e.get("shot_rule", "count") != "count" or e.get("many_threshold") is not None
             or e.get("few_threshold") is not None else ""]
    return ", ".join([label, *(o for o in other if o)])


def collect(path: Path) -> Collection:
    """Read a suite output, a run directory or a folder of run directories."""
    path = Path(path)
    if (path / "suite.yaml").is_file():
        return _collect_suite(path)
    cfg = _run_config(path) if (path / SUMMARY_FILE).is_file() else None
    run = _load_run(path, (cfg or {}).get("seed", 0))
    if run is not None:
        rows = _run_rows(_run_label(run), run)
        notes = [text] if (text := run.damage()) else []
        return Collection(f"{path.name}", "", [Setting(setting_label(run.summary, cfg), rows,
                                                       notes + chance_models(run.summary), reference=rows[0].label)],
                          [run.seed])
    children = sorted(p for p in path.iterdir() if (p / SUMMARY_FILE).is_file()) if path.is_dir() else []
    unfinished = sorted(p.name for p in path.iterdir() if (p / "config.yaml").is_file()
                        and not (p / SUMMARY_FILE).is_file()) if path.is_dir() else []
    if not children and unfinished:
        raise FedltError(f"{path} holds only unfinished runs (no summary.json: {', '.join(unfinished[:3])}); finish "
                         f"one with fedlt run --resume {path / unfinished[0]}, then report")
    if not children:
        raise FedltError(f"{path} is neither a run directory (summary.json), a `fedlt bench` output (suite.yaml), "
                         "nor a folder of run directories; pass one of those")
    configs = [_run_config(c) for c in children]
    runs = [_load_run(c, (cfg or {}).get("seed", 0)) for c, cfg in zip(children, configs)]
    by_setting: dict[str, list[Row]] = {}  # runs of other data or rounds are another table, never one mixed
    notes: dict[str, list[str]] = {}
    for child, run, cfg in zip(children, runs, configs):
        label = setting_label(run.summary, cfg)
        by_setting.setdefault(label, []).extend(_run_rows(child.name, run))
        notes.setdefault(label, []).extend(f"{child.name}: {line}" for line in chance_models(run.summary))
    settings = [Setting(label, rows, notes[label], reference=rows[0].label) for label, rows in by_setting.items()]
    settings[0].warnings += [damage for run in runs if (damage := run.damage())]
    if unfinished:
        settings[0].warnings.append(f"left out {len(unfinished)} unfinished run(s) without summary.json "
                                    f"({', '.join(unfinished[:3])}); finish them with fedlt run --resume DIR")
    return Collection(path.name, "", settings, sorted({r.seed for r in runs}))


def _collect_suite(path: Path) -> Collection:
    from fedlt.bench.suite import LOG_FILE, cell_dir, parse_suite

    tree = read_yaml_mapping(path / "suite.yaml", "suite file")
    spec = parse_suite(tree, str(path / "suite.yaml"))
    selections = {m.name: _select(path, spec, m) for m in spec.methods if m.grid}
    personal = {m.name: _select_personal(path, spec, m, selections.get(m.name)) for m in spec.methods
                if m.select_personal}
    failed = _failed_cells(path)
    settings = []
    for s in spec.settings:
        rows, warnings, never_ran = [], [], []
        for m in spec.methods:
            if m.settings is not None and s.name not in m.settings:
                continue
            folder, variant, noted, chosen = m.name, None, len(warnings), None
            if m.grid:
                chosen = selections[m.name].chosen.get(s.name)
                if chosen is None:
                    warnings.append(f"row '{m.name}': no candidate of its grid has finished cells here")
                folder = selections[m.name].folder(chosen) if chosen else folder
                variant = selections[m.name].variants.get(chosen) if chosen else None
            runs = _seed_runs(cell_dir(path, s.name, folder, 0).parent)
            warnings += [f"row '{m.name}': seed {seed} failed: {error}; `fedlt bench` runs it again"
                         for seed, error in failed.get(cell_dir(path, s.name, folder, 0).parent.parts[-2:], {}).items()
                         if seed not in {r.seed for r in runs}]
            runs, foreign = _one_config(runs, [*spec.overrides, *s.overrides, *m.overrides])
            warnings += [f"row '{m.name}': left out {reason}" for reason in foreign]
            warnings += [f"row '{m.name}': left out {r.path}{_aborted(r)}: {r.summary.get('reason')}; `fedlt bench` "
                         "runs it again (from its checkpoint, where it can)" for r in runs if _aborted(r)]
            runs = [r for r in runs if not _aborted(r)]  # its partial rounds are no seed of the row
            warnings += [f"row '{m.name}': seed {r.seed}{_diverged(r)}" for r in runs if _diverged(r)]
            warnings += [f"row '{m.name}': seed {r.seed}: {line}"
                         for r in runs if not _diverged(r) for line in nonfinite_models(r.final(None))]
            warnings += [f"row '{m.name}': seed {r.seed}: {line}" for r in runs for line in chance_models(r.summary)]
            warnings += [f"row '{m.name}': seed {r.seed}{unevaluated_note(r.summary)}; its cell counts with that "
                         "round's accuracy" for r in runs if unevaluated_note(r.summary)]
            warnings += [f"row '{m.name}': {damage}" for r in runs if (damage := r.damage())]
            if not runs and len(warnings) == noted:  # nothing failed or was left out: its cells never ran
                never_ran.append(f"'{m.name}'")
            upper = bool(runs) and _is_upper_bound(runs[0], None)
            expected = len(m.seeds or spec.seeds)
            reading = personal[m.name].variants.get(personal[m.name].chosen.get(s.name, AS_RUN), AS_RUN) \
                if m.name in personal else None
            picked = "; ".join(part for part in (chosen, f"PM: {reading}" if reading not in (None, AS_RUN) else "")
                               if part)
            rows.append(Row(m.name, variant, runs, ranked=not upper and m.name not in spec.unranked, expected=expected,
                            personal=reading, chosen=picked or None))
            for label, key in m.variants.items():  # heads of the same runs: the same candidate's cells
                rows.append(Row(label, key, runs, ranked=key != "oracle" and label not in spec.unranked,
                                expected=expected, chosen=chosen or None))
                missing = [r.path for r in runs if r.final(key) is None]
                if missing:
                    have = sorted((runs[0].final(None) or {}).get("variants") or {})
                    warnings.append(f"row '{label}': variant '{key}' is not in {missing[0]}/summary.json "
                                    f"(it has: {', '.join(have) or 'none'})")
            for key in m.select_personal:
                missing = [r.path for r in runs if r.personal(key) is None]
                if missing:
                    have = sorted((runs[0].final(None) or {}).get(PM_VARIANTS) or {})
                    warnings.append(f"row '{m.name}': personal reading '{key}' is not in {missing[0]}/summary.json "
                                    f"(its {PM_VARIANTS}: {', '.join(have) or 'none'})")
        if never_ran:
            warnings.append(f"row{'s' * (len(never_ran) > 1)} {', '.join(never_ran)}: no cell has run yet; "
                            "`fedlt bench` runs them (--row to run one alone)")
        in_setting = any(r.label == spec.reference for r in rows)
        reference = spec.reference if in_setting else rows[0].label if rows else None
        if spec.reference is not None and not in_setting and rows:
            warnings.append(f"the reference row '{spec.reference}' is not in this setting; "
                            f"differences are against its first row '{reference}'")
        settings.append(Setting(s.name, rows, warnings, reference))
    from fedlt.reporting.claims import ClaimSpec

    cost = suite_cost(path / LOG_FILE)
    claims = [ClaimSpec(**c.model_dump()) for c in spec.claims]
    found = sorted({run.seed for s in settings for row in s.rows for run in row.runs})  # what the tables average
    for row in (row for s in settings for row in s.rows):
        row.caption_seeds = len(found or spec.seeds)
    return Collection(spec.title or spec.name, spec.description.strip(), settings, found or spec.seeds,
                      spec.notes.strip(),
                      spec.report_messages, spec.reference, cost.sentence() if cost else "", claims,
                      [*selections.values(), *personal.values()])


def _failed_cells(path: Path) -> dict[tuple[str, ...], dict[int, str]]:
    """The cells ``fedlt bench`` recorded as failed in ``failed.json``: (setting folder, row folder) ->
    seed -> error, wherever the suite's folder has moved since."""
    from fedlt.bench.suite import load_failures

    found: dict[tuple[str, ...], dict[int, str]] = {}
    for run_dir, record in load_failures(path).items():
        cell = Path(run_dir)
        if re.fullmatch(r"seed\d+", cell.name):
            found.setdefault(cell.parent.parts[-2:], {})[int(cell.name[4:])] = str(record.get("error", "?"))
    return found


def _one_config(runs: list[Run], given: list[str]) -> tuple[list[Run], list[str]]:
    """A row's runs that are one config at their folders' seeds, and why each other one is left out:
    a run copied in from elsewhere, which `fedlt bench` refuses to keep (runs without a config pass).
    ``given``: the row's overrides, where ``{seed}`` is the folder's seed (``seed=100{seed}``: a replicate)."""
    from fedlt.bench.suite import IGNORED_KEYS

    per_seed = [key for key in (o.partition("=")[0].strip() for o in given if "{seed}" in o)  # each cell its own
                if key not in ("seed", "data.seed")]  # these two checked against the folder's seed below
    kept, foreign, first = [], [], None
    for run in runs:
        cfg = read_yaml_mapping(run.path / "config.yaml", "run config") if (run.path / "config.yaml").is_file() else None
        if cfg:
            file_config(run.path / "config.yaml", cfg)  # a value no run takes: one error naming the file and key
            cfg = _without(cfg, per_seed)
        if cfg == {}:
            foreign.append(f"{run.path}: its config.yaml is empty, so what it ran is unknown")
            continue
        expected = _seeds_of(run.seed, given)
        ran = (cfg.get("seed"), (cfg.get("data") or {}).get("seed")) if cfg is not None else expected
        if ran != expected:
            foreign.append(f"{run.path}: it ran seed {ran[0]!r} (data.seed {ran[1]!r}) where its folder means "
                           f"seed {expected[0]!r} (data.seed {expected[1]!r})")
            continue
        diff = config_difference(cfg, first[1], (*IGNORED_KEYS, "seed", "data.seed"), common=True) \
            if cfg is not None and first else None
        if diff:
            foreign.append(f"{run.path}: its config differs from seed {first[0]}'s ({diff})")
            continue
        first = first or ((run.seed, cfg) if cfg is not None else None)
        kept.append(run)
    return kept, foreign


def _without(tree: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """A copy of a config tree without the dotted ``keys`` (those a row sets per seed, compared elsewhere)."""
    tree = copy.deepcopy(tree)
    for key in keys:
        *path, last = key.split(".")
        node = tree
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return tree


def _seeds_of(seed: int, given: list[str]) -> tuple[Any, Any]:
    """(seed, data.seed) of the cell of ``seed`` whose overrides are ``given``, as `fedlt bench` sets them."""
    from fedlt.bench.suite import seeded

    values: dict[str, Any] = {"seed": seed, "data.seed": None}
    for override in seeded(seed, given):
        key, _, value = override.partition("=")
        if key.strip() in values:
            text = value.strip()
            values[key.strip()] = int(text) if text.lstrip("-").isdigit() else None if text in ("", "null") else text
    return values["seed"], values["data.seed"]


def _seed_runs(method_dir: Path) -> list[Run]:
    """The finished runs in ``method_dir/seed<S>``, by seed."""
    runs = []
    if method_dir.is_dir():
        for seed_dir in sorted(method_dir.glob("seed*")):
            if seed_dir.name[4:].isdigit():
                run = _load_run(seed_dir, int(seed_dir.name[4:]))
                if run is not None:
                    runs.append(run)
    return sorted(runs, key=lambda r: r.seed)


def _select(path: Path, spec: SuiteSpec, row: MethodRow) -> Selection:
    """Which candidate of ``row``'s grid, or of a row that joins its choice (``select_with``), each
    also read through the variants its row names in ``select_variants``, the suite's validation
    metric selects (bench/selection). A joined row's candidates are named by their own row labels,
    a variant reading by its candidate and the override it stands for."""
    from fedlt.bench.suite import cell_dir

    settings = [s.name for s in spec.settings if row.settings is None or s.name in row.settings]
    owners = [row, *(other for other in spec.methods if other.select_with == row.name)]
    folders: dict[str, str] = {}
    variants: dict[str, str] = {}
    for owner in owners:
        own = [(d, candidate_label(owner.name, d)) for d, _ in candidates(owner.grid)] if owner.grid \
            else [(owner.name, owner.name)]
        for description, label in own:
            name = description if owner is row else label
            folders[name] = label
            for key, override in owner.select_variants.items():
                folders[f"{name}, {override}"] = label
                variants[f"{name}, {override}"] = key
    scores, diverged = {}, {}
    for candidate, label in folders.items():
        runs = {s: _seed_runs(cell_dir(path, s, label, 0).parent) for s in settings}
        scores[candidate] = {s: {r.seed: float(f[spec.select_on]) for r in runs[s]
                                 if (f := r.final(variants.get(candidate))) and f.get(spec.select_on) is not None}
                             for s in settings}
        diverged[candidate] = [f"{s} / seed {r.seed}" for s in settings for r in runs[s] if _diverged(r)]
    joined = {c: label for c, label in folders.items() if label != candidate_label(row.name, c)}
    return select(row.name, spec.select_on, scores, settings, row.seeds or spec.seeds, spec.select_per_setting,
                  joined, {c: cells for c, cells in diverged.items() if cells}, variants)


def _select_personal(path: Path, spec: SuiteSpec, row: MethodRow, chosen: Selection | None) -> Selection:
    """Which reading of ``row``'s personalized model (its runs' own, or a key of ``select_personal``)
    has the highest ``val_pm_acc``, read in the cells of the candidate its global model was chosen
    from (the row's own cells without a grid): the trained configuration is chosen first, its
    personalized model among the readings of that training."""
    from fedlt.bench.suite import cell_dir

    settings = [s.name for s in spec.settings if row.settings is None or s.name in row.settings]
    readings = {AS_RUN: AS_RUN, **{override: key for key, override in row.select_personal.items()}}
    scores: dict[str, dict[str, dict[int, float]]] = {}
    overrides = {s.name: [*spec.overrides, *s.overrides, *row.overrides] for s in spec.settings}
    for setting in settings:
        candidate = chosen.chosen.get(setting) if chosen is not None else None
        folder = chosen.folder(candidate) if candidate is not None else row.name
        runs = _one_config(_seed_runs(cell_dir(path, setting, folder, 0).parent), overrides[setting])[0]
        for name, key in readings.items():
            scores.setdefault(name, {})[setting] = {r.seed: float(f["val_pm_acc"]) for r in runs
                                                    if (f := r.personal(key)) and f.get("val_pm_acc") is not None}
    return select(f"{row.name}: personalized model", "val_pm_acc", scores, settings, row.seeds or spec.seeds,
                  spec.select_per_setting, variants=readings)
