"""A tiny, learnable, always-identical dataset for tests and smoke runs (no files needed).

Every class has a smooth random colour template; an image is its class template plus
independent Gaussian pixel noise. The noise is strong enough that a model has to train
(an untrained one is at chance) and that accuracy stays short of 100% (so long-tail effects
remain visible), yet weak enough that a small CNN passes 90% balanced test accuracy within
a few epochs. Everything comes from one generator seeded with 0.

The CIFAR-shaped stand-ins (:data:`STAND_INS`) are the same construction at CIFAR-10's and
CIFAR-100's class counts and split sizes, 32 px: a timing run on them (``fedlt bench
paper-rounds``) meets the protocol's long tail, client sizes and classifier width without the
dataset's files.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedlt.data.dataset import DatasetPair, ImageDataset
from fedlt.data.sources.common import check_memory

DEFAULT_IMAGE_SIZE = 16
NUM_CLASSES = 10
TRAIN_PER_CLASS = 300
TEST_PER_CLASS = 100
CLASSES = [f"class{k}" for k in range(NUM_CLASSES)]
#: dataset name -> (classes, training images per class, test images per class): CIFAR-10 and CIFAR-100
STAND_INS = {"synthetic_cifar10": (10, 5000, 1000), "synthetic_cifar100": (100, 500, 100)}
STAND_IN_IMAGE_SIZE = 32

_SEED = 0
_TEMPLATE_GRID = 4  # templates are random at 4x4 and upsampled: smooth blobs, not pixel noise
_TEMPLATE_AMPLITUDE = 40.0  # template pixels span 128 +- this
_NOISE_STD = 90.0  # above the template contrast: single pixels say little, whole images a lot


def make_synthetic(image_size: int = DEFAULT_IMAGE_SIZE, classes: int = NUM_CLASSES,
                   train_per_class: int = TRAIN_PER_CLASS, test_per_class: int = TEST_PER_CLASS) -> DatasetPair:
    """The synthetic dataset: ``classes`` classes of 3 x ``image_size`` x ``image_size`` images, 300/100
    per class by default."""
    # the uint8 images and float32 copies while they are made (noise, statistics): 5 bytes a value, about
    check_memory("synthetic", classes * (train_per_class + test_per_class), (3, image_size, image_size), 5)
    generator = torch.Generator().manual_seed(_SEED)
    names = [f"class{k}" for k in range(classes)]
    coarse = torch.rand(classes, 3, _TEMPLATE_GRID, _TEMPLATE_GRID, generator=generator)
    smooth = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)
    templates = 128.0 + _TEMPLATE_AMPLITUDE * (2.0 * smooth - 1.0)

    def split(per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.arange(classes).repeat_interleave(per_class)
        noise = _NOISE_STD * torch.randn(labels.shape[0], 3, image_size, image_size, generator=generator)
        # the labels run class by class, so each class's template is added to its block in place
        noise.view(classes, per_class, 3, image_size, image_size).add_(templates[:, None])
        return noise.round_().clamp_(0, 255).to(torch.uint8), labels

    train_images, train_labels = split(train_per_class)
    test_images, test_labels = split(test_per_class)
    scaled = train_images.float().div_(255.0)
    mean = tuple(scaled.mean(dim=(0, 2, 3)).tolist())
    std = tuple(scaled.std(dim=(0, 2, 3)).tolist())
    return DatasetPair(
        ImageDataset(train_images, train_labels, list(names), mean, std),
        ImageDataset(test_images, test_labels, names, mean, std),
    )
