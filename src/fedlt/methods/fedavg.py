"""FedAvg (McMahan et al. 2017) with a choice of local loss for long-tailed data.

``loss.name`` picks CE, logit adjustment, balanced softmax, focal or LDAM; ``loss.prior`` picks
the class distribution behind the re-balancing losses: the client's own label counts
(``local``), the federation's counts that the server sums from a one-off ``class_counts`` query
(``global``; reveals each client's label histogram to the server), or ``uniform``.
"""

from __future__ import annotations

import numpy as np
import torch

from fedlt.losses import PRIOR_LOSSES, make_loss
from fedlt.messages import Message, Query, Reply
from fedlt.methods.base import Client, ClientContext, LocalObjective, Server, Stage, broadcast_state, clone_state
from fedlt.training.sequential import BatchLoss, train_local
from fedlt.transfer import to_host



class FedAvgServer(Server):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.global_counts: torch.Tensor | None = None

    @classmethod
    def secure_phases(cls, config):
        return {**super().secure_phases(config), "query:class_counts": "sum"}

    def _needs_global_counts(self) -> bool:
        loss = self.ctx.config.loss
        return loss.name in PRIOR_LOSSES and loss.prior == "global"

    def next_query(self, stage: Stage, rnd: int, clients: list[int]) -> Query | None:
        if stage == "setup" and self._needs_global_counts() and self.global_counts is None:
            return Query("class_counts", {cid: Message() for cid in clients})
        return None

    def receive(self, query: Query, replies: dict[int, Reply]) -> None:
        if query.name != "class_counts":
            return super().receive(query, replies)
        self.global_counts = sum(r.payload["class_counts"] for r in replies.values())

    def fit_message(self, rnd: int, cid: int) -> Message:
        msg = Message(weights=broadcast_state(self.model))
        if self.global_counts is not None:
            msg.payload["class_counts"] = self.global_counts
        return msg

    def state_dict(self):
        return {**super().state_dict(), "global_counts": self.global_counts}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.global_counts = state["global_counts"]


def local_loss(ctx: ClientContext, msg: Message):
    """The configured classification loss, with its prior resolved for this client."""
    cfg = ctx.loss_config
    # on the host: the loss's terms are made there and copied to the device without a wait
    counts = ctx.data.host_counts().astype(np.float64)
    if cfg.prior == "global":
        if "class_counts" not in msg.payload:
            raise RuntimeError("loss.prior=global but the server sent no class counts (setup stage not run)")
        counts = to_host(msg.payload["class_counts"]).astype(np.float64)
    elif cfg.prior == "uniform":
        counts = np.ones_like(counts)
    if counts.sum() <= 0:  # a client the partition left without samples trains on nothing: any prior will do
        counts = np.ones_like(counts)
    return make_loss(
        cfg.name, prior=(counts / counts.sum()).astype(np.float32), class_counts=counts, device=ctx.data.labels.device,
        tau=cfg.tau, focal_gamma=cfg.focal_gamma, ldam_max_margin=cfg.ldam_max_margin, ldam_scale=cfg.ldam_scale,
    )


class FedAvgClient(Client):
    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        ctx.model.load_state_dict(msg.weights, strict=False)
        metrics = train_local(ctx, self.batch_loss(ctx, msg))
        return Reply(weights=clone_state(ctx.model), num_samples=len(ctx.data), metrics=metrics)

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective:
        return LocalObjective(local_loss(ctx, msg))

    def batch_loss(self, ctx: ClientContext, msg: Message) -> BatchLoss:
        """The local objective of one batch: the configured loss plus :meth:`regularizer`.

        Subclasses replace it when the objective needs more than the logits (FedDecorr: the
        features) or fixes its own loss (FedLC).
        """
        loss = local_loss(ctx, msg)
        return lambda x, y: loss(ctx.model(x), y) + self.regularizer(ctx, msg)

    def regularizer(self, ctx: ClientContext, msg: Message) -> torch.Tensor | float:
        """Extra local objective term (FedProx's proximal term ...); none for FedAvg."""
        return 0.0

    def query(self, name: str, ctx: ClientContext, msg: Message) -> Reply:
        if name == "class_counts":
            return Reply(payload={"class_counts": ctx.data.class_counts().cpu()}, num_samples=len(ctx.data))
        return super().query(name, ctx, msg)
