"""The run directory: resolved config, per-round metrics, summary, report, plot, checkpoint.

Files are written atomically (temp file + rename), so an interrupted run never leaves a
truncated summary; ``metrics.jsonl`` is appended one evaluated round at a time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from fedlt.config import DIRICHLET_PARTITIONS, Config, federation_seed
from fedlt.data.registry import DATASETS, lt_name
from fedlt.errors import ConfigError, FedltError, interrupt_kept
from fedlt.methods.registry import get_method

CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, REPORT_FILE, PLOT_FILE = (
    "config.yaml", "metrics.jsonl", "summary.json", "report.md", "curves.png",
)
#: written at run start: per-client class counts (the partition heatmap); after training, when the
#: method exposes any: named tensors such as synthetic features (the feature projection plot)
PARTITION_FILE, ARTIFACTS_FILE = "partition.json", "artifacts.pt"
#: every file a run writes into its directory besides its config and checkpoint
RUN_FILES = (METRICS_FILE, SUMMARY_FILE, REPORT_FILE, PLOT_FILE, PARTITION_FILE, ARTIFACTS_FILE)
#: metric keys that measure the machine, not the method: excluded from reproducibility checks
TIMING_KEYS = ("time_s", "elapsed_s")
#: what the engine itself writes into a metrics line (the test-set metrics, round bookkeeping);
#: every other key is a method's own diagnostic (``Server.metrics()``)
SCALAR_EVAL_KEYS = ("acc", "many_acc", "medium_acc", "few_acc", "loss", "pm_acc")
EVAL_KEYS = (*SCALAR_EVAL_KEYS, "per_class_acc", "variants")
#: a personalized method's other evaluation-time readings of its personalized model: name -> their
#: ``pm_acc`` (and ``val_pm_acc``), written only by methods that have such readings
PM_VARIANTS = "pm_variants"
#: how many clients' personalized models (of the headline reading, or of a ``pm_variants`` reading) gave
#: a non-finite test loss: their accuracy is a NaN model's; written only where some did
PM_NONFINITE = "pm_nonfinite"
#: the validation set's figures (``data.val_per_class``), beside the test set's in every evaluated round
VAL_KEYS = ("val_acc", "val_many_acc", "val_medium_acc", "val_few_acc", "val_loss", "val_pm_acc")
ENGINE_KEYS = ("round", "lr", "train_loss", "comm", "dropped", "diverged", *TIMING_KEYS, *EVAL_KEYS, PM_VARIANTS,
               PM_NONFINITE, *VAL_KEYS)
#: the environment variable naming the file where a Flower ServerApp writes how its run ended: set
#: by :mod:`fedlt.deploy`, since ``flwr run`` exits 0 even when the ServerApp raised
OUTCOME_ENV = "FEDLT_OUTCOME_FILE"
#: the environment variable naming the file where :mod:`fedlt.deploy` says why it stops a ServerApp (its
#: timeout), so the aborted summary records that rather than only "stopped by a signal"
STOP_REASON_ENV = "FEDLT_STOP_REASON_FILE"
#: the environment variable naming the file where :mod:`fedlt.deploy` lists, one name a line, the sites
#: whose SuperNode process it saw exit, so the ServerApp stops waiting for them at once instead of until
#: Flower's heartbeat (up to 60 s) or ``flower.timeout_s`` gives up on them
LOST_NODES_ENV = "FEDLT_LOST_NODES_FILE"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with removed_unless_renamed(tmp):
        tmp.write_text(text)
        os.replace(tmp, path)


@contextmanager
def removed_unless_renamed(tmp: Path) -> Iterator[None]:
    """``tmp``, written to be renamed into place inside, is removed when the writing fails or is
    interrupted (Ctrl-C, SIGTERM): the folder keeps neither a cut file nor a stray temporary one."""
    try:
        yield
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


#: the run folders this process writes, by (device, inode), and how many holds each has
_held: dict[tuple[int, int], int] = {}


@contextmanager
def writing(run_dir: Path) -> Iterator[None]:
    """This process's hold on ``run_dir`` while it writes there. A second process (a resume of a run
    still going, the same run started twice) is refused instead of interleaving its metrics and
    checkpoints with the first's; this process may hold it again inside (a resume, then its run)."""
    with holding(run_dir, f"{run_dir} is being written by another fedlt process (the run, or a resume of it, is "
                          "still going); let it end or stop it, then resume the folder"):
        yield


@contextmanager
def holding(folder: Path, refusal: str) -> Iterator[None]:
    """This process's hold on ``folder``; another process's is refused with ``refusal`` (a ConfigError).
    An advisory lock on the folder itself, which the system releases when the process ends, however
    it ends; where there are no such locks (not a POSIX system; NFS, where it would need a file open
    for writing), nothing is held."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        yield
        return
    handle = os.open(folder, os.O_RDONLY)
    stat = os.fstat(handle)
    key = (stat.st_dev, stat.st_ino)
    try:
        if key not in _held:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # refused before the work starts, like bad input
                raise ConfigError(refusal) from None
            except OSError:  # a file system without these locks
                pass
        _held[key] = _held.get(key, 0) + 1
        try:
            yield
        finally:
            _held[key] -= 1
            if not _held[key]:
                del _held[key]
    finally:
        os.close(handle)


def check_not_written(run_dir: Path) -> None:
    """Refuse ``run_dir`` now if another process writes there (see :func:`writing`): before the data a
    resume would read first."""
    with writing(run_dir):
        pass


def new_run_dir(cfg: Config) -> Path:
    """A fresh, unique run directory (``out_dir/name`` or ``out_dir/method-dataset-time``)."""
    base = Path(cfg.run.out_dir)
    name = cfg.run.name or f"{cfg.method}-{cfg.data.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base / name, 1
    while True:  # made, not looked for first: a folder another process makes meanwhile is passed over too
        try:
            path.mkdir(parents=True)
            break
        except OSError as err:
            if isinstance(err, FileExistsError) and base.is_dir():
                n += 1
                path = base / f"{name}-{n}"
                continue
            raise ConfigError(f"cannot create the run directory {path} ({err.strerror or err}); "  # not a folder,
                              "set run.out_dir to a writable folder") from None  # or not writable
    try:
        write_atomic(path / CONFIG_FILE, yaml.safe_dump(cfg.dump(), sort_keys=False))
    except BaseException:  # stopped (or failed) here, the folder would hold only its config, and no run
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def partition_record(cfg: Config, counts: Any, class_names: list[str]) -> dict[str, Any]:
    """The federation's split as plain JSON: ``counts[k][c]`` = samples of class c on client k."""
    d = cfg.data
    return {
        "dataset": d.dataset, "imbalance_factor": d.imbalance_factor, "partition": d.partition,
        "alpha": d.alpha if d.partition in DIRICHLET_PARTITIONS else None, "num_clients": d.num_clients,
        "seed": federation_seed(d, cfg.seed),  # the federation's: data.seed where set
        "class_names": list(class_names), "counts": [[int(n) for n in row] for row in counts],
    }


def write_partition(run_dir: Path, record: dict[str, Any]) -> None:
    write_atomic(run_dir / PARTITION_FILE, json.dumps(record) + "\n")


def save_artifacts(run_dir: Path, tensors: dict[str, Any]) -> None:
    tmp = run_dir / (ARTIFACTS_FILE + ".tmp")
    with removed_unless_renamed(tmp):
        save_tensors(tensors, tmp)
        os.replace(tmp, run_dir / ARTIFACTS_FILE)


def save_tensors(obj: Any, path: Path) -> None:
    """``torch.save`` into a file opened here: a path the system refuses, or a full disk, is then an
    OSError naming the file (torch's own writer reports a RuntimeError naming nothing), an interrupt
    stays one, and what was written of the file is removed."""
    import torch

    try:
        with interrupt_kept(), open(path, "wb") as handle:
            torch.save(obj, handle)
    except BaseException as err:
        path.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:
            raise OSError(err.errno, err.strerror, str(path)) from None
        raise


def append_metrics(run_dir: Path, row: dict[str, Any]) -> None:
    with open(run_dir / METRICS_FILE, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def read_metrics(run_dir: Path, up_to_round: int | None = None, damaged: list[int] | None = None,
                 finished: bool = False) -> list[dict[str, Any]]:
    """The rows of ``run_dir``'s metrics file, passing over lines that are no row. ``damaged``, when
    given, gets the numbers of the unreadable lines before the last one: a kill mid-write tears only
    the last line, so those are damage that cost the reports rows; of a ``finished`` run (its summary is
    written last, and the resume that finished it rewrote the file) the last line's too."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    lines = path.read_bytes().splitlines()
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):  # a line torn by a kill mid-write, after the checkpoint
            if damaged is not None and (finished or number < len(lines)) and line.strip():
                damaged.append(number)
            continue
        if isinstance(row, dict) and isinstance(row.get("round"), int):  # anything else is no row of a run
            problem = _figures_problem(row, f"round {row['round']}")
            if problem:
                raise FedltError(f"{path} is not a readable metrics file: {problem}; re-run that run, or delete "
                                 "its folder")
            rows.append(row)
    return [r for r in rows if up_to_round is None or r["round"] <= up_to_round]


def rewrite_metrics(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    write_atomic(run_dir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in rows))


def counted(n: Any, noun: str) -> str:
    """``n`` and the noun, singular for one: ``counted(1, "local epoch")`` -> ``"1 local epoch"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def loss_label(cfg: Config) -> str:
    """The loss a run trained with, as its summary, report and progress name it: a method with its own
    objective reads no ``loss.*`` setting, so its runs name no configured loss."""
    spec = get_method(cfg.method)
    if not spec.uses_loss_config:
        return "the method's own"
    if cfg.loss.name in ("ce", "focal"):
        return cfg.loss.name
    knob = spec.prior_knob
    prior = cfg.method_args.get(knob, spec.args.model_fields[knob].default) if knob else cfg.loss.prior
    return f"{cfg.loss.name} (prior {prior}{f', method_args.{knob}' if knob else ''})"


def progress_label(cfg: Config, backend: str) -> str:
    """``[fedavg/bsm sequential]``, ``[sfd sequential]``: what a run's progress lines start with."""
    name = f"{cfg.method}/{cfg.loss.name}" if get_method(cfg.method).uses_loss_config else cfg.method
    return f"{name} {backend}"


def nonfinite_variants(final: dict[str, Any] | None) -> list[str]:
    """The variants of an evaluation (a summary's ``final``) whose test loss is not finite: NaN models."""
    return [name for name, v in ((final or {}).get("variants") or {}).items()
            if isinstance(v, dict) and _is_number(v.get("loss")) and not math.isfinite(v["loss"])]


def nonfinite_personal(final: dict[str, Any] | None) -> dict[str | None, int]:
    """Clients whose personalized models are NaN, per reading (None: the headline one), where any are."""
    final = final or {}
    readings = [(None, final), *((final.get(PM_VARIANTS) or {}).items())]
    return {name: v[PM_NONFINITE] for name, v in readings if isinstance(v, dict) and v.get(PM_NONFINITE)}


def personal_nan_label(count: int, reading: str | None = None) -> str:
    return f"{count} client(s)' personalized models" + (f" ({reading})" if reading else "") + " are non-finite"


def nonfinite_models(final: dict[str, Any] | None) -> list[str]:
    """The models of an evaluation that are NaN though the run did not diverge, a line each: their
    accuracy is what a NaN model scores (one class everywhere), reported as it is and named by this."""
    return ([f"variant '{name}' is a non-finite model (NaN test loss); its accuracy is a NaN model's"
             for name in nonfinite_variants(final)]
            + [personal_nan_label(n, reading) + "; PM counts their accuracy, a NaN model's"
               for reading, n in nonfinite_personal(final).items()])


#: a class-mean accuracy at most this many times 1/K is chance: what a model predicting one class everywhere
#: scores exactly, and a model guessing at random scores within sampling noise (at 10 classes)
CHANCE_FACTOR = 1.1
#: ... or at most this many binomial standard deviations of a random guesser's accuracy above 1/K, on the
#: run's test samples: at 100 classes and 10,000 samples 1.1/K is one deviation (0.10 points), 1.21% no chance
CHANCE_DEVIATIONS = 3.0


def chance_ceiling(classes: int, test_samples: Any) -> float:
    """The accuracy (%) at or under which a model of ``classes`` classes is at chance: ``CHANCE_FACTOR``
    times 1/K, or a random guesser's accuracy plus ``CHANCE_DEVIATIONS`` of its sampling noise on
    ``test_samples`` (where the summary has them), whichever is larger."""
    p = 1 / classes
    noise = (CHANCE_DEVIATIONS * 100 * math.sqrt(p * (1 - p) / test_samples)
             if isinstance(test_samples, int) and test_samples > 0 else 0.0)
    return max(CHANCE_FACTOR * 100 * p, 100 * p + noise)


def _class_mean(figures: Any, classes: int) -> tuple[float, int] | None:
    """A model's class-mean test accuracy and its number of classes: from its per-class accuracies where
    it has them (the headline model), else its ``acc`` (a variant) over the run's ``classes``."""
    if not isinstance(figures, dict):
        return None
    per_class = figures.get("per_class_acc")
    if isinstance(per_class, list) and per_class and all(_is_number(a) for a in per_class):
        mean = sum(per_class) / len(per_class)  # a class without test images counts 0 here, but not in acc
        return (max(mean, figures["acc"]) if _is_number(figures.get("acc")) else mean), len(per_class)
    return (figures["acc"], classes) if _is_number(figures.get("acc")) and classes else None


#: what to do about a model at chance: a short run that predicts its largest classes (its training loss fell)
#: trains on; one whose steps were too large (its loss grew, or was large from round 1 on: a network whose
#: units the first steps cut off, as SFD's A-SCL at fl.lr=0.05 does to the CNN at 100 classes) steps less
CHANCE_ADVICE = ("if its training loss fell, it has not yet learned past its largest classes: train longer (fl.rounds) "
                 "or use a long-tail loss (loss.name=bsm); if it grew, or was already large in round 1 (the first "
                 "steps too large), lower fl.lr, set fl.grad_clip, or bring a scaled loss (loss.ldam_scale, loss.tau) "
                 "toward its default")


def chance_models(summary: dict[str, Any]) -> list[str]:
    """The finite global models of a run's final evaluation that score chance accuracy, a line each. A run
    whose model grew without becoming NaN (a learning rate or a loss scale too large for it) finishes
    with such a model; its accuracy read as a figure looks like a weak method, so it is named."""
    final = summary.get("final") or {}
    if summary.get("status") == "diverged":
        return []  # named as diverged
    lines = []
    nan = nonfinite_variants(final)
    classes = len(summary.get("class_names") or final.get("per_class_acc") or [])
    for name, figures in [(None, final), *((final.get("variants") or {}).items())]:
        if name in nan or (measured := _class_mean(figures, classes)) is None:
            continue
        mean, classes = measured
        ceiling = chance_ceiling(classes, summary.get("test_samples"))
        if mean > ceiling:
            continue
        model = "the global model" if name is None else f"variant '{name}'"
        best = (summary.get("best_round") or {}) if name is None else {}
        earlier = (f", though round {best['round']} scored {best['acc']:.2f}%, so it got worse afterwards"
                   if _is_number(best.get("acc")) and best["acc"] > ceiling else "")
        lines.append(f"{model} scores chance accuracy ({mean:.2f}% over {classes} classes; predicting one class "
                     f"everywhere scores {100 / classes:.2f}%){earlier}; {CHANCE_ADVICE}")
    return lines


def model_notes(summary: dict[str, Any]) -> list[str]:
    """What a run's end says of its final models beside their figures: NaN ones, and those at chance."""
    return [*nonfinite_models(summary.get("final")), *chance_models(summary)]


def summarize(cfg: Config, rows: list[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    """Headline = the final round; the best round is reported separately and labelled as such,
    chosen on validation accuracy where the run has a validation set."""
    evaluated = [r for r in rows if "acc" in r or "pm_acc" in r]
    final = evaluated[-1] if evaluated else {}
    # a run without a global model but with local validation sets chooses its round on val_pm_acc, so the
    # local test sets are read once, for the result (docs/evaluation.md)
    key = "val_acc" if final.get("val_acc") is not None else "acc" if final.get("acc") is not None else \
        "val_pm_acc" if final.get("val_pm_acc") is not None else \
        "pm_acc" if final.get("pm_acc") is not None else None  # None: no round was evaluated
    best = max(evaluated, key=lambda r: r.get(key) or -1.0) if evaluated else {}
    server = {k: v for k, v in final.items() if k not in ENGINE_KEYS}
    # a finished run whose last rounds were not evaluated (a real federation's secure evaluation that lost
    # too many nodes): its headline is an earlier round's, which every reader of the summary must be told
    short = "status" not in extra and rows and final.get("round") != cfg.fl.rounds
    return {
        "method": cfg.method,
        "dataset": cfg.data.dataset,
        "loss": loss_label(cfg),
        "rounds": cfg.fl.rounds,
        # server_metrics: the method's own numbers of the final round (privacy parameters, proxy
        # diagnostics ...), so a summary alone says how the run was made
        "final": {"round": final.get("round"), **{k: final.get(k) for k in EVAL_KEYS},
                  **{k: final.get(k) for k in VAL_KEYS if k in final},
                  **{k: final[k] for k in (PM_VARIANTS, PM_NONFINITE) if final.get(k)}, "server_metrics": server},
        "best_round": {"round": best.get("round"), "selected_by": key, **{k: best.get(k) for k in SCALAR_EVAL_KEYS},
                       **{k: best.get(k) for k in VAL_KEYS if k in best}},
        "communication_bytes": {
            k: sum(r["comm"][k] for r in rows) for k in ("down_model", "down_payload", "up_model", "up_payload")
        } if rows else {},
        **({"last_evaluated_round": final.get("round")} if short else {}),
        **extra,
    }


def unevaluated_note(summary: dict[str, Any]) -> str:
    """`` (last evaluated round N of M)`` for a finished run whose headline is not its last round's
    (``last_evaluated_round`` in its summary), else ``""``."""
    if "last_evaluated_round" not in summary:
        return ""
    last = summary["last_evaluated_round"]
    return (f" (last evaluated round {last} of {summary.get('rounds', '?')})" if last is not None
            else f" (no round of {summary.get('rounds', '?')} evaluated)")


#: what every caller of a summary indexes; a summary of this version of fedlt has all of them
SUMMARY_KEYS = {"method": str, "final": dict, "best_round": dict}


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
             bool: "a boolean"}
    return names.get(type(value), "null")


def _unreadable(run_dir: str | Path, reason: str) -> FedltError:
    return FedltError(f"{Path(run_dir) / SUMMARY_FILE} is not a readable run summary ({reason}); rewrite it with "
                      f"`fedlt run --resume {run_dir}` (a suite's cell: `fedlt bench run` again) or delete that folder")


def check_summary(summary: Any, run_dir: str | Path) -> dict[str, Any]:
    """``summary`` if it is a run summary (a JSON object with :data:`SUMMARY_KEYS`), else a
    FedltError naming ``run_dir/summary.json``."""
    if not isinstance(summary, dict):
        raise _unreadable(run_dir, f"it holds {_json_type(summary)}, not a JSON object")
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    if missing:
        raise _unreadable(run_dir, f"no key{'s' * (len(missing) > 1)} {', '.join(repr(k) for k in missing)}")
    for key, kind in SUMMARY_KEYS.items():
        if not isinstance(summary[key], kind):
            raise _unreadable(run_dir, f"'{key}' is {_json_type(summary[key])}, not {_json_type(kind())}")
    if "round" not in summary["final"]:
        raise _unreadable(run_dir, "'final' has no 'round'")
    for part in ("final", "best_round"):  # what tables, plots and statistics compute with
        value = summary[part].get("round")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise _unreadable(run_dir, f"'{part}.round' is {_json_type(value)}, not a whole number")
        problem = _figures_problem(summary[part], part)
        if problem:
            raise _unreadable(run_dir, problem)
    elapsed = summary.get("elapsed_s")
    if elapsed is not None and not _is_number(elapsed):
        raise _unreadable(run_dir, f"'elapsed_s' is {_json_type(elapsed)}, not a number")
    counts = summary.get("train_class_counts")
    if counts is not None and not (isinstance(counts, list) and all(_is_number(c) for c in counts)):
        raise _unreadable(run_dir, "'train_class_counts' is not an array of numbers")
    per_class = summary["final"].get("per_class_acc")
    if counts is not None and per_class is not None and len(per_class) != len(counts):
        raise _unreadable(run_dir, f"'final.per_class_acc' has {len(per_class)} classes, 'train_class_counts' "
                          f"{len(counts)}")
    problem = _labels_problem(summary, counts)
    if problem:
        raise _unreadable(run_dir, problem)
    return summary


def _labels_problem(summary: dict[str, Any], counts: list | None) -> str | None:
    """What is wrong with the summary's texts and class groups that tables and plots label with (the shot
    rule, the calibrations, the shot groups' classes, the code's version); None when nothing is."""
    if "shot_rule" in summary and not isinstance(summary["shot_rule"], str):
        return f"'shot_rule' is {_json_type(summary['shot_rule'])}, not a string"
    calibration = summary.get("calibration")
    if calibration is not None and not (isinstance(calibration, list) and all(isinstance(c, str) for c in calibration)):
        return "'calibration' is not an array of strings"
    groups = summary.get("shot_groups")
    if groups is not None:
        if not isinstance(groups, dict):
            return f"'shot_groups' is {_json_type(groups)}, not an object"
        for name, classes in groups.items():
            if not (isinstance(classes, list) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                                                      and (counts is None or c < len(counts)) for c in classes)):
                return f"'shot_groups.{name}' is not an array of class indices"
    env = summary.get("environment")
    for key in ("source_hash", "git_commit"):
        value = env.get(key) if isinstance(env, dict) else None
        if value is not None and not isinstance(value, str):
            return f"'environment.{key}' is {_json_type(value)}, not a string"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _figures_problem(figures: dict[str, Any], where: str) -> str | None:
    """What is wrong with one evaluation's figures (a summary's ``final`` or ``best_round``, a metrics
    row), as tables, plots and statistics compute with them; None when nothing is. An accuracy must be
    finite (a mean over seeds of NaN is no figure); a loss may be inf or NaN (a diverged run's)."""
    for key in (*SCALAR_EVAL_KEYS, *VAL_KEYS):
        value = figures.get(key)
        if value is None:
            continue
        if not _is_number(value):
            return f"'{where}.{key}' is {_json_type(value)}, not a number"
        if not key.endswith("loss") and not math.isfinite(value):
            return f"'{where}.{key}' is {value}, not a finite accuracy"
    per_class = figures.get("per_class_acc")
    if per_class is not None and not (isinstance(per_class, list) and all(_is_number(v) for v in per_class)):
        return f"'{where}.per_class_acc' is not an array of numbers"
    for key in ("variants", PM_VARIANTS):
        variants = figures.get(key)
        if variants is None:
            continue
        if not isinstance(variants, dict):
            return f"'{where}.{key}' is {_json_type(variants)}, not an object"
        for name, inner in variants.items():
            if not isinstance(inner, dict):
                return f"'{where}.{key}.{name}' is {_json_type(inner)}, not an object"
            problem = _figures_problem(inner, f"{where}.{key}.{name}")
            if problem:
                return problem
    return None


def check_output_path(path: Path, folder: bool, flag: str = "--out", writes: bool = True) -> None:
    """Refuse an output path that cannot be written, before any work starts: a file where a
    folder must go (or the reverse), a file on the way to it, or (when the command ``writes``) a
    folder the system will not let it write. ``flag`` names the option or key in the message."""
    existing = next((p for p in [path, *path.parents] if p.exists()), path)  # the nearest existing one
    if existing == path and folder and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file; give a folder (it is created if missing)")
    if existing == path and not folder and path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give the path of a file to write")
    if existing != path and not existing.is_dir():
        raise ConfigError(f"{flag} {path}: {existing} is a file, not a folder; choose another path")
    parent = existing if existing.is_dir() else existing.parent
    if writes and not os.access(parent, os.W_OK | os.X_OK):  # read-only file systems too, even for root
        raise ConfigError(f"{flag} {path}: {parent} is not writable; choose a folder you can write")
    if writes:  # what the permissions allow a file system may still refuse (root on /proc): try, leave nothing
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".fedlt-probe-", dir=parent))
        except OSError as err:
            raise ConfigError(f"{flag} {path}: {parent} is not writable ({err.strerror}); choose a folder you "
                              "can write") from None


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """``run_dir/summary.json``, checked by :func:`check_summary`: a cut-off, empty or foreign file
    is one FedltError naming it, never a JSONDecodeError or KeyError later on."""
    try:
        text = (Path(run_dir) / SUMMARY_FILE).read_text()
        summary = json.loads(text)
    except OSError as err:
        raise _unreadable(run_dir, err.strerror or type(err).__name__) from None
    except UnicodeDecodeError:
        raise _unreadable(run_dir, "not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise _unreadable(run_dir, "the file is empty" if not text.strip() else
                          f"invalid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    return check_summary(summary, run_dir)


def percent_cell(value: Any) -> str:
    """An accuracy in a Markdown table: two decimals, ``-`` where it was not measured."""
    return "-" if value is None else f"{value:.2f}"


def percent_cells(row: dict[str, Any], keys: tuple[str, ...]) -> str:
    """``row``'s values of ``keys`` as Markdown cells (:func:`percent_cell`), joined by `` | ``."""
    return " | ".join(percent_cell(row.get(k)) for k in keys)


def write_summary(run_dir: Path, cfg: Config, rows: list[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    """A finished run's summary, report and plot; the summary last, since its presence marks the run
    finished: a run stopped before it is resumed, and its resume writes all three."""
    summary = summarize(cfg, rows, extra)
    write_atomic(run_dir / REPORT_FILE, render_report(cfg, summary, rows))
    plot_curves(run_dir / PLOT_FILE, rows, title=f"{cfg.method} on {cfg.data.dataset}")
    write_atomic(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    return summary


def write_aborted_summary(run_dir: Path, cfg: Config, reason: str, rounds_done: int,
                          extra: dict[str, Any]) -> dict[str, Any]:
    """The summary of a run that stopped early: what the evaluated rounds reached, marked
    ``"status": "aborted"`` with the reason, so no reader takes it for a finished run."""
    return write_stopped_summary(run_dir, cfg, read_metrics(run_dir), "aborted", reason, rounds_done, extra)


def write_stopped_summary(run_dir: Path, cfg: Config, rows: list[dict[str, Any]], status: str, reason: str,
                          rounds_done: int, extra: dict[str, Any]) -> dict[str, Any]:
    """The summary of a run that did not finish (``status``: aborted, diverged) and why."""
    summary = summarize(cfg, rows, {"status": status, "reason": reason, "rounds_done": rounds_done, **extra})
    write_atomic(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    return summary


#: a listing of classes (a shot group's) names this many and counts the rest
LISTED_CLASSES = 20
#: up to this many classes (or clients) a report or ``fedlt data describe`` gives one row each; beyond, a
#: row per bin of classes of about equal size (ImageNet-LT's 1,000, iNaturalist's 8,142 rows are unreadable)
ROWS_EACH = 100
SIZE_BINS = 10


def listed(items: list[str], limit: int = LISTED_CLASSES) -> str:
    """``items`` joined, the first ``limit`` of them and how many there are in all beyond that."""
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}, ... ({len(items)} in all)"


def size_bins(counts: list[int], bins: int = SIZE_BINS) -> list[tuple[list[int], str]]:
    """The classes from head to tail (most training samples first, ties by index) cut into ``bins``
    groups of about equal numbers of classes, each with its span of training samples (``40..12``):
    how per-class figures are read at many classes."""
    order = sorted(range(len(counts)), key=lambda c: (-counts[c], c))
    step, extra = divmod(len(order), bins)
    cuts = [i * step + min(i, extra) for i in range(bins + 1)]
    groups = [order[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
    return [(g, f"{counts[g[0]]}" if counts[g[0]] == counts[g[-1]] else f"{counts[g[0]]}..{counts[g[-1]]}")
            for g in groups]


def _per_class_lines(accs: list[float], counts: list[int] | None, names: list[str]) -> list[str]:
    """The report's per-class accuracy: a row per class, or per size bin beyond ``ROWS_EACH`` classes."""
    if counts is None or len(accs) <= ROWS_EACH:
        counts = counts or [None] * len(accs)
        return ["| class | train samples | acc |", "|---|---|---|",
                *(f"| {names[i]} | {counts[i]} | {a:.2f} |" for i, a in enumerate(accs))]
    lines = [f"{len(accs)} classes, too many for a row each: the classes from head to tail in {SIZE_BINS} bins of "
             "about equal numbers of classes, with their mean accuracy (every class's is `final.per_class_acc` "
             "in summary.json).", "", "| bin | classes | train samples | mean acc | classes at 0 |", "|---|---|---|---|---|"]
    for k, (members, span) in enumerate(size_bins(counts), start=1):
        lines.append(f"| {k} | {len(members)} | {span} | {sum(accs[c] for c in members) / len(members):.2f} | "
                     f"{sum(accs[c] == 0 for c in members)} |")
    return lines


def _long_tail_label(d: Any) -> str:
    """``IF=100``, or, for a dataset long-tailed as distributed (whose data.imbalance_factor is not read),
    ``long-tailed as distributed``, as reports and ``fedlt data describe`` name it."""
    info = DATASETS.get(d.dataset)
    return "long-tailed as distributed" if info is not None and info.long_tailed else f"IF={d.imbalance_factor:g}"


def render_report(cfg: Config, summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    f, b = summary["final"], summary["best_round"]
    d = cfg.data
    has_val = f.get("val_acc") is not None
    has_val_pm = f.get("val_pm_acc") is not None
    headline = ("acc", "many_acc", "medium_acc", "few_acc", "pm_acc", *(("val_acc",) if has_val else ()),
                *(("val_pm_acc",) if has_val_pm else ()))
    calibrated = summary.get("calibration") or []  # the first is the headline's head
    added = [name for name in calibrated[:1] if name not in get_method(cfg.method).calibration]  # not its own
    lines = [
        f"# {cfg.method}{''.join(' + ' + name for name in added)} on {lt_name(d.dataset)}",
        "",
        (f"{d.num_clients} sites holding their own data (flower.node_data)" if cfg.flower.node_data else
         f"{_long_tail_label(d)}, {d.partition} partition"
         + (f" (alpha={d.alpha:g})" if d.partition in DIRICHLET_PARTITIONS else "") + f", {d.num_clients} clients")
        + f", participation {cfg.fl.participation:g}, {counted(cfg.fl.rounds, 'round')}, "
        f"{counted(cfg.fl.local_epochs, 'local epoch')}, model {cfg.model.name}, loss {loss_label(cfg)}, seed {cfg.seed}"
        + (f" (the federation's: data.seed {d.seed})." if d.seed is not None and d.seed != cfg.seed else "."),
        "",
        f"{summary.get('data', '')}",
        "",
        f"Shot groups — {summary.get('shot_rule', '')}: "
        + "; ".join(f"{g} = classes {listed([str(i) for i in c]) or 'none'}"
                    for g, c in summary.get("shot_groups", {}).items())
        + (" (a group is empty: eval.many_threshold and eval.few_threshold move the counts, eval.shot_rule=cumulative "
           "splits by shares of the samples)" if cfg.eval.shot_rule == "count"
           and not all(summary.get("shot_groups", {}).values()) else ""),
        "",
        "| | round | GM acc | many | medium | few | PM acc |" + (" val acc |" if has_val else "")
        + (" val PM |" if has_val_pm else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if has_val else "") + ("---|" if has_val_pm else ""),
        f"| final{unevaluated_note(summary) or ' (headline)'} | {f['round']} | {percent_cells(f, headline)} |",
        f"| best round (by {b['selected_by']}) | {b['round']} | {percent_cells(b, headline)} |",
        "",
        "GM: global model on the balanced test set"
        + (f" (the backbone with {calibrated[0]}'s head"
           + ("; the model before it is the variant 'uncalibrated')" if "uncalibrated" in (f.get("variants") or {})
              else "; the method has no global model of its own)") if calibrated else "")
        + ". PM: mean over clients of accuracy on local test sets "
        + ("(each site's own test/ folder)." if cfg.flower.node_data else
           "drawn from the test set in each client's training proportions.")
        + (" val: the global model on the balanced validation set (data.val_per_class), disjoint from the "
           "training federation and the test set: make choices on it." if has_val else "")
        + (" val PM: PM on local validation sets, drawn from the validation set as the local test sets are from "
           "the test set." if has_val_pm else "")
        + "".join(f" **Non-finite:** {line}." for line in nonfinite_models(f))
        + "".join(f" **Chance:** {line}." for line in chance_models(summary)),
    ]
    if f.get(PM_VARIANTS):
        lines += ["", "## Other readings of the personalized model (final round)", "",
                  "Evaluation-time readings of the same training, described on the method's page under "
                  "docs/methods.", "", "| reading | PM acc |" + (" val PM |" if has_val_pm else ""),
                  "|---|---|" + ("---|" if has_val_pm else "")]
        pm = ("pm_acc", *(("val_pm_acc",) if has_val_pm else ()))
        lines += [f"| {name} | {percent_cells(v, pm)} |" for name, v in f[PM_VARIANTS].items()]
    if f.get("server_metrics"):
        lines += ["", "Method's own metrics (final round): "
                  + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in f["server_metrics"].items())]
    if f.get("per_class_acc"):
        names = summary.get("class_names", [str(i) for i in range(len(f["per_class_acc"]))])
        lines += ["", "## Per-class accuracy (final round)", "",
                  *_per_class_lines(f["per_class_acc"], summary.get("train_class_counts"), names)]
    if f.get("variants"):
        lines += ["", "## Variants of the global model (final round)", "",
                  "| variant | acc | many | medium | few |" + (" val acc |" if has_val else ""),
                  "|---|---|---|---|---|" + ("---|" if has_val else "")]
        variant = ("acc", "many_acc", "medium_acc", "few_acc", *(("val_acc",) if has_val else ()))
        lines += [f"| {name} | {percent_cells(v, variant)} |" for name, v in f["variants"].items()]
        if "oracle" in f["variants"]:
            lines += ["", "oracle: NOT PRIVATE — clients uploaded real features; a diagnostic upper bound."]
    messages = summary.get("messages") or {}
    if messages:
        lines += ["", "## What each exchange carries (first message of each kind)", "",
                  "| exchange | direction | model bytes | payload entries (bytes) |", "|---|---|---|---|"]
        for kind, both in messages.items():
            for direction, m in both.items():
                entries = ", ".join(f"{k} {e.get('shape', e.get('value'))} ({e['bytes']})" for k, e in m["payload"].items())
                lines.append(f"| {kind} | {direction.replace('_', ' ')} | {m['model_bytes']} | {entries or '-'} |")
    lines += ["", "## Rounds", "", "| round | GM acc | PM acc | train loss |" + (" val acc |" if has_val else ""),
              "|---|---|---|---|" + ("---|" if has_val else "")]
    per_round = ("acc", "pm_acc", "train_loss", *(("val_acc",) if has_val else ()))
    lines += [f"| {r['round']} | {percent_cells(r, per_round)} |" for r in rows if "acc" in r or "pm_acc" in r]
    comm = summary["communication_bytes"]
    if comm:
        lines += ["", "Communication (MB, whole run): " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in comm.items())]
    return "\n".join(lines) + "\n"


def plot_curves(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evaluated = [r for r in rows if "acc" in r or "pm_acc" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    try:  # closed however it ends: a long-lived process (a bench) would keep every failed figure
        for key, label in (("acc", "GM (balanced test)"), ("few_acc", "GM few-shot"), ("pm_acc", "PM (local tests)"),
                           ("val_acc", "GM (validation)")):
            pts = [(r["round"], r[key]) for r in evaluated if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=label)
        ax.set(xlabel="round", ylabel="accuracy (%)", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        tmp = path.with_name("tmp-" + path.name)
        with removed_unless_renamed(tmp):
            fig.savefig(tmp, dpi=100)
            os.replace(tmp, path)
    finally:
        plt.close(fig)
