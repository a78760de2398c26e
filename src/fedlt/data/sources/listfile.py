"""ImageNet-LT and iNaturalist 2018 in the layout the long-tail literature ships.

An image root plus one list file per split whose lines read ``relative/path.jpg LABEL``
(paths relative to the image root); for iNaturalist 2018 also the organisers' own COCO-style
annotation files (``train2018.json``, ``val2018.json``) where those lists are absent. Images come
in any size, so each is resized (shorter side to ``image_size``) and centre-cropped to a square. Decoding 100k+ JPEGs takes minutes,
so the decoded tensor is cached per (list file, image size), and decoded again when the list or
any image it names changes; see :mod:`.cache`.
"""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fedlt.data.dataset import DatasetPair, ImageDataset
from fedlt.data.sources import cache
from fedlt.data.sources.common import check_labels, decode_all, read_rgb, require_dir, to_chw, unextracted, unreadable
from fedlt.errors import DataError

DEFAULT_IMAGE_SIZE = 64
#: labels at or above this are refused as a list file's corruption (iNaturalist has 8,142 classes)
MAX_LABEL = 1_000_000


@dataclass(frozen=True)
class ListLayout:
    """File names, normalisation statistics and download hint of one list-file dataset.

    ``val_list`` is the dataset's own validation list (a balanced split of neither train nor test),
    None where the literature uses it as the test split. ``names`` is an optional file next to the train list with one class name per line
    (line i names label i); without it classes are named by their label numbers.
    """

    dataset: str
    train_list: str
    test_list: str
    val_list: str | None
    names: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    fix: str
    #: the organisers' COCO-style annotation files (train, test), read where the lists are absent
    annotations: tuple[str, str] | None = None


IMAGENET_LT = ListLayout(
    dataset="imagenet_lt",
    train_list="ImageNet_LT_train.txt",
    test_list="ImageNet_LT_test.txt",
    val_list="ImageNet_LT_val.txt",
    names="ImageNet_LT_classnames.txt",
    mean=(0.485, 0.456, 0.406),
    std=(0.229, 0.224, 0.225),
    fix=(
        "pass data.root=DIR with DIR the ImageNet 2012 folder the list paths are relative to "
        "(holding train/ and val/), and put the ImageNet_LT_*.txt lists of the OLTR release in DIR or its parent"
    ),
)
INAT2018 = ListLayout(
    dataset="inat",
    train_list="iNaturalist18_train.txt",
    test_list="iNaturalist18_val.txt",
    val_list=None,  # the official validation list is the literature's test split
    names="iNaturalist18_classnames.txt",
    mean=(0.466, 0.471, 0.380),
    std=(0.195, 0.194, 0.192),
    fix=(
        "pass data.root=DIR with DIR the iNaturalist 2018 folder the paths are relative to (holding "
        "train_val2018/), and put the official train2018.json and val2018.json (or the iNaturalist18_*.txt "
        "lists) in DIR or its parent"
    ),
    annotations=("train2018.json", "val2018.json"),
)


def load_imagenet_lt(root: Path, image_size: int = DEFAULT_IMAGE_SIZE) -> DatasetPair:
    """ImageNet-LT (1000 classes; the test split is the balanced 50k list)."""
    return load_list_dataset(IMAGENET_LT, root, image_size)


def load_inat2018(root: Path, image_size: int = DEFAULT_IMAGE_SIZE) -> DatasetPair:
    """iNaturalist 2018 (8142 classes; the official validation split serves as test split)."""
    return load_list_dataset(INAT2018, root, image_size)


def load_list_dataset(
    layout: ListLayout,
    root: Path,
    image_size: int = DEFAULT_IMAGE_SIZE,
    train_list: str | None = None,
    test_list: str | None = None,
) -> DatasetPair:
    """Read a list-file dataset whose images live under ``root``.

    Parameters
    ----------
    layout : the dataset's file names and statistics
    root : image root the list paths are relative to
    image_size : side of the square images produced
    train_list, test_list : list file names (looked up in ``root``, then its parent) or
        paths, replacing the layout's defaults
    """
    root = require_dir(layout.dataset, Path(root).expanduser(), layout.fix)
    if train_list is None and test_list is None and _reads_annotations(layout, root):
        train_file, test_file = (_find_list(layout, root, name) for name in layout.annotations)
        train_entries, classes, ids = _parse_annotations(layout, train_file)
        test_entries = _parse_annotations(layout, test_file, ids)[0]
        return DatasetPair(*_splits(layout, root, [(train_file, train_entries), (test_file, test_entries)],
                                    image_size, classes))
    train_file = _find_list(layout, root, train_list or layout.train_list)
    test_file = _find_list(layout, root, test_list or layout.test_list)
    train_entries = _parse(layout, train_file)
    test_entries = _parse(layout, test_file)
    names_file = train_file.parent / layout.names
    if names_file.is_file():
        classes = _read_names(layout, names_file)
    else:
        top = max(label for _, label in train_entries + test_entries)
        classes = [str(label) for label in range(top + 1)]
    return DatasetPair(*_splits(layout, root, [(train_file, train_entries), (test_file, test_entries)], image_size,
                                classes))


def load_list_split(layout: ListLayout, root: Path, list_name: str, image_size: int, classes: list[str]) -> ImageDataset:
    """One more split of a list-file dataset (its validation list), labelled like the training split."""
    root = require_dir(layout.dataset, Path(root).expanduser(), layout.fix)
    list_file = _find_list(layout, root, list_name)
    return _splits(layout, root, [(list_file, _parse(layout, list_file))], image_size, classes)[0]


def _splits(layout: ListLayout, root: Path, splits: list[tuple[Path, list[tuple[str, int]]]], image_size: int,
            classes: list[str]) -> list[ImageDataset]:
    """The splits' datasets: labels checked and every listed image found before any is decoded (a
    missing test image must not wait for minutes of training-set decoding), cached ones read back."""
    labels = [torch.tensor([label for _, label in entries], dtype=torch.int64) for _, entries in splits]
    for (list_file, _), split_labels in zip(splits, labels):
        check_labels(layout.dataset, list_file, split_labels, len(classes), f"fix the list file or {layout.names}")
    cached = [_cached_images(layout, root, list_file, [path for path, _ in entries], image_size)
              for list_file, entries in splits]
    for (list_file, entries), images in zip(splits, cached):
        if images is None:
            _check_listed(layout, root, list_file, [path for path, _ in entries])
    out = []
    for (list_file, entries), split_labels, images in zip(splits, labels, cached):
        if images is None:
            images = _decode(layout, root, list_file, [path for path, _ in entries], image_size)
        out.append(ImageDataset(images, split_labels, list(classes), layout.mean, layout.std))
    return out


def _check_listed(layout: ListLayout, root: Path, list_file: Path, paths: list[str]) -> None:
    """Every image a list names is there; ImageNet's validation archive extracts flat (val/X.JPEG),
    where the lists name val/<wnid>/X.JPEG: said so when that is the case."""
    missing = next((path for path in paths if not _is_file(root / path)), None)
    if missing is None:
        return
    flat = root / Path(missing).parent.parent / Path(missing).name
    hint = (f"; {flat} exists: sort {flat.parent} into one folder per class, as {list_file.name} names them"
            if flat != root / missing and _is_file(flat) else "")
    absent = sum(not _is_file(root / path) for path in paths)
    raise DataError(f"{layout.dataset}: {absent} of the {len(paths)} images {list_file.name} lists are missing, e.g. "
                    f"{root / missing}{hint}; {layout.fix}")


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False too where the system refuses the name itself (longer than a file name
    may be: ENAMETOOLONG, which ``is_file`` raises): a corrupt list line is a missing image, not a crash."""
    try:
        return path.is_file()
    except OSError as err:
        if err.errno != errno.ENAMETOOLONG:  # a folder it may not read: the CLI names that with its fix
            raise
        return False


def decode_image(path: Path, image_size: int, dataset: str, fix: str) -> np.ndarray:
    """One image as (3, image_size, image_size) uint8: shorter side resized, then centre-cropped."""
    image = read_rgb(dataset, path, fix, min_side=image_size)
    width, height = image.size
    scale = image_size / min(width, height)
    size = (max(image_size, round(width * scale)), max(image_size, round(height * scale)))
    if size != image.size:
        image = image.resize(size, Image.Resampling.BILINEAR)
    left, top = (size[0] - image_size) // 2, (size[1] - image_size) // 2
    return to_chw(image.crop((left, top, left + image_size, top + image_size)))


def _find_list(layout: ListLayout, root: Path, name: str) -> Path:
    given = Path(name).expanduser()
    candidates = [given] if given.is_absolute() else [root / given, root.parent / given]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    where = " or ".join(str(c.parent) for c in candidates)
    annotation = given.name in (layout.annotations or ())
    folders = [root, root.parent]
    absent = [name for name in (given.name, *(layout.annotations or ()))  # the official annotations, if not there
              if not any((folder / name).is_file() for folder in folders)]
    packed = None if given.is_absolute() else unextracted(folders, [f"{name}.tar.gz" for name in absent])
    elsewhere = " (or draw the validation set from data.val_from=train or test)" if name == layout.val_list else ""
    raise DataError(f"{layout.dataset}: {'annotation' if annotation else 'list'} file {given.name} not found in "
                    f"{where}; {packed or layout.fix}{elsewhere}")


def _reads_annotations(layout: ListLayout, root: Path) -> bool:
    """The organisers' annotation files stand in for the lists when no train list is there and they are."""
    if layout.annotations is None or any((d / layout.train_list).is_file() for d in (root, root.parent)):
        return False
    return any((d / layout.annotations[0]).is_file() for d in (root, root.parent))


def _parse_annotations(layout: ListLayout, path: Path, ids: dict[int, int] | None = None
                       ) -> tuple[list[tuple[str, int]], list[str], dict[int, int]]:
    """``(file_name, label)`` of a COCO-style annotation file (``images``, ``annotations`` joined on
    ``image_id``; ``category_id`` -> label in category id order, the identity for iNaturalist's
    0..N-1), the class names and that id map (the training file's, passed for the test file)."""
    try:
        tree = json.loads(path.read_bytes())
        files = {image["id"]: image["file_name"] for image in tree["images"]}
        categories = sorted((c["id"], str(c["name"])) for c in tree["categories"])
        orphan = next((a for a in tree["annotations"] if a["image_id"] not in files), None)
        if orphan is not None:
            raise DataError(f"{layout.dataset}: {path}: annotation {orphan.get('id', '?')!r} names image_id "
                            f"{orphan['image_id']!r}, which is not among its images; {layout.fix}")
        pairs = [(files[a["image_id"]], a["category_id"]) for a in tree["annotations"]]
        if not all(isinstance(name, str) for name in files.values()) or not all(
                type(cid) is int for cid in [*(c for _, c in pairs), *(c for c, _ in categories)]):
            raise TypeError("every file_name must be a string and every category id an integer")
    except PermissionError as exc:
        raise unreadable(layout.dataset, path, exc) from None
    except (OSError, ValueError, TypeError, KeyError, RecursionError) as exc:  # JSON (nested too deep), bytes,
        # or shape
        raise DataError(f"{layout.dataset}: {path} is not a COCO-style annotation file with images, annotations "
                        f"and categories ({type(exc).__name__}: {exc}); extract it again from the official "
                        f"{path.name}.tar.gz (or download that again)") from None
    ids = ids if ids is not None else {cid: label for label, (cid, _) in enumerate(categories)}
    unknown = next((cid for _, cid in pairs if cid not in ids), None)
    if unknown is not None or not pairs:
        why = f"category {unknown!r} is not among the training file's" if pairs else "it has no annotations"
        raise DataError(f"{layout.dataset}: {path}: {why}; {layout.fix}")
    return [(name, ids[cid]) for name, cid in pairs], [name for _, name in categories], ids


def _read_text(layout: ListLayout, path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8-sig").splitlines()  # a leading byte-order mark is no path
    except PermissionError as exc:
        raise unreadable(layout.dataset, path, exc) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{layout.dataset}: cannot read {path} ({exc}); {layout.fix}") from exc


def _parse(layout: ListLayout, path: Path) -> list[tuple[str, int]]:
    entries = []
    for number, line in enumerate(_read_text(layout, path), start=1):
        if not line.strip():
            continue
        parts = line.rsplit(maxsplit=1)
        if len(parts) != 2 or not (parts[1].isascii() and parts[1].isdigit()):
            shown = line if len(line) <= 80 else line[:77] + "..."
            raise DataError(
                f"{layout.dataset}: line {number} of {path} reads {shown!r}, expected 'relative/path.jpg LABEL' "
                "with LABEL a non-negative integer; fix or regenerate the list file"
            )
        if int(parts[1]) >= MAX_LABEL:
            raise DataError(f"{layout.dataset}: line {number} of {path} has label {parts[1]}, above any class count "
                            f"(at most {MAX_LABEL - 1}); fix or regenerate the list file")
        entries.append((parts[0], int(parts[1])))
    if not entries:
        raise DataError(f"{layout.dataset}: list file {path} has no entries; fix or regenerate the list file")
    return entries


def _read_names(layout: ListLayout, path: Path) -> list[str]:
    names = [line.strip() for line in _read_text(layout, path) if line.strip()]
    if not names:
        raise DataError(f"{layout.dataset}: class names file {path} is empty; delete it or list one name per line")
    return names


def _cache_entry(layout: ListLayout, root: Path, list_file: Path, paths: list[str], image_size: int) -> Path:
    return cache.entry_path(f"{layout.dataset}-{list_file.stem}-{image_size}px", [list_file],
                            {"root": root.resolve(), "size": image_size}, watched=[root / path for path in paths])


def _cached_images(layout: ListLayout, root: Path, list_file: Path, paths: list[str], image_size: int
                   ) -> torch.Tensor | None:
    """A split's decoded images from the cache, when neither its list file nor any image it names changed."""
    stored = cache.load(_cache_entry(layout, root, list_file, paths, image_size))
    if stored is not None and "images" in stored:
        images = stored["images"]
        if images.dtype == torch.uint8 and tuple(images.shape) == (len(paths), 3, image_size, image_size):
            return images
    return None


def _decode(layout: ListLayout, root: Path, list_file: Path, paths: list[str], image_size: int) -> torch.Tensor:
    """A split's images decoded (minutes for 100k+ JPEGs), then cached."""
    fix = f"fix {list_file.name} or {layout.fix}"
    images = decode_all(
        [root / path for path in paths], lambda path: decode_image(path, image_size, layout.dataset, fix),
        (3, image_size, image_size), layout.dataset
    )
    cache.store(_cache_entry(layout, root, list_file, paths, image_size), {"images": images})
    return images
