"""FedBABU (Oh et al., ICLR 2022): federate only the body under a frozen random head, then
personalize by fine-tuning.

The head keeps its random initialisation for the whole training (every client trains the body
through the same fixed head, so no client can bias it); clients upload only the body. The global
model is the body with that head. Personalized model k is the global model fine-tuned on the
client's data — body and head, with the run's SGD settings at ``fl.lr`` without its schedule (a
decayed lr at the last evaluation would fine-tune nothing) — for ``finetune_epochs`` at every
evaluation; the fine-tuned weights are not kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedlt.messages import Message, Reply
from fedlt.methods.base import Client, ClientContext, LocalObjective, MethodArgs, ModelHead, clone_state
from fedlt.methods.personal import at_evaluation_lr, keys_with_prefix
from fedlt.training.sequential import train_local


#: the random head's norms were never trained, so they carry no class prior to re-balance
FEDBABU_HEAD = ModelHead("a frozen random head (never trained)")


class FedBABUArgs(MethodArgs):
    personal_knobs = ("finetune_epochs",)
    finetune_epochs: int = Field(5, ge=0, description="local fine-tuning epochs of the whole model for the "
                                                      "personalized models (the paper's tau_f)")


def train_body_only(model: nn.Module) -> None:
    """Only the body trains; the head stays as it was initialised."""
    model.requires_grad_(False)
    model.encoder.requires_grad_(True)


def body(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return keys_with_prefix(state, ["encoder."])


class FedBABUClient(Client):
    personalized = True
    objective_backends = ("graphed",)
    backend_refusal_why = "only its body trains, under a frozen head"

    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        model = ctx.model
        model.load_state_dict(msg.weights, strict=False)
        metrics = train_local(ctx, lambda x, y: F.cross_entropy(model(x), y), params=model.encoder.parameters())
        return Reply(weights=body(clone_state(model)), num_samples=len(ctx.data), metrics=metrics)

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective:
        """Cross-entropy through the frozen head, the body trained, the body uploaded."""
        return LocalObjective(F.cross_entropy, prepare=train_body_only, finish=lambda state, extra: body(state))

    def personalize(self, ctx: ClientContext, msg: Message) -> None:
        model = ctx.model
        model.load_state_dict(msg.weights, strict=False)
        if self.args.finetune_epochs:
            train_local(at_evaluation_lr(ctx), lambda x, y: F.cross_entropy(model(x), y), epochs=self.args.finetune_epochs)
