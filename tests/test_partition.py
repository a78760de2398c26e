"""Long-tail subsampling, client partitions and local test sets."""

from __future__ import annotations

import hashlib
import time
from fractions import Fraction

import numpy as np
import pytest

from fedlt.config import DataConfig
from fedlt.data.federated import build_federated_data, build_partition
from fedlt.data.local_test import local_test_indices
from fedlt.data.longtail import longtail_counts, longtail_indices
from fedlt.data.partition import (
    Partition,
    dirichlet_partition,
    grouped_dirichlet_partition,
    iid_partition,
    pathological_partition,
)
from fedlt.errors import DataError


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def balanced_labels(num_classes: int, per_class: int, seed: int = 123) -> np.ndarray:
    """Shuffled labels with ``per_class`` samples of each class."""
    return rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def check_partition(part: Partition, num_samples: int) -> None:
    """Raise ``AssertionError`` unless every sample in ``0..num_samples-1`` is held exactly once."""
    if part.counts.shape[0] != part.num_clients:
        raise AssertionError(f"counts has {part.counts.shape[0]} rows for {part.num_clients} clients")
    held = np.concatenate([np.asarray(ix, dtype=np.int64) for ix in part.client_indices])
    if held.size and (held.min() < 0 or held.max() >= num_samples):
        raise AssertionError(f"an index lies outside 0..{num_samples - 1}")
    times = np.bincount(held, minlength=num_samples)
    if not np.all(times == 1):
        missing, repeated = int(np.sum(times == 0)), int(np.sum(times > 1))
        raise AssertionError(f"{missing} samples held by no client, {repeated} by more than one")
    if not np.array_equal(part.sizes, [len(ix) for ix in part.client_indices]):
        raise AssertionError("counts rows do not sum to the client sizes")


def recount(labels: np.ndarray, part: Partition) -> np.ndarray:
    num_classes = int(labels.max()) + 1
    return np.stack([np.bincount(labels[ix], minlength=num_classes) for ix in part.client_indices])


def same_partition(a: Partition, b: Partition) -> bool:
    pairs = zip(a.client_indices, b.client_indices)
    return a.num_clients == b.num_clients and all(np.array_equal(x, y) for x, y in pairs)


# --- long tail ------------------------------------------------------------------------------


def test_longtail_counts_cifar10_if100():
    assert longtail_counts(5000, 10, 100).tolist() == [5000, 2997, 1796, 1077, 645, 387, 232, 139, 83, 50]


def test_longtail_counts_edge_cases():
    assert longtail_counts(500, 7, 1).tolist() == [500] * 7
    assert longtail_counts(42, 1, 100).tolist() == [42]
    # n * IF**-1 is 0.999... in floating point for n = IF = 49; the tail must still keep 1.
    assert longtail_counts(49, 2, 49).tolist() == [49, 1]
    counts = longtail_counts(500, 100, 50)
    assert counts[0] == 500 and counts[-1] == 10 and np.all(np.diff(counts) <= 0)


def test_longtail_counts_rejects_bad_factor():
    with pytest.raises(DataError, match="imbalance_factor >= 1"):
        longtail_counts(5000, 10, 0.5)
    with pytest.raises(DataError, match="tail class"):
        longtail_counts(10, 10, 100)


def test_longtail_indices_per_class_counts_and_subset():
    labels = np.concatenate([balanced_labels(10, 100), np.zeros(7, dtype=np.int64)])  # class 0 larger
    before = labels.copy()
    idx = longtail_indices(labels, 10, rng(0))
    assert np.all(np.diff(idx) > 0)  # sorted, no duplicates
    assert idx.min() >= 0 and idx.max() < labels.size
    # n_max is the smallest class (100), not class 0's 107.
    assert np.bincount(labels[idx]).tolist() == longtail_counts(100, 10, 10).tolist()
    assert np.array_equal(labels, before)


def test_longtail_indices_seeded_and_test_split_untouched():
    train, test = balanced_labels(10, 100, seed=1), balanced_labels(10, 20, seed=2)
    test_before = test.copy()
    a, b, c = (longtail_indices(train, 10, rng(s)) for s in (0, 0, 1))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert np.bincount(train[a]).tolist() == np.bincount(train[c]).tolist()
    assert np.array_equal(test, test_before)
    assert np.bincount(test).tolist() == [20] * 10


def test_a_train_fraction_keeps_each_class_in_proportion_as_a_subset_of_the_full_draw():
    labels = balanced_labels(10, 100, seed=3)
    full = longtail_indices(labels, 10, rng(0))
    tenth = longtail_indices(labels, 10, rng(0), fraction=0.1)
    assert np.bincount(labels[tenth]).tolist() == [10, 8, 6, 5, 4, 3, 2, 2, 1, 1]  # round(0.1 n_c), >= 1
    assert set(tenth) <= set(full)


def test_longtail_indices_missing_class():
    labels = np.array([0, 0, 2, 2])
    with pytest.raises(DataError, match="class 1 has no samples"):
        longtail_indices(labels, 2, rng())
    # A missing *last* class is only visible with the dataset's class count.
    with pytest.raises(DataError, match="class 3 has no samples"):
        longtail_indices(np.array([0, 1, 2, 2]), 1, rng(), num_classes=4)


# --- partitions -----------------------------------------------------------------------------

LABELS = balanced_labels(10, 200)  # 2000 samples


@pytest.mark.parametrize(
    "make",
    [
        lambda r: dirichlet_partition(LABELS, 20, 0.5, r),
        lambda r: dirichlet_partition(LABELS, 20, 0.5, r, min_size=20),
        lambda r: dirichlet_partition(LABELS, 20, 0.1, r, equal_size=True),
        lambda r: grouped_dirichlet_partition(LABELS, 20, 0.5, r),
        lambda r: pathological_partition(LABELS, 20, 2, r),
        lambda r: iid_partition(LABELS, 20, r),
    ],
    ids=["dirichlet", "dirichlet-min", "dirichlet-equal", "grouped-dirichlet", "pathological", "iid"],
)
def test_partition_invariants(make):
    part = make(rng(0))
    check_partition(part, LABELS.size)
    assert part.num_clients == 20
    assert part.counts.dtype == np.int64 and part.counts.shape == (20, 10)
    assert np.array_equal(part.counts, recount(LABELS, part))
    assert part.sizes.tolist() == [len(ix) for ix in part.client_indices]
    for ix in part.client_indices:
        assert ix.dtype == np.int64 and np.all(np.diff(ix) > 0)
    assert same_partition(part, make(rng(0)))
    assert not same_partition(part, make(rng(1)))


def test_check_partition_catches_missing_and_repeated_samples():
    labels = np.array([0, 1, 0, 1])
    bad = Partition([np.array([0, 1]), np.array([1, 2])], np.array([[1, 1], [1, 1]]))
    with pytest.raises(AssertionError, match="1 samples held by no client, 1 by more than one"):
        check_partition(bad, labels.size)


def test_dirichlet_smaller_alpha_more_skew():
    def mean_max_share(alpha: float) -> float:
        shares = []
        for seed in range(5):
            counts = dirichlet_partition(LABELS, 10, alpha, rng(seed)).counts
            held = counts.sum(axis=1) > 0
            shares.append((counts[held].max(axis=1) / counts[held].sum(axis=1)).mean())
        return float(np.mean(shares))

    assert mean_max_share(0.1) > mean_max_share(10.0) + 0.3


def test_dirichlet_min_size_honoured():
    for seed in range(3):
        part = dirichlet_partition(LABELS, 20, 0.3, rng(seed), min_size=40)
        assert part.sizes.min() >= 40


def test_dirichlet_tiny_alpha_does_not_hang():
    labels = balanced_labels(10, 600)
    start = time.perf_counter()
    part = dirichlet_partition(labels, 100, 0.01, rng(0))
    assert time.perf_counter() - start < 2.0
    check_partition(part, labels.size)


def test_dirichlet_unreachable_min_size_gives_up_with_fix():
    labels = balanced_labels(10, 600)
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"after 1000 draws.*lower data.min_client_size") as info:
        dirichlet_partition(labels, 100, 0.01, rng(0), min_size=50)
    assert time.perf_counter() - start < 10.0
    assert "\n" not in str(info.value)


def test_dirichlet_impossible_min_size_fails_before_drawing():
    generator = rng(0)
    state = generator.bit_generator.state
    with pytest.raises(DataError, match=r"min_client_size=21 is impossible.*min_client_size well below 20"):
        dirichlet_partition(LABELS, 100, 0.5, generator, min_size=21)
    assert generator.bit_generator.state == state


def test_dirichlet_equal_size():
    for seed in range(3):
        part = dirichlet_partition(LABELS[:1997], 20, 0.1, rng(seed), equal_size=True)
        assert part.sizes.tolist() == [100] * 17 + [99] * 3
    skewed = dirichlet_partition(LABELS, 10, 0.05, rng(0), equal_size=True).counts
    assert (skewed.max(axis=1) / skewed.sum(axis=1)).mean() > 0.3  # still label-skewed


def test_dirichlet_rounding_by_floor_of_the_cumulative_share_or_by_largest_remainders():
    """floor cuts each class at floor(n x cumsum(p)): the last client takes every class's rounding
    remainder, so it holds every class, the small ones too. largest_remainder (SFD's released split)
    gives each client floor(n x p_k) and one more to the clients with the largest fractional parts."""
    sizes = np.array([500, 120, 40, 9, 5, 3])
    labels = rng(7).permutation(np.repeat(np.arange(sizes.size), sizes))
    clients = 12
    for seed in range(3):
        shares = rng(seed).dirichlet(np.full(clients, 0.3), size=sizes.size) * sizes[:, None]  # the first draw
        floor = dirichlet_partition(labels, clients, 0.3, rng(seed))
        check_partition(floor, labels.size)
        cumulative = np.hstack([np.floor(np.cumsum(shares, axis=1)[:, :-1]).astype(int), sizes[:, None]])
        assert np.array_equal(floor.counts, np.diff(cumulative, axis=1, prepend=0).T)
        assert (floor.counts[-1] > 0).all()  # every class, on every draw
        largest = dirichlet_partition(labels, clients, 0.3, rng(seed), rounding="largest_remainder")
        check_partition(largest, labels.size)
        assert np.array_equal(largest.counts.sum(axis=0), sizes)
        for c in range(sizes.size):
            whole, fraction = np.floor(shares[c]).astype(int), shares[c] - np.floor(shares[c])
            rounded_up = np.sort(np.argsort(-fraction, kind="stable")[:sizes[c] - whole.sum()])
            assert np.array_equal(np.flatnonzero(largest.counts[:, c] > whole), rounded_up), (seed, c)
            assert (largest.counts[:, c] - whole <= 1).all()
    with pytest.raises(ValueError, match="rounding must be one of"):
        dirichlet_partition(labels, clients, 0.3, rng(), rounding="nearest")


def test_rounding_is_a_dirichlet_splits_setting():
    assert DataConfig(partition="dirichlet", rounding="largest_remainder").rounding == "largest_remainder"
    with pytest.raises(ValueError, match="data.rounding=largest_remainder rounds a Dirichlet split's shares, not "
                       "data.partition=grouped_dirichlet's; remove data.rounding"):
        DataConfig(partition="grouped_dirichlet", rounding="largest_remainder")


@pytest.mark.parametrize("alpha", [0, -1.0])
def test_dirichlet_rejects_nonpositive_alpha(alpha):
    with pytest.raises(DataError, match="alpha"):
        dirichlet_partition(LABELS, 10, alpha, rng())
    with pytest.raises(DataError, match="alpha"):
        grouped_dirichlet_partition(LABELS, 10, alpha, rng())


def test_grouped_dirichlet_splits_each_group_of_ten_clients_its_own_share_then_recuts_to_equal_sizes():
    """CReFF's and FedYoYo's released split: 20 clients = 2 groups, each drawing over its own half of
    the shuffled samples, so clients 0-9 hold exactly the first half of the permutation."""
    labels = longtail_labels = np.repeat(np.arange(10), [500, 300, 180, 110, 70, 40, 25, 15, 10, 10])
    for seed in range(3):
        part = grouped_dirichlet_partition(labels, 20, 0.5, rng(seed))
        assert part.sizes.tolist() == [63] * 20  # 1260 samples re-cut into 20
        first_half = set(rng(seed).permutation(labels.size)[:630].tolist())
        assert set(np.concatenate(part.client_indices[:10]).tolist()) == first_half
    # fuller clients take no more: fewer classes per client than one Dirichlet draw re-cut (equal_size)
    classes = [[(p.counts > 0).sum(axis=1).mean() for p in (
        grouped_dirichlet_partition(longtail_labels, 20, 0.5, rng(s)),
        dirichlet_partition(longtail_labels, 20, 0.5, rng(s), equal_size=True))] for s in range(5)]
    grouped, recut = np.mean(classes, axis=0)
    assert grouped < recut, (grouped, recut)
    with pytest.raises(DataError, match="half the group's mean"):  # one class, alpha tiny: someone stays empty
        grouped_dirichlet_partition(np.zeros(100, dtype=np.int64), 10, 0.001, rng(), max_retries=3)


@pytest.mark.parametrize("make", [dirichlet_partition, pathological_partition])
def test_num_clients_bounds(make):
    extra = (0.5,) if make is dirichlet_partition else (1,)
    labels = LABELS[:50]
    with pytest.raises(DataError, match="data.num_clients=51 exceeds the 50 training samples"):
        make(labels, 51, *extra, rng())
    with pytest.raises(DataError, match="data.num_clients=0"):
        make(labels, 0, *extra, rng())
    with pytest.raises(DataError, match="exceeds"):
        iid_partition(labels, 51, rng())


def test_too_many_clients_names_the_settings_that_shrank_the_training_set():
    def message(**data) -> str:
        with pytest.raises(DataError) as info:
            build_partition(DataConfig(num_clients=51, **data), LABELS[:50], rng())
        return str(info.value)

    assert message(train_fraction=0.1).endswith("use fewer clients, a larger data.train_fraction (now 0.1) or a smaller "
                                                "data.imbalance_factor")
    assert message(dataset="synthetic").endswith("use fewer clients or a smaller data.imbalance_factor")
    # a source long-tailed as distributed takes no imbalance factor, nor does a balanced one shrink
    assert message(dataset="inat").endswith("use fewer clients")
    assert message(imbalance_factor=1).endswith("use fewer clients")


def test_pathological_exact_classes_and_coverage():
    for num_clients, k in [(20, 2), (7, 3), (5, 2), (3, 10)]:
        part = pathological_partition(LABELS, num_clients, k, rng(num_clients))
        check_partition(part, LABELS.size)
        assert ((part.counts > 0).sum(axis=1) == k).all()
        assert (part.counts.sum(axis=0) == 200).all()  # every class used, entirely
        holders = (part.counts > 0).sum(axis=0)
        assert holders.max() - holders.min() <= 1  # classes spread evenly over clients


def test_pathological_rejects_bad_settings():
    with pytest.raises(DataError, match="classes_per_client=11"):
        pathological_partition(LABELS, 20, 11, rng())
    with pytest.raises(DataError, match="classes_per_client=0"):
        pathological_partition(LABELS, 20, 0, rng())
    with pytest.raises(DataError, match="some class would be dropped; use more clients"):
        pathological_partition(LABELS, 4, 2, rng())


# Long-tailed labels as the synthetic dataset gives them at IF=100: 300, 179, ..., 5, 3 per class.
LT_LABELS = rng(5).permutation(np.repeat(np.arange(10), longtail_counts(300, 10, 100)))  # 740 samples


def digest(part: Partition) -> str:
    return hashlib.sha256(b"".join(ix.tobytes() + b"|" for ix in part.client_indices)).hexdigest()[:16]


def test_pathological_valid_seeded_splits_unchanged():
    # Digests of the splits made before the redraw for min_client_size existed: valid splits stay identical.
    assert digest(pathological_partition(LABELS, 20, 2, rng(0))) == "10e41964bfc915ef"
    assert digest(pathological_partition(LABELS, 7, 3, rng(7))) == "da480ac4997dbcd9"
    assert digest(pathological_partition(LT_LABELS, 20, 2, rng(0))) == "eadebe7f849b6dda"
    assert digest(pathological_partition(LT_LABELS, 30, 1, rng(1))) == "5abcbb3f58f9b08c"


def test_pathological_never_leaves_a_client_empty():
    generator = rng(0)
    state = generator.bit_generator.state
    with pytest.raises(DataError) as info:  # class 9 (3 samples) is shared among 50 clients
        pathological_partition(LT_LABELS, 500, 1, generator)
    message = str(info.value)
    for fragment in ["500 clients x 1 class", "at least 50 clients", "class 9 has only 3 training samples",
                     "use data.num_clients <= 30", "data.classes_per_client", "data.imbalance_factor"]:
        assert fragment in message
    assert generator.bit_generator.state == state  # failed before drawing
    assert pathological_partition(LT_LABELS, 30, 1, rng(0)).sizes.min() >= 1  # the bound it names works
    with pytest.raises(DataError, match=r"every client holding >= 1 samples after 20 draws.*use fewer clients"):
        pathological_partition(LT_LABELS, 500, 3, rng(0), max_retries=20)


def test_pathological_min_size_honoured():
    assert pathological_partition(LT_LABELS, 20, 2, rng(3)).sizes.min() < 10  # the draw a min_size redraws
    for seed in range(4):
        part = pathological_partition(LT_LABELS, 20, 2, rng(seed), min_size=10)
        check_partition(part, LT_LABELS.size)
        assert part.sizes.min() >= 10
        assert ((part.counts > 0).sum(axis=1) <= 2).all()
    with pytest.raises(DataError, match=r"after 1000 draws.*lower data.min_client_size"):
        pathological_partition(LT_LABELS, 20, 2, rng(0), min_size=30)


def test_pathological_impossible_min_size_fails_before_drawing():
    generator = rng(0)
    state = generator.bit_generator.state
    with pytest.raises(DataError, match=r"pathological partition: data.min_client_size=38 is impossible.*well below 37"):
        pathological_partition(LT_LABELS, 20, 2, generator, min_size=38)
    assert generator.bit_generator.state == state


def test_pathological_config_reaches_the_partition():
    cfg = DataConfig(dataset="synthetic", partition="pathological", classes_per_client=1, num_clients=500)
    with pytest.raises(DataError, match="some client would get none"):
        build_federated_data(cfg, seed=0)
    cfg = DataConfig(dataset="synthetic", partition="pathological", min_client_size=8)
    assert build_federated_data(cfg, seed=0).partition.sizes.min() >= 8


def test_iid_near_equal_and_mixed():
    part = iid_partition(LABELS, 7, rng(0))
    assert part.sizes.max() - part.sizes.min() <= 1
    shares = part.counts / part.sizes[:, None]
    assert np.abs(shares - 0.1).max() < 0.06


# --- local test sets ------------------------------------------------------------------------


def expected_takes(row: np.ndarray, pool: np.ndarray) -> list[int]:
    held = [c for c in range(row.size) if row[c] > 0]
    if not held:
        return [0] * row.size
    size = min(Fraction(int(pool[c]) * int(row.sum()), int(row[c])) for c in held)  # S_k
    return [int(Fraction(int(row[c]), int(row.sum())) * size) for c in range(row.size)]  # floor


def test_local_test_matches_train_proportions_and_is_maximal():
    test_labels = np.concatenate([balanced_labels(5, 30), np.full(4, 2)])  # class 2 has 34
    pool = np.bincount(test_labels)
    train_counts = np.array([[100, 50, 0, 0, 7], [0, 0, 0, 0, 0], [3, 3, 3, 3, 3], [0, 0, 17, 1, 0], [1, 0, 90, 0, 0]])
    result = local_test_indices(train_counts, test_labels, rng(0))
    assert len(result) == len(train_counts)
    for row, idx in zip(train_counts, result):
        assert idx.dtype == np.int64 and np.all(np.diff(idx) > 0)  # sorted, no duplicates
        takes = np.bincount(test_labels[idx], minlength=5)
        assert takes.tolist() == expected_takes(row, pool)
        assert (takes[row == 0] == 0).all()  # only the client's own classes
        if row.sum():
            # Maximal: some held class uses its whole test pool, so S_k cannot grow.
            assert (takes[row > 0] == pool[row > 0]).any()
    assert result[1].size == 0
    assert np.bincount(test_labels[result[2]], minlength=5).tolist() == [30] * 5
    assert np.bincount(test_labels[result[3]], minlength=5).tolist() == [0, 0, 34, 2, 0]


def test_local_test_seeded_and_independent_per_client():
    test_labels = balanced_labels(4, 50)
    train_counts = np.array([[10, 10, 1, 0], [10, 10, 1, 0]])
    a = local_test_indices(train_counts, test_labels, rng(0))
    b = local_test_indices(train_counts, test_labels, rng(0))
    c = local_test_indices(train_counts, test_labels, rng(1))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert not np.array_equal(a[0], a[1])  # same distribution, separate draws


def test_local_test_on_dirichlet_partition():
    test_labels = balanced_labels(10, 100)
    part = dirichlet_partition(LABELS, 10, 0.3, rng(3))
    for row, idx in zip(part.counts, local_test_indices(part.counts, test_labels, rng(4))):
        assert np.bincount(test_labels[idx], minlength=10).tolist() == expected_takes(row, np.bincount(test_labels))


# --- class order: which classes are head and tail -------------------------------------------

def synthetic_data_cfg(**kw) -> DataConfig:
    return DataConfig(**{"dataset": "synthetic", "num_clients": 4, "imbalance_factor": 10, **kw})


def test_class_order_moves_the_counts_and_keeps_each_class_draw():
    labels = balanced_labels(10, 100)
    natural = longtail_indices(labels, 10, rng(0))
    order = np.array([3, 7, 0, 9, 1, 5, 2, 8, 4, 6])
    moved = longtail_indices(labels, 10, rng(0), class_order=order)
    targets = longtail_counts(100, 10, 10)
    assert np.bincount(labels[moved], minlength=10)[order].tolist() == targets.tolist()  # class order[r] has rank r
    assert np.array_equal(longtail_indices(labels, 10, rng(0), class_order=np.arange(10)), natural)
    for c in range(10):  # the same draw per class: the smaller kept set is a prefix of the larger
        a, b = set(natural[labels[natural] == c]), set(moved[labels[moved] == c])
        assert a <= b or b <= a


def test_shuffled_class_order_is_a_seeded_permutation_from_its_own_stream():
    counts = {seed: build_federated_data(synthetic_data_cfg(class_order="shuffled"), seed).train_counts
              for seed in (0, 1, 2)}
    natural = build_federated_data(synthetic_data_cfg(), 0).train_counts
    assert all(sorted(c.tolist()) == sorted(natural.tolist()) for c in counts.values())  # same long tail, moved
    assert np.array_equal(build_federated_data(synthetic_data_cfg(class_order="shuffled"), 0).train_counts, counts[0])
    assert len({tuple(c.tolist()) for c in counts.values()}) == 3  # a different order per seed
    assert natural.tolist() == sorted(natural.tolist(), reverse=True)  # natural: class 0 the head
    # its own stream: the order of seed 0 does not depend on the data stream (same order, other IF)
    steep = build_federated_data(synthetic_data_cfg(class_order="shuffled", imbalance_factor=50), 0).train_counts
    assert np.array_equal(np.argsort(-steep, kind="stable"), np.argsort(-counts[0], kind="stable"))


def test_explicit_class_order_and_its_errors():
    reverse = list(range(9, -1, -1))
    counts = build_federated_data(synthetic_data_cfg(class_order=reverse), 0).train_counts
    assert counts.tolist() == sorted(counts.tolist())  # class 9 is the head
    with pytest.raises(DataError, match=r"data.class_order=\[0, 1, 2\] is not a permutation of the 10 classes 0..9"):
        build_federated_data(synthetic_data_cfg(class_order=[0, 1, 2]), 0)
    with pytest.raises(ValueError, match="must list every class once"):
        synthetic_data_cfg(class_order=[0, 0, 1])
    with pytest.raises(ValueError, match="'random' is not a class order; use natural, shuffled or a list"):
        synthetic_data_cfg(class_order="random")
    with pytest.raises(ValueError, match="9.5 is no class index; list every class by its whole-number index"):
        synthetic_data_cfg(class_order=[*range(9), 9.5])


def test_data_seed_fixes_the_federation_while_the_run_seed_varies(tmp_path):
    from fedlt.config import load_config
    from fedlt.engine.sampling import sampling_schedule
    from fedlt.config import federation_seed

    fixed = synthetic_data_cfg(seed=3, class_order="shuffled")
    a, b = build_federated_data(fixed, 0), build_federated_data(fixed, 1)
    assert same_partition(a.partition, b.partition) and np.array_equal(a.train_counts, b.train_counts)
    assert same_partition(a.partition, build_federated_data(synthetic_data_cfg(class_order="shuffled"), 3).partition)
    cfg = load_config(None, ["data.seed=3", "seed=7"])
    assert federation_seed(cfg.data, cfg.seed) == 3 and federation_seed(synthetic_data_cfg(), 7) == 7
    assert sampling_schedule(3, 20, 8, 5) != sampling_schedule(7, 20, 8, 5)
