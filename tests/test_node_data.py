"""Real federations' data: the declaration without training data, a node's own image folder, and
``fedlt data export``, whose node folders must load back as exactly the clients' rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_datasets import dump, write_cifar10, write_cinic, write_idx, write_svhn

from fedlt.cli import main
from fedlt.config import Config, DataConfig, load_config
from fedlt.data import export
from fedlt.data.declaration import DeclaredDataset, declared_dataset
from fedlt.data.export import client_name, export_federation
from fedlt.data.federated import FederatedData, build_federated_data
from fedlt.data.partition import Partition
from fedlt.data.registry import DATASETS, load_dataset
from fedlt.data.sources import cifar, idx, listfile
from fedlt.data.sources.imagefolder import class_folder_name, load_image_folder, load_node_data
from fedlt.errors import ConfigError, DataError
from fedlt.run_parts import check_config

SRC = Path(__file__).resolve().parents[1] / "src"
RNG = np.random.default_rng(0)
#: a small synthetic federation; the class names exercise the folder-name escaping
ODD_NAMES = ["cat/dog", ".hidden", "50%", "a:b", "plain", "x*y", "q?", "<tag>", "pipe|", "back\\slash"]
SYNTHETIC = ["data.dataset=synthetic", "data.num_clients=3", "data.val_per_class=5"]


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No test sees the user's data folders or writes to the user's cache."""
    monkeypatch.delenv("FEDLT_DATA", raising=False)
    monkeypatch.setenv("FEDLT_CACHE", str(tmp_path / "cache"))


def write_balanced_fmnist(root: Path, train_per_class: int = 12, test_per_class: int = 6) -> Path:
    """Fashion-MNIST IDX files with every class present, as a federation needs."""
    root.mkdir(parents=True)
    for prefix, per_class in (("train", train_per_class), ("t10k", test_per_class)):
        labels = RNG.permutation(np.repeat(np.arange(10), per_class)).astype(np.uint8)
        images = RNG.integers(0, 256, (labels.size, 28, 28), dtype=np.uint8)
        write_idx(root / f"{prefix}-images-idx3-ubyte", 2051, images, gz=False)
        write_idx(root / f"{prefix}-labels-idx1-ubyte", 2049, labels, gz=False)
    return root


def assert_rows(loaded, images: torch.Tensor, labels: torch.Tensor, classes: list[str]) -> None:
    assert loaded.images.dtype == torch.uint8 and torch.equal(loaded.images, images)
    assert torch.equal(loaded.labels, labels) and loaded.classes == classes


def assert_round_trip(out: Path, cfg: Config, data: FederatedData) -> None:
    """Every node folder holds its client's rows and local test set in order; the server its sets."""
    deployed = load_config(out / "federation.yaml")
    assert deployed.flower.node_data is True and deployed.engine == "flower"
    assert deployed.flower.min_nodes == data.num_clients  # every site awaited
    check_config(deployed)  # the exported config is one a deployment accepts
    declared = declared_dataset(deployed.data)
    classes = declared.classes
    nodes = sorted(p.name for p in (out / "nodes").iterdir())
    assert nodes == [client_name(k, data.num_clients) for k in range(data.num_clients)]
    for k, name in enumerate(nodes):
        node = load_node_data(out / "nodes" / name, declared)
        rows = data.client_indices(k)
        assert_rows(node.train, data.train.images[rows], data.train.labels[rows], classes)
        local = torch.as_tensor(data.local_test[k], dtype=torch.int64)
        if len(local):
            assert_rows(node.test, data.test.images[local], data.test.labels[local], classes)
        else:
            assert node.test is None
        assert node.train.mean == data.train.mean and node.train.std == data.train.std
    assert_rows(load_image_folder(out / "server", "test", declared), data.test.images, data.test.labels, classes)
    if data.val is not None:
        assert_rows(load_image_folder(out / "server", "val", declared), data.val.images, data.val.labels, classes)
    else:
        assert not (out / "server" / "val").exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []  # no staging folder left


# ----------------------------------------------------------------------------- declaration


def write_cifar100(parent: Path) -> None:
    folder = parent / "cifar-100-python"
    folder.mkdir()
    names = [name.encode() for name in cifar.CIFAR100.classes]
    x = RNG.integers(0, 256, (4, 3072), dtype=np.uint8)
    dump(folder / "meta", {b"fine_label_names": names})
    dump(folder / "train", {b"data": x, b"fine_labels": [0, 42, 99, 7]})
    dump(folder / "test", {b"data": x[:2], b"fine_labels": [0, 42]})


WRITERS = {
    "fmnist": lambda root: write_balanced_fmnist(root / "fmnist", 1, 1),
    "cifar10": lambda root: (write_cifar10(root), root)[1],
    "cifar100": lambda root: (write_cifar100(root), root)[1],
    "svhn": lambda root: (write_svhn(root / "svhn"), root / "svhn")[1],
    "cinic10": lambda root: (write_cinic(root / "cinic", splits=("train", "test")), root / "cinic")[1],
    "synthetic": lambda root: None,
    "synthetic_cifar10": lambda root: None,
    "synthetic_cifar100": lambda root: None,
}


def test_every_dataset_is_declared_or_needs_data_classes() -> None:
    assert set(WRITERS) | {"imagenet_lt", "inat", "imagefolder", "imagefolder_lt"} == set(DATASETS)


@pytest.mark.parametrize("name", list(WRITERS))
def test_declaration_equals_what_the_loader_produces(tmp_path: Path, name: str) -> None:
    root = WRITERS[name](tmp_path)
    pair = load_dataset(name, root=None if root is None else str(root))
    declared = declared_dataset(DataConfig(dataset=name))
    assert declared == DeclaredDataset(pair.train.classes, pair.train.in_channels, pair.train.image_size,
                                       pair.train.mean, pair.train.std)


def test_published_class_names() -> None:
    hundred = declared_dataset(DataConfig(dataset="cifar100")).classes
    assert len(set(hundred)) == 100 and hundred == sorted(hundred)  # the meta file lists them alphabetically
    assert (hundred[0], hundred[42], hundred[99]) == ("apple", "leopard", "worm")
    assert declared_dataset(DataConfig(dataset="cinic10")).classes == list(cifar.CIFAR10.classes)
    assert declared_dataset(DataConfig(dataset="fmnist")).classes[0] == "T-shirt/top"


def test_synthetic_declaration_follows_the_image_size() -> None:
    declared = declared_dataset(DataConfig(dataset="synthetic", image_size=8))
    pair = load_dataset("synthetic", image_size=8)
    assert declared.image_size == 8 and (declared.mean, declared.std) == (pair.train.mean, pair.train.std)


def test_data_classes_renames_and_is_required_where_files_name_the_classes() -> None:
    names = [f"n{k}" for k in range(10)]
    assert declared_dataset(DataConfig(dataset="svhn", classes=names)).classes == names
    lt = declared_dataset(DataConfig(dataset="imagenet_lt", classes=["a", "b", "c"], image_size=32))
    assert lt == DeclaredDataset(["a", "b", "c"], 3, 32, listfile.IMAGENET_LT.mean, listfile.IMAGENET_LT.std)
    assert declared_dataset(DataConfig(dataset="inat", classes=["a"])).image_size == listfile.DEFAULT_IMAGE_SIZE


def test_a_simulated_federation_names_its_classes_by_data_classes_and_refuses_a_wrong_count() -> None:
    """In one process the files give the labels; ``data.classes`` renames them in every split (the
    reports' per-class names) and must name each of the files' classes once."""
    names = [f"kind{k}" for k in range(10)]
    data = build_federated_data(DataConfig(dataset="synthetic", image_size=8, classes=names, val_per_class=2), seed=0)
    assert data.train.classes == data.test.classes == data.val.classes == names
    assert load_dataset("synthetic", image_size=8).train.classes[0] != "kind0"  # the loader's own splits are untouched
    with pytest.raises(ConfigError, match=r"data.classes lists 9 names but synthetic has 10 classes; list 10 names"):
        build_federated_data(DataConfig(dataset="synthetic", image_size=8, classes=names[:9]), seed=0)
    with pytest.raises(ConfigError, match="names 'kind1' twice"):
        build_federated_data(DataConfig(dataset="synthetic", image_size=8, classes=[*names[:9], "kind1"]), seed=0)


@pytest.mark.parametrize(
    ("data", "error", "fragments"),
    [
        ({"dataset": "cifar10", "classes": ["a", "b"]}, ConfigError, ["data.classes lists 2 names", "10 classes"]),
        ({"dataset": "fmnist", "classes": [*"abcdefghi", "a"]}, ConfigError, ["names 'a' twice"]),
        ({"dataset": "svhn", "classes": [*"abcdefghi", " "]}, ConfigError, ["data.classes[9] is an empty name"]),
        ({"dataset": "imagenet_lt"}, ConfigError, ["data.classes is required for imagenet_lt"]),
        ({"dataset": "inat", "classes": []}, ConfigError, ["data.classes is empty"]),
        ({"dataset": "fmnist", "image_size": 32}, DataError, ["fmnist", "data.image_size=32", "set it to 28"]),
        ({"dataset": "mnist"}, DataError, ["unknown dataset 'mnist'", "fmnist"]),
    ],
)
def test_declaration_errors(data: dict, error: type, fragments: list[str]) -> None:
    with pytest.raises(error) as info:
        declared_dataset(DataConfig(**data))
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message


# ----------------------------------------------------------------------------- a node's folder

DECLARED = DeclaredDataset([f"c{k}" for k in range(10)], 3, 8, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def save(path: Path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def rgb(side: int = 8) -> np.ndarray:
    return RNG.integers(0, 256, (side, side, 3), dtype=np.uint8)


def test_a_datasets_digest_changes_with_any_pixel_label_or_order_and_with_nothing_else() -> None:
    """What a site sends so a resumed run tells its data from other data: short, and different for images
    changed under the same class counts."""
    from fedlt.data.dataset import ImageDataset

    g = torch.Generator().manual_seed(0)
    images, labels = torch.randint(0, 256, (6, 3, 4, 4), dtype=torch.uint8, generator=g), torch.tensor([0, 1, 1, 2, 2, 2])
    base = ImageDataset(images, labels, ["a", "b", "c"], (0.5,) * 3, (0.25,) * 3)
    digest = base.digest()
    assert len(digest) == 32 and int(digest, 16) >= 0
    assert ImageDataset(images.clone(), labels.clone(), ["x", "y", "z"], (0.1,) * 3, (1.0,) * 3).digest() == digest
    pixel = images.clone()
    pixel[3, 1, 2, 2] ^= 1
    order = torch.tensor([1, 0, 2, 3, 4, 5])
    others = [ImageDataset(pixel, labels, base.classes, base.mean, base.std),  # the same class counts
              ImageDataset(images, torch.tensor([1, 0, 1, 2, 2, 2]), base.classes, base.mean, base.std),
              base.subset(order), ImageDataset(images.reshape(6, 3, 2, 8), labels, base.classes, base.mean, base.std)]
    assert len({digest, *(d.digest() for d in others)}) == 5


def test_a_node_missing_classes_keeps_global_labels_in_file_name_order(tmp_path: Path) -> None:
    pixels = {}
    for label in (1, 2, 3, 4, 6, 7, 8, 9):  # no c0, no c5
        for name in ("b.png", f"a{label}.jpeg") if label == 2 else ("b.png",):
            pixels[(name, label)] = rgb()
            save(tmp_path / "train" / f"c{label}" / name, pixels[(name, label)])
    # a JPEG is lossy, so the a2.jpeg row is compared with what PIL decodes from it
    pixels[("a2.jpeg", 2)] = np.asarray(Image.open(tmp_path / "train" / "c2" / "a2.jpeg"))
    (tmp_path / "train" / ".DS_Store").write_text("hidden entries are skipped")
    node = load_node_data(tmp_path, DECLARED)
    order = sorted(pixels)  # by file name, then class index
    assert node.test is None and node.train.num_classes == 10 and node.train.classes == DECLARED.classes
    assert node.train.labels.tolist() == [label for _, label in order] == [2, 1, 2, 3, 4, 6, 7, 8, 9]
    assert node.train.class_counts().tolist() == [0, 1, 2, 1, 1, 0, 1, 1, 1, 1]
    expected = torch.from_numpy(np.stack([pixels[key] for key in order])).permute(0, 3, 1, 2)
    assert torch.equal(node.train.images, expected)
    assert (node.train.mean, node.train.std) == (DECLARED.mean, DECLARED.std)  # declared, not measured


def test_class_folder_names_escape_only_what_a_file_system_cannot_hold() -> None:
    assert class_folder_name("T-shirt/top") == "T-shirt%2Ftop"
    assert class_folder_name("Ankle boot") == "Ankle boot"
    assert class_folder_name(".x") == "%2Ex" and class_folder_name("a%2Fb") == "a%252Fb"
    assert len({class_folder_name(n) for n in ODD_NAMES}) == len(ODD_NAMES)
    assert all("/" not in class_folder_name(n) and not class_folder_name(n).startswith(".") for n in ODD_NAMES)


def _unknown_class(root: Path) -> Path:
    save(root / "train" / "zebra" / "z.png", rgb())
    return root / "train" / "zebra"


def _empty_class(root: Path) -> Path:
    (root / "train" / "c4").mkdir()
    return root / "train" / "c4"


def _garbage(root: Path) -> Path:
    path = root / "train" / "c1" / "broken.png"
    path.write_bytes(b"not an image at all")
    return path


def _truncated(root: Path) -> Path:
    path = root / "train" / "c1" / "a.png"
    path.write_bytes(path.read_bytes()[:60])
    return path


def _sized(side: int) -> Path:
    def damage(root: Path) -> Path:
        save(root / "train" / "c2" / "big.png", rgb(side))
        return root / "train" / "c2" / "big.png"

    return damage


def _mode(pixels: np.ndarray) -> Path:
    def damage(root: Path) -> Path:
        save(root / "test" / "c2" / "odd.png", pixels)
        return root / "test" / "c2" / "odd.png"

    return damage


def _no_train(root: Path) -> Path:
    os.rename(root / "train", root / "training")
    return root / "train"


def _empty_train(root: Path) -> Path:
    for path in (root / "train" / "c1").iterdir():
        path.unlink()
    (root / "train" / "c1").rmdir()
    return root / "train"


def _empty_test(root: Path) -> Path:
    (root / "test").mkdir()
    return root / "test"


def _text_file(root: Path) -> Path:
    (root / "train" / "c1" / "notes.txt").write_text("labels")
    return root / "train" / "c1" / "notes.txt"


def _stray_image(root: Path) -> Path:
    save(root / "train" / "loose.png", rgb())
    return root / "train" / "loose.png"


@pytest.mark.parametrize(
    ("damage", "fragments"),
    [
        (_unknown_class, ["unknown class folder", "data.classes: c0, c1, c2"]),
        (_empty_class, ["holds no images"]),
        (_garbage, ["cannot decode image", "valid PNG or JPEG"]),
        (_truncated, ["cannot decode image"]),
        (_sized(9), ["is 9x9, expected 8x8", "not resized"]),
        (_mode(RNG.integers(0, 256, (8, 8), dtype=np.uint8)), ["1 channel(s) (mode L), expected 3 (mode RGB)"]),
        (_mode(RNG.integers(0, 256, (8, 8, 4), dtype=np.uint8)), ["4 channel(s) (mode RGBA), expected 3"]),
        (_no_train, ["does not exist", "train/<class>"]),
        (_empty_train, ["holds no images"]),
        (_empty_test, ["holds no images"]),
        (_text_file, ["is not a .png/.jpg/.jpeg image"]),
        (_stray_image, ["is a file where class folders are expected"]),
    ],
)
def test_node_folder_errors_are_one_line_naming_the_file(tmp_path: Path, damage, fragments: list[str]) -> None:
    save(tmp_path / "train" / "c1" / "a.png", rgb())
    culprit = damage(tmp_path)
    with pytest.raises(DataError) as info:
        load_node_data(tmp_path, DECLARED)
    message = str(info.value)
    assert "\n" not in message and message.startswith("node data: ") and str(culprit) in message, message
    assert all(f in message for f in fragments), message


def test_greyscale_nodes_need_mode_l(tmp_path: Path) -> None:
    grey = DeclaredDataset(["a", "b"], 1, 8, (0.5,), (0.5,))
    pixels = RNG.integers(0, 256, (8, 8), dtype=np.uint8)
    save(tmp_path / "train" / "b" / "0.png", pixels)
    assert torch.equal(load_node_data(tmp_path, grey).train.images, torch.from_numpy(pixels)[None, None])
    save(tmp_path / "train" / "a" / "1.png", rgb())
    with pytest.raises(DataError, match=r"3 channel\(s\) \(mode RGB\), expected 1 \(mode L\)"):
        load_node_data(tmp_path, grey)


# ----------------------------------------------------------------------------- export


def test_synthetic_export_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, SYNTHETIC)
    cfg.data.classes = ODD_NAMES
    out = tmp_path / "fed"
    lines: list[str] = []
    assert export_federation(cfg, out, progress=lines.append) == out
    data = build_federated_data(cfg.data, cfg.seed)
    assert_round_trip(out, cfg, data)
    assert sorted(p.name for p in (out / "server" / "test").iterdir()) == sorted(map(class_folder_name, ODD_NAMES))
    assert load_config(out / "federation.yaml").data.classes == ODD_NAMES
    first = sorted((out / "nodes" / "client-0" / "train").rglob("*.png"), key=lambda p: p.name)
    assert [p.name for p in first[:2]] == ["000000.png", "000001.png"]
    assert lines[-2].startswith("nodes 3/3 written") and lines[-1] == "server written (test 1000, validation 50 images)"


def test_export_fills_an_existing_empty_folder_in_place(tmp_path: Path) -> None:
    """An existing empty OUT (a mount point, the shell's working directory) stays the same folder."""
    cfg = load_config(None, SYNTHETIC)
    out = tmp_path / "fed"
    out.mkdir()
    inode = out.stat().st_ino
    export_federation(cfg, out)
    assert out.stat().st_ino == inode
    assert sorted(p.name for p in out.iterdir()) == ["federation.yaml", "nodes", "server"]
    assert_round_trip(out, cfg, build_federated_data(cfg.data, cfg.seed))


def test_an_export_killed_outright_leaves_nothing_that_blocks_the_next(tmp_path: Path) -> None:
    """An export into an existing folder stages inside it; killed by SIGKILL, it left a hidden staging
    folder there, and every later export into that folder was refused as "not empty"."""
    import re

    from fedlt.data.export import check_export_folder
    from fedlt.errors import DataError

    ended = subprocess.Popen(["true"])
    ended.wait()
    out = tmp_path / "fed"
    (out / f".partial-{ended.pid}-0123abcd" / "nodes").mkdir(parents=True)  # its process is gone
    live = out / f".partial-{os.getpid()}-0123abcd"
    live.mkdir()  # an export still writing
    with pytest.raises(DataError, match=f"export folder {re.escape(str(out))} is not empty"):
        check_export_folder(out)
    live.rmdir()
    cfg = load_config(None, SYNTHETIC)
    export_federation(cfg, out)
    assert sorted(p.name for p in out.iterdir()) == ["federation.yaml", "nodes", "server"]


def test_fashion_mnist_export_round_trips(tmp_path: Path) -> None:
    root = write_balanced_fmnist(tmp_path / "idx")
    cfg = load_config(None, ["data.dataset=fmnist", f"data.root={root}", "data.num_clients=4",
                             "data.imbalance_factor=3", "data.partition=pathological", "data.classes_per_client=3"])
    out = export_federation(cfg, tmp_path / "fed")
    data = build_federated_data(cfg.data, cfg.seed)
    assert_round_trip(out, cfg, data)
    assert (out / "server" / "test" / "T-shirt%2Ftop").is_dir()
    assert load_config(out / "federation.yaml").data.classes == idx.CLASSES
    with Image.open(next((out / "server" / "test" / "Trouser").iterdir())) as image:
        assert image.mode == "L" and image.size == (28, 28)


def test_export_client_names_sort_in_client_order() -> None:
    assert [client_name(k, 11) for k in (0, 9, 10)] == ["client-00", "client-09", "client-10"]
    assert client_name(0, 1) == "client-0" and client_name(99, 100) == "client-99"


def test_a_failed_export_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, SYNTHETIC)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "_write_server", full_disk)
    with pytest.raises(DataError, match="No space left on device"):
        export_federation(cfg, tmp_path / "fed")
    monkeypatch.setattr(export, "_write_server", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        export_federation(cfg, tmp_path / "fed")
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_client_without_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, SYNTHETIC)
    real = build_federated_data(cfg.data, cfg.seed)
    rows = real.partition.client_indices
    emptied = Partition([rows[0], rows[1][:0], rows[2]], real.partition.counts)
    monkeypatch.setattr(export, "build_federated_data", lambda *args: FederatedData(
        real.train, real.test, emptied, real.local_test))
    with pytest.raises(DataError, match="client 1 holds no training rows.*data.min_client_size=1"):
        export_federation(cfg, tmp_path / "fed")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- the command line


def cli_error(args: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> str:
    """``fedlt ARGS`` in this process, as the console script runs it: exit 2 and one stderr line."""
    monkeypatch.setattr(sys, "argv", ["fedlt", *args])
    with pytest.raises(SystemExit) as info:
        main()
    captured = capsys.readouterr()
    assert info.value.code == 2 and captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedlt: error: "), captured.err
    return lines[0]


@pytest.mark.parametrize("existing", [False, True])  # OUT new (the staging folder renamed), or empty (filled)
def test_an_export_interrupted_as_it_ends_says_what_is_there(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, existing: bool) -> None:
    """Ctrl-C just after the last rename said "nothing was written" beside a complete export; before it
    (filling an empty folder), the moved parts are removed and the line is right."""
    out = tmp_path / "fed"
    if existing:
        out.mkdir()
    replace = os.replace

    def then_ctrl_c(source, target):
        replace(source, target)
        if Path(target) in (out, out / export.FEDERATION_FILE):  # the export's last rename
            raise KeyboardInterrupt

    monkeypatch.setattr(export.os, "replace", then_ctrl_c)
    monkeypatch.setattr(sys, "argv", ["fedlt", "data", "export", *SYNTHETIC, "--out", str(out)])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 130
    line = capsys.readouterr().err.splitlines()[-1]
    if existing:  # stopped before the export's end: what it had moved into OUT is gone
        assert line == f"fedlt: interrupted; nothing was written to {out}" and list(out.iterdir()) == []
    else:
        assert line == f"fedlt: interrupted; the export in {out} is complete"
        assert load_config(out / "federation.yaml").flower.node_data


def test_cli_export_refuses_a_non_empty_folder_and_a_bad_config(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    line = cli_error(["data", "export", *SYNTHETIC, "--out", str(full)], capsys, monkeypatch)
    assert f"export folder {full} is not empty" in line
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    new = tmp_path / "new"
    line = cli_error(["data", "export", *SYNTHETIC, "data.alpha=-1", "--out", str(new)], capsys, monkeypatch)
    assert "data.alpha" in line
    line = cli_error(["data", "export", *SYNTHETIC, "data.classes=[a, b]", "--out", str(new)], capsys, monkeypatch)
    assert "data.classes lists 2 names but synthetic has 10 classes" in line
    # what the federation's deployment would refuse: refused before anything is written
    line = cli_error(["data", "export", *SYNTHETIC, "method=centralized", "--out", str(new)], capsys, monkeypatch)
    assert "method centralized trains on pooled data" in line
    line = cli_error(["data", "export", *SYNTHETIC, "calibration=creff", "--out", str(new)], capsys, monkeypatch)
    assert "calibration=creff" in line and "privacy.allow_leaks=true" in line
    assert [p.name for p in tmp_path.iterdir()] == ["full"]  # no export folder, no staging folder


def test_cli_paths_too_long_to_look_up_are_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A --node-data, --server-test or --out path with a name longer than the file system allows: the
    OSError that Path.is_dir raises for it is one error line, not a traceback."""
    too_long = tmp_path / ("x" * 300)
    (tmp_path / "nodes" / "site").mkdir(parents=True)
    (tmp_path / "test").mkdir()
    config = tmp_path / "federation.yaml"
    config.write_text("data:\n  dataset: synthetic\n")
    line = cli_error(["deploy", "--node-data", str(too_long), "--workdir", str(tmp_path / "wd"), str(config)],
                     capsys, monkeypatch)
    assert f"--node-data {too_long} is not a folder" in line
    line = cli_error(["deploy", "--node-data", str(tmp_path / "nodes"), "--server-test", str(too_long), "--workdir",
                      str(tmp_path / "wd"), str(config)], capsys, monkeypatch)
    assert f"--server-test {too_long} is not a folder" in line
    line = cli_error(["data", "export", *SYNTHETIC, "--out", str(too_long / "fed")], capsys, monkeypatch)
    assert "File name too long" in line and str(too_long) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["federation.yaml", "nodes", "test"]  # nothing written

def test_cli_export_writes_a_federation(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("FEDLT_DATA", "PYTHONPATH")}
    env.update(PYTHONPATH=str(SRC), FEDLT_CACHE=str(tmp_path / "cache"))
    out = tmp_path / "fed"
    out.mkdir()  # an empty folder is fine
    proc = subprocess.run([sys.executable, "-m", "fedlt.cli", "data", "export", "data.dataset=synthetic",
                           "data.num_clients=2", "fl.participation=1", "data.val_per_class=2", "--out", str(out)],
                          cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out} (2 nodes)") and "nodes 2/2 written" in proc.stderr
    deployed = load_config(out / "federation.yaml")
    assert deployed.flower.node_data and deployed.data.num_clients == 2 and deployed.data.classes
    assert sorted(p.name for p in (out / "nodes").iterdir()) == ["client-0", "client-1"]
    assert (out / "nodes" / "client-1" / "train").is_dir() and (out / "server" / "test").is_dir()
    # the command it suggests evaluates on every set it wrote for the server
    assert proc.stdout.rstrip().endswith(f"{out / 'federation.yaml'} eval.val_data={out / 'server' / 'val'}")


def test_a_server_sets_errors_name_the_setting_not_a_node(tmp_path: Path) -> None:
    """The server's own test set is not a node's folder: its errors start with eval.test_data."""
    from fedlt.engine.flower_nodes import server_set
    from fedlt.errors import DataError

    cfg = load_config(None, ["data.dataset=cifar10", f"eval.test_data={tmp_path / 'test'}"])
    folder = tmp_path / "test" / "cat"
    folder.mkdir(parents=True)
    Image.fromarray(np.zeros((9, 9, 3), np.uint8)).save(folder / "a.png")
    with pytest.raises(DataError, match=r"^eval.test_data: image .*a.png is 9x9, expected 32x32; images are not "
                                        r"resized, resize it first$"):
        server_set(cfg, "test_data", "cpu")
