"""Per-client local test sets for personalized evaluation (FedLoGe's protocol).

Each client's local test set is sampled from the global balanced test set with the client's
training class proportions, so the local train and test distributions are aligned.
"""

from __future__ import annotations

import numpy as np


def local_test_indices(
    train_counts: np.ndarray, test_labels: np.ndarray, rng: np.random.Generator
) -> list[np.ndarray]:
    """Sorted test-set indices for each client, matching its training class proportions.

    For client k with proportions ``p_kc = n_kc / N_k``, the total size is
    ``S_k = min_c |test_c| / p_kc`` over classes with ``p_kc > 0``: the largest sample for
    which ``p_kc * S_k`` fits in every class's test pool, i.e. the biggest local test set
    whose proportions match training exactly (up to the floor) without drawing a test
    image twice. Class c contributes ``floor(p_kc * S_k)`` images drawn without replacement.
    Clients are drawn independently, so different clients may share test images; a client
    with no training data gets an empty array.
    """
    train_counts = np.asarray(train_counts, dtype=np.int64)
    test_labels = np.asarray(test_labels)
    if train_counts.ndim != 2 or (train_counts < 0).any():
        raise ValueError("train_counts must be a non-negative (K, C) count matrix")
    num_classes = train_counts.shape[1]
    if test_labels.ndim != 1 or (test_labels.size and (test_labels.min() < 0 or test_labels.max() >= num_classes)):
        raise ValueError(f"test_labels must be a 1-D array with values in 0..{num_classes - 1}")
    pools = [np.flatnonzero(test_labels == c) for c in range(num_classes)]
    pool_sizes = np.array([p.size for p in pools], dtype=np.int64)
    result = []
    for row in train_counts:
        held = np.flatnonzero(row)
        if held.size == 0:
            result.append(np.zeros(0, dtype=np.int64))
            continue
        # Binding class b minimises |test_c| / n_kc; floor(p_kc * S_k) = n_kc * |test_b| // n_kb,
        # computed in integers so the floor is exact.
        b = held[np.argmin(pool_sizes[held] / row[held])]
        takes = row * pool_sizes[b] // row[b]
        drawn = [rng.choice(pools[c], size=int(takes[c]), replace=False) for c in held if takes[c] > 0]
        result.append(np.sort(np.concatenate(drawn)).astype(np.int64) if drawn else np.zeros(0, dtype=np.int64))
    return result
