"""``fedlt bench engines``: what running on Flower costs. The same config runs in-process, on
Flower's simulation engine and on a SuperLink with SuperNodes on 127.0.0.1; the table gives the
seconds per round each engine's run directory records (``time_s``: the round loop, training and
evaluation) and the whole command's wall time, start-up included.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path

from fedlt.config import load_config


def _seconds_per_round(run_dir: Path) -> tuple[list[float], float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["time_s"] for r in rows]
    return times, json.loads((run_dir / "summary.json").read_text())["final"]["acc"]


def run_engine_bench(config: str, overrides: list[str], nodes: int = 3) -> str:
    """Run the three engines on ``config`` + ``overrides`` (one metrics line per round) and
    return a Markdown report."""
    import fedlt
    from fedlt.deploy import local_federation

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    work = Path(tempfile.mkdtemp(prefix="fedlt-engines-"))
    base = [*overrides, "eval.every=1", f"run.out_dir={work}"]
    cfg = load_config(config, base)
    results = {}
    for engine in ("inprocess", "flower"):
        t0 = time.perf_counter()
        fedlt.run(config, overrides=[*base, f"engine={engine}", f"run.name={engine}"], quiet=True)
        results[engine] = (*_seconds_per_round(work / engine), time.perf_counter() - t0)
    t0 = time.perf_counter()
    with local_federation(work / "federation", nodes) as fed:
        done = fed.run(Path(config), [*base, "run.name=deployment"], timeout=3600)
    if not (work / "deployment" / "summary.json").is_file():
        raise RuntimeError(f"the deployment run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    results[f"deployment ({nodes} SuperNodes, loopback)"] = (*_seconds_per_round(work / "deployment"),
                                                             time.perf_counter() - t0)
    lines = [
        f"Config: `{config}` {' '.join(overrides)} ({cfg.data.num_clients} clients, "
        f"{cfg.clients_per_round()} per round, {cfg.fl.rounds} rounds, method {cfg.method}); "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores.",
        "",
        "| engine | s/round (mean) | s/round (each) | final acc | wall s (with start-up) |",
        "|---|---|---|---|---|",
    ]
    for name, (times, acc, wall) in results.items():
        each = ", ".join(f"{t:.1f}" for t in times)
        lines.append(f"| {name} | {sum(times) / len(times):.2f} | {each} | {acc:.2f} | {wall:.1f} |")
    return "\n".join(lines)
