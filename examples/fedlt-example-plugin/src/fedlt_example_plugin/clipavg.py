"""ClipAvg: FedAvg whose server clips every client's update to an L2 norm before averaging.

A client whose data pull the model far (one holding many samples of a few head classes, or a
faulty one) then moves the global model by at most ``method_args.max_norm`` per round. The
clipped parameter updates are averaged by sample count and applied with ``method_args.server_lr``;
BatchNorm statistics are averaged as in FedAvg. Clients are FedAvg's, so every ``loss.*`` works.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedlt.messages import Reply
from fedlt.methods.aggregation import weighted_average
from fedlt.methods.base import MethodArgs, MethodSpec
from fedlt.methods.fedavg import FedAvgClient, FedAvgServer


class ClipAvgArgs(MethodArgs):
    max_norm: float = Field(5.0, gt=0, description="largest L2 norm of one client's parameter update")
    server_lr: float = Field(1.0, gt=0, description="server step on the averaged clipped update")


class ClipAvgServer(FedAvgServer):
    """Reads each reply to clip it, so ``fit`` is not a secure phase (``secagg.enabled`` is refused);
    FedAvg's ``class_counts`` query stays a plain sum."""

    clipped_fraction: float | None = None

    def aggregate(self, rnd: int, replies: dict[int, Reply]) -> None:
        averaged = weighted_average(replies)  # BatchNorm statistics and anything else: as FedAvg
        params = {k: p.detach() for k, p in self.model.named_parameters()}
        deltas, clipped = {}, 0
        for cid, reply in replies.items():
            delta = {k: v.to(params[k].device) - params[k] for k, v in reply.weights.items() if k in params}
            norm = float(torch.sqrt(sum(d.double().pow(2).sum() for d in delta.values()))) if delta else 0.0
            scale = min(1.0, self.args.max_norm / norm) if norm > 0 else 1.0
            clipped += scale < 1.0
            deltas[cid] = Reply(weights={k: d * scale for k, d in delta.items()}, num_samples=reply.num_samples)
        for name, step in weighted_average(deltas).items():
            averaged[name] = params[name] + self.args.server_lr * step
        self.model.load_state_dict(averaged, strict=False)
        self.clipped_fraction = clipped / max(1, len(replies))

    def metrics(self) -> dict[str, float]:
        return {} if self.clipped_fraction is None else {"clipped_fraction": self.clipped_fraction}


SPEC = MethodSpec("clipavg", "ClipAvg: FedAvg with each client's update clipped to method_args.max_norm (default 5) "
                  "on the server", ClipAvgServer, FedAvgClient, ClipAvgArgs)
