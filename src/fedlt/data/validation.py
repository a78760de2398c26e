"""A balanced validation set, disjoint from the training federation and from the test set.

Choices (a method's knobs, a learning rate) are made on validation accuracy so that the test set
is read once, for the result. ``data.val_per_class=N`` draws N images of every class from one
of three sources (``data.val_from``):

- ``dataset``: the dataset's own validation list (ImageNet-LT's ``ImageNet_LT_val.txt``, CINIC-10's
  ``valid/``);
- ``train``: held out of the balanced training source *before* the long-tail draw. The draw
  takes the head class's size from the smallest class of the source, so every class's target
  shrinks by the factor ``(n_max - N) / n_max`` (Fashion-MNIST, N=500: head 6000 -> 5500,
  tail 60 -> 55) and the draw itself differs from the run without validation;
- ``test``: split off the balanced test set, which keeps N fewer images per class; the training
  federation is then exactly the one without validation.

``auto`` takes the dataset's own list where it has one, ``test`` for a source that is already
long-tailed (iNaturalist: its smallest classes cannot spare N images), else ``train``. The draw
uses its own seeded stream, so it is the same for every method run with one federation seed.
"""

from __future__ import annotations

import numpy as np

from fedlt.errors import DataError


def balanced_indices(labels: np.ndarray, per_class: int, num_classes: int, rng: np.random.Generator,
                     keep_one: bool, where: str, fix: str, names: list[str] | None = None) -> np.ndarray:
    """Sorted indices of ``per_class`` uniformly drawn samples of every class of ``labels``.

    ``keep_one``: the split must keep at least one sample of every class after the draw (the
    test set it is taken from still has to measure every class). A class that cannot supply
    them is a DataError naming it (by ``names`` too, where given), ``where`` and ``fix``.
    """
    labels = np.asarray(labels)
    sizes = np.bincount(labels, minlength=num_classes)
    need = per_class + int(keep_one)
    short = np.flatnonzero(sizes < need)
    if short.size:
        c = int(short[0])
        most = int(sizes.min()) - int(keep_one)
        raise DataError(
            f"data.val_per_class={per_class}: class {c}{'' if names is None or names[c] == str(c) else f' ({names[c]})'} has only "
            f"{int(sizes[c])} images in {where}"
            + (", and one must stay there" if keep_one else "")
            + f"; use data.val_per_class <= {max(most, 0)}{fix}"
        )
    chosen = [rng.permutation(np.flatnonzero(labels == c))[:per_class] for c in range(num_classes)]
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def complement(size: int, taken: np.ndarray) -> np.ndarray:
    """The indices of ``range(size)`` not in ``taken``, sorted."""
    keep = np.ones(size, dtype=bool)
    keep[taken] = False
    return np.flatnonzero(keep)


def resolve_source(wanted: str, dataset: str, has_own: bool, long_tailed_source: bool) -> str:
    """The source ``data.val_from`` names for ``dataset`` (``auto`` resolved)."""
    if wanted == "auto":
        return "dataset" if has_own else "test" if long_tailed_source else "train"
    if wanted == "dataset" and not has_own:
        raise DataError(f"data.val_from=dataset: {dataset} has no validation list of its own; "
                        "use data.val_from=train or test (or auto)")
    return wanted
