"""Splitting a training set across federated clients (Dirichlet, pathological, IID).

Every partitioner takes its own ``np.random.Generator`` so a split depends only on the
seed it is given, never on global RNG state, and every sample goes to exactly one client.
Impossible settings raise :class:`~fedlt.errors.DataError` up front or after a bounded
number of redraws, never a silent hang.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedlt.errors import DataError


@dataclass
class Partition:
    """Which training samples each client holds.

    Attributes
    ----------
    client_indices : per client, sorted int64 indices into the training set
    counts : int64 (K, C) matrix, ``counts[k, c]`` = samples of class ``c`` on client ``k``
    """

    client_indices: list[np.ndarray]
    counts: np.ndarray

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    @property
    def sizes(self) -> np.ndarray:
        """Samples per client (int64, length K)."""
        return self.counts.sum(axis=1)


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 0,
    max_retries: int = 1000,
    equal_size: bool = False,
    rounding: str = "floor",
) -> Partition:
    """Label-skewed split: each class is divided among clients by proportions ~ Dir(alpha * 1_K).

    Smaller ``alpha`` means more skew. The whole draw is repeated until every client holds
    ``>= min_size`` samples, at most ``max_retries`` times.

    ``rounding`` makes a class's shares ``n p_k`` whole (:func:`_class_cuts`): ``floor`` cuts at
    ``floor(n cumsum(p))``, as most released splits do, which hands each class's rounding remainder
    to the last client (it holds every class); ``largest_remainder`` gives each client
    ``floor(n p_k)`` and one more to the largest fractional parts (SFD's released split).

    ``equal_size=True`` is a non-default variant used by CReFF and FedYoYo: after the draw,
    the client lists are concatenated in client order and re-cut into K equal parts (the
    remainder going to the first clients), so clients differ in class mix but not in size.
    Every client then holds ``>= N // K`` samples, so no redraw is needed.
    """
    labels = _check_labels(labels)
    n = labels.size
    _check_num_clients(num_clients, n)
    _check_alpha(alpha)
    _check_min_size("Dirichlet", min_size, num_clients, n)
    if max_retries < 1:
        raise ValueError(f"max_retries must be >= 1, got {max_retries}")
    members = _class_members(labels)
    class_sizes = np.array([m.size for m in members], dtype=np.int64)
    for _ in range(max_retries):
        proportions = rng.dirichlet(np.full(num_clients, float(alpha)), size=class_sizes.size)
        cuts = _class_cuts(proportions, class_sizes, rounding)
        if equal_size or _split_sizes(cuts, class_sizes).sum(axis=0).min() >= min_size:
            break
    else:
        raise DataError(
            f"Dirichlet partition: no split with every client holding >= {min_size} samples after "
            f"{max_retries} draws (alpha={alpha}, {num_clients} clients, {n} samples); lower "
            "data.min_client_size, raise data.alpha or use fewer clients"
        )
    per_client: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, idx in enumerate(members):
        for k, part in enumerate(np.split(rng.permutation(idx), cuts[c])):
            per_client[k].append(part)
    parts = [np.concatenate(p) for p in per_client]
    if equal_size:
        parts = np.array_split(np.concatenate(parts), num_clients)
    return _make_partition(labels, parts)


#: how :func:`dirichlet_partition` makes a class's shares whole
ROUNDINGS = ("floor", "largest_remainder")


def _class_cuts(proportions: np.ndarray, class_sizes: np.ndarray, rounding: str) -> np.ndarray:
    """Where each class's samples are cut among the clients, (C, K-1), from its proportions (C, K)."""
    if rounding == "floor":
        return np.floor(np.cumsum(proportions, axis=1)[:, :-1] * class_sizes[:, None]).astype(np.int64)
    if rounding != "largest_remainder":
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    shares = proportions / proportions.sum(axis=1, keepdims=True) * class_sizes[:, None]
    counts = np.floor(shares).astype(np.int64)
    short = class_sizes - counts.sum(axis=1)  # samples the floors leave, fewer than K per class
    order = np.argsort(-(shares - counts), axis=1, kind="stable")  # largest fractional part first
    extra = np.arange(proportions.shape[1])[None, :] < short[:, None]
    np.put_along_axis(counts, order, counts[np.arange(len(counts))[:, None], order] + extra, axis=1)
    return np.cumsum(counts, axis=1)[:, :-1]


def grouped_dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    group_size: int = 10,
    max_retries: int = 1000,
) -> Partition:
    """CReFF's and FedYoYo's released split, which their papers' numbers come from: the shuffled
    samples are cut into one contiguous share per group of ``group_size`` clients; within a group
    each class in turn is split by proportions ~ Dir(alpha) among the group's clients still below
    the group's mean size (a client at the mean gets no more), the group redrawn until its smallest
    client holds half the mean; then the clients' lists, concatenated in client order, are re-cut
    into K equal parts (the remainder to the first). More skewed than ``dirichlet`` with
    ``equal_size``: clients fill up and stop taking classes."""
    labels = _check_labels(labels)
    n = labels.size
    _check_num_clients(num_clients, n)
    _check_alpha(alpha)
    order = rng.permutation(n)
    num_groups = -(-num_clients // group_size)
    per_client: list[np.ndarray] = []
    start = 0
    for g in range(num_groups):
        members = min(group_size, num_clients - g * group_size)
        end = n if g == num_groups - 1 else start + int(group_size / num_clients * n)
        per_client += _balanced_group(order[start:end], labels, members, alpha, rng, max_retries)
        start = end
    return _make_partition(labels, np.array_split(np.concatenate(per_client), num_clients))


def _balanced_group(rows: np.ndarray, labels: np.ndarray, num_clients: int, alpha: float,
                    rng: np.random.Generator, max_retries: int) -> list[np.ndarray]:
    """One group of :func:`grouped_dirichlet_partition`: its clients' rows, in draw order."""
    mean, least = rows.size / num_clients, int(0.5 * rows.size / num_clients)
    by_class = [rows[labels[rows] == c] for c in range(int(labels.max()) + 1)]
    for _ in range(max_retries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for members in by_class:
            share = rng.dirichlet(np.full(num_clients, float(alpha))) * (sizes < mean)
            share = share / share.sum() if share.sum() > 0 else np.full(num_clients, 1.0 / num_clients)
            cuts = (np.cumsum(share) * members.size).astype(np.int64)[:-1]
            for k, piece in enumerate(np.split(members, cuts)):
                parts[k].append(piece)
                sizes[k] += piece.size
        if sizes.min() >= least:
            return [np.concatenate(p) for p in parts]
    raise DataError(
        f"grouped Dirichlet partition: no split of a group of {num_clients} clients with each holding half the "
        f"group's mean ({least} samples) after {max_retries} draws (alpha={alpha}); raise data.alpha or data.max_retries"
    )


def pathological_partition(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    rng: np.random.Generator,
    min_size: int = 0,
    max_retries: int = 1000,
) -> Partition:
    """Each client holds exactly ``classes_per_client`` distinct classes (FedAvg's shard split).

    Class slots are dealt round-robin over a shuffled class order, so every class is held by
    ``floor`` or ``ceil`` of ``K * k / C`` clients and none is dropped; the resulting class sets
    are then given to a random permutation of the clients. Each class is shuffled and cut into
    near-equal shards, one per client holding it.

    As in :func:`dirichlet_partition`, the deal is repeated until every client holds
    ``>= max(min_size, 1)`` samples, at most ``max_retries`` times, so no client is ever empty.
    A class with fewer samples than holders leaves some of them without a shard of it; those
    clients hold fewer than ``k`` classes.
    """
    labels = _check_labels(labels)
    n = labels.size
    _check_num_clients(num_clients, n)
    members = _class_members(labels)
    num_classes = len(members)
    k = classes_per_client
    if not 1 <= k <= num_classes:
        raise DataError(
            f"data.classes_per_client={k} must lie in 1..{num_classes} (the number of classes); "
            "change data.classes_per_client"
        )
    if num_clients * k < num_classes:
        raise DataError(
            f"pathological partition: {num_clients} clients x {k} classes each cover fewer than the "
            f"{num_classes} classes, so some class would be dropped; use more clients or raise "
            "data.classes_per_client"
        )
    _check_min_size("pathological", min_size, num_clients, n)
    if max_retries < 1:
        raise ValueError(f"max_retries must be >= 1, got {max_retries}")
    class_sizes = np.array([m.size for m in members], dtype=np.int64)
    if k == 1:
        _check_one_class_clients(class_sizes, num_clients)
    least = max(min_size, 1)  # a client without samples is never produced
    for _ in range(max_retries):
        order = rng.permutation(num_classes)
        owner = rng.permutation(num_clients)
        holders: list[list[int]] = [[] for _ in range(num_classes)]
        for slot in range(num_clients * k):
            holders[int(order[slot % num_classes])].append(int(owner[slot // k]))
        # Client sizes: np.array_split (below) cuts class c into shards for its sorted holders.
        sizes = np.zeros(num_clients, dtype=np.int64)
        for c, clients in enumerate(holders):
            sizes[sorted(clients)] += _shard_sizes(int(class_sizes[c]), len(clients))
        if sizes.min() >= least:
            break
    else:
        lower = "lower data.min_client_size, " if min_size > 1 else ""
        raise DataError(
            f"pathological partition: no split with every client holding >= {least} samples after "
            f"{max_retries} draws ({k} classes per client, {num_clients} clients, {n} samples); "
            f"{lower}use fewer clients, a higher data.classes_per_client or data.train_fraction, or a smaller "
            "data.imbalance_factor"
        )
    per_client: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, idx in enumerate(members):
        clients = sorted(holders[c])
        for client, shard in zip(clients, np.array_split(rng.permutation(idx), len(clients))):
            per_client[client].append(shard)
    return _make_partition(labels, [np.concatenate(p) for p in per_client])


def iid_partition(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> Partition:
    """Uniformly random split into K near-equal parts (sizes differ by at most one)."""
    labels = _check_labels(labels)
    _check_num_clients(num_clients, labels.size)
    return _make_partition(labels, np.array_split(rng.permutation(labels.size), num_clients))


def _check_alpha(alpha: float) -> None:
    if not alpha > 0:
        raise DataError(f"data.alpha={alpha} must be > 0 (Dirichlet concentration); use e.g. data.alpha=0.5")


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or (labels.size and labels.min() < 0):
        raise ValueError("labels must be a 1-D array of non-negative integers")
    return labels


def _check_num_clients(num_clients: int, num_samples: int) -> None:
    if num_clients < 1:
        raise DataError(f"data.num_clients={num_clients} must be >= 1; use at least one client")
    if num_clients > num_samples:
        raise DataError(
            f"data.num_clients={num_clients} exceeds the {num_samples} training samples; use fewer clients"
        )


def _check_min_size(kind: str, min_size: int, num_clients: int, num_samples: int) -> None:
    if min_size < 0:
        raise DataError(f"data.min_client_size={min_size} is negative; use data.min_client_size >= 0")
    if min_size * num_clients > num_samples:
        raise DataError(
            f"{kind} partition: data.min_client_size={min_size} is impossible for {num_clients} clients "
            f"and {num_samples} samples ({num_clients} x {min_size} > {num_samples}); "
            f"use a data.min_client_size well below {num_samples // num_clients} (what an even split would give "
            "each client; a random split rarely comes near it) or fewer clients"
        )


def _check_one_class_clients(class_sizes: np.ndarray, num_clients: int) -> None:
    """With one class per client, a class with fewer samples than holders leaves a client empty in every deal."""
    least_holders = num_clients // class_sizes.size  # every class goes to at least this many clients
    c = int(np.argmin(class_sizes))
    if class_sizes[c] < least_holders:
        raise DataError(
            f"pathological partition: {num_clients} clients x 1 class each share every class among at least "
            f"{least_holders} clients, but class {c} has only {class_sizes[c]} training samples, so some client "
            f"would get none; use data.num_clients <= {class_sizes.size * class_sizes[c]}, a higher "
            "data.classes_per_client or data.train_fraction, or a smaller data.imbalance_factor"
        )


def _shard_sizes(num_samples: int, num_shards: int) -> np.ndarray:
    """Sizes of the ``np.array_split`` pieces of ``num_samples`` items into ``num_shards``."""
    return num_samples // num_shards + (np.arange(num_shards) < num_samples % num_shards)


def _class_members(labels: np.ndarray) -> list[np.ndarray]:
    """Indices of each class ``0..labels.max()``, in ascending order."""
    order = np.argsort(labels, kind="stable")
    bounds = np.cumsum(np.bincount(labels))[:-1]
    return np.split(order.astype(np.int64), bounds)


def _split_sizes(cuts: np.ndarray, class_sizes: np.ndarray) -> np.ndarray:
    """(C, K) sizes of the pieces that ``np.split`` makes at ``cuts`` (C, K-1)."""
    edges = np.concatenate([np.zeros((cuts.shape[0], 1), np.int64), cuts, class_sizes[:, None]], axis=1)
    return np.diff(edges, axis=1)


def _make_partition(labels: np.ndarray, parts: list[np.ndarray]) -> Partition:
    num_classes = int(labels.max()) + 1
    client_indices = [np.sort(p).astype(np.int64) for p in parts]
    counts = np.stack([np.bincount(labels[ix], minlength=num_classes) for ix in client_indices]).astype(np.int64)
    return Partition(client_indices=client_indices, counts=counts)
