"""From a config to the federation's data: source -> long tail -> partition -> local test sets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fedlt.config import DataConfig, federation_seed
from fedlt.data.dataset import DatasetPair, ImageDataset
from fedlt.data.declaration import class_names
from fedlt.data.local_test import local_test_indices
from fedlt.data.longtail import distributed_indices, longtail_indices, resolve_class_order
from fedlt.data.partition import (
    Partition, dirichlet_partition, grouped_dirichlet_partition, iid_partition, pathological_partition,
)
from fedlt.data.registry import DATASETS, has_own_validation, load_dataset
from fedlt.data.validation import balanced_indices, complement, resolve_source
from fedlt.errors import ConfigError, DataError
from fedlt.seeding import numpy_rng


@dataclass
class FederatedData:
    """The long-tailed training set split over clients, the balanced test set, local test sets,
    and the balanced validation set when one was asked for (``data.val_per_class``).

    ``train``, ``test`` and ``val`` are held once (on the training device); clients are index arrays.
    """

    train: ImageDataset
    test: ImageDataset
    partition: Partition
    local_test: list[np.ndarray]
    hflip: bool = True
    val: ImageDataset | None = None
    #: where ``val`` came from (``dataset``, ``train`` or ``test``; see :mod:`fedlt.data.validation`)
    val_source: str | None = None
    #: each client's rows of ``val``, drawn in its training proportions as ``local_test`` is from
    #: ``test``: personalized models are chosen on them (``val_pm_acc``)
    local_val: list[np.ndarray] | None = None
    #: every client's rows on the training device, made by the first :meth:`client_indices`
    _rows: list[torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)

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
        """Client ``cid``'s rows of ``train`` (int64, on its device; shared, not to be written to).
        Every client's rows go to the device in one copy, the first time: a copy from host memory per
        client would make the host wait for the device at each client's start."""
        if self._rows is None:
            rows = self.partition.client_indices
            flat = torch.as_tensor(np.concatenate([np.asarray(r, dtype=np.int64) for r in rows]) if rows else
                                   np.zeros(0, dtype=np.int64), device=self.train.images.device)
            self._rows = list(flat.split([len(r) for r in rows]))
        return self._rows[cid]

    def client_counts(self, cid: int) -> np.ndarray:
        """Client ``cid``'s training samples per class (int64, on the host)."""
        return self.partition.counts[cid]

    def pooled(self) -> "FederatedData":
        """Every training sample in one client: the centralized oracle's view (local tests kept)."""
        merged = np.sort(np.concatenate(self.partition.client_indices))
        one = Partition([merged], self.partition.counts.sum(axis=0, keepdims=True))
        return FederatedData(self.train, self.test, one, self.local_test, self.hflip, self.val, self.val_source,
                             self.local_val)

    def describe(self) -> str:
        counts = self.train_counts
        sizes = self.partition.sizes
        return (
            f"{len(self.train)} training samples in {self.num_classes} classes "
            f"(head {counts.max()}, tail {counts.min()}), {self.num_clients} clients "
            f"of {sizes.min()}..{sizes.max()} samples; {len(self.test)} "
            + ("balanced " if len(set(self.test.class_counts().tolist())) == 1 else "")
            + "test samples"
            + (f"; {len(self.val)} balanced validation samples (from {self.val_source})" if self.val is not None else "")
        )


def build_partition(cfg: DataConfig, labels: np.ndarray, rng: np.random.Generator) -> Partition:
    if cfg.num_clients > len(labels):
        # the knobs that shrank the training set; a source long-tailed as distributed takes no imbalance factor
        shrink = [f"a larger data.train_fraction (now {cfg.train_fraction:g})"] if cfg.train_fraction < 1 else []
        if cfg.imbalance_factor > 1 and not (cfg.dataset in DATASETS and DATASETS[cfg.dataset].long_tailed):
            shrink.append("a smaller data.imbalance_factor")
        raise DataError(
            f"data.num_clients={cfg.num_clients} exceeds the {len(labels)} long-tailed training samples; "
            f"use fewer clients{''.join(', ' + s for s in shrink[:-1])}{' or ' + shrink[-1] if shrink else ''}"
        )
    if cfg.partition == "dirichlet":
        return dirichlet_partition(
            labels, cfg.num_clients, cfg.alpha, rng,
            min_size=cfg.min_client_size, max_retries=cfg.max_retries, equal_size=cfg.equal_size,
            rounding=cfg.rounding,
        )
    if cfg.partition == "grouped_dirichlet":
        return grouped_dirichlet_partition(labels, cfg.num_clients, cfg.alpha, rng, max_retries=cfg.max_retries)
    if cfg.partition == "pathological":
        return pathological_partition(
            labels, cfg.num_clients, cfg.classes_per_client, rng,
            min_size=cfg.min_client_size, max_retries=cfg.max_retries,
        )
    return iid_partition(labels, cfg.num_clients, rng)


def check_class_order(cfg: DataConfig) -> None:
    """A dataset long-tailed as distributed keeps each class's own size: no head/tail order applies."""
    if cfg.dataset in DATASETS and DATASETS[cfg.dataset].long_tailed and cfg.class_order != "natural":
        raise ConfigError(f"{cfg.dataset} is long-tailed as distributed, each class keeping its own size, so "
                          "no class order applies; drop data.class_order")


def build_federated_data(cfg: DataConfig, seed: int, device: torch.device | str = "cpu", *,
                         loaded: dict[tuple, DatasetPair] | None = None) -> FederatedData:
    """Load the source, hold out the validation set, subsample it long-tailed (IF; a source that is
    long-tailed as distributed is kept as it is), split it over clients, draw local test sets.

    All randomness comes from the federation seed's ``validation``, ``data``, ``class_order``,
    ``local_test`` and ``local_val`` streams, so every method run with the same seed sees the same federation, and
    without ``data.val_per_class`` the federation is the one drawn before validation existed.
    ``loaded`` keeps the last dataset read for the next call that reads the same one (several
    federations of one dataset, as ``fedlt bench`` validates them).
    """
    check_class_order(cfg)
    info = DATASETS[cfg.dataset] if cfg.dataset in DATASETS else None
    source = None
    if cfg.val_per_class and info is not None:
        source = resolve_source(cfg.val_from, cfg.dataset, has_own_validation(cfg.dataset, cfg.root), info.long_tailed)
    read = (cfg.dataset, cfg.root, cfg.image_size, source == "dataset")
    pair = (loaded or {}).get(read)
    if pair is None:
        pair = load_dataset(cfg.dataset, root=cfg.root, image_size=cfg.image_size, every_class=True,
                            with_val=source == "dataset")
        if loaded is not None:  # only the last one: a suite's federations come grouped by dataset
            loaded.clear()
            loaded[read] = pair
    if cfg.classes is not None:  # the names reports give the classes, checked as a federation checks them
        pair = pair.named(class_names(cfg, pair.train.classes))
    seed = federation_seed(cfg, seed)
    source_train, test, val = pair.train, pair.test, None
    if source is not None:
        source_train, test, val = _hold_out_validation(cfg, source, pair, numpy_rng(seed, "validation"),
                                                       info is not None and info.long_tailed)
    rng = numpy_rng(seed, "data")
    order = resolve_class_order(cfg.class_order, pair.num_classes, numpy_rng(seed, "class_order"))
    if info is not None and info.long_tailed:  # its own long tail: data.imbalance_factor and class_order do not apply
        keep = distributed_indices(source_train.labels.numpy(), rng, cfg.train_fraction)
    else:
        keep = longtail_indices(source_train.labels.numpy(), cfg.imbalance_factor, rng, cfg.train_fraction,
                                num_classes=pair.num_classes, class_order=order)
    train = source_train.subset(torch.as_tensor(keep, dtype=torch.int64))
    partition = build_partition(cfg, train.labels.numpy(), rng)
    local = local_test_indices(partition.counts, test.labels.numpy(), numpy_rng(seed, "local_test"))
    local_val = None if val is None else local_test_indices(partition.counts, val.labels.numpy(),
                                                            numpy_rng(seed, "local_val"))
    return FederatedData(train.to(device), test.to(device), partition, local, cfg.flips(DATASETS[cfg.dataset].hflip),
                         val.to(device) if val is not None else None, source, local_val)


def _hold_out_validation(cfg: DataConfig, source: str, pair: DatasetPair, rng: np.random.Generator,
                         long_tailed: bool = False) -> tuple[ImageDataset, ImageDataset, ImageDataset]:
    """(training source, test set, validation set) with ``cfg.val_per_class`` images of every class
    moved from ``source`` into the validation set."""
    n, classes = cfg.val_per_class, pair.num_classes
    if source == "dataset":
        rows = balanced_indices(pair.val.labels.numpy(), n, classes, rng, keep_one=False,
                                where=f"{cfg.dataset}'s own validation split", fix=", add images of that class "
                                "to it, or draw the validation set from data.val_from=train or test",
                                names=pair.val.classes)
        return pair.train, pair.test, pair.val.subset(torch.as_tensor(rows))
    split = pair.train if source == "train" else pair.test
    other = "test" if source == "train" else "train"
    if source == "train" and not long_tailed:  # what is left must still reach the tail: checked first, so the
        smallest = int(split.class_counts().min())  # largest N named is one that fits both rules
        most = smallest - max(math.ceil(cfg.imbalance_factor), 1)
        if n > most:
            problem = (f"leaves {smallest - n} images in its smallest class, too few for data.imbalance_factor="
                       f"{cfg.imbalance_factor:g} (the tail would get none)") if n <= smallest else \
                f"is more than its smallest class holds ({smallest} images)"
            raise DataError(f"data.val_per_class={n} held out of {cfg.dataset}'s training source {problem}; use "
                            f"data.val_per_class <= {max(most, 0)} or data.val_from=test")
    rows = balanced_indices(split.labels.numpy(), n, classes, rng, keep_one=True,
                            where=f"the {source} split of {cfg.dataset}", fix=f" or data.val_from={other}")
    rest = split.subset(torch.as_tensor(complement(len(split), rows)))
    held = split.subset(torch.as_tensor(rows))
    return (rest, pair.test, held) if source == "train" else (pair.train, rest, held)
