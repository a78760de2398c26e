"""From a config to the federation's data: source -> long tail -> partition -> local test sets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedlt.config import DataConfig
from fedlt.data.dataset import ImageDataset
from fedlt.data.local_test import local_test_indices
from fedlt.data.longtail import longtail_indices, resolve_class_order
from fedlt.data.partition import Partition, dirichlet_partition, iid_partition, pathological_partition
from fedlt.data.registry import DATASETS, load_dataset
from fedlt.errors import DataError
from fedlt.seeding import numpy_rng


@dataclass
class FederatedData:
    """The long-tailed training set split over clients, the balanced test set, local test sets.

    ``train`` and ``test`` are held once (on the training device); clients are index arrays.
    """

    train: ImageDataset
    test: ImageDataset
    partition: Partition
    local_test: list[np.ndarray]
    hflip: bool = True

    @property
    def num_clients(self) -> int:
        return self.partition.num_clients

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    @property
    def train_counts(self) -> np.ndarray:
        """Training samples per class of the whole (long-tailed) federation."""
        return self.partition.counts.sum(axis=0)

    def client_indices(self, cid: int) -> torch.Tensor:
        return torch.as_tensor(self.partition.client_indices[cid], dtype=torch.int64, device=self.train.images.device)

    def pooled(self) -> "FederatedData":
        """Every training sample in one client: the centralized oracle's view (local tests kept)."""
        merged = np.sort(np.concatenate(self.partition.client_indices))
        one = Partition([merged], self.partition.counts.sum(axis=0, keepdims=True))
        return FederatedData(self.train, self.test, one, self.local_test, self.hflip)

    def describe(self) -> str:
        counts = self.train_counts
        sizes = self.partition.sizes
        return (
            f"{len(self.train)} training samples in {self.num_classes} classes "
            f"(head {counts.max()}, tail {counts.min()}), {self.num_clients} clients "
            f"of {sizes.min()}..{sizes.max()} samples; {len(self.test)} balanced test samples"
        )


def federation_seed(cfg: DataConfig, run_seed: int) -> int:
    """``data.seed`` when set, else the run's seed: the seed of everything that defines the federation."""
    return run_seed if cfg.seed is None else cfg.seed


def build_partition(cfg: DataConfig, labels: np.ndarray, rng: np.random.Generator) -> Partition:
    if cfg.num_clients > len(labels):
        raise DataError(
            f"data.num_clients={cfg.num_clients} exceeds the {len(labels)} long-tailed training samples; "
            "use fewer clients or a smaller data.imbalance_factor"
        )
    if cfg.partition == "dirichlet":
        return dirichlet_partition(
            labels, cfg.num_clients, cfg.alpha, rng,
            min_size=cfg.min_client_size, max_retries=cfg.max_retries, equal_size=cfg.equal_size,
        )
    if cfg.partition == "pathological":
        return pathological_partition(
            labels, cfg.num_clients, cfg.classes_per_client, rng,
            min_size=cfg.min_client_size, max_retries=cfg.max_retries,
        )
    return iid_partition(labels, cfg.num_clients, rng)


def build_federated_data(cfg: DataConfig, seed: int, device: torch.device | str = "cpu") -> FederatedData:
    """Load the source, subsample it long-tailed (IF), split it over clients, draw local test sets.

    All randomness comes from the federation seed's ``data``, ``class_order`` and ``local_test``
    streams, so every method run with the same seed sees the same federation.
    """
    pair = load_dataset(cfg.dataset, root=cfg.root, image_size=cfg.image_size, every_class=True)
    seed = federation_seed(cfg, seed)
    rng = numpy_rng(seed, "data")
    order = resolve_class_order(cfg.class_order, pair.num_classes, numpy_rng(seed, "class_order"))
    keep = longtail_indices(pair.train.labels.numpy(), cfg.imbalance_factor, rng, cfg.train_fraction,
                            num_classes=pair.num_classes, class_order=order)
    train = pair.train.subset(torch.as_tensor(keep, dtype=torch.int64))
    partition = build_partition(cfg, train.labels.numpy(), rng)
    local = local_test_indices(partition.counts, pair.test.labels.numpy(), numpy_rng(seed, "local_test"))
    return FederatedData(train.to(device), pair.test.to(device), partition, local, DATASETS[cfg.dataset].hflip)
