"""The in-memory dataset every loader returns.

Images stay uint8 (N, C, H, W) so a whole dataset fits on the training device; batches are
sliced by index and normalised there (see :func:`ImageDataset.normalize`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

#: bytes of images read at a time to hash a dataset, so its copy never doubles the memory it takes
DIGEST_CHUNK = 64 << 20


@dataclass
class ImageDataset:
    """One split of an image classification dataset, held as tensors.

    Attributes
    ----------
    images : uint8 tensor (N, C, H, W)
    labels : int64 tensor (N,), values in ``[0, len(classes))``
    classes : class names, index = label
    mean, std : per-channel normalisation statistics on the [0, 1] scale
    """

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise ValueError(f"images must be uint8 (N, C, H, W), got {self.images.dtype} {tuple(self.images.shape)}")
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise ValueError("labels must be int64 with one entry per image")
        if len(self.mean) != self.images.shape[1] or len(self.std) != self.images.shape[1]:
            raise ValueError("mean/std need one value per channel")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def in_channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.images.shape[-1])

    def class_counts(self) -> torch.Tensor:
        """Number of samples per class (int64, length ``num_classes``)."""
        return torch.bincount(self.labels, minlength=self.num_classes)

    def digest(self) -> str:
        """A short hash (32 hex digits) of the images and labels, in their order: a site's data told
        from other data without any of it leaving the site."""
        h = hashlib.blake2b(repr(tuple(self.images.shape)).encode(), digest_size=16)
        rows = max(1, DIGEST_CHUNK // max(1, math.prod(self.images.shape[1:])))
        for start in range(0, len(self), rows):
            h.update(self.images[start:start + rows].cpu().numpy().tobytes())
        h.update(self.labels.cpu().numpy().tobytes())
        return h.hexdigest()

    def subset(self, indices: torch.Tensor) -> "ImageDataset":
        """A new dataset holding ``indices`` (copies the selected rows)."""
        return ImageDataset(self.images[indices], self.labels[indices], list(self.classes), self.mean, self.std)

    def to(self, device: torch.device | str) -> "ImageDataset":
        return ImageDataset(self.images.to(device), self.labels.to(device), self.classes, self.mean, self.std)

    def normalize(self, images_uint8: torch.Tensor) -> torch.Tensor:
        """uint8 batch -> float32 batch, scaled to [0, 1] then standardised per channel."""
        return self.standardize(images_uint8.float().div_(255.0))

    def standardize(self, images01: torch.Tensor) -> torch.Tensor:
        """float batch in [0, 1] (e.g. after augmentation) -> standardised per channel."""
        mean, std = self._statistics(images01.device)
        return (images01 - mean) / std

    def _statistics(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``mean`` and ``std`` as (1, C, 1, 1) tensors on ``device``, made once per device: a
        fresh copy from host memory in every batch would make a GPU wait for the host."""
        cache = self.__dict__.setdefault("_on_device", {})
        if device not in cache:
            cache[device] = tuple(torch.tensor(v, device=device).view(1, -1, 1, 1) for v in (self.mean, self.std))
        return cache[device]


@dataclass
class DatasetPair:
    """The train and test splits of a dataset, as a loader returns them, and its own validation
    split where one was asked for and the dataset has one."""

    train: ImageDataset
    test: ImageDataset
    val: ImageDataset | None = None

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    def named(self, classes: list[str]) -> "DatasetPair":
        """The same splits with the classes called ``classes`` (one name per label)."""
        splits = (self.train, self.test, self.val)
        return DatasetPair(*(None if d is None else ImageDataset(d.images, d.labels, list(classes), d.mean, d.std)
                             for d in splits))
