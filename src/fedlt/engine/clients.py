"""The client side of every engine: one worker model, the federation's data and a method's
:class:`~fedlt.methods.base.Client`, answering one message at a time.

The in-process engine calls :meth:`ClientRuntime.handle` directly; Flower's ClientApp calls the
same method on each SuperNode, so a client computes exactly the same thing in both engines.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from fedlt import fused
from fedlt.config import RESAMPLING_AUGMENTATIONS, Config
from fedlt.data.augment import get_augmentation
from fedlt.data.federated import FederatedData
from fedlt.engine.sampling import lr_at
from fedlt.engine import secure_aggregation as secagg
from fedlt.engine.checkpoint import unsafe_entry
from fedlt.engine.portable_model import decode_model
from fedlt.errors import PluginError
from fedlt.evaluation import (SharedEncoderFeatures, equal, head_of_features, local_accuracy, per_class_counts,
                              predict)
from fedlt.messages import Message, Reply, check_reply
from fedlt.methods.base import ClientContext, ClientData, MethodSpec, TrainSettings, clone_state
from fedlt.methods.registry import parse_method_args
from fedlt.models import FedModel
from fedlt.seeding import seed_for

#: exchange kinds besides ``fit`` and ``query:NAME``: build the personalized model and return its
#: accuracy on this client's local test set as a sum the server can add up without seeing a sample:
#: ``pm_sum`` (100 x accuracy, 0 without a local test set) and ``pm_n`` (1, or 0 without one), and
#: ``val_pm_sum`` / ``val_pm_n`` on the local validation set where the run has one, ``pm_nonfinite`` (1 when
#: the model's test loss there is not finite: a NaN model, which the report names); each of the
#: method's other personal readings (:meth:`~fedlt.methods.base.Client.personal_readings`) adds the
#: same entries suffixed ``/NAME``
EVALUATE = "evaluate"
#: a real federation's engine kinds (``flower.node_data``), answered from the node's own data and
#: only summed by the server: ``counts``, the client's training samples per class; ``evaluate_counts``,
#: per-class correct / samples / loss sums of each model sent (``payload["models"]``) on the
#: client's own test split, with its accuracy under the first model as ``pm_sum`` / ``pm_n``
COUNTS, EVALUATE_COUNTS = "counts", "evaluate_counts"


def new_model(cfg: Config, spec: MethodSpec, data: FederatedData, device: torch.device) -> FedModel:
    """Same architecture and same initial weights every time (the ``model`` seed stream)."""
    d = data.train
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_for(cfg.seed, "model"))
        model = spec.make_model(cfg, d.num_classes, d.in_channels, d.image_size)
    model = model.to(device)
    if channels_last(cfg, device):
        model = model.to(memory_format=torch.channels_last)
    return model


def keeps_sent_encoder(model: FedModel, msg: Message) -> bool:
    """Whether a personalized ``model`` has the encoder the server sent, which every client that
    personalizes only its head shares (decided per client, whatever was evaluated before)."""
    mine = model.encoder.state_dict(keep_vars=True)
    sent = [msg.weights.get("encoder." + key) for key in mine]
    return all(t is not None for t in sent) and equal(list(mine.values()), sent)


def channels_last(cfg: Config, device: torch.device) -> bool:
    """``run.channels_last`` applies on the CPU, where it was measured faster. On CUDA it was not
    (the CNN on an H100: 0.725 vs 0.695 s a round), and cuDNN's backward under ``vmap`` (the
    vectorized backend) refuses channels-last tensors."""
    return cfg.run.channels_last and device.type == "cpu"


class ClientRuntime:
    """Runs a method's client procedure for any client id of ``data`` under ``cfg``."""

    def __init__(self, cfg: Config, spec: MethodSpec, data: FederatedData, device: torch.device):
        self.cfg, self.device = cfg, device
        self.eval_data = data
        self.train_data = data.pooled() if spec.pooled else data
        self.client = spec.client(parse_method_args(spec, cfg.method_args))
        self.worker = new_model(cfg, spec, data, device)
        self._worker_init = clone_state(self.worker)
        # the worker's tensors in _worker_init's order: a module's tensors stay the same objects
        # (load_state_dict copies in place), so each client's reset needs no state-dict traversal
        worker = self.worker.state_dict(keep_vars=True)
        self._worker_tensors = [worker[k] for k in self._worker_init]
        self._augment = get_augmentation(cfg.data.augment) if cfg.data.augment != "none" else None
        if cfg.data.augment in RESAMPLING_AUGMENTATIONS:
            self._augment = partial(self._augment, interpolation=cfg.data.interpolation)
        # during an evaluation phase only: the test and validation sets' features, worth making where
        # the clients' local sets together outnumber the set they are drawn from
        self._test_features = SharedEncoderFeatures()
        self._val_features = SharedEncoderFeatures()
        self._share_test_features = sum(len(data.local_test[c]) for c in range(data.num_clients)) > len(data.test)
        self._share_val_features = data.local_val is not None and data.val is not None \
            and sum(len(data.local_val[c]) for c in range(data.num_clients)) > len(data.val)
        self._readings = self.client.personal_readings()

    def context(self, cid: int, rnd: int, state: dict[str, Any]) -> ClientContext:
        """A client's view; the worker model starts from the initial weights, so entries a message
        does not carry never leak from the previous client (or depend on resume)."""
        fused.copy_(self._worker_tensors, list(self._worker_init.values()))
        fl = self.cfg.fl
        data = self.train_data
        return ClientContext(
            cid=cid, round=rnd, model=self.worker,
            data=ClientData(data.train.images, data.train.labels, data.client_indices(cid), data.num_classes,
                            self._standardizer(), self._augment, data.hflip, data.client_counts(cid)),
            state=state,
            train=TrainSettings(fl.local_epochs, fl.batch_size, lr_at(fl, rnd), fl.momentum, fl.weight_decay,
                                fl.grad_clip, base_lr=fl.lr),
            device=self.device, seed=self.cfg.seed, loss_config=self.cfg.loss, node_data=self.cfg.flower.node_data,
        )

    def _standardizer(self):
        standardize = self.train_data.train.standardize
        if not channels_last(self.cfg, self.device):
            return standardize
        return lambda x: standardize(x).contiguous(memory_format=torch.channels_last)

    def handle(self, kind: str, cid: int, rnd: int, msg: Message, state: dict[str, Any]) -> Reply:
        """Answer one exchange: ``fit``, ``query:NAME`` or ``evaluate``; ``state`` is the client's
        persistent ``ctx.state`` and is updated in place."""
        if kind.startswith("secagg:"):
            return secagg.client_step(kind, cid, msg, state)
        secure = msg.payload.get(secagg.ENTRY)
        if secure is None:
            state.pop(secagg.ENTRY, None)  # secrets of a secure phase this client dropped out of
            return self._answer(kind, cid, rnd, msg, state)
        # a secure phase: answer as usual, upload only the masked vector
        msg = Message(msg.weights, {k: v for k, v in msg.payload.items() if k != secagg.ENTRY})
        return secagg.mask_reply(cid, self._answer(kind, cid, rnd, msg, state), secure, state)

    def _answer(self, kind: str, cid: int, rnd: int, msg: Message, state: dict[str, Any]) -> Reply:
        if kind != EVALUATE:
            self.forget_test_features()
        ctx = self.context(cid, rnd, state)
        if kind == "fit" or kind.startswith("query:"):
            name = kind.removeprefix("query:")
            reply = self.client.fit(ctx, msg) if kind == "fit" else self.client.query(name, ctx, msg)
            check_client_hook(self.client, "fit" if kind == "fit" else f"query('{name}')", reply, state, len(ctx.data))
            return reply
        if kind == EVALUATE:
            payload = self._personalized_accuracy(self.client, ctx, msg, "")
            for name, reading in self._readings.items():  # each from the initial worker, as the first
                payload.update(self._personalized_accuracy(reading, self.context(cid, rnd, state), msg, "/" + name))
            return Reply(payload=payload)
        if kind == COUNTS:
            return Reply(payload={"counts": ctx.data.class_counts().double()})
        if kind == EVALUATE_COUNTS:
            return self._evaluate_counts(cid, msg)
        raise ValueError(f"unknown exchange kind '{kind}'")

    def _personalized_accuracy(self, client: Any, ctx: ClientContext, msg: Message, suffix: str) -> dict[str, Any]:
        """``client``'s personalized model's accuracy on this client's local test set and, where
        there is one, its local validation set, as ``EVALUATE``'s summable entries."""
        client.personalize(ctx, msg)
        check_client_state(client, "personalize", ctx.state)
        data, batch_size = self.eval_data, self.cfg.eval.batch_size
        shared = head_of_features(self.worker) and keeps_sent_encoder(self.worker, msg)
        out: dict[str, Any] = {}
        for key, dataset, rows, features, worth in (
                ("pm", data.test, data.local_test, self._test_features, self._share_test_features),
                ("val_pm", data.val, data.local_val, self._val_features, self._share_val_features)):
            if dataset is None or rows is None:
                continue
            on = features.of(self.worker, dataset, batch_size) if worth and shared else None
            idx = torch.as_tensor(rows[ctx.cid], dtype=torch.int64, device=dataset.labels.device)
            correct, losses = predict(self.worker, dataset, batch_size, indices=idx, features=on)
            out[f"{key}_sum{suffix}"] = local_accuracy(correct) or 0.0
            out[f"{key}_n{suffix}"] = int(correct.numel() > 0)
            if key == "pm":
                out[f"pm_nonfinite{suffix}"] = int(not bool(torch.isfinite(losses).all()))
        return out

    def forget_test_features(self) -> None:
        """Free the evaluation sets' features kept for an evaluation phase (it has ended)."""
        self._test_features.clear()
        self._val_features.clear()

    def _local_test(self, cid: int) -> torch.Tensor:
        test = self.eval_data.test
        return torch.as_tensor(self.eval_data.local_test[cid], dtype=torch.int64, device=test.labels.device)

    def _evaluate_counts(self, cid: int, msg: Message) -> Reply:
        """Federated evaluation: every model of the message on this client's test split, as sums."""
        test, idx = self.eval_data.test, self._local_test(cid)
        payload: dict[str, Any] = {}
        for i, (name, data) in enumerate(msg.payload["models"].items()):
            correct, losses = predict(decode_model(data, self.worker), test, self.cfg.eval.batch_size, indices=idx)
            hits, totals, loss = per_class_counts(correct, losses, test.labels[idx], test.num_classes)
            payload.update({f"hits/{name}": hits, f"loss/{name}": loss, "totals": totals})
            if i == 0:
                payload.update(pm_sum=local_accuracy(correct) or 0.0, pm_n=int(correct.numel() > 0))
        return Reply(payload=payload)


def check_client_hook(client: Any, hook: str, reply: Any, state: dict[str, Any], samples: int) -> None:
    """A client hook's reply and state as the engine needs them, refused in one line naming the hook of the
    method's own client (inside a calibration's wrapper): a wrong type fails deep in the engine, weights
    worth 0 samples are silently left out of the average, and state a checkpoint cannot keep fails only at
    the first checkpoint, rounds later."""
    where = f"{type(getattr(client, 'inner', client)).__name__}.{hook}"
    check_reply(reply, where)
    if (odd := next((k for k, v in reply.weights.items() if not isinstance(v, torch.Tensor)), None)) is not None:
        raise PluginError(f"{where} replied with weight {odd!r} as a {type(reply.weights[odd]).__name__}; reply "
                          "tensors, e.g. clone_state(ctx.model)")
    if hook == "fit" and reply.weights and reply.num_samples <= 0 < samples:
        raise PluginError(f"{where} replied with weights worth num_samples={reply.num_samples} from a client holding "
                          f"{samples} samples; the average ignores such replies: set Reply(num_samples=...)")
    check_client_state(client, hook, state)


def check_client_state(client: Any, hook: str, state: dict[str, Any]) -> None:
    """``ctx.state`` after a client hook, refused in one line if a checkpoint or a Flower node cannot keep it."""
    where = f"{type(getattr(client, 'inner', client)).__name__}.{hook}"
    if (bad := unsafe_entry(state, "ctx.state", portable=True)) is not None:
        raise PluginError(f"{where} left {bad} in ctx.state, which a checkpoint or a Flower node cannot keep: keep "
                          "tensors, numbers, strings, and lists, tuples or dicts of them (string or int keys), "
                          "e.g. torch.as_tensor(...)")
