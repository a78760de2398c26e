"""Dataset names -> loaders, and where each dataset's files are looked for.

Root resolution, first match wins: an explicit ``root`` (``data.root``) and then ``$FEDLT_DATA``,
each narrowed to its conventional subfolder for the dataset when that exists, so one
``FEDLT_DATA`` can hold every dataset side by side; the dataset's default folder (only
Fashion-MNIST has one, from the Debian package).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fedlt.data.dataset import DatasetPair, ImageDataset
from fedlt.data.sources import cifar, cinic, idx, listfile, svhn, synthetic
from fedlt.data.sources.common import check_labels
from fedlt.errors import DataError

Loader = Callable[[Path | None, int], DatasetPair]
#: ``val_loader(root, image_size, classes)``: the dataset's own validation split
ValLoader = Callable[[Path | None, int, list[str]], ImageDataset]

_REFETCH = "re-download or regenerate the dataset files"


@dataclass(frozen=True)
class DatasetInfo:
    """How to find and read one dataset.

    Attributes
    ----------
    description : one line for ``fedlt datasets``
    loader : ``loader(root, image_size) -> DatasetPair``
    subfolder : conventional folder name under ``$FEDLT_DATA`` (``None``: needs no files)
    image_size : the images' side: fixed, or the default when ``resizable``
    resizable : whether ``load_dataset``'s ``image_size`` chooses the side
    default_root : folder used when neither ``root`` nor ``$FEDLT_DATA`` is given (``data/SUBFOLDER`` of the
                   working directory instead when it is missing and that exists: set-up's download)
    hflip : whether a horizontal flip keeps the label (not for digits)
    val_loader : the dataset's own validation split, if it has one (``data.val_from=dataset``)
    long_tailed : the training files are long-tailed already, so a class may not spare
        validation images (``data.val_from=auto`` then splits the test set)
    channels : channels of every image, known without reading them (model x dataset checks)
    val_folder : where the dataset's own validation split is optional, the subfolder that holds it: the
        dataset has one (``data.val_from=auto`` takes it) only where that folder exists
    classes : its number of classes, known without reading the files (``None``: its folders say)
    """

    description: str
    loader: Loader
    subfolder: str | None
    image_size: int
    resizable: bool = False
    default_root: Path | None = None
    hflip: bool = True
    val_loader: ValLoader | None = None
    long_tailed: bool = False
    channels: int = 3
    val_folder: str | None = None
    classes: int | None = None


DATASETS: dict[str, DatasetInfo] = {
    "fmnist": DatasetInfo(
        "Fashion-MNIST, 10 classes, 1x28x28, 60k/10k; IDX files (.gz or plain) in "
        f"{idx.DEFAULT_ROOT} (Debian package dataset-fashion-mnist) or $FEDLT_DATA/fashion-mnist",
        lambda root, size: idx.load_fashion_mnist(root),
        subfolder="fashion-mnist",
        default_root=idx.DEFAULT_ROOT,
        image_size=28,
        channels=1,
        classes=10,
    ),
    "cifar10": DatasetInfo(
        "CIFAR-10, 10 classes, 3x32x32, 50k/10k; python pickles in $FEDLT_DATA/cifar-10-batches-py "
        "(or the binary version, cifar-10-batches-bin)",
        lambda root, size: cifar.load_cifar10(root),
        subfolder=cifar.CIFAR10.folder,
        image_size=32,
        classes=10,
    ),
    "cifar100": DatasetInfo(
        "CIFAR-100 (fine labels), 100 classes, 3x32x32, 50k/10k; python pickles in $FEDLT_DATA/cifar-100-python "
        "(or the binary version, cifar-100-binary)",
        lambda root, size: cifar.load_cifar100(root),
        subfolder=cifar.CIFAR100.folder,
        image_size=32,
        classes=100,
    ),
    "svhn": DatasetInfo(
        "SVHN digits, 10 classes, 3x32x32, 73k/26k; train_32x32.mat, test_32x32.mat in $FEDLT_DATA/svhn",
        lambda root, size: svhn.load_svhn(root),
        subfolder="svhn",
        image_size=32,
        hflip=False,
        classes=10,
    ),
    "cinic10": DatasetInfo(
        "CINIC-10, 10 classes, 3x32x32, 90k/90k; train/ and test/ PNG class folders in $FEDLT_DATA/cinic-10 "
        "(validation: valid/)",
        lambda root, size: cinic.load_cinic10(root),
        subfolder="cinic-10",
        image_size=32,
        val_loader=lambda root, size, classes: cinic.load_cinic10_val(root),
        val_folder="valid",
        classes=10,
    ),
    "imagenet_lt": DatasetInfo(
        "ImageNet-LT, 1000 classes, 3xSxS (data.image_size, default 64), 116k/50k; ImageNet images in "
        "$FEDLT_DATA/imagenet with ImageNet_LT_{train,test}.txt (validation: ImageNet_LT_val.txt) there or in its "
        "parent",
        lambda root, size: listfile.load_imagenet_lt(root, size),
        subfolder="imagenet",
        image_size=listfile.DEFAULT_IMAGE_SIZE,
        resizable=True,
        val_loader=lambda root, size, classes: listfile.load_list_split(
            listfile.IMAGENET_LT, root, listfile.IMAGENET_LT.val_list, size, classes),
        long_tailed=True,
        classes=1000,
    ),
    "inat": DatasetInfo(
        "iNaturalist 2018, 8142 classes, 3xSxS (data.image_size, default 64), 438k/24k; images in "
        "$FEDLT_DATA/inaturalist2018 with train2018.json and val2018.json (or iNaturalist18_{train,val}.txt) there "
        "or in its parent",
        lambda root, size: listfile.load_inat2018(root, size),
        subfolder="inaturalist2018",
        image_size=listfile.DEFAULT_IMAGE_SIZE,
        resizable=True,
        long_tailed=True,
        classes=8142,
    ),
    **{name: DatasetInfo(
        "your own images: RGB PNG or JPEG files of side data.image_size (default 32) in DIR/train/<class>/ and "
        "DIR/test/<class>/ (optionally DIR/val/<class>/), data.root=DIR; classes in sorted folder order"
        + ("; long-tailed as they are (no data.imbalance_factor)" if long_tailed else
           "; long-tailed by data.imbalance_factor from a balanced train/"),
        lambda root, size: _folders().load_folder_dataset(root, size),
        subfolder="imagefolder",
        image_size=32,
        resizable=True,
        val_loader=lambda root, size, classes: _folders().load_folder_val(root, size, classes),
        long_tailed=long_tailed,
        val_folder="val",
    ) for name, long_tailed in (("imagefolder", False), ("imagefolder_lt", True))},
    "synthetic": DatasetInfo(
        "seeded toy dataset for tests and smoke runs, 10 classes, 3xSxS (data.image_size, default 16), "
        "3000/1000; generated, no files",
        lambda root, size: synthetic.make_synthetic(size),
        subfolder=None,
        image_size=synthetic.DEFAULT_IMAGE_SIZE,
        resizable=True,
        classes=synthetic.NUM_CLASSES,
    ),
    **{name: DatasetInfo(
        f"the synthetic construction at CIFAR-{classes}'s size for timing without files ({classes} classes, "
        f"3xSxS (data.image_size, default 32), {classes * train // 1000}k/{classes * test // 1000}k; not CIFAR's "
        "images); generated",
        lambda root, size, shape=(classes, train, test): synthetic.make_synthetic(size, *shape),
        subfolder=None,
        image_size=synthetic.STAND_IN_IMAGE_SIZE,
        resizable=True,
        classes=classes,
    ) for name, (classes, train, test) in synthetic.STAND_INS.items()},
}

def _folders():
    """The image-folder reader, imported when used: it reads a federation's declarations, which read this registry."""
    from fedlt.data.sources import imagefolder

    return imagefolder


#: the datasets every process of fedlt knows; one added to DATASETS in code exists in its own process only
BUILTIN_DATASETS = frozenset(DATASETS)


def list_datasets() -> list[tuple[str, str]]:
    """``(name, description)`` pairs in registry order, for ``fedlt datasets``."""
    return [(name, info.description) for name, info in DATASETS.items()]


def load_dataset(
    name: str, root: str | None = None, image_size: int | None = None, *, every_class: bool = False,
    with_val: bool = False,
) -> DatasetPair:
    """Load dataset ``name`` as uint8 train/test tensors.

    Parameters
    ----------
    name : a key of :data:`DATASETS`
    root : folder holding the dataset's files; see the module docstring for the fallbacks
    image_size : image side for imagenet_lt, inat and synthetic; for fixed-size datasets it
        may only repeat the native size
    every_class : also require a training and a test sample of every class (``classes``, the
        dataset's class list), as a federation does; without it small test files may lack classes
    with_val : also load the dataset's own validation split (``DatasetPair.val``); a dataset
        without one is a DataError

    Raises
    ------
    DataError
        unknown name, no or unusable folder, missing or corrupt files, bad labels, an empty
        split, a class without training samples (``every_class``)
    """
    info = dataset_info(name)
    size = resolve_image_size(name, image_size)
    folder = _resolve_root(name, info, root)
    pair = info.loader(folder, size)
    where = folder if folder is not None else name
    for split, which in ((pair.train, "training"), (pair.test, "test")):
        _finish(name, where, split, which)
    if every_class:
        _require_every_class(name, where, pair.train)
        _require_every_class(name, where, pair.test, "test")
    if with_val:
        if info.val_loader is None:
            raise DataError(f"{name} has no validation list of its own; use data.val_from=train or test (or auto)")
        pair.val = info.val_loader(folder, size, pair.train.classes)
        _finish(name, where, pair.val, "validation")
    return pair


def has_own_validation(name: str, root: str | None) -> bool:
    """Whether dataset ``name`` (files in ``root``) has a validation split of its own."""
    info = dataset_info(name)
    if info.val_loader is None:
        return False
    if info.val_folder is None:
        return True
    try:
        folder = _resolve_root(name, info, root)
    except DataError:  # no folder given: the loader names that problem
        return False
    return folder is not None and (folder / info.val_folder).is_dir()


def dataset_info(name: str) -> DatasetInfo:
    """The registry entry of dataset ``name``; an unknown name is a DataError listing the known ones."""
    info = DATASETS.get(name)
    if info is None:
        raise DataError(f"unknown dataset '{name}'; set data.dataset to one of: {', '.join(DATASETS)}")
    return info


def lt_name(name: str) -> str:
    """How tables and titles name a federation's data: ``fmnist-LT`` for a source made long-tailed,
    ``imagenet_lt`` for one long-tailed as distributed (not ``imagenet_lt-LT``)."""
    info = DATASETS.get(name)
    return name if info is not None and info.long_tailed else f"{name}-LT"


def tail_label(name: str, imbalance_factor: float) -> str:
    """``IF=100``, or ``as distributed`` for a dataset long-tailed already (data.imbalance_factor not read)."""
    info = DATASETS.get(name)
    return "as distributed" if info is not None and info.long_tailed else f"IF={imbalance_factor:g}"


def resolve_image_size(name: str, requested: int | None) -> int:
    """The image side dataset ``name`` loads at for ``data.image_size`` = ``requested`` (None: its own)."""
    info = dataset_info(name)
    if requested is None or requested == info.image_size:
        return info.image_size
    if not info.resizable:
        raise DataError(
            f"{name}: images are {info.image_size}x{info.image_size} and are not resized, "
            f"but data.image_size={requested}; drop data.image_size or set it to {info.image_size}"
        )
    if requested < 1:
        raise DataError(f"{name}: data.image_size={requested} is not a positive image side; use e.g. 32 or 64")
    return requested


def _resolve_root(name: str, info: DatasetInfo, root: str | None) -> Path | None:
    if info.subfolder is None:
        return None
    if root is not None:  # narrowed like $FEDLT_DATA, so one data.root serves a suite of several datasets
        given = _look_up(name, Path(root).expanduser(), "data.root=DIR")
        return given / info.subfolder if (given / info.subfolder).is_dir() else given
    env = os.environ.get("FEDLT_DATA")
    if env:
        base = _look_up(name, Path(env).expanduser(), "FEDLT_DATA=DIR")
        nested = base / info.subfolder
        if nested.is_dir():
            return nested
        default = info.default_root
        if default is not None and default.is_dir() and not any((base / f.name).exists() for f in default.iterdir()):
            return default  # FEDLT_DATA holds other datasets (not this one's files); this one is installed system-wide
        return base
    if info.default_root is not None:
        local = Path("data") / info.subfolder  # where scripts/setup.sh downloads it when apt cannot install it
        return local if not info.default_root.is_dir() and local.is_dir() else info.default_root
    raise DataError(
        f"{name}: no data folder given and FEDLT_DATA is unset; pass data.root=DIR "
        f"or set FEDLT_DATA=DIR (looked up as DIR/{info.subfolder} first)"
    )


def _look_up(name: str, folder: Path, setting: str) -> Path:
    """``folder``, or a DataError where the system refuses to look it up at all (a name longer than the file
    system allows): ``is_dir`` raises that OSError, which the narrowing and the loaders would let through."""
    try:
        folder.exists()
    except OSError as err:
        raise DataError(f"{name}: data folder {folder} cannot be looked up ({err.strerror}); set {setting} to the "
                        "folder holding the dataset's files") from None
    return folder


def _finish(name: str, where: Path | str, split: ImageDataset, which: str) -> None:
    """Enforce what every consumer relies on: a non-empty split, labels index ``classes``, contiguous images."""
    if len(split) == 0:
        raise DataError(f"{name}: the {which} set in {where} is empty (0 images); {_REFETCH}")
    check_labels(name, where, split.labels, split.num_classes, _REFETCH)
    if not split.images.is_contiguous():
        split.images = split.images.contiguous()


def _require_every_class(name: str, where: Path | str, split: ImageDataset, which: str = "training") -> None:
    """Every class in ``split.classes`` needs a sample: a training one, or the class count would shrink
    downstream; a test one, or the class's accuracy (and its shot group's) would read 0 instead of unmeasured."""
    missing = torch.nonzero(split.class_counts() == 0).flatten().tolist()
    if missing:
        c = missing[0]
        label = f"class {c}" if split.classes[c] == str(c) else f"class {c} ({split.classes[c]})"
        others = f" and {len(missing) - 1} other classes have" if len(missing) > 1 else " has"
        if name.startswith("imagefolder"):  # the user's own folders: the fix is theirs to make
            folder = Path(where) / ("train" if which == "training" else which) / split.classes[c]
            fix = f"add {which} images of that class to {folder}/"
        else:
            fix = f"the files are incomplete or not {name}'s, {_REFETCH}"
        raise DataError(f"{name}: {label}{others} no {which} samples in {where}, but {name} has {split.num_classes} "
                        f"classes; {fix}")
