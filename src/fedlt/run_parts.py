"""A run's parts from its config: the checked method, the device, the backend and the federation's
data — what :mod:`fedlt.api` and every engine build from the same config (under Flower, the
server and each SuperNode), below both so that no engine imports the API.

:func:`check_config` runs every check that needs no data, so a bad config fails before any file
is written or any process starts; :func:`setup_parts` adds torch's settings, the device and the
data.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from fedlt.calibration.calibrators import CALIBRATORS
from fedlt.config import DIRICHLET_PARTITIONS, Config, FlowerConfig, LossConfig, PrivacyConfig, SecAggConfig
from fedlt.data.federated import FederatedData, build_federated_data, check_class_order
from fedlt.data.registry import BUILTIN_DATASETS, DATASETS
from fedlt.errors import ConfigError
from fedlt.host_memory import keep_freed_buffers
from fedlt.losses import LOSSES, PRIOR_LOSSES, make_loss
from fedlt.methods.base import Client, MethodArgs, MethodSpec, declares_local_objective
from fedlt.methods.registry import METHODS, get_method, parse_method_args
from fedlt.models.registry import MODELS, check_model_input
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
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"run.device={name} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                          f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"run.device={name} but this torch has no usable MPS (Apple GPU); use run.device=auto or cpu")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"run.device={name}: fedlt trains on cpu, cuda (cuda:N) or mps; use run.device=auto")
    return device


def _check_client_gpus(cfg: Config) -> None:
    """``flower.gpus_per_client`` asks Ray for GPUs: refused when it asks for more than one client can
    have on this machine, or for GPUs while the run is held on the CPU."""
    wanted = cfg.flower.gpus_per_client
    if cfg.engine != "flower" or wanted == 0:
        return
    present = torch.cuda.device_count()
    if wanted > present:
        fix = (f"most {present} (a fraction shares one GPU), or 0 to train the simulated clients on CPU" if present
               else "most 0: set flower.gpus_per_client=0, and the simulated clients train on the CPU")
        raise ConfigError(f"flower.gpus_per_client={wanted:g} but this machine has {present} CUDA device(s); use at {fix}")
    if resolve_device(cfg.run.device).type != "cuda":
        raise ConfigError(f"flower.gpus_per_client={wanted:g} reserves GPUs but run.device={cfg.run.device} keeps "
                          "training on the CPU; set run.device=auto (or cuda) or flower.gpus_per_client=0")


def trains_together(client_cls: type[Client], backend: str) -> bool:
    """Whether ``backend`` (vectorized, graphed) can train this client class: it declares its local
    step as a :class:`~fedlt.methods.base.LocalObjective` of a form that backend takes."""
    return declares_local_objective(client_cls) and backend in client_cls.objective_backends


#: ``run.backend=auto``: the backend measured fastest, by device type and model (``*``: any other),
#: among those the method supports (docs/results/speed.md: on the CPU the vectorized backend ran at
#: 0.77-0.88x of sequential training; on an H200 graphed training ran ResNet-8/32 clients of the papers'
#: size at 5.0-11.4x sequential, and with 40 small clients every model at 2.2-4.7x sequential and
#: 4.0-6.4x vectorized)
AUTO_BACKENDS = {("cpu", "*"): "sequential", ("cuda", "*"): "graphed"}


def auto_backend(device: torch.device, model: str) -> str:
    return AUTO_BACKENDS.get((device.type, model)) or AUTO_BACKENDS.get((device.type, "*"), "sequential")


def choose_backend(cfg: Config, client_cls: type[Client], device: torch.device) -> str:
    """``sequential``, ``parallel``, ``vectorized`` or ``graphed`` for this run; a ConfigError for an
    impossible request."""
    wanted = cfg.run.backend
    if wanted == "parallel":
        if device.type != "cpu":
            raise ConfigError(f"run.backend=parallel trains clients in CPU processes, but run.device is {device}; "
                              "use run.backend=vectorized (or sequential) on a GPU, or run.device=cpu")
        return "parallel"
    if wanted == "auto":
        wanted = auto_backend(device, cfg.model.name)
        if wanted in ("vectorized", "graphed") and not trains_together(client_cls, wanted):
            wanted = "sequential"
    if wanted == "sequential" or cfg.secagg.enabled:
        return "sequential"
    if not trains_together(client_cls, wanted):
        # parallel runs any method a worker process can build by name (not one registered in code only)
        parallel = [] if METHODS.in_code_only(cfg.method) else ["parallel"]
        refused = f"run.backend={wanted} does not support method {cfg.method}"
        why = client_cls.backend_refusal_why
        if declares_local_objective(client_cls):
            others = ", ".join(f"run.backend={b}" for b in (*client_cls.objective_backends, *parallel))
            raise ConfigError(f"{refused} ({why or 'its step is more than a loss of the logits'}); use {others}, "
                              "run.backend=auto or run.backend=sequential")
        others = "auto, sequential or parallel" if parallel else "auto or sequential"
        raise ConfigError(f"{refused} ({why or 'its local step is its own'}); use run.backend={others}")
    return wanted


def loss_refusal(spec: MethodSpec, loss: str) -> str | None:
    """Why method ``spec`` cannot train with ``loss`` (one of LOSSES), from its declarations; None
    when it can."""
    if not spec.uses_loss_config and loss != "ce":
        return f"method {spec.name} + loss {loss}: {spec.name} fixes its own training objective; remove loss.name={loss}"
    if spec.losses is not None and loss not in spec.losses:
        return (f"method {spec.name} + loss {loss}: {spec.name} trains only with {', '.join(spec.losses)} "
                f"({spec.losses_why}); use loss.name=<one of {', '.join(spec.losses)}>")
    return None


def calibration_refusal(spec: MethodSpec, args: MethodArgs, name: str) -> str | None:
    """Why calibration ``name`` has no meaning on method ``spec`` with knobs ``args``, from the
    method's declared head and the calibration's declared needs; None when it has one."""
    head = spec.head(args)
    why = CALIBRATORS[name].refusal(spec.name, head)
    if why is None:
        return None
    working = [n for n, c in CALIBRATORS.items() if c.refusal(spec.name, head) is None]
    fix = f"use calibration=<one of {', '.join(working)}>" + (f" or {head.fix}" if head.fix else "")
    return f"method {spec.name} + calibration {name} has no meaning: {why}; {fix}"


#: the loss knobs that belong to one loss
LOSS_KNOBS = {"focal_gamma": "focal", "ldam_max_margin": "ldam", "ldam_scale": "ldam"}


def _check_loss(cfg: Config, spec: MethodSpec) -> None:
    if cfg.loss.name not in LOSSES:
        raise ConfigError(f"unknown loss '{cfg.loss.name}'; use loss.name=<one of {', '.join(LOSSES)}>")
    refusal = loss_refusal(spec, cfg.loss.name)
    if refusal:
        raise ConfigError(refusal)
    c = cfg.loss
    trains = f"loss.name={c.name}" if spec.uses_loss_config else f"method {spec.name} (its own objective)"
    if c.tau != LossConfig.model_fields["tau"].default and (c.name != "la" or not spec.uses_loss_config):
        raise ConfigError(f"loss.tau={c.tau} scales logit adjustment's log-prior (loss.name=la), and {trains} has no "
                          "tau; drop loss.tau" + (" or use loss.name=la" if spec.uses_loss_config else ""))
    for knob, owner in LOSS_KNOBS.items():  # a knob of another loss would be recorded and silently not used
        value = getattr(c, knob)
        if value != LossConfig.model_fields[knob].default and (c.name != owner or not spec.uses_loss_config):
            raise ConfigError(f"loss.{knob}={value} acts only on loss.name={owner}, and {trains} has no {knob}; "
                              f"drop loss.{knob}" + (f" or use loss.name={owner}" if spec.uses_loss_config else ""))
    if c.prior != "local" and (c.name not in PRIOR_LOSSES or not spec.uses_loss_config):
        raise ConfigError(f"loss.prior={c.prior} acts only on the losses built from class counts "
                          f"({', '.join(PRIOR_LOSSES)}), and {trains} has none; drop loss.prior"
                          + (f" or use loss.name=<one of {', '.join(PRIOR_LOSSES)}>" if spec.uses_loss_config else ""))
    try:  # surface bad loss arguments now, not inside the first client's training
        make_loss(c.name, prior=torch.full((2,), 0.5), class_counts=torch.ones(2), tau=c.tau, focal_gamma=c.focal_gamma,
                  ldam_max_margin=c.ldam_max_margin, ldam_scale=c.ldam_scale)
    except ValueError as err:
        raise ConfigError(f"invalid loss settings: {err}") from None


def no_global_model_refusal(method: str) -> str:
    return (f"method {method} has no global model under these settings, so eval.personalized=false leaves the run "
            "nothing to measure; set eval.personalized=true")


def check_built_by_name(cfg: Config, elsewhere: tuple[str, str] | None = None) -> None:
    """A method or calibration registered in code reaches no other process: the workers of
    run.backend=parallel, Flower's nodes and a caller's own worker processes (``elsewhere``: where,
    and what to use instead) build the run from its config, by name."""
    where, other = elsewhere or (None, None)
    if where is None and cfg.engine == "flower":
        where, other = "Flower's nodes (engine=flower)", "engine=inprocess"
    elif where is None and cfg.run.backend == "parallel":
        where, other = "the worker processes of run.backend=parallel", "run.backend=sequential"
    if where is None:
        return
    named = [("method", cfg.method, METHODS, "writing-a-method"),  # every kind of entry point is described there
             *(("calibration", n, CALIBRATORS, "writing-a-method") for n in cfg.calibration),
             ("model", cfg.model.name, MODELS, "writing-a-method")]
    for kind, name, registry, page in named:
        if registry.in_code_only(name):
            raise ConfigError(f"{kind} {name} is registered in this process's code, and {where} build the run by "
                              f"name in processes of their own; register it through a fedlt.{kind}s entry point "
                              f"(docs/{page}.md), or use {other}")
    if cfg.data.dataset in DATASETS and cfg.data.dataset not in BUILTIN_DATASETS:
        raise ConfigError(f"dataset {cfg.data.dataset} is added to DATASETS in this process's code, and {where} load "
                          f"the data by name in processes of their own; use {other}")


def outside_code(cfg: Config) -> dict[str, str]:
    """The run's method, calibrations and model whose code is not fedlt's, with where it comes from
    (:meth:`fedlt.plugins.PluginRegistry.provenance`): a run records them beside fedlt's source hash."""
    named = [(cfg.method, METHODS), *((name, CALIBRATORS) for name in cfg.calibration), (cfg.model.name, MODELS)]
    return {name: origin for name, registry in named if (origin := registry.provenance(name)) is not None}


def run_calibrations(cfg: Config) -> list[str]:
    """The calibrations a run applies: its method's own, then the configured ones."""
    own = get_method(cfg.method).calibration
    return [*own, *(name for name in cfg.calibration if name not in own)]


def check_new_config(cfg: Config) -> MethodSpec:
    """:func:`check_config`, and what a new run (not a resumed one, which was accepted when it started)
    must not hold: a calibration knob none of its calibrations reads, which its config would record as if
    it had been applied."""
    spec = check_config(cfg)
    if cfg.calibration_args:
        from fedlt.calibration.wrapper import parse_calibration_args

        parse_calibration_args(cfg.calibration_args, run_calibrations(cfg))
    return spec


def unread_settings(cfg: Config) -> list[str]:
    """Settings a config gives that its other settings leave unread (see ``MethodArgs.unread_knobs``), a line
    each: a suite's rows keep such pins, so a run names them rather than refusing them."""
    args, given = parse_method_args(get_method(cfg.method), cfg.method_args), set(cfg.method_args)
    unread = args.unread_knobs(given)
    if not cfg.eval.personalized:
        named = {line.split()[0] for line in unread}
        unread += [line for line in args.unevaluated_knobs(given) if line.split()[0] not in named]
    for section, keys, why in _unread_sections(cfg):
        given = getattr(cfg, section).model_fields_set
        unread += [f"{section}.{key} is not read {why}" for key in keys if key in given]
    return unread


def method_notes(cfg: Config) -> list[str]:
    """Pairings of valid settings that the method's paper did not make and that have failed (see
    ``Server.config_notes``), a line each, told before the run rather than refused."""
    spec = get_method(cfg.method)
    known = DATASETS.get(cfg.data.dataset)
    classes = len(cfg.data.classes) if cfg.data.classes else known.classes if known else None
    return spec.server.config_notes(cfg, parse_method_args(spec, cfg.method_args), classes)


def _unread_sections(cfg: Config) -> list[tuple[str, tuple[str, ...], str]]:
    """The config keys that these values of other keys leave unread: (section, keys, why)."""
    d, backend = cfg.data, cfg.run.backend
    unread = []
    if d.val_per_class == 0:
        unread.append(("data", ("val_from",), "with data.val_per_class=0 (no validation split)"))
    if d.partition not in DIRICHLET_PARTITIONS:
        unread.append(("data", ("alpha",), f"with data.partition={d.partition} (it is the Dirichlet concentration)"))
    if d.partition != "pathological":
        unread.append(("data", ("classes_per_client",), f"with data.partition={d.partition} (it shapes the "
                       "pathological partition)"))
    if d.partition == "iid":
        unread.append(("data", ("max_retries",), "with data.partition=iid (one draw)"))
    if d.dataset in DATASETS and DATASETS[d.dataset].long_tailed:
        unread.append(("data", ("imbalance_factor",), f"with data.dataset={d.dataset} (its training split is "
                       "long-tailed as distributed; no long-tail draw is made)"))
    if backend in ("sequential", "vectorized", "graphed"):
        unread.append(("run", ("workers",), f"with run.backend={backend} (it sizes run.backend=parallel's pool)"))
    if backend in ("sequential", "vectorized", "parallel"):
        unread.append(("run", ("streams",), f"with run.backend={backend} (it sizes run.backend=graphed's streams)"))
    if not cfg.secagg.enabled and not cfg.flower.node_data:  # nodes holding their data sum securely anyway
        unread.append(("secagg", tuple(k for k in SecAggConfig.model_fields if k != "enabled"),
                       "with secagg.enabled=false"))
    if cfg.engine == "inprocess":  # flower.node_data itself is checked (refused in-process)
        unread.append(("flower", tuple(k for k in FlowerConfig.model_fields if k != "node_data"),
                       "by engine=inprocess (Flower's settings)"))
    elif not cfg.flower.node_data:
        unread.append(("flower", ("min_nodes",), "in a simulation (flower.node_data=false)"))
    if cfg.engine == "inprocess" or not cfg.flower.node_data:
        unread.append(("privacy", tuple(PrivacyConfig.model_fields), "unless nodes hold their own data "
                       "(flower.node_data=true)"))
    return unread


def check_config(cfg: Config) -> MethodSpec:
    """Every check that needs no data: method and its knobs, calibrations, loss, each pair of them,
    model and dataset names, tracking. ``fedlt bench`` runs it on every cell before the first one trains."""
    spec = get_method(cfg.method)
    calibration = run_calibrations(cfg)
    if calibration:
        from fedlt.calibration.wrapper import parse_calibration_args, with_calibration

        spec = with_calibration(spec, calibration)
        parse_calibration_args(cfg.calibration_args)
    elif cfg.calibration_args:
        raise ConfigError("calibration_args given but no calibration; add e.g. calibration=ccvr or drop them")
    _check_loss(cfg, spec)
    method_args = parse_method_args(spec, cfg.method_args)
    for name in calibration:
        refusal = calibration_refusal(spec, method_args, name)
        if refusal:
            raise ConfigError(refusal)
    if cfg.model.name not in MODELS:
        raise ConfigError(f"unknown model '{cfg.model.name}'; use model.name=<one of {', '.join(MODELS)}>")
    if cfg.data.dataset not in DATASETS:
        raise ConfigError(f"unknown dataset '{cfg.data.dataset}'; set data.dataset to one of: {', '.join(DATASETS)}")
    check_model_input(cfg.model.name, cfg.data, DATASETS[cfg.data.dataset])
    check_class_order(cfg.data)
    check_tracking(cfg)
    given = [k for k in ("test_data", "val_data") if getattr(cfg.eval, k) is not None]
    if given and not cfg.flower.node_data:
        raise ConfigError(f"eval.{given[0]} is the server's own set in a federation whose nodes hold their data "
                          f"(flower.node_data=true); this run reads {cfg.data.dataset}'s splits: drop eval.{given[0]}")
    if cfg.engine == "flower" and cfg.run.backend in ("vectorized", "parallel", "graphed"):
        raise ConfigError(f"run.backend={cfg.run.backend} is for the in-process engine, but under engine=flower "
                          "each client trains on its SuperNode; use run.backend=auto or sequential")
    check_built_by_name(cfg)
    choose_backend(cfg, spec.client, resolve_device(cfg.run.device))
    _check_client_gpus(cfg)
    refusal = spec.server.model_refusal(cfg, method_args) or spec.server.config_refusal(cfg, method_args)
    if refusal:
        raise ConfigError(refusal)
    if not cfg.eval.personalized and not spec.server.has_global_model(cfg, method_args):
        raise ConfigError(no_global_model_refusal(cfg.method))
    if cfg.engine == "flower" and spec.pooled:
        raise ConfigError(f"method {cfg.method} trains on pooled data; run it with engine=inprocess")
    _check_secagg(cfg, spec)
    _check_node_data(cfg, spec, method_args)
    return spec


def _check_node_data(cfg: Config, spec: MethodSpec, method_args: MethodArgs) -> None:
    """``flower.node_data``: what a federation whose server holds no data can run, and what would
    show the server a node's label histogram or features in the clear."""
    if not cfg.flower.node_data:
        return
    if cfg.engine != "flower":
        raise ConfigError("flower.node_data=true is a real federation of SuperNodes; run it with engine=flower "
                          "(fedlt deploy --node-data DIR), or set flower.node_data=false")
    if spec.pooled:
        raise ConfigError(f"method {cfg.method} trains on pooled data, which a real federation does not have; "
                          "use a federated method")
    if cfg.data.val_per_class:
        raise ConfigError("data.val_per_class draws a validation set from the dataset, which the server of a real "
                          "federation does not hold; set data.val_per_class=0")
    if cfg.eval.shot_rule == "cumulative_local":
        raise ConfigError("eval.shot_rule=cumulative_local needs every client's class counts, which the server of a "
                          "real federation does not hold; use eval.shot_rule=cumulative")
    refusal = spec.server.node_data_refusal(cfg, method_args)
    if refusal:
        raise ConfigError(refusal)
    leaks = spec.server.clear_uploads(cfg, method_args)
    if leaks and not cfg.privacy.allow_leaks:
        raise ConfigError(f"flower.node_data: {leaks[0]} shows the server a node's label histogram or features in "
                          "the clear; drop it, or set privacy.allow_leaks=true to accept that")


def _check_secagg(cfg: Config, spec: MethodSpec) -> None:
    """``secagg.enabled`` only where the method's own fit upload can be aggregated securely."""
    if not cfg.secagg.enabled:
        return
    if spec.pooled:
        raise ConfigError(f"method {cfg.method} trains on pooled data: there is nothing to aggregate securely; "
                          "set secagg.enabled=false")
    own = get_method(cfg.method).calibration  # CReFF is FedAvg + its calibration: the method's own
    readers = [name for name in spec.calibration if CALIBRATORS[name].reads_fit_replies and name not in own]
    inner = getattr(spec.server, "inner_cls", spec.server)  # the method's server, under the calibrations'
    if readers and "fit" in inner.secure_phases(cfg):
        others = ", ".join(n for n, c in CALIBRATORS.items() if c.private and not c.reads_fit_replies)
        raise ConfigError(f"secagg.enabled: calibration={readers[0]} reads each client's fit reply, so the fit upload "
                          f"cannot be aggregated securely; drop {readers[0]} from calibration (these calibrations are "
                          f"secure: {others}) or set secagg.enabled=false")
    if "fit" not in spec.server.secure_phases(cfg):
        raise ConfigError(f"secagg.enabled: method {cfg.method}'s server reads each client's fit reply, so it cannot "
                          "be aggregated securely; use a method whose server averages or sums the replies (fedavg, "
                          "sfd, ccvr, fedloge, fedrod, ...: see docs/secure-aggregation.md) or set secagg.enabled=false")
    raw = [name for name in spec.calibration if not CALIBRATORS[name].private]
    if raw:
        raise ConfigError(f"secagg.enabled: calibration {raw[0]} uploads real features, which secure aggregation "
                          "cannot sum; drop it from calibration or set secagg.enabled=false")
    if cfg.clients_per_round() < 2:
        raise ConfigError(f"secagg.enabled needs at least 2 clients per round, fl.participation samples "
                          f"{cfg.clients_per_round()}; raise fl.participation")
    if cfg.run.backend in ("vectorized", "graphed"):
        raise ConfigError(f"run.backend={cfg.run.backend} does not run secure aggregation's masked exchanges; "
                          "use run.backend=sequential (or auto) with secagg.enabled")
    if importlib.util.find_spec("flwr") is None:  # the primitives are Flower's (engine.secure_aggregation)
        raise ConfigError("secagg.enabled needs Flower's SecAgg+ primitives: pip install 'fedlt[flower]'")


def setup_parts(cfg: Config) -> tuple[MethodSpec, FederatedData, torch.device]:
    """The checked method, the federation's data and the device, with torch's settings applied:
    what both the server and (under Flower) every SuperNode build from the same config."""
    spec, device = setup_runtime(cfg)
    return spec, build_federated_data(cfg.data, cfg.seed, device), device


#: torch's thread count in this process before the first run set one (the threads of run.threads=null)
_PROCESS_THREADS: int | None = None


def process_threads() -> int:
    """The threads of a run without run.threads: torch's choice for this process, before any run set one."""
    global _PROCESS_THREADS
    if _PROCESS_THREADS is None:
        _PROCESS_THREADS = torch.get_num_threads()
    return _PROCESS_THREADS


def setup_runtime(cfg: Config) -> tuple[MethodSpec, torch.device]:
    """The checked method and the device, with torch's settings applied (no data read)."""
    spec = check_config(cfg)
    keep_freed_buffers()
    # every run sets its settings: a run must not inherit an earlier run's in this process
    default_threads = process_threads()  # read before this run sets any
    torch.set_num_threads(cfg.run.threads or default_threads)
    device = resolve_device(cfg.run.device)
    deterministic = cfg.run.deterministic
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False  # autotuning picks kernels by timing, so it is off either way
    if device.type == "cuda":  # atomics in CUDA's index_add/scatter kernels reorder float sums run to run
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
        torch.use_deterministic_algorithms(deterministic, warn_only=True)  # a CPU run leaves a caller's setting
    return spec, device
