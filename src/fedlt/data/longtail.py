"""Exponential long-tail subsampling of a balanced training set (the CIFAR-LT protocol).

Class ``c`` keeps ``floor(n_max * IF^(-c / (C - 1)))`` samples, so class 0 is the head with
``n_max`` samples and the last class the tail with ``n_max / IF``. Only the training split is
subsampled; the test set stays balanced so that accuracy measures every class equally.
"""

from __future__ import annotations

import numpy as np

from fedlt.errors import DataError

# Relative slack for the floor: ``n * IF**-1`` is computed as e.g. 0.9999999999999999 for
# n = IF = 49, which a bare floor would turn into 0 instead of 1.
_FLOOR_SLACK = 1e-12


def longtail_counts(n_max: int, num_classes: int, imbalance_factor: float) -> np.ndarray:
    """Per-class sample counts ``floor(n_max * IF^(-c/(C-1)))``, class 0 the head (int64).

    ``imbalance_factor`` (IF) is the head/tail ratio ``n_0 / n_{C-1}``; IF = 1 is balanced.
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if imbalance_factor < 1:
        raise DataError(
            f"data.imbalance_factor={imbalance_factor} is below 1 (the head/tail ratio); "
            "use data.imbalance_factor >= 1"
        )
    if n_max < 1:
        raise DataError(f"long-tail subsampling: head class size n_max={n_max}; every class needs >= 1 sample")
    if num_classes == 1:
        return np.array([n_max], dtype=np.int64)
    exponents = -np.arange(num_classes) / (num_classes - 1)
    values = n_max * np.power(float(imbalance_factor), exponents)
    counts = np.floor(values * (1.0 + _FLOOR_SLACK)).astype(np.int64)
    if counts[-1] < 1:
        raise DataError(
            f"data.imbalance_factor={imbalance_factor} leaves the tail class with 0 of {n_max} samples; "
            f"use data.imbalance_factor <= {n_max}"
        )
    return counts


def longtail_indices(labels: np.ndarray, imbalance_factor: float, rng: np.random.Generator,
                     fraction: float = 1.0, num_classes: int | None = None,
                     class_order: np.ndarray | None = None) -> np.ndarray:
    """Sorted indices into ``labels`` that form the long-tailed training subset; with
    ``fraction`` < 1, ``max(1, round(fraction x count))`` of each class (the first ones of the
    same draw, so a smaller fraction is a subset of a larger one).

    ``n_max`` is the size of the *smallest* class of the (nominally balanced) source, so every
    class has at least its target count even when the source is slightly unbalanced. Which
    samples a class keeps is a uniform draw from ``rng``. The number of classes C is
    ``num_classes`` (default ``labels.max() + 1``); every class in ``0..C-1`` must be present.

    ``class_order`` (a permutation of ``0..C-1``, default the natural order) lists the classes
    from head to tail: class ``class_order[r]`` gets the ``r``-th largest count. ``rng`` draws
    the same per-class permutations whatever the order, so an order only moves the counts.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0 or not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0:
        raise ValueError("labels must be a non-empty 1-D array of non-negative integers")
    class_sizes = np.bincount(labels, minlength=num_classes or 0)
    empty = np.flatnonzero(class_sizes == 0)
    if empty.size:
        raise DataError(
            f"long-tail subsampling: class {int(empty[0])} has no samples in the source split, so it cannot "
            "reach its target count; check the dataset files (every class 0..C-1 must be present)"
        )
    targets = longtail_counts(int(class_sizes.min()), class_sizes.size, imbalance_factor)
    if fraction < 1:
        targets = np.maximum(1, np.round(targets * fraction)).astype(np.int64)
    if class_order is not None:
        by_class = np.empty_like(targets)
        by_class[np.asarray(class_order)] = targets
        targets = by_class
    kept = []
    for c, target in enumerate(targets):
        members = np.flatnonzero(labels == c)
        kept.append(rng.permutation(members)[:target])
    return np.sort(np.concatenate(kept)).astype(np.int64)


def distributed_indices(labels: np.ndarray, rng: np.random.Generator, fraction: float = 1.0) -> np.ndarray:
    """Sorted indices of a training split that is long-tailed as distributed (ImageNet-LT, iNaturalist):
    all of it, or with ``fraction`` < 1 ``max(1, round(fraction x count))`` of each class, drawn from
    ``rng``. Long-tail subsampling would take its smallest class as the head's size and flatten it."""
    labels = np.asarray(labels)
    if fraction >= 1:
        return np.arange(labels.size, dtype=np.int64)
    kept = []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        kept.append(rng.permutation(members)[:max(1, round(fraction * members.size))])
    return np.sort(np.concatenate(kept)).astype(np.int64)


def resolve_class_order(order: str | list[int], num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """The head-to-tail class order a config asks for: ``natural`` (0, 1, ..., C-1), ``shuffled``
    (a permutation drawn from ``rng``, its own seeded stream) or an explicit permutation."""
    if order == "natural":
        return np.arange(num_classes)
    if order == "shuffled":
        return rng.permutation(num_classes)
    if sorted(order) != list(range(num_classes)):  # checked before numpy, which holds no index past 64 bits
        raise DataError(
            f"data.class_order={list(order)} is not a permutation of the {num_classes} classes 0..{num_classes - 1}; "
            "list every class once, head first, or use natural or shuffled"
        )
    return np.asarray(order, dtype=np.int64)
