"""Benchmark suites: a grid of methods x settings x seeds where every cell is an ordinary run.

A suite file (format in docs/benchmarks.md, built-in ones in ``bench/suites/``) lists settings (table
groups) and methods (table rows). Cell ``(setting, method, seed)`` runs ``fedlt run`` with the
overrides of the suite, the setting, the method, then ``seed=S`` and its run directory
``OUT/<setting-slug>/<method-slug>/seed<S>``. Because the cell's place is fixed, the suite is
resumable: a finished cell (a readable ``summary.json``, the same config and the same resolved method
arguments) is skipped, an interrupted one continues from its checkpoint, and a folder holding a
*different* config is an error, never silently mixed into a table. A row whose finished cells ran
other code, or a folder measured on another machine type, takes no new cells either. Every cell's
config is validated before the first cell trains.
A failing cell is logged to ``OUT/failed.json`` and the others go on. An interrupted bench stops its
workers' cells where they can resume and starts no other (:mod:`fedlt.bench.workers`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import traceback
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal

import yaml
from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator,
)

from fedlt.environment import code_version, same_code
from fedlt.bench.heartbeat import cell_progress, heartbeat
from fedlt.bench.selection import SELECT_METRICS, candidate_label, candidates
from fedlt.bench.workers import run_in_workers
from fedlt.config import DuplicateKey, config_difference as _config_difference, load_yaml, read_yaml_mapping, yaml_problem
from fedlt.environment import collect as collect_environment
from fedlt.errors import ConfigError, FedltError
from fedlt.progress import duration
from fedlt.results import write_atomic
from fedlt.results import CONFIG_FILE

if TYPE_CHECKING:
    from fedlt.config import Config

SUITES_DIR = Path(__file__).resolve().parent / "suites"
REPO_ROOT = Path(__file__).resolve().parents[3]
SUITE_FILE, FAILED_FILE, LOG_FILE = "suite.yaml", "failed.json", "bench-log.jsonl"
#: config keys that do not change a cell's numbers: a finished cell is reused whatever they are
IGNORED_KEYS = ("run.out_dir", "run.name", "run.threads", "run.workers", "run.checkpoint_every", "run.tensorboard", "data.root")


def slug(text: str) -> str:
    """``"IF=100, alpha=0.5"`` -> ``"if-100-alpha-0-5"``: lowercase, non-alphanumerics -> '-'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _overrides_ok(values: list[str]) -> list[str]:
    for v in values:
        if "=" not in v:
            raise ValueError(f"'{v}' is not key=value; write overrides like fl.rounds=25")
    return values


Overrides = Annotated[list[str], AfterValidator(_overrides_ok)]


#: a setting's or row's name: the tables' label and (as a slug) a folder name
Name = Annotated[str, Field(min_length=1, pattern=r"\S")]


class SettingSpec(_Strict):
    """One table: a group of cells that differ only by method and seed."""

    name: Name
    overrides: Overrides = []


class MethodRow(_Strict):
    """One table row (the run's headline model), plus extra rows read from the same runs."""

    name: Name
    overrides: Overrides = []
    variants: dict[str, str] = Field(default_factory=dict, description="row label -> key of summary final.variants")
    settings: list[str] | None = Field(None, description="run this row only in these settings")
    seeds: list[StrictInt] | None = Field(None, description="run this row only with these of the suite's seeds")
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="config key -> candidate values: every "
                                       "combination runs, the report selects one on validation data (bench/selection)")
    select_variants: dict[str, str] = Field(
        default_factory=dict, description="variant key of this row's runs -> the override that makes it the global "
        "model (an evaluation-only reading, e.g. another head on the same training): the selection weighs each "
        "candidate read through that variant beside the candidate itself, without training it again")
    select_personal: dict[str, str] = Field(
        default_factory=dict, description="key of this row's runs' pm_variants (another evaluation-time reading of "
        "the personalized model) -> the override that makes it the run's own: the report chooses the row's "
        "personalized model among the runs' own and these on val_pm_acc, in the cells its global model was chosen "
        "from, and the row's PM column reads the chosen one")
    select_with: str | None = Field(None, description="a grid row whose selection also weighs this row's candidates "
                                    "(another reading of the same method, run as its own row): that row's table "
                                    "entry is then the best on validation of both rows' candidates")

    @field_validator("grid")
    @classmethod
    def _grid(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in v.items():
            if not values:
                raise ValueError(f"grid key '{key}' has no values; list at least one, e.g. {key}: [1, 4]")
        return v


class ClaimRow(_Strict):
    """A paper's claim, checked in the report as the paired difference ``row - against``."""

    paper: str = Field(description="who claims it, e.g. 'CReFF (IJCAI 2022)'")
    claim: str = Field(description="the claim in words")
    row: str = Field(description="the row the paper says is better (or close)")
    against: str
    metric: Literal["acc", "many_acc", "medium_acc", "few_acc", "pm_acc"] = "acc"
    paper_figure: str = Field("", description="the paper's own comparison: table, setting, values")
    paper_diff: float | None = Field(None, description="the paper's row - against, in points")
    margin: float | None = Field(None, gt=0, description="a closeness claim: |row - against| <= margin points")
    seeds: int | None = Field(None, ge=2, description="the paired seeds the claim is to be judged on, stated "
                              "before it is measured; the report marks a claim measured on another count")


class SuiteSpec(_Strict):
    name: str
    title: str | None = None
    description: str = ""
    base: str | None = None
    overrides: Overrides = []
    seeds: list[StrictInt] = [0]
    settings: list[SettingSpec] = Field(default_factory=lambda: [SettingSpec(name="default")])
    methods: list[MethodRow]
    #: optional: row labels shown but never bold/underlined, e.g. controls and diagnoses (the
    #: centralized method and the ``oracle`` variant are never ranked anyway: they are upper
    #: bounds, not competitors)
    unranked: list[str] = []
    #: optional: the row label the tables' paired differences (Δ) are taken against; default: the
    #: first row of each setting
    reference: str | None = None
    #: optional: add "what a client uploads" (first cell's messages) to the report
    report_messages: bool = False
    #: optional: markdown appended to the report's tables
    notes: str = ""
    #: optional: papers' claims, each checked as a paired difference of two rows (a report section)
    claims: list[ClaimRow] = []
    #: what a grid row's candidates are selected on (the final round's validation metric), and
    #: whether one choice holds across all settings (default) or each setting chooses its own
    select_on: Literal[SELECT_METRICS] = "val_acc"  # type: ignore[valid-type]
    select_per_setting: bool = False

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", v):
            raise ValueError(f"'{v}' is not a slug; use lowercase letters, digits, '-' and '_' (e.g. my-suite)")
        return v

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int]) -> list[int]:
        if not v or len(set(v)) != len(v) or min(v) < 0:
            raise ValueError(f"{v} must be a non-empty list of distinct seeds >= 0, e.g. [0, 1, 2]")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "SuiteSpec":
        _check_cell_keys(self)
        if not self.settings:
            raise ValueError("settings is empty; list at least one, e.g. - {name: default}, or leave the key out")
        names = [s.name for s in self.settings]
        _unique("settings", [slug(n) for n in names], names)
        if not self.methods:
            raise ValueError("methods is empty; list at least one row, e.g. - {name: FedAvg, overrides: [method=fedavg]}")
        folders = [label for m in self.methods
                   for label in [m.name, *(candidate_label(m.name, d) for d, _ in candidates(m.grid) if m.grid)]]
        _unique("methods", [slug(f) for f in folders], folders)
        labels = set()
        for i, m in enumerate(self.methods):
            for s in m.settings or []:
                if s not in names:
                    raise ValueError(f"methods[{i}].settings names '{s}', which is not a setting; use one of: "
                                     + ", ".join(names))
            outside = sorted(set(m.seeds or []) - set(self.seeds))
            if outside or m.seeds == []:
                raise ValueError(f"methods[{i}].seeds names seed {outside[0] if outside else '(none)'}, which the suite "
                                 f"does not run; use some of: {', '.join(map(str, self.seeds))}")
            for label in [m.name, *m.variants]:
                if label in labels:
                    raise ValueError(f"row label '{label}' (methods[{i}]) appears twice; give every row its own name")
                labels.add(label)
        for label in self.unranked:
            if label not in labels:
                raise ValueError(f"unranked names '{label}', which is no row; use a method name or variant label")
        for i, c in enumerate(self.claims):
            for key in ("row", "against"):
                if getattr(c, key) not in labels:
                    raise ValueError(f"claims[{i}].{key} names '{getattr(c, key)}', which is no row; use a method "
                                     "name or variant label")
            if c.row == c.against:  # a difference of 0 on every seed: a closeness claim would hold by itself
                raise ValueError(f"claims[{i}] compares '{c.row}' with itself; set against to the row the paper "
                                 "compares it with")
        for i, m in enumerate(self.methods):
            if m.select_with is not None:
                _check_select_with(i, m, {r.name: r for r in self.methods})
            if m.select_variants and not (m.grid or m.select_with):
                raise ValueError(f"methods[{i}].select_variants needs a selection to join: give the row a grid or "
                                 "select_with")
            if m.select_variants and self.select_on == "val_pm_acc":
                raise ValueError(f"methods[{i}].select_variants reads variants of the global model, which have no "
                                 "val_pm_acc; select on a global-model metric (select_on: val_acc), or choose the "
                                 "personalized model with select_personal")
        if self.reference is not None and self.reference not in labels:
            raise ValueError(f"reference names '{self.reference}', which is no row; use one of: "
                             + ", ".join(label for m in self.methods for label in [m.name, *m.variants]))
        return self


def _check_cell_keys(spec: "SuiteSpec") -> None:
    """The suite's own overrides leave to each cell what :data:`CELL_KEYS` names, as the command line's must:
    the cell's ``run.out_dir`` and ``run.name`` come after them (one there would be dropped without a word),
    and a ``seed=`` without ``{seed}`` gives every seed's cell one seed, so its seeds repeat one run."""
    places = [("overrides", spec.overrides),
              *((f"settings[{i}].overrides", s.overrides) for i, s in enumerate(spec.settings)),
              *((f"methods[{i}].overrides", m.overrides) for i, m in enumerate(spec.methods)),
              *((f"methods[{i}].grid", [o for _, given in candidates(m.grid) for o in given])
                for i, m in enumerate(spec.methods) if m.grid)]
    for where, overrides in places:
        for override in overrides:
            key, _, value = override.partition("=")
            key = key.strip()
            if key == "seed" and "{seed}" not in value:
                raise ValueError(f"{where}: {override} gives every cell that seed, whatever its seed<S> folder says, "
                                 "so the suite's seeds would repeat one run; choose the seeds with seeds: (or --seeds), "
                                 "or make the seed the cell's, e.g. seed=100{seed}")
            if key in CELL_KEYS and key != "seed":
                raise ValueError(f"{where}: {override}: {CELL_KEYS[key]}; drop it")


def _check_select_with(i: int, row: MethodRow, rows: dict[str, MethodRow]) -> None:
    """``row.select_with`` names another grid row that runs on the same settings and seeds and is
    not itself joined to a third (one level: the joined row's folders are read as they are)."""
    target = rows.get(row.select_with)
    where = f"methods[{i}].select_with names '{row.select_with}'"
    if target is None or target is row or not target.grid:
        raise ValueError(f"{where}, which is no other row with a grid; name the grid row whose choice this row's "
                         "readings join")
    if target.select_with is not None:
        raise ValueError(f"{where}, which itself joins '{target.select_with}'; name '{target.select_with}' instead")
    if (row.settings, row.seeds) != (target.settings, target.seeds):
        raise ValueError(f"{where}, which runs other settings or seeds; give both rows the same settings and seeds")


def _unique(what: str, slugs: list[str], names: list[str]) -> None:
    seen: dict[str, str] = {}
    for s, n in zip(slugs, names):
        if s in seen:
            raise ValueError(f"{what} '{seen[s]}' and '{n}' share the folder name '{s}'; rename one")
        seen[s] = n


@dataclass
class Suite:
    spec: SuiteSpec
    path: Path  # the suite file
    base: Path | None  # the resolved base config

    @property
    def title(self) -> str:
        return self.spec.title or self.spec.name


def builtin_suites() -> dict[str, Path]:
    return {p.stem: p for p in sorted(SUITES_DIR.glob("*.yaml"))}


def _describe(err: ValidationError) -> str:
    errors = err.errors()
    # a misspelt key is both unknown and, when required, missing: name the spelling, which is the fix
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".") or "suite"
    if first["type"] == "extra_forbidden":
        return f"unknown key '{where}'; remove it or fix its spelling (see the suite format in docs/benchmarks.md)"
    if first["type"] == "missing":
        return f"key '{where}' is missing; add it (see the suite format in docs/benchmarks.md)"
    if first["type"] in ("string_too_short", "string_pattern_mismatch") and where.endswith(".name"):
        return f"{where} is empty; give it a name, the label its table shows"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"].endswith(("_type", "_parsing")) or first["type"] == "list_type":  # a value of the wrong kind
        return f"{where}: {message}, got {first['input']!r} (see the suite format in docs/benchmarks.md)"
    return f"{where}: {message}" if first["loc"] else message  # a check across keys names its keys itself


#: top-level keys of a run config that no suite has: a run config given to fedlt bench
RUN_CONFIG_KEYS = frozenset({"seed", "method", "data", "fl", "model", "loss", "eval", "run", "method_args"})


def parse_suite(tree: Any, source: str) -> SuiteSpec:
    if not isinstance(tree, dict):
        raise ConfigError(f"suite {source} must be a mapping with name, seeds, settings and methods")
    if "methods" not in tree and "name" not in tree and set(tree) & RUN_CONFIG_KEYS:
        raise ConfigError(f"{source} is a run config, not a suite (a suite has name, settings and methods); run it "
                          "with fedlt run, or name it as a suite's base: config")
    try:
        return SuiteSpec.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(f"suite {source}: {_describe(err)}") from None


def load_suite(name_or_path: str | Path) -> Suite:
    """A suite by file path or built-in name; every error is a one-line ConfigError."""
    path = Path(name_or_path)
    if not path.is_file():
        builtin = builtin_suites()
        if str(name_or_path) not in builtin:
            if "=" in str(name_or_path):  # an override given before the suite
                raise ConfigError(f"'{name_or_path}' is a key=value override where the suite is expected; give the "
                                  "suite first: fedlt bench SUITE key=value ...")
            raise ConfigError(f"no suite file or built-in suite '{name_or_path}'; give a YAML file or one of: "
                              f"{', '.join(builtin)} (fedlt bench list)")
        path = builtin[str(name_or_path)]
    try:
        tree = load_yaml(path.read_bytes())
    except yaml.YAMLError as err:
        hint = "" if isinstance(err, DuplicateKey) else " (quote overrides holding [ ] or : )"
        raise ConfigError(yaml_problem(err, f"suite {path}") + hint) from None
    spec = parse_suite(tree, str(path))
    return Suite(spec, path, _resolve_base(spec.base, path))


def _resolve_base(base: str | None, suite_file: Path) -> Path | None:
    """``base`` is relative to the repository root; the working directory and the suite's own
    folder are tried too, so a suite file beside its config works anywhere."""
    if base is None:
        return None
    p = Path(base)
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p, suite_file.parent / p]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise ConfigError(f"suite {suite_file}: base config '{base}' not found (looked in {', '.join(map(str, candidates))});"
                      " run from the repository root or give an absolute path")


# ---- cells ------------------------------------------------------------------------------------
@dataclass
class Cell:
    setting: str
    method: str
    seed: int
    overrides: list[str]
    run_dir: Path
    state: str = "new"  # new | done | resume
    threads: int | None = None  # run.threads the cell's own config sets
    row: str = ""  # the suite row it belongs to: ``method``, or the grid row ``method`` is a candidate of
    diverged: bool = False  # done, and its training diverged (a result, kept; a failure of its method)

    def __post_init__(self) -> None:
        self.row = self.row or self.method

    @property
    def label(self) -> str:
        return f"{self.setting} / {self.method} / seed {self.seed}"

    @property
    def is_candidate(self) -> bool:
        """One of a grid row's candidates: chosen on validation, its test accuracy never shown."""
        return self.row != self.method


def cell_dir(out: Path, setting: str, method: str, seed: int) -> Path:
    return out / slug(setting) / slug(method) / f"seed{seed}"


def select_rows(suite: Suite, labels: list[str]) -> set[str]:
    """The method rows to run for row labels given by the user; a variant label (e.g. ``CCVR``)
    selects the row whose runs it is read from. An unknown label is a ConfigError naming the rows."""
    owner = {label: m.name for m in suite.spec.methods for label in [m.name, *m.variants]}
    unknown = [label for label in labels if label not in owner]
    if unknown:
        raise ConfigError(f"--row '{unknown[0]}' is no row of suite {suite.spec.name}; use one of: "
                          + ", ".join(owner))
    return {owner[label] for label in labels}


#: what a suite sets for each cell, so an override for every cell may not: the override, and why
CELL_KEYS = {"seed": "a suite gives each cell its seed (pick them with --seeds)",
             "run.out_dir": "a suite's cells go under --out (give that instead)",
             "run.name": "a suite names each cell's folder after its setting, row and seed"}


def seeded(seed: int, given: list[str]) -> list[str]:
    """A cell's overrides: ``seed=S`` first, then ``given`` with ``{seed}`` read as S (a later ``seed=``
    wins, as in a replicate row)."""
    return [f"seed={seed}", *(o.replace("{seed}", str(seed)) for o in given)]


def expand(suite: Suite, out: Path, seeds: list[int] | None = None, extra: list[str] | None = None,
           rows: list[str] | None = None) -> list[Cell]:
    """All cells, settings-major then methods then seeds (the tables' order). ``extra`` overrides
    (from the command line, e.g. ``data.root=...``) follow the method's; ``rows`` (row labels)
    keeps only those rows' cells, so a long suite can be run in the order its comparisons need.

    ``{seed}`` in an override is the cell's seed, and the cell's ``seed=S`` comes first, so a row
    can train the federation of seed S with other training randomness:
    ``[data.seed={seed}, seed=100{seed}]`` (a replicate: what a paired comparison calls noise)."""
    s = suite.spec
    for override in extra or []:
        key = override.split("=", 1)[0].strip()
        if key in CELL_KEYS:
            raise ConfigError(f"{override}: {CELL_KEYS[key]}; drop it")
    chosen = select_rows(suite, rows) if rows else None
    cells = []
    for setting in s.settings:
        for m in s.methods:
            if (m.settings is not None and setting.name not in m.settings) or (chosen and m.name not in chosen):
                continue
            choices = [(candidate_label(m.name, d), o) for d, o in candidates(m.grid)] if m.grid else [(m.name, [])]
            for label, chosen_overrides in choices:
                for seed in seeds or s.seeds:
                    if m.seeds is not None and seed not in m.seeds:
                        continue
                    run_dir = cell_dir(out, setting.name, label, seed)
                    given = [*s.overrides, *setting.overrides, *m.overrides, *chosen_overrides, *(extra or [])]
                    overrides = [*seeded(seed, given), f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}"]
                    cells.append(Cell(setting.name, label, seed, overrides, run_dir, row=m.name))
    return cells


def config_difference(saved: dict[str, Any], wanted: dict[str, Any]) -> str | None:
    """:func:`fedlt.config.config_difference` ignoring :data:`IGNORED_KEYS` (where a cell's files go,
    how many threads it had)."""
    return _config_difference(saved, wanted, IGNORED_KEYS)


#: method knobs, by method, with what kept runs did where their summary does not record the knob: one
#: added after they ran, or one whose default changed before summaries recorded every knob (whatever the
#: knob's default is now, such a run ran this value unless its config set another)
KNOBS_BEFORE_THEY_EXISTED = {"sfd": {"scl_form": "paper"},
                             "fedloge": {"personal_head": "realigned", "la_fr_psi": "unit", "generic_head": "psi"},
                             "fedyoyo": {"view_interpolation": "bilinear", "asd_average": "batch",
                                         "prior_features": "train"},
                             "feddecorr": {"normalization": "paper"}, "gbme": {"gpi_counts": "proxy"}}


def method_args_difference(saved: dict[str, Any], cfg: Config, recorded: bool = True) -> str | None:
    """The first knob whose value a finished run used differs from what ``cfg`` resolves to now, as
    ``method_args.key: a -> b``: a changed default changes the run although the config file does not.
    ``saved``: the run's ``summary["method_args"]`` (every knob, defaults included), or without that
    record (``recorded=False``) its config's knobs, where only :data:`KNOBS_BEFORE_THEY_EXISTED` is known."""
    from fedlt.methods.registry import get_method, parse_method_args

    resolved = parse_method_args(get_method(cfg.method), cfg.method_args).model_dump(mode="json")
    before = KNOBS_BEFORE_THEY_EXISTED.get(cfg.method, {})
    ran = {**before, **saved}
    if not recorded:  # only the knobs its config set, or listed above, are known
        unknown = sorted(set(cfg.method_args) - set(ran))
        if unknown:
            return f"method_args.{unknown[0]}: the default of its time, not recorded -> {resolved.get(unknown[0])!r}"
        resolved = {k: resolved.get(k) for k in ran}
    return config_difference({f"method_args.{k}": v for k, v in ran.items()},
                             {f"method_args.{k}": v for k, v in resolved.items()})


#: calibration knobs whose default changed before summaries recorded every calibration knob, by the
#: calibration that reads them: a finished cell without that record ran these unless its config set them
DEFAULTS_BEFORE_RECORD = {"creff": {"creff_feature_momentum": 0.5}}

#: calibration knobs added later: a run whose record (or, before records, config) lacks one ran this value,
#: whatever the knob's default is now
CALIBRATION_KNOBS_BEFORE_THEY_EXISTED = {"creff": {"creff_matching_bias": "row"}}


def calibration_args_difference(summary: dict[str, Any], saved: dict[str, Any], cfg: Config) -> str | None:
    """The first knob of a calibration a finished run used whose value (``summary["calibration_args"]``,
    or for a run from before that record its config's ``saved`` knobs over :data:`DEFAULTS_BEFORE_RECORD`)
    differs from what ``cfg`` resolves to now, as ``calibration_args.key: a -> b``. A knob named
    ``<calibration>_...`` counts only where that calibration ran; the others (``retrain_*``) are shared."""
    from fedlt.calibration.calibrators import CALIBRATORS
    from fedlt.calibration.wrapper import parse_calibration_args

    used = summary.get("calibration") or []
    ran = summary.get("calibration_args")
    absent = {k: v for name in used for k, v in CALIBRATION_KNOBS_BEFORE_THEY_EXISTED.get(name, {}).items()}
    if not isinstance(ran, dict):
        before = {k: v for name in used for k, v in DEFAULTS_BEFORE_RECORD.get(name, {}).items()}
        ran = parse_calibration_args({**before, **absent, **saved}).model_dump(mode="json")
    else:
        ran = {**absent, **ran}
    resolved = parse_calibration_args(cfg.calibration_args).model_dump(mode="json")

    def read(knob: str) -> bool:
        owner = [name for name in CALIBRATORS if knob.startswith(f"{name}_")]
        return not owner or owner[0] in used

    return config_difference({f"calibration_args.{k}": v for k, v in ran.items() if read(k)},
                             {f"calibration_args.{k}": v for k, v in resolved.items() if read(k)})


def check_row_reads(suite: Suite, row: MethodRow, cfg: Config, spec) -> None:
    """What the suite reads from a row's runs, they give: the variants its labels and selection read,
    and the metric of each claim on it (a method without a global model has no global accuracy, a
    run without personalized evaluation no PM, a variant no PM)."""
    from fedlt.methods.registry import parse_method_args

    args = parse_method_args(spec, cfg.method_args)
    given = spec.server.variant_names(cfg, args)
    for key in [*row.variants.values(), *row.select_variants]:
        if key not in given:
            raise ConfigError(f"suite {suite.spec.name}, row '{row.name}': its runs give no variant '{key}' (they "
                              f"give: {', '.join(sorted(given)) or 'none'}); fix the row's variants or select_variants")
    for i, claim in enumerate(suite.spec.claims):
        personal = claim.metric == "pm_acc"
        for label in (claim.row, claim.against):
            missing = None
            if label == row.name and personal and not cfg.eval.personalized:
                missing = "eval.personalized=false: no personalized accuracy"
            elif label == row.name and not personal and not spec.server.has_global_model(cfg, args):
                missing = "no global model"
            elif label in row.variants and personal:
                missing = "a variant of the global model, without personalized accuracy"
            if missing:
                raise ConfigError(f"suite {suite.spec.name}, claims[{i}] compares {claim.metric} of '{label}', whose "
                                  f"runs have {missing}; compare another metric or row")


def validate_cells(suite: Suite, cells: list[Cell]) -> None:
    """Build and check every cell's config, classify its folder, and build the federation of every cell
    still to train (its files, long tail, validation split and partition), before anything trains."""
    from fedlt.config import load_config
    from fedlt.config import federation_seed
    from fedlt.data.federated import build_federated_data
    from fedlt.run_parts import check_new_config

    federations: dict[str, tuple[Config, str]] = {}  # data settings and federation seed -> one such cell
    selected = {m.name for m in suite.spec.methods if m.grid or m.select_with}  # rows whose cells are chosen among
    personal = {m.name for m in suite.spec.methods if m.select_personal}  # rows whose personal reading is chosen
    rows = {m.name: m for m in suite.spec.methods}
    others: list[OtherConfig] = []
    for cell in cells:
        try:
            cfg = load_config(suite.base, cell.overrides)
            spec = check_new_config(cfg)
        except FedltError as err:
            raise ConfigError(f"suite {suite.spec.name}, cell '{cell.label}': {err}") from None
        check_row_reads(suite, rows[cell.row], cfg, spec)
        if (cell.row in selected or cell.row in personal) and cfg.data.val_per_class == 0:
            what = f"its grid is selected on {suite.spec.select_on}" if cell.row in selected \
                else "its personalized model is selected on val_pm_acc"
            raise ConfigError(f"suite {suite.spec.name}, row '{cell.row}': {what}, but its cells have no validation "
                              "set; add data.val_per_class=N (e.g. 500) to the suite's overrides")
        cell.threads = cfg.run.threads
        try:
            validate_cell_folder(cell, cfg)
        except OtherConfig as other:
            others.append(other)
            continue
        if cell.state != "done":  # a partition can be impossible for one seed only (a retried Dirichlet draw)
            data = cfg.data.model_copy(update={"seed": federation_seed(cfg.data, cfg.seed)})  # data.seed=S is seed S
            key = json.dumps(data.model_dump(mode="json"), sort_keys=True)
            federations.setdefault(key, (cfg, cell.label))
    refuse_other_configs(others)
    loaded: dict = {}  # each dataset read once: the federations go dataset by dataset
    by_dataset = sorted(federations.values(), key=lambda item: json.dumps(
        [item[0].data.dataset, item[0].data.root, item[0].data.image_size]))
    for cfg, label in by_dataset:  # missing or corrupt files, impossible splits: before any cell trains
        try:
            build_federated_data(cfg.data, cfg.seed, loaded=loaded)
        except FedltError as err:
            raise ConfigError(f"suite {suite.spec.name}, cell '{label}': {err}") from None


def check_kept_cells(suite: Suite, out: Path, cells: list[Cell], overrides: list[str] | None) -> None:
    """Check the folder's other runs against the suite as it is now: those of rows ``--row`` leaves out
    and of seeds ``--seeds`` leaves out (earlier calls' extra seeds included). The folder's suite file
    is rewritten from this suite and its report reads every seed folder of a row, so a run of an
    edited row's old settings would pass for the new ones."""
    from fedlt.config import load_config

    given = {c.run_dir for c in cells}
    others: list[OtherConfig] = []
    seeds = set(suite.spec.seeds)
    for folder in out.glob("*/*/seed*"):
        if re.fullmatch(r"seed\d+", folder.name) and folder.is_dir():
            seeds.add(int(folder.name[4:]))
    for cell in expand(suite, out, sorted(seeds), overrides):
        if cell.run_dir not in given and (cell.run_dir / "summary.json").is_file():  # what a report reads
            try:
                cfg = load_config(suite.base, cell.overrides)
            except FedltError as err:
                raise ConfigError(f"suite {suite.spec.name}, cell '{cell.label}': {err}") from None
            try:
                validate_cell_folder(cell, cfg)
            except OtherConfig as other:
                others.append(other)
    refuse_other_configs(others)


class OtherConfig(ConfigError):
    """A cell's folder holds a run of another config."""

    def __init__(self, cell: Cell, diff: str):
        super().__init__(f"cell '{cell.label}': {cell.run_dir} holds a run of another config ({diff}); delete that "
                         "folder or pass --out to a fresh one")
        self.cell, self.diff = cell, diff


def refuse_other_configs(found: list[OtherConfig]) -> None:
    """One error for every cell folder that holds a run of another config (a changed override changes every
    cell of a row, and naming them one per call made the user delete them one per call)."""
    if len(found) == 1:
        raise found[0]
    if found:
        first, others = found[0], [f.cell.run_dir for f in found[1:]]
        listed = ", ".join(map(str, others[:3])) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        more = "does 1 more cell's folder" if len(others) == 1 else f"do {len(others)} more cells' folders"
        raise ConfigError(f"cell '{first.cell.label}': {first.cell.run_dir} holds a run of another config "
                          f"({first.diff}), and so {more} ({listed}); delete them, or "
                          "pass --out to a fresh folder")


def validate_cell_folder(cell: Cell, cfg: Config) -> None:
    """Classify a cell's folder: new (also a run that aborted), done (a readable summary), resume (a
    checkpoint), or an error (a run of another config, or of other resolved method arguments where its
    summary records them)."""
    from fedlt.engine.checkpoint import CHECKPOINT_FILE
    from fedlt.results import SUMMARY_FILE, read_summary

    saved_path = cell.run_dir / CONFIG_FILE
    if cell.run_dir.exists() and not cell.run_dir.is_dir():
        raise ConfigError(f"cell '{cell.label}': {cell.run_dir} is a file where the cell's run directory goes; "
                          "move it away or pass --out to a fresh folder")
    if not saved_path.is_file():
        if cell.run_dir.exists() and any(cell.run_dir.iterdir()):
            raise ConfigError(f"cell '{cell.label}': {cell.run_dir} holds files but no fedlt run; "
                              "delete that folder or pass --out to a fresh one")
        cell.state = "new"
        return
    saved = read_yaml_mapping(saved_path, f"cell '{cell.label}': run config")
    if not saved:  # an empty file would match any config
        raise ConfigError(f"cell '{cell.label}': {saved_path} is empty, so what the cell ran is unknown; delete "
                          f"{cell.run_dir} to run the cell afresh")
    try:
        summary = read_summary(cell.run_dir) if (cell.run_dir / SUMMARY_FILE).is_file() else None
    except FedltError:  # a cut-off or foreign summary: unfinished, so resuming rewrites it
        summary = None
    # a finished run's calibration and method knobs are matched on the values it ran with, however they were
    # spelled (a default it ran is a value a row may now spell out): as its summary records them, or as far as
    # its config and the knobs' earlier defaults tell
    resolved = ("calibration_args", "method_args") if summary else ()
    diff = _config_difference(saved, cfg.dump(), IGNORED_KEYS + resolved)
    if diff is None and summary and isinstance(summary.get("method_args"), dict):
        diff = method_args_difference(summary["method_args"], cfg)
    elif diff is None and summary:  # a summary from before method_args were recorded: its config's knobs
        raw = saved.get("method_args")
        diff = method_args_difference(raw if isinstance(raw, dict) else {}, cfg, recorded=False)
    if diff is None and summary:
        raw = saved.get("calibration_args")
        diff = calibration_args_difference(summary, raw if isinstance(raw, dict) else {}, cfg)
    if diff is not None:
        raise OtherConfig(cell, diff)
    if summary and summary.get("status") == "aborted":  # a Flower run stopped early: on from its checkpoint
        cell.state = "resume" if _resumable_on_nodes(cell.run_dir) else "new"  # where it can, else again
    elif summary:
        cell.state, cell.diverged = "done", summary.get("status") == "diverged"
    elif (cell.run_dir / CHECKPOINT_FILE).is_file():
        if not zipfile.is_zipfile(cell.run_dir / CHECKPOINT_FILE):  # torch's format: cut off, it has no directory
            raise ConfigError(f"cell '{cell.label}': {cell.run_dir / CHECKPOINT_FILE} is cut off or damaged, so the "
                              f"cell cannot resume; delete {cell.run_dir} to run it afresh")
        cell.state = "resume"
    else:
        cell.state = "new"  # started, killed before its first checkpoint: nothing to keep


def _resumable_on_nodes(run_dir: Path) -> bool:
    """Whether an aborted cell can go on from its checkpoint on Flower's simulation engine (its clients kept
    nothing on their nodes), as ``fedlt run --resume`` would."""
    try:
        from fedlt.engine.flower_app import resume_point
    except ImportError:  # no Flower: the cell runs again from the start
        return False
    point = resume_point(run_dir)
    return point is not None and not point[0].get("deployed")


# ---- running ----------------------------------------------------------------------------------
def run_cell(base: str | None, overrides: list[str], run_dir: str, state: str, threads: int | None) -> dict[str, Any]:
    """One cell, in this process or a pool worker; never raises (the error is returned)."""
    from fedlt import api
    from fedlt.results import check_not_written

    t0, c0 = time.perf_counter(), _cpu_seconds()
    out: dict[str, Any] = {"run_dir": run_dir}
    try:
        if state == "resume":
            result = api.resume(run_dir, quiet=True)
        else:
            if Path(run_dir).exists():  # empty, or this suite's unfinished cell without a checkpoint
                check_not_written(Path(run_dir))  # not another bench's cell, still going
                shutil.rmtree(run_dir)
            # cells share the cores: a run.backend=parallel cell gets one worker of its share
            extra = [f"run.threads={threads}", "run.workers=1"] if threads else []
            result = api.run(base, overrides=[*overrides, *extra], quiet=True)
        final = result.summary["final"]
        out.update(status="ok", acc=final.get("acc"), pm_acc=final.get("pm_acc"), val_acc=final.get("val_acc"),
                   environment=result.summary["environment"])
    except Exception as err:  # a failing cell must not stop the suite; it is reported
        out.update(status="failed", error=f"{type(err).__name__}: {err}",
                   traceback=None if isinstance(err, FedltError) else traceback.format_exc(limit=-8),
                   environment=collect_environment())
    out.update(wall_s=round(time.perf_counter() - t0, 2), cpu_s=round(_cpu_seconds() - c0, 2))
    return out


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (run.backend=parallel's workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class SuiteResult:
    out: Path
    cells: list[Cell]
    ran: list[Cell] = field(default_factory=list)
    skipped: list[Cell] = field(default_factory=list)
    failed: list[tuple[Cell, str]] = field(default_factory=list)

    @property
    def diverged_before(self) -> list[Cell]:
        """Cells kept from an earlier call whose training diverged: that call counted them as failed."""
        return [c for c in self.skipped if c.diverged]


def write_suite_file(suite: Suite, out: Path, seeds: list[int] | None) -> None:
    """The suite a folder's report reads: its own seeds and any run beyond them (``--seeds`` runs some of
    a suite's seeds, or more; the folder keeps the suite's rows, whose own seeds stay some of these)."""
    tree = suite.spec.model_dump(exclude_defaults=False)
    tree["seeds"] = sorted(set(suite.spec.seeds) | set(seeds or []))
    tree["base"] = _portable(suite.base) if suite.base else None
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / SUITE_FILE, yaml.safe_dump(tree, sort_keys=False, allow_unicode=True))


def _portable(base: Path) -> str:
    """A base config inside the repository as its path from the repository's root (what
    :func:`_resolve_base` finds again in any clone); one outside it as its absolute path."""
    try:
        return base.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(base)


#: what decides a run's floats beyond its config: cells that differ here are not paired digit for digit
MACHINE_KEYS = ("cpu_capability", "gpu", "torch")


def machine(env: dict[str, Any]) -> str:
    return ", ".join(f"{k} {env.get(k)}" for k in MACHINE_KEYS if env.get(k) is not None)


def finished_environments(suite: Suite, out: Path) -> Iterator[tuple[Cell, dict[str, Any]]]:
    """Every finished cell of the folder (all settings, rows and seeds of the suite: a readable summary)
    with the ``environment`` its summary records (``{}`` where none is); a cell trained by several
    processes (resumed) once with each one's."""
    from fedlt.results import read_summary

    for cell in expand(suite, out, None):
        try:
            summary = read_summary(cell.run_dir)
        except FedltError:  # none, or cut off: unfinished
            continue
        if summary.get("status") == "aborted":  # runs again from the start: not a finished cell
            continue
        segments = summary.get("segments")
        envs = [s.get("environment") for s in segments if isinstance(s, dict)] if isinstance(segments, list) \
            else [summary.get("environment")]
        for env in envs or [None]:
            yield cell, env if isinstance(env, dict) else {}


def check_same_machine(suite: Suite, out: Path, todo: list[Cell]) -> None:
    """Refuse to add cells to a folder whose finished cells ran on another machine type: every row
    is paired with the reference row by seed, and a pair across CPU capabilities or torch versions
    differs by up to several points on the same seed."""
    from fedlt.config import load_config
    from fedlt.run_parts import resolve_device

    if not todo:
        return
    here = machine(collect_environment(resolve_device(load_config(suite.base, todo[0].overrides).run.device)))
    for _, env in finished_environments(suite, out):
        if env and machine(env) != here:
            raise ConfigError(f"{out} holds finished cells measured on another machine type ({machine(env)}; this "
                              f"machine: {here}), and rows are paired by seed across the folder; use another --out "
                              f"for this machine type and re-run the reference row there, or pass --mixed-machines")


def check_same_code(suite: Suite, out: Path, todo: list[Cell]) -> None:
    """Refuse to add cells to a row whose finished cells ran other fedlt source than this process, or
    than each other (:func:`fedlt.environment.same_code`): a row's seeds are averaged and paired as one
    method, and a code change between seeds makes them two. A cell to resume counts with the code that
    trained its first rounds (its checkpoint's record): its rounds too are one method."""
    from fedlt.config import load_config
    from fedlt.engine.checkpoint import load_checkpoint
    from fedlt.run_parts import outside_code

    rows = {(c.setting, c.method) for c in todo}
    finished: dict[tuple[str, str], list[tuple[Cell, dict[str, Any]]]] = {}
    for cell, env in finished_environments(suite, out):
        if (cell.setting, cell.method) in rows:
            finished.setdefault((cell.setting, cell.method), []).append((cell, env))
    for cell in (c for c in todo if c.state == "resume"):
        segments = load_checkpoint(cell.run_dir, mmap=True).get("segments") or []
        for env in (s.get("environment") for s in segments if isinstance(s, dict)):
            finished.setdefault((cell.setting, cell.method), []).append((cell, env if isinstance(env, dict) else {}))
    if not finished:
        return
    rows_cell = {(c.setting, c.method): c for c in todo}
    for (setting, method), cells in finished.items():
        row_cfg = load_config(suite.base, rows_cell[setting, method].overrides)
        here = collect_environment(outside_code=outside_code(row_cfg))
        envs = [here, *(env for _, env in cells)]
        if all(same_code(a, b) for i, a in enumerate(envs) for b in envs[i + 1:]):
            continue
        seeds: dict[str, list[int]] = {}
        for cell, env in cells:
            seeds.setdefault(code_version(env) or "not recorded", []).append(cell.seed)
        ran = "; ".join(f"{version}: seed{'s' * (len(s) > 1)} {', '.join(map(str, s))}" for version, s in seeds.items())
        raise ConfigError(f"row '{method}' ({setting}) in {out} holds finished or started cells of other or "
                          "unidentifiable code "
                          f"({ran}; this process: {code_version(here)}), and a row's seeds are one method; re-run the "
                          "row at one commit into a fresh --out (or delete its cells there), or pass --mixed-code")


def check_workers_can_build(suite: Suite, todo: list[Cell]) -> None:
    """Refuse, before any cell trains, a cell whose method or calibration is registered only in this
    process's code: the worker processes of ``--workers N`` look it up by name and would fail each such cell."""
    from fedlt.config import load_config
    from fedlt.run_parts import check_built_by_name

    for cell in todo:
        try:
            check_built_by_name(load_config(suite.base, cell.overrides),
                                ("the bench's worker processes (--workers N)", "--workers 1"))
        except ConfigError as err:
            raise ConfigError(f"suite {suite.spec.name}, cell '{cell.label}': {err}") from None


def run_suite(suite: Suite, out: Path, seeds: list[int] | None = None, workers: int = 1, dry_run: bool = False,
              echo: Callable[[str], None] = print, overrides: list[str] | None = None,
              rows: list[str] | None = None, mixed_machines: bool = False, mixed_code: bool = False) -> SuiteResult:
    """Validate every cell, then run the unfinished ones (``workers`` processes in parallel);
    ``rows`` limits the run to those row labels (the others' finished cells stay as they are).
    Unless ``mixed_machines``, a folder whose finished cells ran on another machine type is refused;
    unless ``mixed_code``, a row whose finished cells ran other code than this process."""
    if workers < 1:
        raise ConfigError(f"--workers {workers}: use 1 or more")
    if (out / CONFIG_FILE).is_file() and not (out / SUITE_FILE).is_file():
        raise ConfigError(f"--out {out} is the folder of a run (it holds {CONFIG_FILE}), not of a bench; give the "
                          "bench a new folder, or the one an earlier call of the suite wrote")
    bad = [o for o in overrides or [] if "=" not in o]
    if bad:
        raise ConfigError(f"'{bad[0]}' is not key=value; after the suite give overrides like data.root=/data")
    cells = expand(suite, out, seeds, overrides, rows)
    validate_cells(suite, cells)
    check_kept_cells(suite, out, cells, overrides)
    result = SuiteResult(out, cells, skipped=[c for c in cells if c.state == "done"])
    todo = [c for c in cells if c.state != "done"]
    if not mixed_machines:
        check_same_machine(suite, out, todo)
    if not mixed_code:
        check_same_code(suite, out, todo)
    if workers > 1 and len(todo) > 1:
        check_workers_can_build(suite, todo)
    if dry_run:
        for c in cells:
            echo(f"{c.state:7s} {c.label:60s} {c.run_dir}")
        echo(f"{len(cells)} cells: {len(result.skipped)} finished, {len(todo)} to run")
        return result
    from fedlt.run_parts import process_threads

    write_suite_file(suite, out, seeds)
    threads = max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None
    name = suite.spec.name
    kept = kept_threads(result.skipped)
    if kept is not None and any(not c.threads for c in todo):
        if kept != (threads or process_threads()):
            echo(f"[bench {name}] cells run with {kept} thread(s) each, as the folder's finished cells did (a thread "
                 "count changes the floats, and rows are paired by seed)")
        threads = kept
    base = str(suite.base) if suite.base else None
    echo(f"[bench {name}] {len(cells)} cells, {len(result.skipped)} already finished, {len(todo)} to run"
         f" with {workers} worker(s) -> {out}")
    t0 = time.perf_counter()
    failures = load_failures(out, {str(c.run_dir) for c in todo})
    walls: list[float] = []

    def finished(cell: Cell, info: dict[str, Any]) -> None:
        if cell.is_candidate:
            info = {k: v for k, v in info.items() if k not in ("acc", "pm_acc")}
        shown = "acc" if "acc" in info else "val_acc"
        with open(out / LOG_FILE, "a") as f:
            f.write(json.dumps({"cell": cell.label, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **info}) + "\n")
        if info["status"] == "ok":
            result.ran.append(cell)
            failures.pop(str(cell.run_dir), None)
            what = f"{shown.replace('_', ' ')} {info[shown]:.2f}" if info.get(shown) is not None else "done"
        else:
            result.failed.append((cell, info["error"]))
            failures[str(cell.run_dir)] = {"cell": cell.label, "run_dir": str(cell.run_dir), "error": info["error"],
                                           "traceback": info.get("traceback")}
            what = f"FAILED: {info['error']}"
        _write_failures(out, failures)
        done = len(result.ran) + len(result.failed)
        walls.append(info["wall_s"])
        elapsed = time.perf_counter() - t0
        left = len(todo) - done  # cells still to finish, `workers` at a time, at the mean cell time so far
        eta = sum(walls) / len(walls) * left / max(1, min(workers, left))
        echo(f"[bench {name}] {done + len(result.skipped)}/{len(cells)} | {cell.label}: {what} "
             f"({duration(info['wall_s'])}) | elapsed {duration(elapsed)}, ETA {duration(eta)}")

    args = [(c, (base, c.overrides, str(c.run_dir), c.state, None if c.threads else threads)) for c in todo]
    def still_running() -> list[Cell]:  # or queued: those have written no round yet, so no line names them
        ended = {id(c) for c, _ in result.failed} | {id(c) for c in result.ran}
        return [c for c in todo if id(c) not in ended]

    began = time.time()
    try:
        with heartbeat(still_running, echo, f"[bench {name}]"):
            if workers == 1 or len(todo) <= 1:
                for cell, a in args:
                    finished(cell, run_cell(*a))
            else:
                run_in_workers(args, workers, run_cell, finished)
    except KeyboardInterrupt as stop:  # the interrupt line names the cells it stopped, and where
        stopped = [f"{c.label} ({where})" for c in still_running()
                   if (where := cell_progress(c.run_dir, began, c.is_candidate))]
        stop.bench_hint = (f"stopped {'; '.join(stopped)}: the same `fedlt bench` command goes on with "
                           f"{'it' if len(stopped) == 1 else 'them'} (from the last checkpoint, where there is one) "
                           "and with the suite's other unfinished cells") if stopped else None
        raise
    kept = result.diverged_before
    echo(f"[bench {name}] {len(result.ran)} ran, {len(result.skipped)} skipped (finished before"
         + (f", {len(kept)} of them diverged" if kept else "") + f"), {len(result.failed)} failed"
         + (f" (see {out / FAILED_FILE})" if result.failed or kept else "") + f"; {duration(time.perf_counter() - t0)}")
    for cell, error in [*result.failed, *((c, "diverged (kept from an earlier call)") for c in kept)]:
        echo(f"[bench {name}] failed: {cell.label}: {error}")
    return result


def kept_threads(finished: list[Cell]) -> int | None:
    """The one thread count the finished cells without their own ``run.threads`` trained with (the last
    process of a resumed one), or None when they record none or several."""
    from fedlt.results import read_summary

    counts = set()
    for cell in finished:
        if cell.threads:
            continue
        summary = read_summary(cell.run_dir)
        env = summary.get("environment") if isinstance(summary.get("environment"), dict) else {}
        if isinstance(env.get("threads"), int):
            counts.add(env["threads"])
    return counts.pop() if len(counts) == 1 else None


def load_failures(out: Path, pending: set[str] = frozenset()) -> dict[str, Any]:
    """Earlier failures (``run_dir`` -> record), minus the cells about to be run again (they get a fresh
    verdict); a damaged file holds none."""
    path = out / FAILED_FILE
    try:
        old = json.loads(path.read_bytes()) if path.is_file() else []
    except (json.JSONDecodeError, UnicodeDecodeError):  # damaged: a failed cell is unfinished and runs again anyway
        old = []
    records = old if isinstance(old, list) else []
    return {f["run_dir"]: f for f in records
            if isinstance(f, dict) and isinstance(f.get("run_dir"), str) and f["run_dir"] not in pending}


def _write_failures(out: Path, failures: dict[str, Any]) -> None:
    path = out / FAILED_FILE
    if failures:
        write_atomic(path, json.dumps(list(failures.values()), indent=2) + "\n")
    elif path.exists():
        path.unlink()


def list_suites() -> list[tuple[str, str, int]]:
    """``(name, title, number of cells)`` of every built-in suite."""
    rows = []
    for name in builtin_suites():
        suite = load_suite(name)
        rows.append((name, suite.title, len(expand(suite, Path("."), None))))
    return rows
