"""The contract between an algorithm and an engine.

A method is a :class:`Server` and a :class:`Client` that talk only through
:class:`~fedlt.messages.Message` / :class:`~fedlt.messages.Reply` objects. Engines (in-process,
Flower) own rounds, sampling, evaluation, checkpoints and progress, and call these hooks:

setup      ``while q := server.next_query("setup", 0, all_clients)``: run q, ``server.receive``
each round r, scheduled clients S0:
           ``S = server.select_clients(r, S0)``        (default S0; GBME selects its own)
           ``server.next_query("before_fit", r, S)`` loop
           ``server.fit_message(r, k)`` -> ``client.fit(ctx_k, msg)`` for k in S
           ``server.aggregate(r, replies)``
           ``server.next_query("after_fit", r, S)`` loop
           ``server.end_round(r)``                       (server-side steps, e.g. calibration)
after the last round:
           ``server.next_query("final", R, all_clients)`` loop, then ``server.finish()``
evaluation ``server.global_model()`` on the balanced test set; personalized models through
           ``server.eval_message(k)`` -> ``client.personalize(ctx_k, msg)`` on local test sets.

Client objects are stateless across clients (one instance serves every client); what a client
must remember between rounds lives in ``ctx.state``, which the engine keeps per client id.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import nn

from fedlt import fused
from fedlt.config import Config, NoBoolForNumbers, with_type_hint
from fedlt.errors import ConfigError, PluginError
from fedlt.messages import Message, Query, Reply
from fedlt.models import FedModel, create_model
from fedlt.seeding import numpy_rng, torch_generator
from fedlt.transfer import to_device

Stage = Literal["setup", "before_fit", "after_fit", "final"]


class MethodArgs(NoBoolForNumbers):
    """Method-specific knobs (``method_args.*``); subclasses add fields with defaults from the paper."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # nan / inf: a typo, never a knob's value
    #: knobs that shape only the personalized models, which ``eval.personalized=false`` never evaluates
    personal_knobs: ClassVar[tuple[str, ...]] = ()

    def unread_knobs(self, given: set[str]) -> list[str]:
        """The ``given`` knobs (those the config sets) that its other knobs leave unread, each with why: a new
        run says so, since its config records them as if they had acted (a suite's rows keep such pins)."""
        return [f"method_args.{knob} is not read {why}" for knobs, why in self.unread_when()
                for knob in knobs if knob in given]

    def unread_when(self) -> list[tuple[tuple[str, ...], str]]:
        """Groups of knobs that this combination of knobs leaves unread, with the reason."""
        return []

    def unevaluated_knobs(self, given: set[str]) -> list[str]:
        """The ``given`` personalization knobs, for a run that evaluates no personalized model."""
        return [f"method_args.{knob} shapes only the personalized models, which eval.personalized=false does not "
                "evaluate" for knob in self.personal_knobs if knob in given]


def parse_args(args_cls: type[MethodArgs], raw: dict, section: str, owner: str) -> MethodArgs:
    """Validate a knob section (``method_args``, ``calibration_args``) as one-line ConfigErrors."""
    try:
        return args_cls.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        # the knob and any list index, without the union member tags pydantic adds (gamma.float)
        loc = first["loc"]
        key = ".".join(str(p) for i, p in enumerate(loc) if i == 0 or isinstance(p, int))
        if first["type"] == "extra_forbidden":
            valid = ", ".join(args_cls.model_fields) or "none"
            raise ConfigError(f"{owner} has no knob {section}.{key}; its knobs: {valid}") from None
        where = f"{section}.{key}" if key else section  # a check across knobs has no single key
        raise ConfigError(f"invalid {where} for {owner}: {with_type_hint(first, args_cls, section + '.')}") from None


@dataclass
class ClientData:
    """One client's training data on the training device: indices into shared tensors, no copies."""

    images: torch.Tensor  # uint8 (N_all, C, H, W), shared by all clients
    labels: torch.Tensor  # int64 (N_all,)
    indices: torch.Tensor  # int64 (n_k,), this client's rows
    num_classes: int
    standardize: Callable[[torch.Tensor], torch.Tensor]  # float [0, 1] batch -> model input
    augment: Callable[[torch.Tensor, torch.Generator, bool], torch.Tensor] | None = None
    hflip: bool = True  # whether flips keep labels (not for digits)
    #: samples per class, when the federation knows them on the host (its partition does)
    counts: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.indices.numel())

    def class_counts(self) -> torch.Tensor:
        """int64 samples per class on the data's device; from the host's counts when given, so the
        host does not wait for the device to count them."""
        if self.counts is not None:
            return to_device(self.counts, self.labels.device)
        return torch.bincount(self.labels[self.indices], minlength=self.num_classes)

    def host_counts(self) -> np.ndarray:
        """int64 samples per class on the host, for per-class terms made there (a loss's prior) and
        copied to the device without a wait: the host's counts when given, else counted on the
        device (a wait)."""
        if self.counts is not None:
            return np.array(self.counts, dtype=np.int64)
        return self.class_counts().cpu().numpy()

    def host_prior(self) -> np.ndarray:
        """float32 class frequencies of this client on the host (a loss's prior); uniform for a client
        the partition left without samples, which trains on nothing."""
        counts = self.host_counts().astype(np.float32)
        total = counts.sum()
        return counts / total if total > 0 else np.full_like(counts, 1 / len(counts))

    def raw(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 images and labels of ``rows`` (positions within this client), for methods that
        build their own views."""
        idx = self.indices[rows]
        return self.images[idx], self.labels[idx]

    def batch(self, rows: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Model-ready images and labels of ``rows``; augmented (``data.augment``) when a
        generator is given — training passes one, feature extraction and evaluation do not."""
        images, labels = self.raw(rows)
        x = images.float().div_(255.0)
        if generator is not None and self.augment is not None:
            x = self.augment(x, generator, self.hflip)
        return self.standardize(x), labels


@dataclass
class TrainSettings:
    """Local optimisation settings for one round (lr already follows the schedule)."""

    epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    grad_clip: float | None
    #: ``fl.lr`` before its schedule, for steps outside training that should not shrink with it
    #: (fine-tuning at evaluation); None: ``lr``
    base_lr: float | None = None


@dataclass
class GradientCorrection:
    """A step on a corrected gradient (SCAFFOLD's ``g - c_i + c``): ``offset`` (a tensor per model
    parameter, in ``model.parameters()`` order) is added to each parameter's gradient before clipping
    and SGD, so the loss, and the reported training loss, stay the task's. ``done`` receives, after the
    client's last step, the sum over its steps of each parameter's own gradient plus weight decay (as
    SGD adds it; before the offset), and the number of steps. The sums may still be being computed on
    the device: read them in ``finish``, not in ``done``."""

    offset: list[torch.Tensor]
    done: Callable[[list[torch.Tensor], int], None]


@dataclass
class LocalObjective:
    """A client's local step written as data, so the vectorized and graphed backends can train many
    clients together: minimise ``loss(model(x), y)`` (a loss from :func:`fedlt.losses.make_loss`)
    plus FedProx's ``prox_mu / 2 * ||w - w_start||^2`` with
    :func:`fedlt.training.sequential.train_local`'s SGD, from the message's weights, replying all
    weights.

    ``loss`` is a plain function or a ``partial`` whose tensor keywords (a log-prior, margins)
    differ per client and whose other keywords are the same for every client of a round."""

    loss: Callable[..., torch.Tensor]
    prox_mu: float = 0.0
    #: the client's own tensors, loaded over the message's weights before training (FedBN's BatchNorm,
    #: FedPer's head: what it keeps and never receives)
    start: dict[str, torch.Tensor] = field(default_factory=dict)
    #: what the reply carries besides the weights: computed before training (CReFF's gradients), or
    #: added by ``finish`` (FedYoYo's prior estimate)
    payload: dict[str, Any] = field(default_factory=dict)
    #: the loss reads more than the logits (features, a projector, extra heads): it is called as
    #: ``loss(model, x, y, **extra)``; only the graphed backend takes such a step
    on_model: bool = False
    #: trainable tensors outside the model (a personal head), passed to an ``on_model`` loss as
    #: keywords and stepped (and clipped) with the model's parameters
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    #: the reply's weights from the trained state dict and extras (keeping what stays on the client
    #: in ``ctx.state``); None: the whole state dict
    finish: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    #: puts the model in this client's mode before its first step (GBME: freezes the experts it does
    #: not train); the parameters that then require a gradient are the ones trained
    prepare: Callable[[nn.Module], None] | None = None
    #: the factor on the round's learning rate at the client's i-th step (from 1; GBME's warm-up)
    lr_scale: Callable[[int], float] | None = None
    #: the step's input and labels from a batch's rows (positions in the client's data), in place of
    #: ``ctx.data.batch`` with ``data.augment`` (FedYoYo: the weak and strong views of each image)
    batch: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    #: the loss's per-client tensors at the client's i-th step (from 1), when they change within a
    #: round (FedYoYo's re-mixed log-prior); the same names and shapes as the loss's own
    step_tensors: Callable[[int], dict[str, torch.Tensor]] | None = None
    #: receives, after each step, what an ``on_model`` loss returned besides its value (it then
    #: returns ``(value, tensor)``; FedYoYo: the teacher view's features) and the batch's labels
    keep: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    #: the gradient corrected by a per-client offset before the SGD step (SCAFFOLD's control variates);
    #: covers the model's parameters, so it takes no ``extra``
    correction: GradientCorrection | None = None

    def of_logits_only(self) -> bool:
        """Whether the step is a loss of the logits and nothing more (what the vectorized backend takes)."""
        return not (self.on_model or self.extra or self.prepare or self.lr_scale or self.batch or self.step_tensors
                    or self.keep or self.correction)


@dataclass
class ClientContext:
    """What a client procedure sees: its id, data, persistent state and the shared model instance."""

    cid: int
    round: int
    model: FedModel
    data: ClientData
    state: dict[str, Any]
    train: TrainSettings
    device: torch.device
    seed: int
    loss_config: Any = None
    #: the client runs on a node that holds its own data (``flower.node_data``), whose server knows
    #: the config: randomness drawn from the seed is no secret from it
    node_data: bool = False

    def generator(self, purpose: int = 0) -> torch.Generator:
        """Training randomness for this (round, client): independent of the order clients run in."""
        return torch_generator(self.seed, "train", self.round, self.cid, purpose, device=self.data.images.device)


@dataclass
class ServerContext:
    """What a server procedure sees: the global model and the federation's public facts."""

    model: FedModel
    config: Config
    num_classes: int
    num_clients: int
    device: torch.device
    args: MethodArgs
    make_model: Callable[[], FedModel]
    #: how far a long server stage is, ``stage_progress(done, total, unit)`` (SAFS: classes synthesized): the
    #: run's progress shows it with an ETA, where a stage of many minutes would otherwise show nothing
    stage_progress: Callable[[int, int, str], None] = lambda done, total, unit: None

    def rng(self, rnd: int, purpose: int = 0) -> np.random.Generator:
        return numpy_rng(self.config.seed, "server", rnd, purpose)

    def generator(self, rnd: int, purpose: int = 0) -> torch.Generator:
        return torch_generator(self.config.seed, "server", rnd, purpose, device=self.device)


def clone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of a model's state dict (what a client sends or a server broadcasts). The state
    is read with its parameters as they are (``keep_vars``): the copies are detached anyway, and
    ``state_dict()`` would detach each parameter first, an operation per tensor for nothing."""
    state = model.state_dict(keep_vars=True)
    return dict(zip(state, fused.clones(list(state.values()))))


@dataclass
class _Broadcast:
    sources: list[torch.Tensor]  # the model's state tensors the copy was made from
    source_versions: list[tuple[int, int]]  # each one's version and storage address
    copy: dict[str, torch.Tensor]
    copy_versions: list[int]


_broadcasts: weakref.WeakKeyDictionary[nn.Module, _Broadcast] = weakref.WeakKeyDictionary()


def broadcast_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``clone_state`` for what a server sends: one copy, shared by the messages it makes until the model
    changes, instead of one per client (on a GPU an allocation per tensor and client, the largest share
    of a client's host time). A change is an in-place write (it raises a tensor's version: a step, an
    aggregation, a calibration), a replaced tensor, or replaced storage (``.data =``, ``module.to``,
    ``double()``); an in-place write through ``.data`` is the one change it cannot see. Receivers load
    the weights into their own model and never write to them, as over a network; a copy found written
    to is refused, not sent on."""
    state = model.state_dict(keep_vars=True)
    sources = list(state.values())
    if torch.is_inference_mode_enabled():  # inference tensors keep no versions to check
        return dict(zip(state, fused.clones(sources)))
    made = _broadcasts.get(model)
    if made is not None and len(made.sources) == len(sources) and made.copy.keys() == state.keys() \
            and all(a is b for a, b in zip(made.sources, sources)) \
            and [(t._version, t.data_ptr()) for t in sources] == made.source_versions:
        written = [k for k, v in zip(made.copy, made.copy_versions) if made.copy[k]._version != v]
        if written:
            raise RuntimeError(f"a receiver wrote to the weights the server sent ({', '.join(written[:3])}); "
                               "a client must copy them into its own model, not change them")
        return dict(made.copy)
    copy = dict(zip(state, fused.clones(sources)))
    _broadcasts[model] = _Broadcast(sources, [(t._version, t.data_ptr()) for t in sources], copy,
                                    [t._version for t in copy.values()])
    return dict(copy)


class Server:
    """Server side of a method. The default is FedAvg's: broadcast the model, average updates."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        self.model = ctx.model
        self.args = ctx.args

    @classmethod
    def secure_phases(cls, config: Config) -> dict[str, str]:
        """Exchanges (``fit``, ``query:NAME``) whose replies this server only sums (``sum``) or
        averages by ``num_samples`` (``weighted_mean``), so ``secagg.enabled`` can hand it one
        aggregate reply instead of each client's (:mod:`fedlt.engine.secure_aggregation`).
        Default: ``fit`` if the server keeps FedAvg's :meth:`aggregate`; a server that reads
        individual replies must not declare them."""
        return {"fit": "weighted_mean"} if cls.aggregate is Server.aggregate else {}

    @classmethod
    def model_refusal(cls, config: Config, args: "MethodArgs") -> str | None:
        """Why this method cannot build ``config.model`` (checked before any data are read); None
        when it can. Default: every registered model."""
        return None

    @classmethod
    def config_notes(cls, config: Config, args: "MethodArgs", classes: int | None) -> list[str]:
        """Valid settings under which this method has failed where its paper paired them otherwise (an
        A-SCL weight with a learning rate), a line each naming the pairing that trains; printed before a
        run starts, not refused. ``classes``: the dataset's class count where it is known before its
        files are read, else None. Default: none."""
        return []

    @classmethod
    def config_refusal(cls, config: Config, args: "MethodArgs") -> str | None:
        """Why this method cannot run under ``config`` (another option it contradicts, too few
        clients), as a one-line refusal naming the fix; None when it can. Checked with the rest of
        the config before any data are read or any process starts. Default: None."""
        return None

    @classmethod
    def trains_in_fit(cls, config: Config, args: "MethodArgs") -> bool:
        """Whether every client's training of a round comes back as a reply of the ``fit`` phase (a
        calibration that reads fit replies, CReFF's, needs it). Default: yes."""
        return True

    @classmethod
    def variant_names(cls, config: Config, args: "MethodArgs") -> set[str]:
        """The names :meth:`extra_models` can give under these settings (a suite checks the variants
        its rows read against them before anything trains). Default: none."""
        return set()

    @classmethod
    def has_global_model(cls, config: Config, args: "MethodArgs") -> bool:
        """Whether :meth:`global_model` returns a model under these settings, as far as they tell
        without building it (checked before training: without one, only personalized evaluation
        measures anything). Default: yes."""
        return True

    @classmethod
    def node_data_refusal(cls, config: Config, args: "MethodArgs") -> str | None:
        """Why this run's options cannot hold on nodes that hold their own data (``flower.node_data``),
        as a one-line refusal naming the fix; None when they can. Default: None."""
        return None

    @classmethod
    def clear_uploads(cls, config: Config, args: "MethodArgs") -> list[str]:
        """The options of this run whose uploads show the server a client's label histogram or real
        features in the clear (beyond what the method must send): a real federation
        (``flower.node_data``) refuses them unless ``privacy.allow_leaks``. Default: none."""
        return []

    def next_query(self, stage: Stage, rnd: int, clients: list[int]) -> Query | None:
        """The next extra round-trip at ``stage``, or None when the stage has nothing (more) to ask."""
        return None

    def receive(self, query: Query, replies: dict[int, Reply]) -> None:
        """Replies to a query from :meth:`next_query`."""
        raise NotImplementedError(f"{type(self).__name__} asked query '{query.name}' but does not receive it")

    def select_clients(self, rnd: int, scheduled: list[int]) -> list[int]:
        """The clients that train in round ``rnd``. Default: the engine's seeded schedule, the same
        for every method; a method with its own selection rule (GBME's per-expert selection)
        returns its choice, drawn from ``ctx.rng``."""
        return scheduled

    def fit_message(self, rnd: int, cid: int) -> Message | None:
        """What sampled client ``cid`` receives to train; None: it sits this round out."""
        return Message(weights=broadcast_state(self.model))

    def aggregate(self, rnd: int, replies: dict[int, Reply]) -> None:
        from fedlt.methods.aggregation import weighted_average

        average = weighted_average(replies)
        unknown = self.model.load_state_dict(average, strict=False).unexpected_keys
        if unknown:
            more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
            raise PluginError(f"{type(self).__name__}.aggregate: the replies' weight {unknown[0]!r}{more} name no "
                              "entry of the model, so their average would be dropped; a client replies with the "
                              "names of ctx.model.state_dict()")

    def end_round(self, rnd: int) -> None:
        """Server-side steps after aggregation (calibration, realignment ...)."""

    def finish(self) -> None:
        """Post-training server steps, after the final queries."""

    def global_model(self) -> FedModel | None:
        """The model evaluated on the balanced test set; None if the method has no global model."""
        return self.model

    def has_final_global_model(self) -> bool:
        """Whether the final round has a global model to evaluate (asked before training, when a
        calibration's head, which the final stage makes, does not exist yet)."""
        return self.global_model() is not None

    def metrics(self) -> dict[str, float]:
        """Server-side diagnostics of the last round, written into its metrics line."""
        return {}

    def extra_models(self) -> dict[str, FedModel]:
        """Variants of the global model also evaluated on the balanced test set (reported under
        ``variants``), e.g. the uncalibrated backbone beside a calibrated one."""
        return {}

    def artifacts(self) -> dict[str, torch.Tensor]:
        """Named tensors the engine saves once after training to ``artifacts.pt`` for reports,
        e.g. ``synthetic_features`` / ``synthetic_labels`` (a ``name/`` prefix is allowed)."""
        return {}

    def eval_message(self, cid: int) -> Message:
        """What a client receives to build its personalized model for evaluation."""
        return Message(weights=broadcast_state(self.global_model() or self.model))

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume; extend for method state (features, optimisers ...)."""
        return {"model": clone_state(self.model)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])


def check_objective(objective: Any, client: Any) -> None:
    """``local_objective``'s answer is a :class:`LocalObjective` or None; anything else fails deep in training."""
    if objective is not None and not isinstance(objective, LocalObjective):
        where = f"{type(getattr(client, 'inner', client)).__name__}.local_objective"
        raise PluginError(f"{where} returned {type(objective).__name__}; it returns a "
                          "fedlt.methods.base.LocalObjective (e.g. LocalObjective(loss)) or None")


def check_message(msg: Any, server: Any) -> None:
    """What a server's ``fit_message`` returns is a :class:`Message` (or None: the client sits the round out)."""
    if msg is not None and not isinstance(msg, Message):
        where = f"{type(getattr(server, 'inner', server)).__name__}.fit_message"
        raise PluginError(f"{where} returned {type(msg).__name__}; it returns a fedlt.messages.Message or None")


def declares_local_objective(client_cls: type["Client"]) -> bool:
    """Whether the client class declares its own :meth:`Client.local_objective` (inheriting one is
    not enough: a subclass may have changed ``fit``)."""
    return "local_objective" in vars(client_cls)


class Client:
    """Client side of a method; one instance serves all clients."""

    #: True when the client keeps a personal model; evaluation then uses :meth:`personalize`.
    personalized: ClassVar[bool] = False
    #: the backends that can train this client's :meth:`local_objective` (the vectorized one takes
    #: only losses of the logits)
    objective_backends: ClassVar[tuple[str, ...]] = ("vectorized", "graphed")
    #: what keeps the other backends that train clients together from training this client (its
    #: step beyond a loss of the logits, or why it has no local objective), for their refusal; None:
    #: a generic reason
    backend_refusal_why: ClassVar[str | None] = None

    def __init__(self, args: MethodArgs):
        self.args = args

    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        raise NotImplementedError

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective | None:
        """This client's :meth:`fit` as a :class:`LocalObjective`, for the vectorized backend; None
        (the default): the local step does not fit that form. The engine only calls it on a class
        that defines it itself, so a subclass that changes :meth:`fit` falls back to sequential
        training until it declares its own."""
        return None

    def query(self, name: str, ctx: ClientContext, msg: Message) -> Reply:
        """Answer an extra round-trip named ``name``; subclasses dispatch on the name."""
        raise PluginError(f"{type(self).__name__} has no query '{name}'; answer it in its query() or do not ask it "
                          "in the server's next_query()")

    def personalize(self, ctx: ClientContext, msg: Message) -> None:
        """Load this client's personalized model into ``ctx.model`` for local-test evaluation."""
        ctx.model.load_state_dict(msg.weights, strict=False)

    def personal_readings(self) -> dict[str, "Client"]:
        """Other readings of the personalized model that are evaluation-time only (another head
        built from the same trained state), by name: each is evaluated beside this one (a run's
        ``pm_variants``), so a default can be chosen on validation data without training again."""
        return {}


@dataclass(frozen=True)
class ModelHead:
    """What a method's trained global model offers a calibration as its classifier, declared by
    the method so that a calibration that has no meaning on it is refused before training."""

    #: the head in a few words, for refusals and the docs ("a fixed simplex-ETF head")
    what: str
    #: reads the model's learned linear head over its feature (bias may be None); None when it has
    #: none (a fixed, cosine or never-trained head): tau-norm then has nothing to rescale
    linear: Callable[[FedModel], nn.Linear] | None = None
    #: heads whose logits the model averages; the feature is then theirs side by side
    experts: int = 1
    #: the method's knob that gives it a learned linear head, if one does ("method_args.expert_head=linear")
    fix: str = ""


#: a plain model's head: the learned ``nn.Linear`` over the backbone's feature
LINEAR_HEAD = ModelHead("a learned linear head", linear=lambda model: model.head)


@dataclass
class MethodSpec:
    """A registered method: its parts, its knobs and a one-line description."""

    name: str
    description: str
    server: type[Server]
    client: type[Client]
    args: type[MethodArgs] = MethodArgs
    #: trains on the union of all clients' data (the centralized oracle); in-process engine only
    pooled: bool = False
    #: builds the model; methods with special heads or experts replace it
    make_model: Callable[[Config, int, int, int], FedModel] = field(
        default=lambda cfg, num_classes, in_channels, image_size: create_model(
            cfg.model.name, num_classes, in_channels=in_channels, image_size=image_size
        )
    )
    #: uses ``loss.*`` from the config (False: the method fixes its own objective)
    uses_loss_config: bool = True
    #: the ``method_args`` knob its loss's prior comes from, where ``loss.prior`` does not set it (GBME's)
    prior_knob: str | None = None
    #: the configurable losses it trains with (None: every one of :data:`fedlt.losses.LOSSES`)
    losses: tuple[str, ...] | None = None
    #: why only those, for the refusal of another loss
    losses_why: str = ""
    #: what its global model offers a calibration, from its parsed ``method_args``
    head: Callable[[MethodArgs], ModelHead] = lambda args: LINEAR_HEAD
    #: classifier calibrations the method always applies (CReFF is FedAvg + its calibration)
    calibration: tuple[str, ...] = ()
    #: whether its clients keep state between rounds in ``ctx.state`` (a personal model, control variates, a
    #: prior estimate), from its parsed ``method_args`` and the run's model (FedBN keeps the model's BatchNorm):
    #: a Flower run of it cannot go on from its checkpoint on SuperNodes started again, which lack that state,
    #: even where no reply that would have shown it arrived
    keeps_state: Callable[[MethodArgs, FedModel], bool] = lambda args, model: False

    def clients_keep_state(self, args: MethodArgs, model: FedModel) -> bool:
        """``keeps_state`` of a run. A declaration of one parameter, the ``method_args`` alone (as a plug-in
        written before the model was passed declares it), is called with them alone."""
        try:
            alone = len(inspect.signature(self.keeps_state).parameters) == 1
        except (TypeError, ValueError):  # a callable without a signature: take it as the current form
            alone = False
        return bool(self.keeps_state(args) if alone else self.keeps_state(args, model))  # type: ignore[call-arg]
