"""The noise floor of candidate reference protocols, from `fedlt bench` outputs of the `protocol`
and `protocol-long` suites (docs/results/protocol.md).

Per setting (a candidate protocol) of FedAvg:
- final accuracy over seeds: mean, sample std, 95% CI of the mean;
- the last 5 evaluated rounds of each seed: their range (max - min) and how far the final round
  sits from their mean;
- the "FedAvg replicate" row (same federation, other training randomness): the paired difference
  FedAvg - replicate is pure training noise; its std gives the replicate floor at n seeds,
  t(0.975, n-1) * sd / sqrt(n): the 95% half-width of a paired difference between two methods that
  differed only by training noise (two different methods add their own, and reach wider intervals);
- a twice-as-long run of the same seeds (if given): the paired difference long - short.

Usage: .venv/bin/python scripts/protocol_noise.py runs/bench/protocol [runs/bench/protocol-long]
       .venv/bin/python scripts/protocol_noise.py --classes runs/bench/class-order
       (per class: training samples and final accuracy, mean over seeds, one column pair per setting)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
from scipy import stats as st

from fedlt.errors import FedltError, one_line
from fedlt.reporting.collect import Row, collect
from fedlt.reporting.stats import paired_difference, summarize

LAST = 5


def by_seed(row: Row, metric: str = "acc") -> dict[int, float]:
    return {run.seed: float(run.final(None)[metric]) for run in row.runs if run.final(None).get(metric) is not None}


def last_rounds(row: Row) -> tuple[float, float]:
    """Mean over seeds of the range of the last LAST evaluated rounds, and of |final - their mean|."""
    ranges, offsets = [], []
    for run in row.runs:
        accs = [r["acc"] for r in run.curve()][-LAST:]
        if len(accs) == LAST:
            ranges.append(max(accs) - min(accs))
            offsets.append(abs(accs[-1] - np.mean(accs)))
    return (float(np.mean(ranges)), float(np.mean(offsets))) if ranges else (float("nan"), float("nan"))


def floor(sd: float, n: int) -> float:
    """Half-width of the 95% CI of a mean paired difference over n seeds whose std is sd."""
    return float(st.t.ppf(0.975, n - 1) * sd / np.sqrt(n))


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def main(folders: list[str]) -> None:
    settings = {}
    for folder in folders:
        for s in collect(Path(folder)).settings:
            settings[s.name] = s
    rounds_epochs = {}
    for name in settings:
        head = name.split()[0]
        if not re.fullmatch(r"\d+x\d+", head):
            raise FedltError(f"setting '{name}' is not a candidate protocol (named ROUNDSxEPOCHS ..., e.g. 50x2); pass "
                             "the output folders of the protocol and protocol-long suites")
        r, e = head.split("x")
        rounds_epochs[name] = (int(r), int(e), name[len(head):])
    print("| protocol | seeds | FedAvg acc: mean ± std [95% CI] | few-shot: mean ± std | last-5 range | "
          "final vs last-5 mean | replicate: sd of paired diff (pairs) | replicate floor: 95% half-width at 3 / 5 seeds | "
          "2x as long: paired diff [95% CI] |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, setting in settings.items():
        rows = {r.label: r for r in setting.rows}
        fedavg = rows.get("FedAvg")
        if fedavg is None or not fedavg.runs:
            continue
        acc = by_seed(fedavg)
        s = summarize(list(acc.values()))
        few = summarize(list(by_seed(fedavg, "few_acc").values()))
        spread, offset = last_rounds(fedavg)
        rep_text, res_text = "-", "-"
        replicate = rows.get("FedAvg replicate")
        if replicate is not None and len(replicate.runs) >= 2:
            d = paired_difference(acc, by_seed(replicate))
            if d is not None and d.std is not None:
                rep_text = f"{d.std:.2f} ({d.n})"
                res_text = f"{floor(d.std, 3):.2f} / {floor(d.std, 5):.2f}"
        long_text = "-"
        r, e, rest = rounds_epochs[name]
        for other, (r2, e2, rest2) in rounds_epochs.items():
            if rest2 == rest and r2 * e2 == 2 * r * e and (r2 == 2 * r or e2 == 2 * e) and "FedAvg" in {
                    x.label for x in settings[other].rows}:
                longer = next(x for x in settings[other].rows if x.label == "FedAvg")
                d = paired_difference(by_seed(longer), acc)
                if d is not None and d.ci is not None:
                    long_text = f"{other.split()[0]}: {d.mean:+.2f} [{d.ci[0]:+.2f}, {d.ci[1]:+.2f}] ({d.n} seeds)"
                    break
        ci = f" [{s.ci[0]:.2f}, {s.ci[1]:.2f}]" if s.ci is not None else ""
        print(f"| {name} | {s.n} | {s.mean:.2f} ± {fmt(s.std)}{ci} | {few.mean:.2f} ± {fmt(few.std)} | "
              f"{fmt(spread)} | {fmt(offset)} | {rep_text} | {res_text} | {long_text} |")


def classes(folder: str) -> None:
    """Per-class training samples and final accuracy (mean over seeds) of the first row of each setting."""
    settings = [s for s in collect(Path(folder)).settings if s.rows and s.rows[0].runs]
    names = settings[0].rows[0].runs[0].summary.get("class_names") or []
    print("| class | " + " | ".join(f"{s.name}: samples | acc" for s in settings) + " |")
    print("|---|" + "---|---|" * len(settings))
    for c, name in enumerate(names):
        cells = []
        for s in settings:
            runs = s.rows[0].runs
            counts = [r.summary["train_class_counts"][c] for r in runs]
            accs = [r.summary["final"]["per_class_acc"][c] for r in runs]
            cells.append(f"{np.mean(counts):.0f} | {np.mean(accs):.1f}")
        print(f"| {c} {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    try:
        if sys.argv[1] == "--classes":
            if len(sys.argv) != 3:
                raise FedltError("--classes takes one folder, the class-order suite's output "
                                 "(e.g. runs/bench/class-order)")
            classes(sys.argv[2])
        else:
            main(sys.argv[1:])
    except FedltError as err:  # a folder that is no such suite's output: one line, exit 2
        print(f"protocol_noise: error: {one_line(str(err))}", file=sys.stderr)
        sys.exit(2)
