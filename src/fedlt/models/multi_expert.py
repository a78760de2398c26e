"""GBME's multi-expert network: a shared backbone, then M experts with their own blocks and heads.

The output is the mean of the experts' logits (GBME Eq. 7). It is a :class:`FedModel`, so the
engine, evaluation and the calibrations treat it like any model: ``encoder`` is the shared
backbone plus every expert's blocks and returns the experts' features side by side
(``M * expert_dim``); ``head`` splits them back and averages the experts' logits.
``expert_logits`` gives chosen experts' own logits, for a loss on each expert (the released code's).

Split per base model (``state_dict`` keys ``encoder.shared.*``, ``encoder.experts.<i>.*``,
``head.heads.<i>.*``):

* ResNets (``resnet8/18/32/34``, BasicBlock): the stem and stage 1 are shared; each expert owns
  stages 2..n at ``width`` (0.75) of the base width — for ResNet-32 that is GBME's released
  network (stages of 24 and 48 channels, 48-d expert feature).
* ``cnn``: the first conv block (conv 32, ReLU, pool) is shared; each expert owns the second
  conv block and the FC feature layer at ``width`` of the base (conv 48, FC 96) — the same
  "early layers shared, late layers per expert" split at the CNN's scale.

Every expert ends in a cosine head (``CosineLinear``, ``scale * cos(w_c, h)``, scale 30), the
"normed" head of the paper's code, or a plain linear head (``head="linear"``). A cosine head's
gradient into the backbone is ``scale / ||h||`` times a unit-scale term, 20x a linear head's on
the CNN at initialisation, so GBME warms the learning rate up over the first round
(:mod:`fedlt.methods.gbme`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedlt.errors import ConfigError
from fedlt.models.base import FedModel
from fedlt.models.resnet import BasicBlock, _init_weights, _stem

#: per ResNet name: blocks per stage and base widths (BasicBlock networks only)
RESNET_LAYOUTS: dict[str, tuple[list[int], list[int]]] = {
    "resnet8": ([1, 1, 1], [64, 128, 256]),
    "resnet18": ([2, 2, 2, 2], [64, 128, 256, 512]),
    "resnet32": ([5, 5, 5], [16, 32, 64]),
    "resnet34": ([3, 4, 6, 3], [64, 128, 256, 512]),
}
SUPPORTED = ("cnn", *RESNET_LAYOUTS)


class CosineLinear(nn.Module):
    """``scale * cos(w_c, h)`` per class; rows start at unit norm (LDAM's "normed linear")."""

    def __init__(self, in_features: int, num_classes: int, scale: float = 30.0) -> None:
        super().__init__()
        weight = torch.empty(num_classes, in_features).uniform_(-1, 1)
        self.weight = nn.Parameter(F.normalize(weight, dim=1))
        self.scale = scale

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.scale * F.linear(F.normalize(h, dim=1), F.normalize(self.weight, dim=1))


class MultiExpertEncoder(nn.Module):
    """Shared backbone, then every expert's own blocks; features concatenated expert by expert."""

    def __init__(self, shared: nn.Module, experts: list[nn.Module]) -> None:
        super().__init__()
        self.shared = shared
        self.experts = nn.ModuleList(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.shared(x)
        return torch.cat([expert(z) for expert in self.experts], dim=1)


class MultiExpertHead(nn.Module):
    """One head per expert on its slice of the features; the output is the mean of their logits."""

    def __init__(self, heads: list[nn.Module], expert_dim: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList(heads)
        self.expert_dim = expert_dim

    def expert_logits(self, features: torch.Tensor) -> list[torch.Tensor]:
        chunks = features.split(self.expert_dim, dim=1)
        return [head(chunk) for head, chunk in zip(self.heads, chunks)]

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.expert_logits(features)).mean(0)


class MultiExpertModel(FedModel):
    """A :class:`FedModel` whose experts can be frozen individually for local training.

    ``set_trainable_experts`` switches ``requires_grad`` off for the other experts' parameters and
    keeps their BatchNorm layers in eval mode even under ``model.train()``: a frozen expert then
    computes exactly the function the server sent (its running statistics are not updated either).
    """

    def __init__(self, encoder: MultiExpertEncoder, head: MultiExpertHead, num_classes: int) -> None:
        super().__init__(encoder, head.expert_dim * len(head.heads), num_classes, head=head)
        self.num_experts = len(head.heads)
        self.expert_dim = head.expert_dim
        self._frozen: set[int] = set()

    def expert_modules(self, index: int) -> list[nn.Module]:
        return [self.encoder.experts[index], self.head.heads[index]]

    def expert_keys(self, index: int) -> list[str]:
        """``state_dict`` keys of expert ``index`` (parameters and buffers)."""
        return [f"encoder.experts.{index}.{k}" for k in self.encoder.experts[index].state_dict()] + [
            f"head.heads.{index}.{k}" for k in self.head.heads[index].state_dict()
        ]

    def expert_logits(self, x: torch.Tensor, experts: list[int]) -> list[torch.Tensor]:
        """Each of ``experts``' own logits on images ``x`` (the shared backbone, then its blocks and
        head); the other experts are not run, so they add nothing to the graph of a loss on these."""
        z = self.encoder.shared(x)
        return [self.head.heads[e](self.encoder.experts[e](z)) for e in experts]

    def shared_keys(self) -> list[str]:
        return [f"encoder.shared.{k}" for k in self.encoder.shared.state_dict()]

    def set_trainable_experts(self, experts: list[int] | None) -> None:
        """Train only ``experts`` (all when None) besides the shared backbone."""
        active = set(range(self.num_experts)) if experts is None else set(experts)
        self._frozen = set(range(self.num_experts)) - active
        for index in range(self.num_experts):
            for module in self.expert_modules(index):
                module.requires_grad_(index in active)
        self.train(self.training)

    def train(self, mode: bool = True) -> "MultiExpertModel":
        super().train(mode)
        for index in self._frozen:
            for module in self.expert_modules(index):
                module.eval()
        return self


def _cnn_parts(in_channels: int, num_experts: int, width: float) -> tuple[nn.Module, list[nn.Module], int]:
    conv, feat = max(1, round(64 * width)), max(1, round(128 * width))
    shared = nn.Sequential(nn.Conv2d(in_channels, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))
    experts = [
        nn.Sequential(
            nn.Conv2d(32, conv, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(conv * 16, feat), nn.ReLU(inplace=True),
        )
        for _ in range(num_experts)
    ]
    return shared, experts, feat


def _resnet_parts(name: str, in_channels: int, num_experts: int, width: float) -> tuple[nn.Module, list[nn.Module], int]:
    depths, widths = RESNET_LAYOUTS[name]

    def stage(in_planes: int, planes: int, depth: int, stride: int) -> nn.Sequential:
        return nn.Sequential(*(BasicBlock(in_planes if i == 0 else planes, planes, stride if i == 0 else 1)
                               for i in range(depth)))

    shared = nn.Sequential(_stem(in_channels, widths[0], False), stage(widths[0], widths[0], depths[0], 1))
    experts = []
    for _ in range(num_experts):
        layers, in_planes = [], widths[0]
        for depth, planes in zip(depths[1:], widths[1:]):
            planes = max(1, round(planes * width))
            layers.append(stage(in_planes, planes, depth, 2))
            in_planes = planes
        experts.append(nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten()))
    return shared, experts, in_planes


def multi_expert_model(name: str, num_classes: int, in_channels: int, num_experts: int = 3,
                       width: float = 0.75, cosine_scale: float = 30.0, head: str = "cosine") -> MultiExpertModel:
    """The multi-expert version of base model ``name`` (see the module docstring for the split);
    ``head``: ``cosine`` (scaled by ``cosine_scale``) or ``linear``."""
    if name not in SUPPORTED:
        raise ConfigError(f"GBME's multi-expert network has no version of model {name!r}; "
                          f"use model.name=<one of {', '.join(SUPPORTED)}> or method_args.ensemble=false")
    if name == "cnn":
        shared, experts, dim = _cnn_parts(in_channels, num_experts, width)
    else:
        shared, experts, dim = _resnet_parts(name, in_channels, num_experts, width)
    if name != "cnn":  # the base ResNets' initialisation (the CNN keeps torch's defaults, as its base)
        for module in (shared, *experts):
            _init_weights(module)
    if head not in ("cosine", "linear"):
        raise ConfigError(f"unknown expert head {head!r}; use cosine or linear")
    heads = [CosineLinear(dim, num_classes, cosine_scale) if head == "cosine" else nn.Linear(dim, num_classes)
             for _ in range(num_experts)]
    return MultiExpertModel(MultiExpertEncoder(shared, experts), MultiExpertHead(heads, dim), num_classes)
