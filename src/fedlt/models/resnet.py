"""ResNets in the variants the Fed-LT literature reports results for.

* ``resnet8``: the three-block network of CReFF and FedYoYo (256-d feature).
* ``resnet18`` / ``resnet34``: CIFAR-style (3x3 stem, no max-pool), 512-d feature.
* ``resnet32``: the 16/32/64-channel network of LDAM and most long-tail papers, 64-d feature.
* ``resnet50``: bottleneck network, 2048-d feature; ImageNet stem for images of 64 px or more.

Every encoder ends in adaptive average pooling and its stem is built for the data's channels, so
any channel count and image size work down to what the registry declares: 8 px, 9 px for the
four-stage networks (a 1x1 last map cannot train a one-sample batch's BatchNorm). Downsampling shortcuts are 1x1 conv + BN. Builders all take ``image_size``
so the registry can call them alike; only ``resnet50`` uses it.
"""

from __future__ import annotations

import torch
from torch import nn

from fedlt.models.base import FedModel

IMAGENET_STEM_MIN_SIZE = 64


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _shortcut(in_planes, planes, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride), 1x1 expand by 4, with a residual connection."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_planes = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.shortcut = _shortcut(in_planes, out_planes, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


def _shortcut(in_planes: int, out_planes: int, stride: int) -> nn.Module:
    """Identity when shapes match, else a 1x1 conv + BN projection."""
    if stride == 1 and in_planes == out_planes:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False),
        nn.BatchNorm2d(out_planes),
    )


def _stem(in_channels: int, width: int, imagenet: bool) -> nn.Sequential:
    """3x3 stride-1 conv for small images; 7x7 stride-2 conv + max-pool for large ones."""
    if imagenet:
        return nn.Sequential(
            nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
    )


class ResNetEncoder(nn.Module):
    """Stem, residual stages (the first at stride 1, the rest at stride 2), global average pool.

    Stages are registered as ``layer1``, ``layer2``, ... so ``state_dict`` keys read like the
    usual ResNet ones, e.g. ``encoder.layer2.0.conv1.weight``.
    """

    def __init__(
        self,
        block: type[BasicBlock | Bottleneck],
        depths: list[int],
        widths: list[int],
        in_channels: int,
        imagenet_stem: bool = False,
    ) -> None:
        super().__init__()
        self.stem = _stem(in_channels, widths[0], imagenet_stem)
        in_planes = widths[0]
        self.stage_names: list[str] = []
        for index, (depth, planes) in enumerate(zip(depths, widths)):
            blocks = []
            for block_index in range(depth):
                stride = 2 if index > 0 and block_index == 0 else 1
                blocks.append(block(in_planes, planes, stride))
                in_planes = planes * block.expansion
            name = f"layer{index + 1}"
            self.add_module(name, nn.Sequential(*blocks))
            self.stage_names.append(name)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = in_planes
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for name in self.stage_names:
            x = getattr(self, name)(x)
        return torch.flatten(self.pool(x), 1)


def _init_weights(module: nn.Module) -> None:
    """Kaiming-normal convs (fan-out, ReLU gain); BN starts as the identity."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def _build(encoder: ResNetEncoder, num_classes: int) -> FedModel:
    return FedModel(encoder, encoder.feature_dim, num_classes)


def resnet8(num_classes: int, in_channels: int = 3, image_size: int = 32) -> FedModel:
    """CReFF/FedYoYo ResNet-8: one BasicBlock per 64/128/256 stage, 256-d feature."""
    return _build(ResNetEncoder(BasicBlock, [1, 1, 1], [64, 128, 256], in_channels), num_classes)


def resnet18(num_classes: int, in_channels: int = 3, image_size: int = 32) -> FedModel:
    """CIFAR-style ResNet-18, 512-d feature."""
    return _build(ResNetEncoder(BasicBlock, [2, 2, 2, 2], [64, 128, 256, 512], in_channels), num_classes)


def resnet32(num_classes: int, in_channels: int = 3, image_size: int = 32) -> FedModel:
    """LDAM-style ResNet-32: five BasicBlocks per 16/32/64 stage, 64-d feature."""
    return _build(ResNetEncoder(BasicBlock, [5, 5, 5], [16, 32, 64], in_channels), num_classes)


def resnet34(num_classes: int, in_channels: int = 3, image_size: int = 32) -> FedModel:
    """CIFAR-style ResNet-34, 512-d feature."""
    return _build(ResNetEncoder(BasicBlock, [3, 4, 6, 3], [64, 128, 256, 512], in_channels), num_classes)


def resnet50(num_classes: int, in_channels: int = 3, image_size: int = 32) -> FedModel:
    """Bottleneck ResNet-50, 2048-d feature; ImageNet stem when ``image_size >= 64``."""
    encoder = ResNetEncoder(
        Bottleneck,
        [3, 4, 6, 3],
        [64, 128, 256, 512],
        in_channels,
        imagenet_stem=image_size >= IMAGENET_STEM_MIN_SIZE,
    )
    return _build(encoder, num_classes)
