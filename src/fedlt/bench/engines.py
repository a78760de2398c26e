"""``fedlt bench engines``: what running on Flower costs. The same config runs in-process, on
Flower's simulation engine and on a SuperLink with SuperNodes on 127.0.0.1 (and, with
``secagg``, each again with secure aggregation); the table gives the seconds per round each run
directory records (``time_s``: the round loop, training and evaluation), the bytes clients
uploaded per round, and the whole command's wall time, start-up included.

Two engines measure a real federation: ``node-data`` exports the config's federation (one folder
per client, the server's test set: :mod:`fedlt.data.export`) and deploys fedlt on it as
``fedlt deploy --node-data --server-test`` does; ``plain-flower`` runs a minimal plain-Flower
FedAvg app (:mod:`fedlt.bench.plain_flower`) on the same export, model and SuperNodes, so the two
rows give the overhead fedlt adds to Flower itself. Both start one SuperNode per client.
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
from fedlt.errors import ConfigError, FedltError
from fedlt.results import counted, read_summary


ENGINES = ("inprocess", "flower", "deployment", "node-data", "plain-flower")
#: engines that run on an exported federation, one SuperNode per client
NODE_ENGINES = ("node-data", "plain-flower")


def _run_record(run_dir: Path) -> tuple[list[float], float, float]:
    """Seconds of each round, final accuracy, mean uploaded bytes per round."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    up = sum(r["comm"]["up_model"] + r["comm"]["up_payload"] for r in rows) / len(rows)
    return [r["time_s"] for r in rows], read_summary(run_dir)["final"]["acc"], up


def _check(cfg, config: str, overrides: list[str], nodes: int | None, engines: tuple[str, ...], secagg: bool) -> None:
    """Refuse what the chosen engines cannot run, before anything is created: over Flower, with the
    deploy command's own checks."""
    from fedlt.deploy import check_deployable, plan_deployment

    if "deployment" in engines:
        plan_deployment(config, overrides, nodes=nodes if nodes is not None else 3)
    elif any(e in ("flower", "node-data") for e in engines):
        check_deployable(config, overrides)
    node_engines = [e for e in engines if e in NODE_ENGINES]
    if node_engines and nodes is not None and nodes != cfg.data.num_clients:
        raise ConfigError(f"--nodes {nodes}: the {node_engines[0]} engine starts one SuperNode per client "
                          f"(data.num_clients={cfg.data.num_clients}); drop --nodes or set data.num_clients={nodes}")
    if "plain-flower" in engines:
        from fedlt.bench.plain_flower import check_plain

        check_plain(cfg)
        if secagg:
            raise ConfigError("--secagg: the plain-flower engine is Flower's own FedAvg, which has no secure "
                              "aggregation; measure it in a run without --secagg")


def _keep_logs(work: Path, err: FedltError) -> FedltError:
    """A failed deployment's error, its scratch folder (logs, Flower state) copied out of the
    temporary one that is about to go."""
    kept = shutil.copytree(work, Path(tempfile.mkdtemp(prefix="fedlt-engines-failed-")), dirs_exist_ok=True)
    return FedltError(f"{err} (the run's logs are kept in {kept})")


def run_engine_bench(config: str, overrides: list[str], nodes: int | None = None,
                     engines: tuple[str, ...] = ENGINES[:3], secagg: bool = False, echo=lambda line: None) -> str:
    """Run ``engines`` on ``config`` + ``overrides`` (one metrics line per round), each also with
    ``secagg.enabled=true`` if ``secagg``, and return a Markdown report. ``nodes``: the SuperNodes
    of ``deployment`` (default 3); the node-data engines start one per client. ``echo`` gets a
    progress line as each engine starts and ends; a deployment's rounds are relayed as they come."""
    import fedlt
    from fedlt.deploy import local_federation, node_data_sites, plan_deployment

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    cfg = load_config(config, [*overrides, "eval.every=1"])  # bad input fails before anything is created
    _check(cfg, config, [*overrides, "eval.every=1"], nodes, engines, secagg)
    nodes = nodes if nodes is not None else 3
    variants = [("", [])] + ([(" + secagg", ["secagg.enabled=true"])] if secagg else [])
    results, notes = {}, []
    with tempfile.TemporaryDirectory(prefix="fedlt-engines-") as tmp:
        work = Path(tmp)
        base = [*overrides, "eval.every=1", f"run.out_dir={work}"]
        # untimed: the process's first run pays one-time costs (torch kernels, dataset files)
        fedlt.run(config, overrides=[*base, "fl.rounds=1", "run.name=warm-up"], quiet=True)
        export = work / "export"
        if any(e in NODE_ENGINES for e in engines):  # untimed too: a federation's sites hold their data already
            from fedlt.data.export import FEDERATION_FILE, NODES, SERVER, export_federation

            t0 = time.perf_counter()
            export_federation(cfg, export)
            notes.append(f"The export of the federation ({cfg.data.num_clients} node folders and the server's "
                         f"test set as PNG files) took {time.perf_counter() - t0:.1f} s, not counted above.")
            federation, site_data, server_test = export / FEDERATION_FILE, export / NODES, export / SERVER / "test"
        for engine in engines:
            for suffix, extra in variants if engine != "plain-flower" else variants[:1]:
                name = f"{engine}{suffix}".replace(" + ", "-")
                given = [*base, *extra, f"run.name={name}"]
                scratch = work / f"federation-{name}"
                echo(f"fedlt bench engines: {engine}{suffix}, {cfg.fl.rounds} round(s) ...")
                t0 = time.perf_counter()
                try:
                    if engine == "plain-flower":
                        from fedlt.bench.plain_flower import run_on

                        with local_federation(scratch, sites=node_data_sites(site_data), flower_waits=True) as fed:
                            got = run_on(fed, federation, server_test, work / f"{name}.json", timeout=3600)
                        label = f"plain Flower FedAvg ({len(fed.nodes)} SuperNodes, own folders)"
                        results[label] = (got["round_s"], got["acc"], sum(got["up_bytes"]) / len(got["up_bytes"]),
                                          time.perf_counter() - t0)
                        echo(f"fedlt bench engines: {engine} done in {results[label][-1]:.1f} s")
                        continue
                    if engine == "deployment":
                        with local_federation(scratch, nodes) as fed:
                            fed.run(Path(config), given, timeout=3600, flower_lines=False)
                        label = f"deployment ({nodes} SuperNodes, loopback){suffix}"
                    elif engine == "node-data":
                        plan = plan_deployment(str(federation), given, node_data=site_data, server_test=server_test)
                        with local_federation(scratch, sites=plan.sites) as fed:
                            fed.run(plan.config, plan.overrides, timeout=3600, flower_lines=False)
                        label = f"fedlt node-data ({len(plan.sites)} SuperNodes, own folders){suffix}"
                    else:
                        fedlt.run(config, overrides=[*given, f"engine={engine}"], quiet=True)
                        label = f"{engine}{suffix}"
                except FedltError as err:
                    if scratch.is_dir():  # a deployment: its logs would go with the temporary folder
                        raise _keep_logs(work, err) from err
                    raise
                results[label] = (*_run_record(work / name), time.perf_counter() - t0)
                echo(f"fedlt bench engines: {engine}{suffix} done in {results[label][-1]:.1f} s")
    lines = [
        f"Config: `{config}` {' '.join(overrides)} ({cfg.data.num_clients} clients, "
        f"{cfg.clients_per_round()} per round, {counted(cfg.fl.rounds, 'round')}, method {cfg.method}); "
        f"{describe(collect())}, {os.cpu_count()} cores.",
        "",
        "| engine | s/round (mean) | s/round (each) | uploaded MB/round | final acc | wall s (with start-up) |",
        "|---|---|---|---|---|---|",
    ]
    for name, (times, acc, up, wall) in results.items():
        each = ", ".join(f"{t:.1f}" for t in times)
        lines.append(f"| {name} | {sum(times) / len(times):.2f} | {each} | {up / 1e6:.2f} | {acc:.2f} | {wall:.1f} |")
    return "\n".join([*lines, *(["", *notes] if notes else [])])
