"""Any method + server-side classifier calibration(s), as one method.

The wrapper adds to the inner method's messages (CReFF's classifier down, its gradients up),
runs one statistics query to every client after the last round for the post-hoc calibrations,
and evaluates the inner backbone with each calibrated head. The first calibration is the
headline global model; the others and the uncalibrated model are reported as variants, so one
run compares them on the same backbone.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Sequence

import torch

from fedlt.calibration.calibrators import CALIBRATORS, CalibrationArgs, creff_client_gradients
from fedlt.calibration.math.classifiers import ridge_sums
from fedlt.calibration.math.rff import random_fourier_features, rff_frequencies
from fedlt.calibration.math.stats import class_feature_sums, merge_sums
from fedlt.data.sources.common import available_memory
from fedlt.errors import ConfigError, PluginError, size_text
from fedlt.messages import Message, Query, Reply, check_reply
from fedlt.methods.base import (
    Client, ClientContext, LocalObjective, MethodArgs, MethodSpec, ModelHead, Server, ServerContext, Stage, clone_state,
    declares_local_objective, parse_args,
)

STATS_QUERY = "calibration_stats"


def _at_least_float32(features: torch.Tensor) -> torch.Tensor:
    """Half-precision features in float32 (statistics and head fits need it); float32 and float64 as they are."""
    return features.to(torch.promote_types(features.dtype, torch.float32))


@torch.no_grad()
def client_features(model, ctx: ClientContext, batch_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of all the client's samples under ``model`` in eval mode (no augmentation)."""
    model.eval()
    feats, labels = [], []
    n = len(ctx.data)
    for start in range(0, n, batch_size):
        x, y = ctx.data.batch(torch.arange(start, min(start + batch_size, n), device=ctx.data.indices.device))
        feats.append(_at_least_float32(model.forward_features(x)))
        labels.append(y)
    if not feats:
        device = ctx.data.indices.device
        return torch.zeros(0, model.feature_dim, device=device), torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat(feats), torch.cat(labels)


class CalibratedServer(Server):
    """Delegates to the inner server and adds the calibrations' steps."""

    inner_cls: type[Server]
    names: tuple[str, ...]
    #: the inner method's declaration of its head (:attr:`MethodSpec.head`)
    head_of: Callable[[MethodArgs], ModelHead]

    @classmethod
    def secure_phases(cls, config):
        """The inner method's, minus fit when a calibrator reads each client's fit reply (CReFF's
        per-class gradients), plus the statistics query when it carries only sums (not the
        oracle's raw features)."""
        calibrators = [CALIBRATORS[n] for n in cls.names]
        phases = dict(cls.inner_cls.secure_phases(config))
        if any(c.reads_fit_replies for c in calibrators):
            phases.pop("fit", None)
        needs = set().union(*(c.needs for c in calibrators))
        if needs and "features" not in needs:
            phases[f"query:{STATS_QUERY}"] = "sum"
        return phases

    @classmethod
    def model_refusal(cls, config, args):
        return cls.inner_cls.model_refusal(config, args)

    @classmethod
    def config_refusal(cls, config, args):
        """The inner method's, and a calibration that reads fit replies on a method whose training
        does not come back as fit replies (GBME's sequential sub-rounds)."""
        readers = [n for n in cls.names if CALIBRATORS[n].reads_fit_replies]
        if readers and not cls.inner_cls.trains_in_fit(config, args):
            return (f"calibration={readers[0]} reads each client's fit reply, but method {config.method} under these "
                    "options trains outside the fit phase (GBME: method_args.expert_aggregation=sequential); "
                    "drop the calibration or use another expert_aggregation")
        return cls.inner_cls.config_refusal(config, args)

    @classmethod
    def variant_names(cls, config, args):
        """The inner method's, the uncalibrated model and every calibration after the first."""
        uncalibrated = {"uncalibrated"} if cls.inner_cls.has_global_model(config, args) else set()
        return cls.inner_cls.variant_names(config, args) | uncalibrated | set(cls.names[1:])

    @classmethod
    def node_data_refusal(cls, config, args):
        return cls.inner_cls.node_data_refusal(config, args)

    @classmethod
    def clear_uploads(cls, config, args):
        """The inner method's, plus calibrations that upload real features (the oracle) or per-class
        replies that name the classes a client holds (CReFF's gradients). Each is named by the option
        that brought it: ``method=creff`` is FedAvg with CReFF, and has no calibration to drop."""
        out = list(cls.inner_cls.clear_uploads(config, args))
        for cal in (CALIBRATORS[n] for n in cls.names):
            option = f"method={config.method}" if config.method == cal.name else f"calibration={cal.name}"
            if not cal.private:
                out.append(f"{option} (uploads real features)")
            elif cal.reads_fit_replies:
                out.append(f"{option} (each client's per-class replies name the classes it holds)")
        return out

    def __init__(self, ctx: ServerContext):
        self.inner = self.inner_cls(ctx)
        super().__init__(ctx)
        cal_args = parse_calibration_args(ctx.config.calibration_args)
        self.calibrators = [CALIBRATORS[n](cal_args, ctx) for n in self.names]
        self.needs = sorted(set().union(*(c.needs for c in self.calibrators)))
        self.model_head = self.head_of(ctx.args)
        dim = self._backbone().feature_dim
        if "class_sums" in self.needs:
            check_second_moments_fit(ctx.config, [c for c in self.calibrators if "class_sums" in c.needs][0].name,
                                     ctx.num_classes, dim, ctx.device)
        for cal in self.calibrators:
            check_features_fit(ctx.config, cal, dim, ctx.device)
        self._stats_done = False
        self._stats: dict[str, Any] = {}
        self._eval_models: dict[str, Any] = {}

    # -- messages ---------------------------------------------------------------------------
    def select_clients(self, rnd, scheduled):
        return self.inner.select_clients(rnd, scheduled)

    def fit_message(self, rnd, cid):
        msg = self.inner.fit_message(rnd, cid)
        if msg is not None:
            for cal in self.calibrators:
                msg.payload.update(cal.fit_payload(rnd))
        return msg

    def aggregate(self, rnd, replies):
        self.inner.aggregate(rnd, replies)
        for cal in self.calibrators:
            cal.on_fit_replies(rnd, replies)

    def end_round(self, rnd):
        self.inner.end_round(rnd)
        for cal in self.calibrators:
            cal.end_round(rnd, self._backbone())

    def next_query(self, stage: Stage, rnd, clients):
        query = self.inner.next_query(stage, rnd, clients)
        if query is not None:
            return query
        if stage == "final" and self.needs and not self._stats_done:
            weights = clone_state(self._backbone())
            payload: dict[str, Any] = {"needs": ",".join(self.needs)}
            if "features" in self.needs:
                payload["oracle_per_class"] = self.calibrators[0].args.oracle_per_class
            for cal in self.calibrators:
                payload.update(cal.stats_payload())
            return Query(STATS_QUERY, {cid: Message(weights=weights, payload=dict(payload)) for cid in clients})
        return None

    def receive(self, query, replies):
        if query.name != STATS_QUERY:
            return self.inner.receive(query, replies)
        self._stats = merge_client_stats(self.needs, replies)
        self._stats_done = True

    def finish(self):
        self.inner.finish()
        read = self.model_head.linear
        learned = read(self._backbone()) if read is not None else None
        for cal in self.calibrators:
            if (returned := cal.finish(self._stats, learned)) is not None:
                raise PluginError(f"{type(cal).__name__}.finish returned {type(returned).__name__}, which is "
                                  "ignored: finish sets the calibrated head (self._head) and returns None")
            check_head(cal, self._backbone())
        self._stats = {}

    # -- evaluation ---------------------------------------------------------------------------
    def _backbone(self):
        return self.inner.global_model() or self.inner.model

    def _with_head(self, name: str, head) -> Any:
        model = self._eval_models.get(name)
        if model is None:
            model = copy.deepcopy(self._backbone())
            self._eval_models[name] = model
        encoder = {k: v for k, v in self._backbone().state_dict().items() if not k.startswith("head.")}
        model.load_state_dict(encoder, strict=False)  # never into the calibrated head
        model.head = head
        return model

    def global_model(self):
        """The headline calibration's model once it has a head; before, the method's own global model
        (None for one without, such as FedPer: its server's head never trains)."""
        head = self.calibrators[0].head()
        return self._with_head(self.calibrators[0].name, head) if head is not None else self.inner.global_model()

    def has_final_global_model(self):
        """Always: the final stage puts the calibrated head on the backbone, even of a method without a
        global model of its own (FedPer)."""
        return True

    def metrics(self):
        out = dict(self.inner.metrics())
        for cal in self.calibrators:
            out.update(cal.metrics())
        return out

    def extra_models(self):
        uncalibrated = self.inner.global_model()
        models = {"uncalibrated": uncalibrated} if uncalibrated is not None else {}
        for cal in self.calibrators[1:]:
            if cal.head() is not None:
                models[cal.name] = self._with_head(cal.name, cal.head())
        return {**self.inner.extra_models(), **models}

    def artifacts(self):
        out = dict(self.inner.artifacts())
        for cal in self.calibrators:
            out.update({f"{cal.name}/{k}": v for k, v in cal.artifacts().items()})
        return out

    def eval_message(self, cid):
        return self.inner.eval_message(cid)

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "calibrators": [c.state_dict() for c in self.calibrators],
                "stats_done": self._stats_done}

    def load_state_dict(self, state):
        self.inner.load_state_dict(state["inner"])
        for cal, s in zip(self.calibrators, state["calibrators"]):
            cal.load_state_dict(s)
        self._stats_done = state["stats_done"]


#: copies of the classes x d x d float64 second moments a run holds at once: a client's sums, the server's
#: running sum, and the calibration's scatter and covariances
SECOND_MOMENT_COPIES = 4


def memory_short(on_device: int, on_host: int, device: torch.device) -> str | None:
    """What is too small for ``on_device`` bytes on the run's device (a GPU's free memory; none to check
    on the CPU) and ``on_host`` bytes of host memory, e.g. ``"2.1 GB of memory available"``; None: both fit."""
    free_device = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    free_host = available_memory()
    if free_device is not None and on_device > free_device:
        return f"{free_device / 1e9:.1f} GB free on {device}"
    if free_host is not None and on_host > free_host:
        return f"{free_host / 1e9:.1f} GB of memory available"
    return None


def _option(config, name: str) -> str:
    """The setting that brought calibration ``name``: ``calibration=ccvr`` or the method it is part of."""
    return f"calibration={name}" if name in config.calibration else f"method={config.method}"


def check_second_moments_fit(config, name: str, classes: int, dim: int, device: torch.device) -> None:
    """Refuse, before the first round, a calibration whose per-class second moments (CCVR's, SAFS's) the
    machine cannot hold: with ImageNet-LT's 1,000 classes a ResNet-50's 2,048-d features make 33.6 GB a
    client, and the run would end after its last round in an out-of-memory error. A client builds its
    sums on the run's device (one array there), the run holds :data:`SECOND_MOMENT_COPIES` in memory."""
    one = classes * dim * dim * 8
    short = memory_short(one, SECOND_MOMENT_COPIES * one, device)
    if short is None:
        return
    option = _option(config, name)
    raise ConfigError(f"{option} needs per-class second moments of the features ({classes} classes x {dim} x {dim} "
                      f"float64: {one / 1e9:.1f} GB a client, about {SECOND_MOMENT_COPIES * one / 1e9:.1f} GB at once), "
                      f"more than the {short}; use a model with narrower features (`fedlt models` gives each one's "
                      "width) or a calibration without them (fed3r, fedncm)")


def check_features_fit(config, cal, dim: int, device: torch.device) -> None:
    """Refuse, before the first round, the features a calibration builds after the last one (CCVR's virtual
    ones, SAFS's synthetic ones) when the machine cannot hold them: ``ccvr_virtual_per_class=1e12`` asked
    for a petabyte after every round had trained. float32 rows, built as parts and joined: two copies."""
    held = cal.features_held(dim)
    if held is None:
        return
    rows, knob = held
    size = 2 * rows * dim * 4
    short = memory_short(size, size, device)
    if short is None:
        return
    raise ConfigError(f"{_option(config, cal.name)} builds up to {rows:,} features of width {dim} after the last round "
                      f"(about {size_text(size)}), more than the {short}; lower calibration_args.{knob}")


def check_head(cal, backbone) -> None:
    """The head a calibration built maps the backbone's features to one logit per class."""
    head = cal.head()
    if head is None:
        raise PluginError(f"{type(cal).__name__}.finish set no head: it stores the calibrated head in self._head "
                          "(e.g. linear_head(weight, bias))")
    x = torch.zeros(2, backbone.feature_dim, device=next(backbone.parameters()).device)
    training = head.training
    head.eval()  # a head with BatchNorm keeps its running statistics
    try:
        with torch.no_grad():
            shape = tuple(head(x).shape)
    except RuntimeError as err:
        shape = f"an error ({str(err).splitlines()[0]})"
    finally:
        head.train(training)
    if shape != (2, cal.num_classes):
        raise PluginError(f"{type(cal).__name__}'s head maps 2 features of width {backbone.feature_dim} to {shape}, "
                          f"not (2, {cal.num_classes}); build it over the model's feature (weight: classes x features)")


def merge_client_stats(needs: list[str], replies: dict[int, Reply]) -> dict[str, Any]:
    """Sum the clients' statistics (they are sums, so a secure aggregate would give the same)."""
    out: dict[str, Any] = {}
    for kind in ("class_sums", "normalized_sums", "ridge_sums", "rff_sums"):
        if kind in needs:
            out[kind] = merge_sums([{k.split("/", 1)[1]: v for k, v in r.payload.items() if k.startswith(kind + "/")}
                                    for r in replies.values()])
    if "features" in needs:
        out["features"] = (torch.cat([r.payload["features/z"] for r in replies.values()]),
                           torch.cat([r.payload["features/y"] for r in replies.values()]))
    return out


class CalibratedClient(Client):
    """Delegates to the inner client and answers the calibrations' requests."""

    inner_cls: type[Client]

    def __init__(self, args):
        self.inner = self.inner_cls(args)
        super().__init__(args)

    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        extra = self._before_training(ctx, msg)
        reply = self.inner.fit(ctx, msg)
        check_reply(reply, f"{type(self.inner).__name__}.fit")
        reply.payload.update(extra)
        return reply

    def _local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective | None:
        """The inner client's local step with the calibrations' payload (CReFF's gradients): set as
        ``local_objective`` on the wrapper of a client that declares one."""
        objective = self.inner.local_objective(ctx, msg)
        if objective is not None:
            objective.payload.update(self._before_training(ctx, msg))
        return objective

    def _before_training(self, ctx: ClientContext, msg: Message) -> dict[str, torch.Tensor]:
        """What the calibrations add to a fit reply from the received model, before training."""
        if "creff/weight" not in msg.payload:
            return {}
        ctx.model.load_state_dict(msg.weights, strict=False)  # gradients use the received backbone
        feats, labels = client_features(ctx.model, ctx)
        return {k: v.cpu() for k, v in creff_client_gradients(ctx.model, feats, labels, msg.payload).items()}

    def query(self, name, ctx, msg):
        if name != STATS_QUERY:
            return self.inner.query(name, ctx, msg)
        ctx.model.load_state_dict(msg.weights, strict=False)
        feats, labels = client_features(ctx.model, ctx)
        needs = msg.payload["needs"].split(",")
        payload: dict[str, Any] = {}
        c = ctx.data.num_classes
        if "class_sums" in needs:
            payload.update({f"class_sums/{k}": v.cpu() for k, v in class_feature_sums(feats, labels, c).items()})
        if "normalized_sums" in needs:
            unit = torch.nn.functional.normalize(feats, dim=1)
            sums = class_feature_sums(unit, labels, c, second_moment=False)
            payload.update({f"normalized_sums/{k}": v.cpu() for k, v in sums.items()})
        if "ridge_sums" in needs:
            gram, cross = ridge_sums(feats, labels, c)
            payload.update({"ridge_sums/gram": gram.cpu(), "ridge_sums/cross": cross.cpu()})
        if "rff_sums" in needs:  # mean random Fourier features (SAFS), as sums, from the server's seed
            w = rff_frequencies(feats.shape[1], int(msg.payload["rff_dim"]), float(msg.payload["rff_gamma"]),
                                int(msg.payload["rff_seed"])).to(device=feats.device, dtype=torch.float32)
            sums = class_feature_sums(random_fourier_features(feats, w), labels, c, second_moment=False)
            payload.update({f"rff_sums/{k}": v.cpu() for k, v in sums.items()})
        if "features" in needs:
            keep = balanced_sample(labels, int(msg.payload["oracle_per_class"]), ctx.generator(purpose=61))
            payload.update({"features/z": feats[keep].cpu(), "features/y": labels[keep].cpu()})
        return Reply(payload=payload, num_samples=len(ctx.data))

    def personalize(self, ctx, msg):
        return self.inner.personalize(ctx, msg)

    def personal_readings(self) -> dict[str, Client]:
        """The inner method's: a calibration leaves its personalized models as the method builds them."""
        return self.inner.personal_readings()


def balanced_sample(labels: torch.Tensor, per_class: int, generator: torch.Generator) -> torch.Tensor:
    """Positions of up to ``per_class`` samples of every class, drawn without replacement."""
    keep = []
    for c in labels.unique():
        idx = (labels == c).nonzero().flatten()
        order = torch.randperm(idx.numel(), generator=generator, device=generator.device).to(idx.device)
        keep.append(idx[order[:per_class]])
    return torch.cat(keep) if keep else torch.zeros(0, dtype=torch.int64, device=labels.device)


def knob_owner(key: str) -> str | None:
    """The built-in calibration a ``calibration_args`` knob belongs to by its name (``<calibration>_...``;
    a plug-in adds no knob); None for a shared knob (``retrain_*``)."""
    return next((name for name in CALIBRATORS if CALIBRATORS[name].shared_knobs is not None
                 and key.startswith(f"{name}_")), None)


def reads_knob(names: Sequence[str], key: str) -> bool:
    """Whether one of the calibrations ``names`` reads the knob ``key`` (a plug-in may read any shared one)."""
    owner = knob_owner(key)
    if owner is not None:
        return owner in names
    return any(CALIBRATORS[name].shared_knobs is None or key in CALIBRATORS[name].shared_knobs for name in names)


def parse_calibration_args(raw: dict, names: Sequence[str] | None = None) -> CalibrationArgs:
    """``calibration_args`` validated; with the run's calibrations ``names``, a knob none of them reads is
    refused too: the run's config would record it as if it had been applied."""
    args = parse_args(CalibrationArgs, raw, "calibration_args", "calibration")
    for key in raw if names is not None else ():
        if not reads_knob(names, key):
            users = [knob_owner(key)] if knob_owner(key) else [
                name for name in CALIBRATORS if key in (CALIBRATORS[name].shared_knobs or ())]
            raise ConfigError(f"calibration_args.{key} is read by calibration={' or '.join(users)}, which this run "
                              f"does not use (it uses {', '.join(names)}); drop it")
    return args


def with_calibration(spec: MethodSpec, names: list[str]) -> MethodSpec:
    """The method ``spec`` with ``names`` calibrations composed onto it (validated here, so a bad
    name or knob fails before any run directory exists)."""
    unknown = [n for n in names if n not in CALIBRATORS]
    if unknown:
        parts = [p.strip() for p in unknown[0].split(",")]
        if len(parts) > 1 and all(p in CALIBRATORS for p in parts):  # a list written without its brackets
            raise ConfigError(f"calibration '{unknown[0]}' is one name with commas; write a list in brackets, "
                              f"quoted for the shell: \"calibration=[{','.join(parts)}]\"")
        raise ConfigError(f"unknown calibration '{unknown[0]}'; use calibration=<one or a list of "
                          f"{', '.join(CALIBRATORS)}>")
    if len(set(names)) != len(names):
        raise ConfigError(f"calibration lists a name twice ({', '.join(names)}); give each once")
    server = type(f"Calibrated{spec.server.__name__}", (CalibratedServer,),
                  {"inner_cls": spec.server, "names": tuple(names), "head_of": staticmethod(spec.head)})
    # the engine reads ``personalized`` from the class: it must declare what the wrapped client does
    # and trains together with other clients (run.backend=vectorized, graphed) where the wrapped one does
    members = {"inner_cls": spec.client, "personalized": spec.client.personalized,
               "objective_backends": spec.client.objective_backends,
               "backend_refusal_why": spec.client.backend_refusal_why}
    if declares_local_objective(spec.client):
        members["local_objective"] = CalibratedClient._local_objective
    client = type(f"Calibrated{spec.client.__name__}", (CalibratedClient,), members)
    return dataclasses.replace(spec, server=server, client=client, calibration=tuple(names))

