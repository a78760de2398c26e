"""FedETF (Li et al., ICCV 2023, "No fear of classifier biases"): train through a synthetic, fixed
simplex-ETF classifier, then adapt it locally.

Model: body -> projection layer (linear) -> L2 normalisation -> fixed ETF (unit class vectors,
built once by the server from its seed and broadcast as buffers) -> logits scaled by a learnable
temperature. Local training minimises the balanced softmax with the client's class counts; body,
projection and temperature are aggregated. Personalized model k: the global model trained on the
client's data as in a round (``adapt_local_epochs``, the whole model, balanced softmax), then
adapted by alternately fine-tuning the ETF classifier and the projection layer with
cross-entropy (``adapt_iterations`` times, ``adapt_epochs`` each) on the frozen body's features.

Defaults follow the authors' released code (its personalization first runs a round's local
training on every client, then 20 alternations of 3 epochs, ETF lr 0.1, projection lr 0.05 with
the configured momentum and weight decay; temperature initialised at 1, as for its ResNets: its
CNN starts at 10); the projection keeps the feature width. Where the code adapts on augmented
batches in train mode, the alternations here run on features computed once, in eval mode,
without augmentation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedlt.calibration.wrapper import client_features
from fedlt.config import Config
from fedlt.losses import make_loss
from fedlt.messages import Message
from fedlt.methods.base import ClientContext, LocalObjective, MethodArgs, ModelHead, Server, ServerContext
from fedlt.methods.personal import at_evaluation_lr, train_on_features
from fedlt.models import FedModel, create_model
from fedlt.models.etf import check_etf_width, simplex_etf
from fedlt.training.sequential import ObjectiveClient, train_local

ETF_PURPOSE = 73


class FedETFArgs(MethodArgs):
    personal_knobs = ("adapt_local_epochs", "adapt_iterations", "adapt_epochs", "adapt_etf_lr", "adapt_projection_lr")
    temperature_init: float = Field(1.0, gt=0, description="initial value of the learnable logit temperature")
    adapt_local_epochs: int | None = Field(
        None, ge=0, description="personalization: epochs of FedETF's own local training (balanced softmax, the whole "
        "model, at fl.lr without its schedule) before the alternations, as the released code; null = fl.local_epochs")
    adapt_iterations: int = Field(20, ge=0, description="personalization: alternations of ETF / projection fine-tuning")
    adapt_epochs: int = Field(3, ge=1, description="personalization: epochs of each fine-tuning phase")
    adapt_etf_lr: float = Field(0.1, gt=0, description="personalization: SGD lr of the ETF classifier (no momentum)")
    adapt_projection_lr: float = Field(0.05, gt=0, description="personalization: SGD lr of the projection layer")


class ETFHead(nn.Module):
    """Projection, normalisation, fixed ETF (buffer ``etf``, (C, d)), learnable temperature."""

    def __init__(self, feature_dim: int, num_classes: int) -> None:
        super().__init__()
        self.projection = nn.Linear(feature_dim, feature_dim)
        self.register_buffer("etf", torch.zeros(num_classes, feature_dim))
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, features: torch.Tensor, etf: torch.Tensor | None = None) -> torch.Tensor:
        z = F.normalize(self.projection(features), dim=1)
        return self.temperature * z @ (self.etf if etf is None else etf).T


#: the ETF's class vectors are fixed at unit norm, never learned: nothing for tau-norm to rescale
FEDETF_HEAD = ModelHead("a fixed simplex-ETF head (its class vectors are not learned)")


def fedetf_model(cfg: Config, num_classes: int, in_channels: int, image_size: int) -> FedModel:
    model = create_model(cfg.model.name, num_classes, in_channels=in_channels, image_size=image_size)
    check_etf_width(model.feature_dim, num_classes, cfg.model.name)
    model.replace_head(ETFHead(model.feature_dim, num_classes))
    return model


class FedETFServer(Server):
    def __init__(self, ctx: ServerContext):
        super().__init__(ctx)
        etf = simplex_etf(self.model.feature_dim, ctx.num_classes, ctx.generator(0, ETF_PURPOSE))
        with torch.no_grad():
            self.model.head.etf.copy_(etf.to(ctx.device))
            self.model.head.temperature.fill_(self.args.temperature_init)


def without_etf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k != "head.etf"}


def _balanced_loss(ctx: ClientContext):
    return make_loss("bsm", prior=ctx.data.host_prior(), device=ctx.data.labels.device)


class FedETFClient(ObjectiveClient):
    personalized = True

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective:
        """Balanced softmax of the logits; the reply leaves out the ETF, which is the server's and fixed."""
        return LocalObjective(_balanced_loss(ctx), finish=lambda state, extra: without_etf(state))

    def personalize(self, ctx: ClientContext, msg: Message) -> None:
        model = ctx.model
        model.load_state_dict(msg.weights, strict=False)
        a = self.args
        epochs = ctx.train.epochs if a.adapt_local_epochs is None else a.adapt_local_epochs
        if epochs:
            loss = _balanced_loss(ctx)
            train_local(at_evaluation_lr(ctx), lambda x, y: loss(model(x), y), epochs=epochs)
        head: ETFHead = model.head
        etf = nn.Parameter(head.etf.clone())
        features = client_features(model, ctx)
        for i in range(a.adapt_iterations):
            train_on_features(ctx, [etf], lambda h: head(h, etf), a.adapt_epochs, features=features,
                              lr=a.adapt_etf_lr, momentum=0.0, weight_decay=0.0, purpose=100 + 2 * i)
            train_on_features(ctx, list(head.projection.parameters()), lambda h: head(h, etf.detach()),
                              a.adapt_epochs, features=features, lr=a.adapt_projection_lr, purpose=101 + 2 * i)
        with torch.no_grad():
            head.etf.copy_(etf)
