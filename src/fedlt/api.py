"""The Python API: ``fedlt.run(config) -> RunResult``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from fedlt.config import Config, apply_overrides, build_config, load_config
from fedlt.data.federated import FederatedData, build_federated_data
from fedlt.engine.simulation import RunResult, Simulation
from fedlt.engine.vectorized import choose_backend
from fedlt.errors import ConfigError
from fedlt.losses import LOSSES, make_loss
from fedlt.data.registry import DATASETS
from fedlt.methods.base import MethodSpec
from fedlt.methods.registry import get_method, parse_method_args
from fedlt.models.registry import MODELS
from fedlt.results import CONFIG_FILE, new_run_dir
from fedlt.tracking import check_tracking


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"run.device='{name}' is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"run.device={name} but no CUDA GPU is available; use run.device=auto or cpu")
    return device


def _check_loss(cfg: Config, uses_loss: bool) -> None:
    if cfg.loss.name not in LOSSES:
        raise ConfigError(f"unknown loss '{cfg.loss.name}'; use loss.name=<one of {', '.join(LOSSES)}>")
    if not uses_loss and cfg.loss.name != "ce":
        raise ConfigError(f"method {cfg.method} fixes its own training objective; remove loss.name={cfg.loss.name}")
    c = cfg.loss
    try:  # surface bad loss arguments now, not inside the first client's training
        make_loss(c.name, prior=torch.full((2,), 0.5), class_counts=torch.ones(2), tau=c.tau, focal_gamma=c.focal_gamma,
                  ldam_max_margin=c.ldam_max_margin, ldam_scale=c.ldam_scale)
    except ValueError as err:
        raise ConfigError(f"invalid loss settings: {err}") from None


def check_config(cfg: Config) -> MethodSpec:
    """Every check that needs no data: method and its knobs, calibrations, loss, model and dataset
    names, tracking. ``fedlt bench`` runs it on every cell before the first one trains."""
    spec = get_method(cfg.method)
    calibration = [*spec.calibration, *(n for n in cfg.calibration if n not in spec.calibration)]
    if calibration:
        from fedlt.methods.calibrated import parse_calibration_args, with_calibration

        spec = with_calibration(spec, calibration)
        parse_calibration_args(cfg.calibration_args)
    elif cfg.calibration_args:
        raise ConfigError("calibration_args given but no calibration; add e.g. calibration=ccvr or drop them")
    _check_loss(cfg, spec.uses_loss_config)
    parse_method_args(spec, cfg.method_args)
    if cfg.model.name not in MODELS:
        raise ConfigError(f"unknown model '{cfg.model.name}'; use model.name=<one of {', '.join(MODELS)}>")
    if cfg.data.dataset not in DATASETS:
        raise ConfigError(f"unknown dataset '{cfg.data.dataset}'; set data.dataset to one of: {', '.join(DATASETS)}")
    check_tracking(cfg)
    if cfg.engine == "flower" and cfg.run.backend in ("vectorized", "parallel"):
        raise ConfigError(f"run.backend={cfg.run.backend} is for the in-process engine, but under engine=flower "
                          "each client trains on its SuperNode; use run.backend=auto or sequential")
    choose_backend(cfg, spec.client, resolve_device(cfg.run.device))
    _check_secagg(cfg, spec)
    return spec


def _check_secagg(cfg: Config, spec: MethodSpec) -> None:
    """``secagg.enabled`` only where the method's own fit upload can be aggregated securely."""
    if not cfg.secagg.enabled:
        return
    if spec.pooled:
        raise ConfigError(f"method {cfg.method} trains on pooled data: there is nothing to aggregate securely; "
                          "set secagg.enabled=false")
    if "fit" not in spec.server.secure_phases(cfg):
        raise ConfigError(f"secagg.enabled: method {cfg.method}'s server reads each client's fit reply, so it cannot "
                          "be aggregated securely; use a method whose server averages or sums the replies (fedavg, "
                          "sfd, ccvr, fedloge, fedrod, ...: see docs/secure-aggregation.md) or set secagg.enabled=false")
    from fedlt.methods.calibrators import CALIBRATORS

    raw = [name for name in spec.calibration if not CALIBRATORS[name].private]
    if raw:
        raise ConfigError(f"secagg.enabled: calibration {raw[0]} uploads real features, which secure aggregation "
                          "cannot sum; drop it from calibration or set secagg.enabled=false")
    if cfg.clients_per_round() < 2:
        raise ConfigError(f"secagg.enabled needs at least 2 clients per round, fl.participation samples "
                          f"{cfg.clients_per_round()}; raise fl.participation")
    if cfg.run.backend == "vectorized":
        raise ConfigError("run.backend=vectorized does not run secure aggregation's masked exchanges; "
                          "use run.backend=sequential (or auto) with secagg.enabled")
    from fedlt.engine.secure_aggregation import flower_crypto

    flower_crypto()


def setup_parts(cfg: Config) -> tuple[MethodSpec, FederatedData, torch.device]:
    """The checked method, the federation's data and the device, with torch's settings applied:
    what both the server and (under Flower) every SuperNode build from the same config."""
    spec = check_config(cfg)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    if cfg.run.deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    device = resolve_device(cfg.run.device)
    return spec, build_federated_data(cfg.data, cfg.seed, device), device


def prepare(cfg: Config) -> Simulation:
    """Validate everything that can fail on user input — method, loss, data, model — before any
    file is written, so a bad config leaves no half-written run directory."""
    sim = Simulation(cfg, *setup_parts(cfg))
    if cfg.run.compile:
        sim.worker.compile()
    return sim


def run(config: Config | dict[str, Any] | str | Path | None = None, *, overrides: list[str] | None = None,
        quiet: bool = False) -> RunResult:
    """Run one experiment. ``config`` is a Config, a nested dict, or a YAML path; ``overrides`` are
    ``key=value`` strings applied on top."""
    if isinstance(config, (Config, dict)):
        tree = config.dump() if isinstance(config, Config) else copy.deepcopy(config)
        cfg = build_config(apply_overrides(tree, overrides or []))
    else:
        cfg = load_config(config, overrides)
    if cfg.engine == "flower":
        return _run_flower(cfg, quiet)
    sim = prepare(cfg)
    run_dir = new_run_dir(cfg)
    return sim.run(run_dir, quiet=quiet)


def _run_flower(cfg: Config, quiet: bool) -> RunResult:
    """The config on Flower's simulation engine; checked first, so a bad config starts no Ray."""
    spec = check_config(cfg)
    if spec.pooled:
        raise ConfigError(f"method {cfg.method} trains on pooled data; run it with engine=inprocess")
    try:
        from fedlt.engine.flower_app import simulate
    except ImportError:
        raise ConfigError("engine=flower needs Flower: pip install 'fedlt[flower]'") from None
    return simulate(cfg, quiet=quiet)


def resume(run_dir: str | Path, *, quiet: bool = False) -> RunResult:
    """Continue a run from its last checkpoint; the result equals an uninterrupted run's."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise ConfigError(f"{run_dir} is not a fedlt run directory (no {CONFIG_FILE}); pass the directory of a run")
    cfg = load_config(run_dir / CONFIG_FILE)
    if cfg.engine == "flower":
        raise ConfigError("engine=flower runs cannot resume (client state lives on the SuperNodes); start a new run")
    sim = prepare(cfg)
    return sim.run(run_dir, resume=True, quiet=quiet)
