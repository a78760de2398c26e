"""A real federation's data (``flower.node_data``): each SuperNode is one client and holds only its
own folder; the server holds no training data at all.

Both sides still hand the shared round loop and client runtime a :class:`FederatedData`, so the
in-process engine, Flower's simulation and a real federation run the same code: a node's view has
one client whose rows are all of the node's images (whatever id the server gave it, which only
seeds its randomness), and its local test set is its own ``test/`` split; the server's view has
the declared shape of the images, the connected clients, the class counts the nodes' summed
replies give it, and the balanced test set only when it is given one (``eval.test_data``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedlt.data.dataset import ImageDataset
from fedlt.data.federated import FederatedData
from fedlt.data.partition import Partition


class _EveryClient:
    """A node's one local test set, under whichever client id the server uses for the node."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def __getitem__(self, cid: int) -> np.ndarray:
        return self.rows

    def __len__(self) -> int:
        return 1


@dataclass
class NodeFederation(FederatedData):
    """One node's data: its single client's rows are every training image it holds."""

    #: :meth:`ImageDataset.digest` of its training set, what the node tells the server of its data
    digest: str = ""

    def client_indices(self, cid: int) -> torch.Tensor:
        return torch.arange(len(self.train), dtype=torch.int64, device=self.train.images.device)

    def client_counts(self, cid: int) -> np.ndarray:
        return self.partition.counts[0]


def node_federation(train: ImageDataset, test: ImageDataset | None, hflip: bool, digest: str = "") -> NodeFederation:
    """The client runtime's view of a node that holds ``train`` (and ``test``, its own test split), whose
    training set hashes to ``digest``."""
    test = test if test is not None else empty_like(train)
    counts = train.class_counts().cpu().numpy()[None, :]
    partition = Partition([np.arange(len(train), dtype=np.int64)], counts)
    return NodeFederation(train, test, partition, _EveryClient(np.arange(len(test), dtype=np.int64)), hflip,  # type: ignore[arg-type]
                          digest=digest)


@dataclass
class ServerFederation(FederatedData):
    """The server's view: no training images, the clients' summed class counts once they replied."""

    counts: np.ndarray | None = None

    @property
    def train_counts(self) -> np.ndarray:
        return self.counts if self.counts is not None else np.zeros(self.num_classes, dtype=np.int64)

    def describe(self) -> str:
        counts = self.train_counts
        return (f"{int(counts.sum())} training samples in {self.num_classes} classes (head {counts.max()}, tail "
                f"{counts.min()}; the nodes' summed counts), {self.num_clients} nodes, each with its own data; "
                + (f"{len(self.test)} test samples on the server" if len(self.test) else "federated evaluation on "
                   "the nodes' own test splits"))


def server_federation(shape: ImageDataset, num_clients: int, test: ImageDataset | None,
                      val: ImageDataset | None = None) -> ServerFederation:
    """The server's data for ``num_clients`` nodes; ``shape`` is an empty dataset of the declared
    image shape, classes and standardisation (what builds the model); ``test`` and ``val`` are the
    server's own sets, when it was given them."""
    partition = Partition([np.zeros(0, dtype=np.int64)] * num_clients,
                          np.zeros((num_clients, shape.num_classes), dtype=np.int64))
    return ServerFederation(shape, test if test is not None else shape, partition, [], True, val,
                            "eval.val_data" if val is not None else None)


def empty_like(data: ImageDataset) -> ImageDataset:
    """No images, the same shape, classes and standardisation."""
    return ImageDataset(data.images[:0], data.labels[:0], list(data.classes), data.mean, data.std)
