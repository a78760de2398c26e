"""``fedlt bench paper-rounds``: what a paper suite's protocol costs on this machine, per backend.

Each row of each ``paper-*`` suite trains rounds of its protocol (model, clients, participation,
local epochs, batch, method, long tail, partition) on synthetic data of its dataset's size
instead of the suite's dataset files: CIFAR-10's or CIFAR-100's class count and training set,
long-tailed and split as the setting says (``synthetic_cifar10`` / ``synthetic_cifar100``), so its
clients hold as many images, and take as many steps, as the protocol's. Each model is timed on
each dataset size its settings use. Warm-up rounds, then a timed round with one local epoch.
Graphed training captures a batch shape on a lane's second use of it, and clients of different
sizes end in short batches of many sizes, so warm-up goes on (at most :data:`MAX_WARMUP_ROUNDS`
rounds) while a round still captures: a long run pays each capture once, and the timed round
should not. Shapes a lane met only once before it may still capture; the table names them. The
timed round splits at the
aggregation into a part that grows with the images a round trains (queries before training, local
training) and a part that does not (the aggregation, server steps such as CReFF's feature
optimisation): ``seconds = fixed + per_image x images``. The full protocol is projected from that
line at the images a round of each setting holds (its long-tailed CIFAR training set x
participation x local epochs), for the suite's rounds, settings and seeds. Evaluation is not
included (it runs every ``eval.every`` rounds, on test sets of another size).
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import torch

from fedlt.api import prepare
from fedlt.bench.speed import sync_device
from fedlt.bench.suite import SuiteSpec, load_suite
from fedlt.config import load_config
from fedlt.data.longtail import longtail_counts
from fedlt.environment import collect, describe
from fedlt.errors import ConfigError
from fedlt.run_parts import check_config, resolve_device

#: training images per class of the balanced CIFAR sets the paper suites subsample
CIFAR_PER_CLASS = {"cifar10": (5000, 10), "cifar100": (500, 100)}
#: a setting's dataset -> the synthetic data of its size (another dataset: CIFAR-10's size)
STAND_INS = {"cifar100": "synthetic_cifar100"}
#: warm-up rounds at most before the timed one (more only while graphed training still captures)
MAX_WARMUP_ROUNDS = 3


class RoundLine(NamedTuple):
    """One timed round: its fixed seconds, seconds per image trained, whole seconds, the images its
    clients trained, and the step graphs it captured (shapes met before that warm-up left uncaptured)."""

    fixed: float
    per_image: float
    seconds: float
    images: int
    captures: int


def stand_in(dataset: str) -> list[str]:
    """The overrides that train on synthetic data of ``dataset``'s size, 32 px."""
    return [f"data.dataset={STAND_INS.get(dataset, 'synthetic_cifar10')}", "data.image_size=32"]


def round_line(base: str | None, overrides: list[str]) -> RoundLine:
    """The timed round after warm-up, with one local epoch (the line is per image trained, so more
    epochs would only take longer to measure). The round's work up to the aggregation (queries
    before training, local training) is what grows with the images; the aggregation and what
    follows (server steps, queries after it) is the fixed part. The run keeps its protocol's number of
    rounds, so a method's phases (GBME's joint warm-up over the first 3/5) are the same whichever
    round is timed."""
    last = MAX_WARMUP_ROUNDS + 1
    wanted = [*overrides, "fl.local_epochs=1", "run.checkpoint_every=0"]
    cfg = load_config(base, wanted)
    sim = prepare(cfg if cfg.fl.rounds >= last else load_config(base, [*wanted, f"fl.rounds={last}"]))
    marks: dict[str, float] = {}
    aggregate = sim.server.aggregate

    def timed_aggregate(rnd, replies):
        sync_device(sim.device)
        marks["trained"] = time.perf_counter()
        marks["images"] = sum(reply.num_samples for reply in replies.values())  # the clients that trained
        return aggregate(rnd, replies)

    def captures() -> int:
        return sim.graphed.captures if sim.graphed is not None else 0

    try:
        sim.setup()
        for rnd in range(1, last):
            before = captures()
            sim.fit_round(rnd)
            if captures() == before:
                break
        sync_device(sim.device)
        sim.server.aggregate = timed_aggregate
        before = captures()
        t0 = time.perf_counter()
        sim.fit_round(rnd + 1)
        sync_device(sim.device)
        seconds = time.perf_counter() - t0
        captured = captures() - before
    finally:
        sim.close()
    trained, images = marks["trained"] - t0, int(marks["images"])
    return RoundLine(seconds - trained, trained / max(images, 1), seconds, images, captured)


def protocol_images(cfg) -> float | None:
    """Images one round of ``cfg``'s real protocol trains (None for datasets other than CIFAR)."""
    if cfg.data.dataset not in CIFAR_PER_CLASS:
        return None
    n_max, classes = CIFAR_PER_CLASS[cfg.data.dataset]
    total = float(longtail_counts(n_max, classes, cfg.data.imbalance_factor).sum()) * cfg.data.train_fraction
    return total * cfg.fl.participation * cfg.fl.local_epochs


def chosen_rows(s: SuiteSpec, rows: int | None, picks: list[str] = ()) -> list[str]:
    """The names of the suite's rows to time: its first ``rows``, or those ``picks`` name (``ROW`` in
    every suite, ``SUITE:ROW`` in that one)."""
    names = [m.name for m in s.methods[:rows]]
    if not picks:
        return names
    return [n for n in names if n in picks or f"{s.name}:{n}" in picks]


def not_projected(name: str) -> str | None:
    """Why suite ``name`` has no protocol to project (no setting on CIFAR-10 or CIFAR-100, the papers'
    data whose size a round stands in for); None for a suite with one."""
    suite = load_suite(name)
    base = str(suite.base) if suite.base else None
    if any(protocol_images(load_config(base, [*suite.spec.overrides, *st.overrides])) is not None
           for st in suite.spec.settings):
        return None
    return (f"{name} is not a paper suite: none of its settings trains on CIFAR-10 or CIFAR-100, whose protocol "
            "a paper round projects; give paper suites (fedlt bench list: paper-creff, paper-sfd, ...)")


def unknown_pick(suites: list[SuiteSpec], picks: list[str]) -> str | None:
    """Why a ``--row`` pick names no row of ``suites``; None when every pick names one."""
    for pick in picks:
        if not any(chosen_rows(s, None, [pick]) for s in suites):
            rows = "; ".join(f"{s.name}: {', '.join(m.name for m in s.methods)}" for s in suites)
            return f"--row {pick} names no row of the suites timed; their rows: {rows}"
    return None


def suite_rows(s: SuiteSpec, rows: int | None, picks: list[str] = ()):
    """``(row name, [(setting, overrides), ...])`` of the rows :func:`chosen_rows` picks."""
    chosen = set(chosen_rows(s, rows, picks))
    for m in (m for m in s.methods if m.name in chosen):
        settings = [st for st in s.settings if m.settings is None or st.name in m.settings]
        yield m.name, [(st.name, [*s.overrides, *st.overrides, *m.overrides]) for st in settings]


def run_paper_rounds(suites: list[str], backends: tuple[str, ...], rows: int | None = None, extra: list[str] = (),
                     echo: Callable[[str], None] = lambda line: None, picks: list[str] = ()) -> str:
    """The cost table of every suite in ``suites`` (its first ``rows`` rows, or the rows ``picks``
    names) for each backend."""
    given = load_config(None, list(extra))
    device = resolve_device(given.run.device)
    if given.run.threads:  # as every round will run: the header names the threads they get
        torch.set_num_threads(given.run.threads)
    lines = ["## What a paper suite's protocol costs here, per backend", "",
             f"device {device}: {describe(collect(device))}. Rounds on synthetic data of each setting's dataset's "
             "size (CIFAR-10's or CIFAR-100's classes and training set, 32 px), long-tailed and split as the "
             "setting says, one local epoch, each model on each dataset size its settings use: warm-up rounds "
             "(more than one only while graphed training still captures new batch shapes, at most "
             f"{MAX_WARMUP_ROUNDS}; captures left in the timed round are named) and a timed round, split at the "
             "aggregation "
             "into the work that grows with the images (training, queries before it: ms per 1,000 images) and the "
             "rest (aggregation, server steps: fixed s); the projection applies seconds = fixed + per image x "
             "images to the images a round of each setting trains (long-tailed CIFAR x participation x local "
             "epochs), times the suite's rounds and seeds, summed over the row's settings. Evaluation is not "
             "included.", ""]
    for name in suites:
        suite = load_suite(name)
        s, base = suite.spec, str(suite.base) if suite.base else None
        lines += [f"### {s.name}: {s.title}", "",
                  "| row | model on data | backend | timed round (s) | fixed s | ms per 1,000 images "
                  "| projected hours |", "|---|---|---|---|---|---|---|"]
        totals: dict[str, float] = {}
        for row, settings in suite_rows(s, rows, picks):
            for backend in backends:
                measured: dict[tuple[str, str], RoundLine] = {}  # (model, stand-in) -> its timed round
                try:
                    first = load_config(base, [*settings[0][1], *extra]).data.dataset
                    check_config(load_config(base, [*settings[0][1], *stand_in(first), *extra,
                                                    f"run.backend={backend}"]))
                except ConfigError as refused:
                    lines.append(f"| {row} | | {backend} | refused: {refused} | | | |")
                    echo(lines[-1])
                    continue
                hours, projected = 0.0, 0
                for _, overrides in settings:
                    cfg = load_config(base, [*overrides, *extra])
                    data = [*stand_in(cfg.data.dataset), *extra]  # extra last: it may replace the stand-in
                    key = (cfg.model.name, load_config(base, [*overrides, *data]).data.dataset)
                    if key not in measured:
                        measured[key] = round_line(base, [*overrides, *data, f"run.backend={backend}"])
                    fixed, per_image = measured[key][:2]
                    images = protocol_images(cfg)
                    if images is not None:
                        hours += (fixed + per_image * images) * cfg.fl.rounds * len(s.seeds) / 3600
                        projected += 1
                totals[backend] = totals.get(backend, 0.0) + hours
                where = "" if projected == len(settings) else f" ({projected} of {len(settings)} settings: CIFAR)"
                for (model, dataset), line in measured.items():
                    still = f" ({line.captures} step graphs captured in it)" if line.captures else ""
                    lines.append(f"| {row} | {model} on {dataset} | {backend} | {line.seconds:.2f}{still} | "
                                 f"{line.fixed:.2f} | {1e6 * line.per_image:.1f} | {hours:.1f}{where} |")
                    echo(lines[-1])
        lines += ["", f"{s.name}, the rows each backend ran: "
                  + "; ".join(f"{b} {h:.1f} h" for b, h in totals.items()) + ".", ""]
    return "\n".join(lines).rstrip()
