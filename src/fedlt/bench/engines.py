"""``fedlt bench engines``: what running on Flower costs. The same config runs in-process, on
Flower's simulation engine and on a SuperLink with SuperNodes on 127.0.0.1 (and, with
``secagg``, each again with secure aggregation); the table gives the seconds per round each run
directory records (``time_s``: the round loop, training and evaluation), the bytes clients
uploaded per round, and the whole command's wall time, start-up included.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from fedlt.config import load_config
from fedlt.environment import collect, describe
from fedlt.results import read_summary


ENGINES = ("inprocess", "flower", "deployment")


def _run_record(run_dir: Path) -> tuple[list[float], float, float]:
    """Seconds of each round, final accuracy, mean uploaded bytes per round."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    up = sum(r["comm"]["up_model"] + r["comm"]["up_payload"] for r in rows) / len(rows)
    return [r["time_s"] for r in rows], read_summary(run_dir)["final"]["acc"], up


def run_engine_bench(config: str, overrides: list[str], nodes: int = 3, engines: tuple[str, ...] = ENGINES,
                     secagg: bool = False) -> str:
    """Run ``engines`` on ``config`` + ``overrides`` (one metrics line per round), each also with
    ``secagg.enabled=true`` if ``secagg``, and return a Markdown report."""
    import fedlt
    from fedlt.deploy import local_federation

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    cfg = load_config(config, [*overrides, "eval.every=1"])  # bad input fails before anything is created
    variants = [("", [])] + ([(" + secagg", ["secagg.enabled=true"])] if secagg else [])
    results = {}
    with tempfile.TemporaryDirectory(prefix="fedlt-engines-") as tmp:
        work = Path(tmp)
        base = [*overrides, "eval.every=1", f"run.out_dir={work}"]
        # untimed: the process's first run pays one-time costs (torch kernels, dataset files)
        fedlt.run(config, overrides=[*base, "fl.rounds=1", "run.name=warm-up"], quiet=True)
        for engine in engines:
            for suffix, extra in variants:
                name = f"{engine}{suffix}".replace(" + ", "-")
                t0 = time.perf_counter()
                if engine == "deployment":
                    with local_federation(work / f"federation-{name}", nodes) as fed:
                        done = fed.run(Path(config), [*base, *extra, f"run.name={name}"], timeout=3600)
                    if not (work / name / "summary.json").is_file():  # keep the federation's logs
                        kept = shutil.copytree(work, Path(tempfile.mkdtemp(prefix="fedlt-engines-failed-")),
                                               dirs_exist_ok=True)
                        raise RuntimeError(f"the deployment run failed (logs kept in {kept}):\n"
                                           f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
                    label = f"deployment ({nodes} SuperNodes, loopback){suffix}"
                else:
                    fedlt.run(config, overrides=[*base, *extra, f"engine={engine}", f"run.name={name}"], quiet=True)
                    label = f"{engine}{suffix}"
                results[label] = (*_run_record(work / name), time.perf_counter() - t0)
    lines = [
        f"Config: `{config}` {' '.join(overrides)} ({cfg.data.num_clients} clients, "
        f"{cfg.clients_per_round()} per round, {cfg.fl.rounds} rounds, method {cfg.method}); "
        f"{describe(collect())}, {os.cpu_count()} cores.",
        "",
        "| engine | s/round (mean) | s/round (each) | uploaded MB/round | final acc | wall s (with start-up) |",
        "|---|---|---|---|---|---|",
    ]
    for name, (times, acc, up, wall) in results.items():
        each = ", ".join(f"{t:.1f}" for t in times)
        lines.append(f"| {name} | {sum(times) / len(times):.2f} | {each} | {up / 1e6:.2f} | {acc:.2f} | {wall:.1f} |")
    return "\n".join(lines)
