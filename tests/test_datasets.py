"""Dataset readers: each on-disk format written for real in tmp_path, read back through the registry."""

from __future__ import annotations

import dataclasses
import gzip
import io
import os
import pickle
import re
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch
from PIL import Image

from fedlt.config import DataConfig
from fedlt.data.federated import build_federated_data
from fedlt.data.registry import DATASETS, has_own_validation, list_datasets, load_dataset
from fedlt.data.sources import cinic, common, idx, listfile
from fedlt.data.sources.synthetic import make_synthetic
from fedlt.errors import ConfigError, DataError

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No test sees the user's data folders or writes to the user's cache."""
    monkeypatch.delenv("FEDLT_DATA", raising=False)
    monkeypatch.setenv("FEDLT_CACHE", str(tmp_path / "cache"))


def error_of(name: str, root: Path | str | None = None, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        load_dataset(name, root=None if root is None else str(root), **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- Fashion-MNIST (IDX)


def write_idx(path: Path, magic: int, array: np.ndarray, gz: bool) -> Path:
    raw = struct.pack(f">{1 + array.ndim}I", magic, *array.shape) + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        raw = gzip.compress(raw)
    path.write_bytes(raw)
    return path


def write_fmnist(root: Path, n_train: int = 7, n_test: int = 4) -> dict[str, np.ndarray]:
    root.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train_x": RNG.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train_y": RNG.integers(0, 10, n_train, dtype=np.uint8),
        "test_x": RNG.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "test_y": RNG.integers(0, 10, n_test, dtype=np.uint8),
    }
    # Train files gzipped (as Debian ships them), test files plain: both forms must work.
    write_idx(root / "train-images-idx3-ubyte", 2051, arrays["train_x"], gz=True)
    write_idx(root / "train-labels-idx1-ubyte", 2049, arrays["train_y"], gz=True)
    write_idx(root / "t10k-images-idx3-ubyte", 2051, arrays["test_x"], gz=False)
    write_idx(root / "t10k-labels-idx1-ubyte", 2049, arrays["test_y"], gz=False)
    return arrays


def test_fmnist_round_trip(tmp_path: Path) -> None:
    arrays = write_fmnist(tmp_path / "fm")
    pair = load_dataset("fmnist", root=str(tmp_path / "fm"))
    assert pair.train.images.shape == (7, 1, 28, 28) and pair.test.images.shape == (4, 1, 28, 28)
    assert pair.train.images.dtype == torch.uint8 and pair.train.labels.dtype == torch.int64
    assert np.array_equal(pair.train.images[:, 0].numpy(), arrays["train_x"])
    assert np.array_equal(pair.test.images[:, 0].numpy(), arrays["test_x"])
    assert pair.train.labels.tolist() == arrays["train_y"].tolist()
    assert pair.test.labels.tolist() == arrays["test_y"].tolist()
    assert pair.train.classes[0] == "T-shirt/top" and pair.train.classes[9] == "Ankle boot"
    assert len(pair.train) == 7 and len(pair.test) == 4 and pair.num_classes == 10
    assert pair.train.mean == (0.2860,) and pair.train.std == (0.3530,)


def test_fmnist_gzipped_files_without_the_suffix_are_read(tmp_path: Path) -> None:
    """A gzipped IDX file renamed without .gz (a download saved under the plain name) was "not an IDX file"."""
    arrays = write_fmnist(tmp_path / "fm")
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        (tmp_path / "fm" / f"{name}.gz").rename(tmp_path / "fm" / name)
    pair = load_dataset("fmnist", root=str(tmp_path / "fm"))
    assert np.array_equal(pair.train.images[:, 0].numpy(), arrays["train_x"])
    assert pair.train.labels.tolist() == arrays["train_y"].tolist()


def test_fmnist_found_through_fedlt_data_subfolder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_fmnist(tmp_path / "fashion-mnist")
    monkeypatch.setenv("FEDLT_DATA", str(tmp_path))
    assert len(load_dataset("fmnist").train) == 7


def test_fmnist_data_root_holding_the_subfolder_is_narrowed_like_fedlt_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data.root=DIR finds DIR/fashion-mnist as FEDLT_DATA=DIR does (and as CIFAR's loader does), so one
    data.root serves a suite whose cells read several datasets (`fedlt bench paper-sfd data.root=/data`)."""
    write_fmnist(tmp_path / "fashion-mnist")
    monkeypatch.delenv("FEDLT_DATA", raising=False)
    assert len(load_dataset("fmnist", root=str(tmp_path)).train) == 7
    assert len(load_dataset("fmnist", root=str(tmp_path / "fashion-mnist")).train) == 7


@pytest.mark.parametrize(
    ("damage", "fragments"),
    [
        ("magic", ["t10k-images-idx3-ubyte", "magic number 2049, expected 2051", "re-download"]),
        ("truncate", ["t10k-images-idx3-ubyte", "truncated", "re-download"]),
        ("truncate_gz", ["train-labels-idx1-ubyte.gz", "cannot read", "re-download"]),
        ("count", ["t10k-labels-idx1-ubyte", "3 labels", "4 images"]),
        ("label", ["label 10", "t10k-labels-idx1-ubyte", "outside [0, 10)"]),
        ("missing", ["missing t10k-labels-idx1-ubyte[.gz]", "dataset-fashion-mnist"]),
    ],
)
def test_fmnist_bad_files(tmp_path: Path, damage: str, fragments: list[str]) -> None:
    root = tmp_path / "fm"
    arrays = write_fmnist(root)
    if damage == "magic":
        write_idx(root / "t10k-images-idx3-ubyte", 2049, arrays["test_x"], gz=False)
    elif damage == "truncate":
        path = root / "t10k-images-idx3-ubyte"
        path.write_bytes(path.read_bytes()[:-5])
    elif damage == "truncate_gz":
        path = root / "train-labels-idx1-ubyte.gz"
        path.write_bytes(path.read_bytes()[:-6])
    elif damage == "count":
        write_idx(root / "t10k-labels-idx1-ubyte", 2049, arrays["test_y"][:3], gz=False)
    elif damage == "label":
        write_idx(root / "t10k-labels-idx1-ubyte", 2049, np.array([0, 1, 10, 2]), gz=False)
    else:
        (root / "t10k-labels-idx1-ubyte").unlink()
    message = error_of("fmnist", root)
    assert "fmnist" in message
    for fragment in fragments:
        assert fragment in message


def test_fmnist_empty_and_missing_folder(tmp_path: Path) -> None:
    message = error_of("fmnist", tmp_path)
    assert "no Fashion-MNIST IDX files" in message and "train-images-idx3-ubyte[.gz]" in message
    assert "dataset-fashion-mnist" in message and "data.root=DIR" in message
    message = error_of("fmnist", tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in message and "does not exist" in message


@pytest.mark.skipif(not idx.DEFAULT_ROOT.is_dir(), reason="Debian package dataset-fashion-mnist is not installed")
def test_real_fashion_mnist() -> None:
    pair = load_dataset("fmnist")
    assert len(pair.train) == 60000 and len(pair.test) == 10000
    assert pair.train.class_counts().tolist() == [6000] * 10
    assert pair.test.class_counts().tolist() == [1000] * 10
    mean = pair.train.images.float().div(255).mean().item()
    assert abs(mean - idx.MEAN[0]) < 1e-3


# ----------------------------------------------------------------------------- CIFAR-10 / CIFAR-100


def dump(path: Path, content: object) -> None:
    with path.open("wb") as handle:
        pickle.dump(content, handle, protocol=2)


def write_cifar10(parent: Path, per_batch: int = 2, n_test: int = 3) -> dict[str, np.ndarray]:
    folder = parent / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    dump(folder / "batches.meta", {b"label_names": names, b"num_cases_per_batch": per_batch, b"num_vis": 3072})
    data, labels = [], []
    for i in range(1, 6):
        x = RNG.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        y = RNG.integers(0, 10, per_batch).tolist()
        batch = {b"batch_label": b"training batch", b"labels": y, b"data": x, b"filenames": []}
        dump(folder / f"data_batch_{i}", batch)
        data.append(x)
        labels += y
    test_x = RNG.integers(0, 256, (n_test, 3072), dtype=np.uint8)
    test_y = RNG.integers(0, 10, n_test).tolist()
    dump(folder / "test_batch", {b"batch_label": b"testing batch", b"labels": test_y, b"data": test_x})
    return {"train_x": np.concatenate(data), "train_y": np.array(labels), "test_x": test_x, "test_y": np.array(test_y)}


def test_cifar10_round_trip_and_channel_major_layout(tmp_path: Path) -> None:
    arrays = write_cifar10(tmp_path)
    for root in (tmp_path, tmp_path / "cifar-10-batches-py"):  # the parent or the extracted folder
        pair = load_dataset("cifar10", root=str(root))
        assert pair.train.images.shape == (10, 3, 32, 32) and pair.test.images.shape == (3, 3, 32, 32)
        assert pair.train.images.dtype == torch.uint8 and pair.train.images.is_contiguous()
        assert pair.train.labels.tolist() == arrays["train_y"].tolist()
        assert pair.test.labels.tolist() == arrays["test_y"].tolist()
        assert pair.train.classes[1] == "automobile" and pair.test.classes[9] == "truck"
        for c, y, x in [(0, 0, 0), (1, 5, 7), (2, 31, 30), (0, 17, 3)]:
            assert pair.train.images[0, c, y, x].item() == arrays["train_x"][0, c * 1024 + y * 32 + x]
            assert pair.test.images[2, c, y, x].item() == arrays["test_x"][2, c * 1024 + y * 32 + x]
        assert np.array_equal(pair.train.images.reshape(10, -1).numpy(), arrays["train_x"])


def python2_pickle(tree: object) -> bytes:
    """``tree`` (dicts, lists, byte strings, small ints, 2-D uint8 arrays) as the CIFAR files hold it:
    a protocol-2 pickle written by Python 2's cPickle with numpy 1, whose strings are raw byte strings
    (SHORT_BINSTRING / BINSTRING, never ``_codecs.encode``) and whose arrays name
    ``numpy.core.multiarray._reconstruct``. Written opcode by opcode: Python 3 cannot produce it."""
    import struct

    def text(b: bytes) -> bytes:
        return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<i", len(b)) + b

    def integer(n: int) -> bytes:
        if n < 256:
            return b"K" + bytes([n])
        return b"M" + struct.pack("<H", n) if n < 65536 else b"J" + struct.pack("<i", n)

    def value(v: object) -> bytes:
        if isinstance(v, bytes):
            return text(v)
        if isinstance(v, int):
            return integer(v)
        if isinstance(v, list):
            return b"](" + b"".join(value(x) for x in v) + b"e"
        if isinstance(v, dict):
            return b"}(" + b"".join(value(k) + value(x) for k, x in v.items()) + b"u"
        assert isinstance(v, np.ndarray) and v.dtype == np.uint8 and v.ndim == 2
        dtype = (b"cnumpy\ndtype\n" + text(b"u1") + b"K\x00K\x01\x87R"  # dtype('u1', 0, 1) and its state
                 + b"(K\x03" + text(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb")
        return (b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + text(b"b") + b"\x87R"
                + b"(K\x01" + integer(v.shape[0]) + integer(v.shape[1]) + b"\x86" + dtype + b"\x89"
                + text(v.tobytes()) + b"tb")

    return b"\x80\x02" + value(tree) + b"."


def test_cifar10_as_its_authors_pickled_it_with_python2_and_numpy1(tmp_path: Path) -> None:
    import pickletools

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    (folder / "batches.meta").write_bytes(python2_pickle({b"num_cases_per_batch": 2, b"label_names": names,
                                                          b"num_vis": 3072}))
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = RNG.integers(0, 256, (2, 3072), dtype=np.uint8)
        y = RNG.integers(0, 10, 2).tolist()
        stream = python2_pickle({b"batch_label": b"batch " + name.encode(), b"labels": y, b"data": x,
                                 b"filenames": [b"a_s_000001.png", b"b_s_000002.png"]})
        pickletools.dis(stream, out=io.StringIO())  # a well-formed pickle
        assert b"_codecs" not in stream and b"numpy.core.multiarray" in stream
        (folder / name).write_bytes(stream)
        batches[name] = (x, y)
    pair = load_dataset("cifar10", root=str(folder))
    train_x = np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)])
    assert np.array_equal(pair.train.images.reshape(10, -1).numpy(), train_x)
    assert pair.train.labels.tolist() == sum((batches[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    assert np.array_equal(pair.test.images.reshape(2, -1).numpy(), batches["test_batch"][0])
    assert pair.train.classes == [n.decode() for n in names]


def test_cifar_batches_re_pickled_by_python3_with_text_keys_read_as_the_originals(tmp_path: Path) -> None:
    """The originals read with ``pickle.load(f, encoding="latin1")`` (torchvision's way) hold text keys
    ('data', 'labels', 'label_names'); dumped again by Python 3 they keep them: the same CIFAR data."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    originals = {"batches.meta": python2_pickle({b"num_cases_per_batch": 2, b"label_names": names, b"num_vis": 3072})}
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batches[name] = (RNG.integers(0, 256, (2, 3072), dtype=np.uint8), RNG.integers(0, 10, 2).tolist())
        originals[name] = python2_pickle({b"batch_label": name.encode(), b"labels": batches[name][1],
                                          b"data": batches[name][0], b"filenames": [b"a.png", b"b.png"]})
    for name, stream in originals.items():
        content = pickle.loads(stream, encoding="latin1")
        assert all(isinstance(key, str) for key in content)
        with (folder / name).open("wb") as handle:
            pickle.dump(content, handle)
    pair = load_dataset("cifar10", root=str(tmp_path))
    train_x = np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)])
    assert np.array_equal(pair.train.images.reshape(10, -1).numpy(), train_x)
    assert pair.train.labels.tolist() == sum((batches[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    assert np.array_equal(pair.test.images.reshape(2, -1).numpy(), batches["test_batch"][0])
    assert pair.test.labels.tolist() == batches["test_batch"][1]
    assert pair.train.classes == [n.decode() for n in names]


def test_a_cifar_folder_extracted_into_a_folder_of_its_own_name_is_named_one_level_down(tmp_path: Path) -> None:
    """`tar -xzf cifar-10-python.tar.gz -C cifar-10-batches-py` nests the folder in itself: where
    data.root (or $FEDLT_DATA) holds the outer one, the error says where the files are, not to download them again."""
    write_cifar10(tmp_path / "cifar-10-batches-py")
    inner = tmp_path / "cifar-10-batches-py" / "cifar-10-batches-py"
    message = error_of("cifar10", tmp_path)
    assert f"the files are one level down, in {inner}: pass data.root={inner}" in message
    assert "download" not in message
    assert len(load_dataset("cifar10", root=str(inner.parent)).train) == 10  # narrowed as a suite's data.root is


def test_the_binary_versions_read_as_the_python_ones(tmp_path: Path) -> None:
    """cifar-10-batches-bin (records: label byte, 3072 pixel bytes; batches.meta.txt) and
    cifar-100-binary (coarse label byte, fine label byte, pixels; fine_label_names.txt)."""
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (folder / "batches.meta.txt").write_text("\n".join(names) + "\n\n")  # the release ends with blank lines
    written = {}
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        x, y = RNG.integers(0, 256, (2, 3072), dtype=np.uint8), RNG.integers(0, 10, 2, dtype=np.uint8)
        np.concatenate([y[:, None], x], axis=1).tofile(folder / name)
        written[name] = (x, y)
    for root in (tmp_path, folder):
        pair = load_dataset("cifar10", root=str(root))
        train_x = np.concatenate([written[f"data_batch_{i}.bin"][0] for i in range(1, 6)])
        assert np.array_equal(pair.train.images.reshape(10, -1).numpy(), train_x)
        train_y = np.concatenate([written[f"data_batch_{i}.bin"][1] for i in range(1, 6)])
        assert pair.train.labels.tolist() == train_y.tolist()
        assert np.array_equal(pair.test.images.reshape(2, -1).numpy(), written["test_batch.bin"][0])
        assert pair.train.classes == names
        assert pair.train.images[1, 2, 10, 20].item() == train_x[1, 2 * 1024 + 10 * 32 + 20]  # channel-major planes
    test_file = (folder / "test_batch.bin").read_bytes()
    (folder / "test_batch.bin").write_bytes(test_file[:3073])  # a test file of another size than the batches
    assert load_dataset("cifar10", root=str(tmp_path)).test.labels.tolist() == written["test_batch.bin"][1][:1].tolist()
    (folder / "test_batch.bin").write_bytes(test_file[:-1])
    message = error_of("cifar10", tmp_path)
    assert "test_batch.bin holds 6145 bytes, not a whole number of 3073-byte records" in message
    (folder / "test_batch.bin").write_bytes((folder / "data_batch_2.bin").read_bytes())
    (folder / "data_batch_2.bin").write_bytes((folder / "data_batch_2.bin").read_bytes()[:3073])  # a whole record
    message = error_of("cifar10", tmp_path)  # the batches of the release are equal: a short one is cut off
    assert f"{folder / 'data_batch_2.bin'} holds 1 records and the other batches 2, so it is cut off" in message

    folder = tmp_path / "c100" / "cifar-100-binary"
    folder.mkdir(parents=True)
    (folder / "fine_label_names.txt").write_text("\n".join(f"fine{i}" for i in range(100)) + "\n")
    x = RNG.integers(0, 256, (3, 3072), dtype=np.uint8)
    coarse, fine = np.array([19, 0, 7], np.uint8), np.array([99, 3, 42], np.uint8)
    for name in ("train.bin", "test.bin"):
        np.concatenate([coarse[:, None], fine[:, None], x], axis=1).tofile(folder / name)
    pair = load_dataset("cifar100", root=str(tmp_path / "c100"))
    assert pair.train.labels.tolist() == [99, 3, 42] and pair.test.classes[42] == "fine42"  # the fine label
    assert np.array_equal(pair.train.images.reshape(3, -1).numpy(), x)


def test_cifar100_fine_labels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    names = [f"class_{i}".encode() for i in range(100)]
    dump(folder / "meta", {b"fine_label_names": names, b"coarse_label_names": names[:20]})
    x = RNG.integers(0, 256, (6, 3072), dtype=np.uint8)
    fine, coarse = [99, 0, 5, 42, 7, 7], [19, 0, 1, 2, 3, 3]
    dump(folder / "train", {b"data": x, b"fine_labels": fine, b"coarse_labels": coarse, b"filenames": []})
    dump(folder / "test", {b"data": x[:2], b"fine_labels": fine[:2], b"coarse_labels": coarse[:2]})
    monkeypatch.setenv("FEDLT_DATA", str(tmp_path))  # finds cifar-100-python/ below it
    pair = load_dataset("cifar100")
    assert pair.num_classes == 100 and pair.train.classes[42] == "class_42"
    assert pair.train.labels.tolist() == fine and pair.test.labels.tolist() == fine[:2]
    assert pair.train.images[3, 2, 10, 20].item() == x[3, 2 * 1024 + 10 * 32 + 20]


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize(
    ("damage", "fragments"),
    [
        ("truncate", ["data_batch_3", "cannot unpickle"]),
        ("garbage", ["test_batch", "cannot unpickle"]),
        ("no_labels", ["data_batch_2", "no b'labels' entry"]),
        ("shape", ["data_batch_1", "expected uint8 (N, 3072)"]),
        ("label", ["label 10", "data_batch_4", "outside [0, 10)"]),
        ("exploit", ["data_batch_5", "refusing to load global"]),
        ("missing", ["missing test_batch"]),
    ],
)
def test_cifar_bad_files(tmp_path: Path, damage: str, fragments: list[str]) -> None:
    write_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    x = RNG.integers(0, 256, (2, 3072), dtype=np.uint8)
    if damage == "truncate":
        path = folder / "data_batch_3"
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "garbage":
        (folder / "test_batch").write_bytes(b"this is not a pickle")
    elif damage == "no_labels":
        dump(folder / "data_batch_2", {b"data": x})
    elif damage == "shape":
        dump(folder / "data_batch_1", {b"data": x.reshape(2, 3, 32, 32), b"labels": [0, 1]})
    elif damage == "label":
        dump(folder / "data_batch_4", {b"data": x, b"labels": [3, 10]})
    elif damage == "exploit":
        dump(folder / "data_batch_5", {b"data": _Exploit(), b"labels": [0, 1]})
    else:
        (folder / "test_batch").unlink()
    message = error_of("cifar10", tmp_path)
    assert message.startswith("cifar10: ") and "cifar-10-python.tar.gz" in message
    for fragment in fragments:
        assert fragment in message


def test_cifar_wrong_folder(tmp_path: Path) -> None:
    message = error_of("cifar100", tmp_path)
    assert "no cifar-100-python/" in message and str(tmp_path) in message and "data.root=DIR" in message


# ----------------------------------------------------------------------------- SVHN (MATLAB v5)


def write_svhn(root: Path, n_train: int = 5, n_test: int = 3) -> dict[str, np.ndarray]:
    root.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        x = RNG.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        y = np.array([[10], [1], [9], [10], [4]][:n], dtype=np.float64)  # 10 is the digit 0
        scipy.io.savemat(root / f"{split}_32x32.mat", {"X": x, "y": y})
        arrays[split] = x
    return arrays


def test_svhn_round_trip_and_label_10_is_digit_0(tmp_path: Path) -> None:
    arrays = write_svhn(tmp_path / "svhn")
    pair = load_dataset("svhn", root=str(tmp_path / "svhn"))
    assert pair.train.images.shape == (5, 3, 32, 32) and pair.test.images.shape == (3, 3, 32, 32)
    assert pair.train.labels.tolist() == [0, 1, 9, 0, 4] and pair.test.labels.tolist() == [0, 1, 9]
    assert pair.train.classes == [str(d) for d in range(10)]
    x = arrays["train"]
    for n, c, row, col in [(0, 0, 0, 0), (4, 2, 31, 1), (2, 1, 7, 19)]:
        assert pair.train.images[n, c, row, col].item() == x[row, col, c, n]
    assert np.array_equal(pair.test.images.numpy(), arrays["test"].transpose(3, 2, 0, 1))
    assert pair.train.images.is_contiguous()


@pytest.mark.parametrize(
    ("damage", "fragments"),
    [
        ("truncate", ["train_32x32.mat", "cannot read"]),
        ("html", ["cannot read", "test_32x32.mat (it is no MATLAB file (it does not start with 'MATLAB'))"]),
        ("label", ["label 11", "test_32x32.mat", "1..10"]),
        ("no_x", ["test_32x32.mat", "no variable 'X'"]),
        ("missing", ["missing test_32x32.mat"]),
    ],
)
def test_svhn_bad_files(tmp_path: Path, damage: str, fragments: list[str]) -> None:
    root = tmp_path / "svhn"
    write_svhn(root)
    x = RNG.integers(0, 256, (32, 32, 3, 2), dtype=np.uint8)
    if damage == "truncate":
        path = root / "train_32x32.mat"
        path.write_bytes(path.read_bytes()[:300])
    elif damage == "html":  # a download that saved an error page under the file's name
        (root / "test_32x32.mat").write_text("<html><body>404 Not Found</body></html>")
    elif damage == "label":
        scipy.io.savemat(root / "test_32x32.mat", {"X": x, "y": np.array([[3.0], [11.0]])})
    elif damage == "no_x":
        scipy.io.savemat(root / "test_32x32.mat", {"images": x, "y": np.array([[3.0], [1.0]])})
    else:
        (root / "test_32x32.mat").unlink()
    message = error_of("svhn", root)
    assert message.startswith("svhn: ") and "ufldl.stanford.edu" in message
    for fragment in fragments:
        assert fragment in message


# ----------------------------------------------------------------------------- CINIC-10 (PNG folders)

CINIC_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def write_cinic(root: Path, splits: tuple[str, ...] = ("train", "valid", "test")) -> dict[tuple[str, str], np.ndarray]:
    """Two PNGs per class and split, one of them greyscale (CINIC has some); returns HWC RGB pixels."""
    pixels = {}
    for split in splits:
        for name in CINIC_CLASSES:
            folder = root / split / name
            folder.mkdir(parents=True)
            rgb = RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(rgb).save(folder / f"{split}-{name}-a.png")
            grey = RNG.integers(0, 256, (32, 32), dtype=np.uint8)
            Image.fromarray(grey).save(folder / f"{split}-{name}-b.png")
            pixels[(split, name)] = np.stack([rgb, np.repeat(grey[..., None], 3, axis=2)])
    return pixels


def test_cinic_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "_PARALLEL_MIN", 2)  # decode on the thread pool, as for the real 90k images
    pixels = write_cinic(tmp_path)
    (tmp_path / "train" / ".cache").mkdir()  # hidden folders are not classes
    (tmp_path / "train" / "cat" / "._train-cat-a.png").write_bytes(b"\x00\x05\x16\x07Mac OS X")  # nor images
    pair = load_dataset("cinic10", root=str(tmp_path))
    assert pair.train.classes == CINIC_CLASSES and pair.test.classes == CINIC_CLASSES
    assert pair.train.images.shape == (20, 3, 32, 32) and len(pair.test) == 20
    assert pair.train.labels.tolist() == [k for k in range(10) for _ in range(2)]
    for k, name in enumerate(CINIC_CLASSES):
        expected = pixels[("test", name)].transpose(0, 3, 1, 2)
        assert np.array_equal(pair.test.images[2 * k : 2 * k + 2].numpy(), expected)
    with_valid = cinic.load_cinic10(tmp_path, include_valid=True)
    assert len(with_valid.train) == 40 and len(with_valid.test) == 20


def test_cinic_valid_folder_is_its_own_validation_split(tmp_path: Path) -> None:
    """CINIC-10 ships train/, valid/ and test/: valid/ is the dataset's own validation split, labelled by
    the same class folders, never mixed into the training or test split."""
    pixels = write_cinic(tmp_path)
    red = np.zeros((32, 32, 3), dtype=np.uint8)
    red[3, 29, 0] = 255  # a mark at (row 3, column 29) of the red channel
    Image.fromarray(red).save(tmp_path / "valid" / "truck" / "valid-truck-c.PNG")
    assert has_own_validation("cinic10", str(tmp_path))
    pair = load_dataset("cinic10", root=str(tmp_path), with_val=True)
    assert pair.val.classes == CINIC_CLASSES and len(pair.val) == 21 and len(pair.train) == 20
    assert pair.val.labels.tolist() == [k for k in range(10) for _ in range(2)] + [9]
    for k, name in enumerate(CINIC_CLASSES):
        expected = pixels[("valid", name)].transpose(0, 3, 1, 2)
        assert np.array_equal(pair.val.images[2 * k : 2 * k + 2].numpy(), expected)
    assert pair.val.images[20, 0, 3, 29].item() == 255 and pair.val.images[20].sum().item() == 255
    cfg = DataConfig(dataset="cinic10", root=str(tmp_path), imbalance_factor=1, num_clients=2, val_per_class=1)
    assert build_federated_data(cfg, seed=0).val_source == "dataset"  # auto takes it

    for png in (tmp_path / "valid" / "ship").iterdir():
        png.unlink()
    assert f"{tmp_path / 'valid' / 'ship'} holds no .png files" in error_of("cinic10", tmp_path, with_val=True)
    (tmp_path / "valid" / "ship").rmdir()
    message = error_of("cinic10", tmp_path, with_val=True)
    assert f"class folders of {tmp_path / 'valid'} (airplane, automobile, bird, cat, deer, dog, frog, horse, " \
        "truck) differ" in message
    for folder in (tmp_path / "valid").iterdir():
        for png in folder.iterdir():
            png.unlink()
        folder.rmdir()
    (tmp_path / "valid").rmdir()
    assert not has_own_validation("cinic10", str(tmp_path))
    assert f"cinic10: no valid/ folder in {tmp_path}" in error_of("cinic10", tmp_path, with_val=True)


def test_cinic_reads_upper_case_png_suffixes(tmp_path: Path) -> None:
    """CINIC-10 copied through Windows tools may name files X.PNG: they are images, not skipped."""
    pixels = write_cinic(tmp_path, splits=("train", "test"))
    for split, name in (("train", "cat"), ("test", "dog"), ("test", "ship")):
        for png in (tmp_path / split / name).iterdir():
            png.rename(png.with_suffix(".PNG" if png.stem.endswith("-a") else ".Png"))
    pair = load_dataset("cinic10", root=str(tmp_path))
    assert pair.train.images.shape == (20, 3, 32, 32) and len(pair.test) == 20
    assert pair.train.labels.tolist() == [k for k in range(10) for _ in range(2)]
    for split, images in (("train", pair.train.images), ("test", pair.test.images)):
        for k, name in enumerate(CINIC_CLASSES):
            assert np.array_equal(images[2 * k : 2 * k + 2].numpy(), pixels[(split, name)].transpose(0, 3, 1, 2))


def test_cinic_bad_folders(tmp_path: Path) -> None:
    write_cinic(tmp_path, splits=("train", "test"))
    (tmp_path / "test" / "zebra").mkdir()
    message = error_of("cinic10", tmp_path)
    assert "class folders of" in message and str(tmp_path / "test") in message and "zebra" in message
    (tmp_path / "test" / "zebra").rmdir()
    (tmp_path / "train" / "bird").rename(tmp_path / "train-bird")  # cat would become label 2, bird's
    (tmp_path / "train" / "zebra").mkdir()
    message = error_of("cinic10", tmp_path)
    assert f"the class folders of {tmp_path / 'train'} are not CINIC-10's ten (missing bird; unknown zebra)" in message
    (tmp_path / "train" / "zebra").rmdir()
    (tmp_path / "train-bird").rename(tmp_path / "train" / "bird")

    for png in (tmp_path / "train" / "dog").iterdir():
        png.unlink()
    message = error_of("cinic10", tmp_path)
    assert f"{tmp_path / 'train' / 'dog'} holds no .png files" in message and "CINIC-10" in message

    Image.new("RGB", (32, 32)).save(tmp_path / "train" / "dog" / "ok.png")
    (tmp_path / "train" / "cat" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    message = error_of("cinic10", tmp_path)
    assert "cannot decode image" in message and "broken.png" in message

    (tmp_path / "train" / "cat" / "broken.png").unlink()
    Image.new("RGB", (40, 32)).save(tmp_path / "train" / "cat" / "wide.png")
    assert "wide.png is 40x32, expected 32x32" in error_of("cinic10", tmp_path)

    message = error_of("cinic10", tmp_path / "train")
    assert "no train/, test/ folder" in message and "data.root=DIR" in message


def test_parallel_decoding_keeps_order_and_errors() -> None:
    paths = [Path(str(i)) for i in range(1000)]  # many chunks on the thread pool
    images = common.decode_all(paths, lambda p: np.full((1, 2, 2), int(p.name) % 256, dtype=np.uint8), (1, 2, 2),
                               "test")
    assert images.shape == (1000, 1, 2, 2) and images[:, 0, 0, 0].tolist() == [i % 256 for i in range(1000)]

    def fail_on_777(path: Path) -> np.ndarray:
        if path.name == "777":
            raise DataError("bad 777")
        return np.zeros((1, 2, 2), dtype=np.uint8)

    with pytest.raises(DataError, match="bad 777"):
        common.decode_all(paths, fail_on_777, (1, 2, 2), "test")


# ----------------------------------------------------------------------------- ImageNet-LT / iNat (list files)

# (relative path, label, (width, height), colour): varied sizes and aspect ratios.
LIST_IMAGES = [
    ("train/n01/a.jpg", 0, (50, 40), (250, 10, 10)),
    ("train/n01/b.jpg", 0, (20, 60), (10, 250, 10)),
    ("train/n02/c.jpg", 2, (33, 33), (10, 10, 250)),
    ("train/n03/d e.jpg", 4, (8, 5), (200, 200, 30)),  # smaller than image_size: upscaled; space in name
]
TEST_IMAGES = [("val/x.jpg", 4, (64, 48), (30, 200, 200)), ("val/y.jpg", 1, (16, 16), (128, 128, 128))]


def write_list_dataset(root: Path, train_name: str, test_name: str, lists_in_parent: bool = False) -> None:
    for rel, _, size, colour in LIST_IMAGES + TEST_IMAGES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, colour).save(root / rel, quality=95)
    list_dir = root.parent if lists_in_parent else root
    (list_dir / train_name).write_text("".join(f"{rel} {label}\n" for rel, label, _, _ in LIST_IMAGES))
    (list_dir / test_name).write_text("".join(f"{rel} {label}\n" for rel, label, _, _ in TEST_IMAGES) + "\n")


def assert_colours(images: torch.Tensor, entries: list) -> None:
    for image, (_, _, _, colour) in zip(images, entries):
        centre = image[:, image.shape[1] // 2, image.shape[2] // 2].tolist()
        assert all(abs(a - b) <= 6 for a, b in zip(centre, colour)), (centre, colour)


def test_imagenet_lt_round_trip(tmp_path: Path) -> None:
    root = tmp_path / "imagenet"
    write_list_dataset(root, "ImageNet_LT_train.txt", "ImageNet_LT_test.txt", lists_in_parent=True)
    pair = load_dataset("imagenet_lt", root=str(root), image_size=12)
    assert pair.train.images.shape == (4, 3, 12, 12) and pair.test.images.shape == (2, 3, 12, 12)
    assert pair.train.images.dtype == torch.uint8
    assert pair.train.labels.tolist() == [0, 0, 2, 4] and pair.test.labels.tolist() == [4, 1]
    assert pair.train.classes == ["0", "1", "2", "3", "4"] and pair.num_classes == 5
    assert_colours(pair.train.images, LIST_IMAGES)
    assert_colours(pair.test.images, TEST_IMAGES)


def test_list_resize_then_centre_crop(tmp_path: Path) -> None:
    """A 60x30 image whose middle half is green: after resize to 16x8... the 16x16 crop is all green."""
    array = np.zeros((30, 60, 3), dtype=np.uint8)
    array[:, :15] = (255, 0, 0)
    array[:, 15:45] = (0, 255, 0)
    array[:, 45:] = (0, 0, 255)
    path = tmp_path / "wide.png"
    Image.fromarray(array).save(path)
    out = listfile.decode_image(path, 16, "imagenet_lt", "fix")
    assert out.shape == (3, 16, 16) and out.dtype == np.uint8
    assert (out[1] >= 200).all() and (out[0, :, 1:-1] <= 40).all() and (out[2, :, 1:-1] <= 40).all()


def test_inat_names_file_and_default_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "inaturalist2018"
    write_list_dataset(root, "iNaturalist18_train.txt", "iNaturalist18_val.txt")
    (root / "iNaturalist18_classnames.txt").write_text("\n".join(f"species {k}" for k in range(6)) + "\n")
    monkeypatch.setenv("FEDLT_DATA", str(tmp_path))
    pair = load_dataset("inat")
    assert pair.train.images.shape == (4, 3, 64, 64)
    assert pair.num_classes == 6 and pair.test.classes[5] == "species 5"


def test_inat_reads_the_organisers_coco_style_annotation_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train2018.json / val2018.json as the organisers ship them: images and annotations joined on
    image_id, category_id the label, categories naming the classes, file_name relative to the root."""
    import json

    root = tmp_path / "inaturalist2018"
    colours = {0: (250, 10, 10), 1: (10, 250, 10), 2: (10, 10, 250)}
    names = {0: "Aves", 1: "Plantae", 2: "Fungi"}  # listed out of id order below, as nothing promises an order

    def annotation_file(split: str, rows: list[tuple[int, int]]) -> dict:
        images, annotations = [], []
        for i, (image_id, category) in enumerate(rows):
            rel = f"train_val2018/{names[category]}/{category}/{split}{image_id}.jpg"
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (20 + i, 16), colours[category]).save(root / rel, quality=95)
            images.append({"id": image_id, "file_name": rel, "width": 20 + i, "height": 16})
            annotations.append({"id": 1000 + image_id, "image_id": image_id, "category_id": category})
        categories = [{"id": c, "name": names[c], "supercategory": names[c]} for c in (2, 0, 1)]
        return {"info": {"year": 2018}, "images": images, "annotations": annotations[::-1], "categories": categories,
                "licenses": []}

    root.mkdir(parents=True)
    (root / "train2018.json").write_text(json.dumps(annotation_file("t", [(7, 0), (3, 2), (9, 0), (4, 1)])))
    (root.parent / "val2018.json").write_text(json.dumps(annotation_file("v", [(11, 1), (12, 2)])))
    monkeypatch.setenv("FEDLT_DATA", str(tmp_path))
    monkeypatch.setenv("FEDLT_CACHE", str(tmp_path / "cache"))
    pair = load_dataset("inat", image_size=8)
    assert pair.train.classes == ["Aves", "Plantae", "Fungi"] and pair.num_classes == 3
    assert sorted(pair.train.labels.tolist()) == [0, 0, 1, 2] and sorted(pair.test.labels.tolist()) == [1, 2]
    for split in (pair.train, pair.test):  # each image's colour is its own category's: paths and labels joined right
        for image, label in zip(split.images, split.labels.tolist()):
            centre = image[:, 4, 4].tolist()
            assert all(abs(a - b) <= 6 for a, b in zip(centre, colours[label])), (centre, label)
    (root / "train2018.json").write_text(json.dumps({"images": [{"id": 1, "file_name": "x.jpg"}],
                                                     "annotations": [{"id": 7, "image_id": 2, "category_id": 0}],
                                                     "categories": []}))
    with pytest.raises(DataError, match=r"train2018\.json: annotation 7 names image_id 2, which is not among its "
                                        r"images; "):
        load_dataset("inat", image_size=8)
    (root / "train2018.json").write_text(json.dumps({"images": [{"id": 1, "file_name": "x.jpg"}],
                                                     "annotations": [{"image_id": 1}], "categories": []}))
    with pytest.raises(DataError, match=r"train2018\.json is not a COCO-style annotation file .*KeyError"):
        load_dataset("inat", image_size=8)
    # values of the wrong type: a number for a file name, a list for a category id
    for image, category in (({"id": 1, "file_name": 5}, 0), ({"id": 1, "file_name": "x.jpg"}, [0])):
        (root / "train2018.json").write_text(json.dumps({
            "images": [image], "annotations": [{"id": 7, "image_id": 1, "category_id": category}],
            "categories": [{"id": 0, "name": "Aves"}]}))
        with pytest.raises(DataError, match=r"train2018\.json is not a COCO-style annotation file .*TypeError: every "
                                            r"file_name must be a string and every category id an integer\); "
                                            r"extract it again from the official train2018\.json\.tar\.gz"):
            load_dataset("inat", image_size=8)
    # the annotations as the organisers ship them, not yet extracted: the error says so, not "list file ... txt"
    (root / "train2018.json").write_text(json.dumps({"images": [], "annotations": [], "categories": []}))
    (root.parent / "val2018.json").rename(root.parent / "val.json")
    (root / "train2018.json.tar.gz").write_bytes(b"")  # kept after extracting: not what is missing
    with pytest.raises(DataError, match=r"^inat: annotation file val2018\.json not found in .*; pass data\.root"):
        load_dataset("inat", image_size=8)
    (root / "train2018.json").unlink()
    packed = re.escape(str(root / "train2018.json.tar.gz"))
    with pytest.raises(DataError, match=rf"^inat: list file iNaturalist18_train\.txt not found in .*; {packed} is "
                                        rf"there but not extracted: run `tar -xzf train2018\.json\.tar\.gz` in "
                                        rf"{re.escape(str(root))}$"):
        load_dataset("inat", image_size=8)


#: four clearly distinct colours, one per quadrant: a transposed, flipped or mirrored image swaps two of them
QUADRANTS = {"top left": (230, 20, 20), "top right": (20, 220, 20), "bottom left": (20, 20, 230),
             "bottom right": (230, 230, 20)}


def quadrant_image(width: int, height: int) -> np.ndarray:
    """An HWC RGB image whose quadrants are QUADRANTS's colours (flat, so JPEG keeps them)."""
    array = np.empty((height, width, 3), dtype=np.uint8)
    for name, colour in QUADRANTS.items():
        rows = slice(0, height // 2) if name.startswith("top") else slice(height // 2, height)
        cols = slice(0, width // 2) if name.endswith("left") else slice(width // 2, width)
        array[rows, cols] = colour
    return array


def assert_quadrants(image: np.ndarray, tolerance: int = 12) -> None:
    """Each quadrant of a (3, S, S) image is its QUADRANTS colour, bar a one-pixel seam blurred by resizing."""
    half = image.shape[1] // 2
    for name, colour in QUADRANTS.items():
        rows = slice(1, half - 1) if name.startswith("top") else slice(half + 1, -1)
        cols = slice(1, half - 1) if name.endswith("left") else slice(half + 1, -1)
        block = image[:, rows, cols].astype(int)
        error = np.abs(block - np.array(colour)[:, None, None]).max()
        assert error <= tolerance, (name, colour, block.reshape(3, -1).mean(axis=1).round().tolist())


def test_list_images_keep_their_orientation_landscape_and_portrait(tmp_path: Path) -> None:
    """Single-colour fixtures cannot tell a transposed or flipped decode from a right one: landscape and
    portrait JPEGs (named .JPEG, as ImageNet's are) of four coloured quadrants keep each colour in its corner
    through draft decoding, resizing and centre cropping."""
    root = tmp_path / "imagenet"
    entries = [("train/n01/n01_1.JPEG", 0, (96, 48)), ("train/n02/n02_1.JPEG", 1, (40, 80)),
               ("val/ILSVRC2012_val_00000001.JPEG", 1, (48, 96)), ("val/ILSVRC2012_val_00000002.JPEG", 0, (80, 40))]
    for rel, _, (width, height) in entries:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(quadrant_image(width, height)).save(root / rel, "JPEG", quality=95)
    (root / "ImageNet_LT_train.txt").write_text("".join(f"{rel} {label}\n" for rel, label, _ in entries[:2]))
    (root / "ImageNet_LT_test.txt").write_text("".join(f"{rel} {label}\n" for rel, label, _ in entries[2:]))
    pair = load_dataset("imagenet_lt", root=str(root), image_size=16)
    assert pair.train.images.shape == (2, 3, 16, 16) and pair.test.images.shape == (2, 3, 16, 16)
    for image in [*pair.train.images, *pair.test.images]:
        assert_quadrants(image.numpy())


def test_list_portrait_images_are_cropped_at_their_centre(tmp_path: Path) -> None:
    """A 30x90 portrait of red, green and blue bands resized to 16x48: the 16x16 crop is the green middle
    band, not the top (or bottom) one (the landscape test cannot tell where a crop starts vertically)."""
    array = np.zeros((90, 30, 3), dtype=np.uint8)
    array[:30] = (255, 0, 0)
    array[30:60] = (0, 255, 0)
    array[60:] = (0, 0, 255)
    path = tmp_path / "tall.JPEG"
    Image.fromarray(array).save(path, "PNG")  # PNG content under ImageNet's suffix: exact bands; read by content
    out = listfile.decode_image(path, 16, "imagenet_lt", "fix")
    assert out.shape == (3, 16, 16) and out.dtype == np.uint8
    assert (out[1] >= 200).all() and (out[0, 1:-1] <= 40).all() and (out[2, 1:-1] <= 40).all()


def test_cmyk_jpegs_are_converted_to_the_rgb_they_show(tmp_path: Path) -> None:
    """ImageNet holds a few CMYK JPEGs (Adobe-inverted, as Photoshop writes them and PIL too): decoded as PIL
    converts CMYK to RGB, black (K) included, never with C, M, Y read as R, G, B."""
    left, right = (0, 255, 255, 0), (200, 30, 0, 40)  # red; a light blue with some black
    image = Image.new("CMYK", (32, 16), left)
    image.paste(right, (16, 0, 32, 16))
    path = tmp_path / "n01_cmyk.JPEG"
    image.save(path, "JPEG", quality=95)
    with Image.open(path) as saved:
        assert saved.mode == "CMYK"
    out = listfile.decode_image(path, 16, "imagenet_lt", "fix").astype(int)
    for cmyk, cols in ((left, slice(0, 7)), (right, slice(9, 16))):
        rgb = np.array(Image.new("CMYK", (1, 1), cmyk).convert("RGB").getpixel((0, 0)))
        assert np.abs(out[:, :, cols] - rgb[:, None, None]).max() <= 8, (cmyk, rgb, out[:, 8, cols].tolist())
    assert out[0, 8, 2] >= 240 and out[1, 8, 2] <= 15  # the red half is red: not (0, 255, 255), cyan


def test_inat_annotation_labels_follow_category_ids_not_their_values_or_listing(tmp_path: Path) -> None:
    """category_id -> label in category id order, as documented: ids 2, 5, 17 become labels 0, 1, 2 and the
    classes are their names in that order (neither the raw ids, nor name order, nor either file's listing
    order), and val2018.json is labelled by train2018.json's map, so one category has one label in both."""
    import json

    root = tmp_path / "inaturalist2018"
    names = {2: "Reptilia", 5: "Aves", 17: "Mammalia", 9: "Insecta"}  # name order is not id order
    colours = {2: (250, 10, 10), 5: (10, 250, 10), 17: (10, 10, 250)}

    def annotation_file(split: str, rows: list[tuple[int, int]], listed: tuple[int, ...]) -> dict:
        images, annotations = [], []
        for image_id, category in rows:
            rel = f"train_val2018/{names[category]}/{category}/{split}{image_id}.jpg"
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (12, 10), colours[category]).save(root / rel, quality=95)
            images.append({"id": image_id, "file_name": rel, "width": 12, "height": 10})
            annotations.append({"id": 1000 + image_id, "image_id": image_id, "category_id": category})
        return {"images": images, "annotations": annotations,
                "categories": [{"id": c, "name": names[c], "supercategory": "Animalia"} for c in listed]}

    root.mkdir()
    (root / "train2018.json").write_text(json.dumps(annotation_file("t", [(1, 17), (2, 2), (3, 5), (4, 2)],
                                                                    listed=(17, 2, 5))))
    # another listing order, and one more category (without images): its own id map would differ from train's
    (root / "val2018.json").write_text(json.dumps(annotation_file("v", [(21, 5), (22, 17), (23, 2)],
                                                                  listed=(5, 9, 17, 2))))
    pair = load_dataset("inat", root=str(root), image_size=8)
    label_of = {2: 0, 5: 1, 17: 2}
    assert pair.train.classes == ["Reptilia", "Aves", "Mammalia"] == pair.test.classes and pair.num_classes == 3
    assert sorted(pair.train.labels.tolist()) == [0, 0, 1, 2] and sorted(pair.test.labels.tolist()) == [0, 1, 2]
    for split in (pair.train, pair.test):  # each row's colour is its category's, and its label that category's
        for image, label in zip(split.images, split.labels.tolist()):
            category = next(c for c, k in label_of.items() if k == label)
            centre = image[:, 4, 4].tolist()
            assert all(abs(a - b) <= 6 for a, b in zip(centre, colours[category])), (centre, label)


@pytest.mark.parametrize("dataset, archive, says", [
    ("cifar10", "cifar-10-python.tar.gz", "no cifar-10-batches-py/ in"),
    ("cifar10", "cifar-10-binary.tar.gz", "no cifar-10-batches-py/ in"),
    ("cifar100", "cifar-100-binary.tar.gz", "no cifar-100-python/ in"),
    ("cinic10", "CINIC-10.tar.gz", "no train/, test/ folder in"),
])
def test_an_archive_not_yet_extracted_is_named_with_the_command_that_extracts_it(tmp_path, dataset, archive, says):
    (tmp_path / archive).write_bytes(b"")
    message = error_of(dataset, tmp_path)
    assert message.startswith(f"{dataset}: {says}") and message.endswith(
        f"{tmp_path / archive} is there but not extracted: run `tar -xzf {archive}` in {tmp_path}"), message


def test_list_cache_reused_and_invalidated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "imagenet"
    write_list_dataset(root, "ImageNet_LT_train.txt", "ImageNet_LT_test.txt")
    first = load_dataset("imagenet_lt", root=str(root), image_size=8)
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 2  # one entry per split

    def must_not_decode(*args, **kwargs):
        raise AssertionError("decoded although the cache is valid")

    monkeypatch.setattr(listfile, "decode_image", must_not_decode)
    second = load_dataset("imagenet_lt", root=str(root), image_size=8)
    assert torch.equal(first.train.images, second.train.images)
    assert torch.equal(first.test.images, second.test.images)

    monkeypatch.undo()
    monkeypatch.setenv("FEDLT_CACHE", str(tmp_path / "cache"))
    decoded: list[Path] = []
    original = listfile.decode_image

    def counting(path: Path, *args) -> np.ndarray:
        decoded.append(path)
        return original(path, *args)

    monkeypatch.setattr(listfile, "decode_image", counting)
    train_list = root / "ImageNet_LT_train.txt"
    train_list.write_text(train_list.read_text().replace("train/n02/c.jpg 2", "train/n02/c.jpg 3"))
    stamp = time.time() + 5
    os.utime(train_list, (stamp, stamp))
    third = load_dataset("imagenet_lt", root=str(root), image_size=8)
    assert len(decoded) == len(LIST_IMAGES)  # train re-decoded, test still cached
    assert third.train.labels.tolist() == [0, 0, 3, 4]
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 2  # the stale train entry was replaced

    decoded.clear()
    load_dataset("imagenet_lt", root=str(root), image_size=10)  # another size is another entry
    assert len(decoded) == len(LIST_IMAGES) + len(TEST_IMAGES)

    # an image replaced under an unchanged list: that split is decoded again, with the new pixels
    decoded.clear()
    Image.new("RGB", (16, 16), (250, 250, 250)).save(root / "val/y.jpg", quality=95)
    os.utime(root / "val/y.jpg", (stamp + 5, stamp + 5))
    fourth = load_dataset("imagenet_lt", root=str(root), image_size=8)
    assert sorted(decoded) == [root / "val/x.jpg", root / "val/y.jpg"]  # the test split only
    assert torch.equal(fourth.train.images, third.train.images)
    assert_colours(fourth.test.images, [TEST_IMAGES[0], (None, None, None, (250, 250, 250))])
    assert len(list((tmp_path / "cache").glob("*-8px-*.pt"))) == 2  # the stale test entry was replaced
    # a listed image deleted after its split was cached: refused, not served from the cache
    (root / "val/x.jpg").unlink()
    assert "1 of the 2 images ImageNet_LT_test.txt lists are missing" in error_of("imagenet_lt", root, image_size=8)


def test_list_bad_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "_PARALLEL_MIN", 2)  # errors must also surface from the thread pool
    root = tmp_path / "imagenet"
    write_list_dataset(root, "ImageNet_LT_train.txt", "ImageNet_LT_test.txt")
    test_list = root / "ImageNet_LT_test.txt"

    test_list.unlink()
    message = error_of("imagenet_lt", root, image_size=8)
    assert "list file ImageNet_LT_test.txt not found" in message and str(root) in message and "OLTR" in message

    test_list.write_text("val/x.jpg 4\nval/y.jpg one\n")
    message = error_of("imagenet_lt", root, image_size=8)
    assert f"line 2 of {test_list}" in message and "'val/y.jpg one'" in message

    test_list.write_text("val/x.jpg 4\nval/missing.jpg 1\n")
    decoded, decode_image = [], listfile.decode_image
    monkeypatch.setattr(listfile, "decode_image", lambda *a: decoded.append(a) or np.zeros((3, 8, 8), np.uint8))
    message = error_of("imagenet_lt", root, image_size=8)
    assert f"1 of the 2 images ImageNet_LT_test.txt lists are missing, e.g. {root / 'val/missing.jpg'}" in message
    assert decoded == []  # found before the training split was decoded
    # ImageNet's validation archive extracts flat: the lists' val/<wnid>/X is val/X
    test_list.write_text("val/n01440764/x.jpg 4\n")
    message = error_of("imagenet_lt", root, image_size=8)
    assert (f"e.g. {root / 'val/n01440764/x.jpg'}; {root / 'val/x.jpg'} exists: sort {root / 'val'} into one folder "
            "per class, as ImageNet_LT_test.txt names them") in message
    monkeypatch.setattr(listfile, "decode_image", decode_image)

    (root / "val" / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    test_list.write_text("val/bad.jpg 1\n")
    message = error_of("imagenet_lt", root, image_size=8)
    assert "cannot decode image" in message and "bad.jpg" in message

    test_list.write_text("\n")
    assert "has no entries" in error_of("imagenet_lt", root, image_size=8)

    message = error_of("imagenet_lt", root, image_size=0)
    assert "data.image_size=0" in message


def test_list_file_override(tmp_path: Path) -> None:
    root = tmp_path / "imagenet"
    write_list_dataset(root, "mine_train.txt", "mine_test.txt")
    pair = listfile.load_list_dataset(listfile.IMAGENET_LT, root, 8, train_list="mine_train.txt",
                                      test_list=str(root / "mine_test.txt"))
    assert len(pair.train) == 4 and len(pair.test) == 2


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic_balanced_and_fast() -> None:
    start = time.perf_counter()
    pair = load_dataset("synthetic")
    assert time.perf_counter() - start < 3.0  # ~0.3 s: a guard against a slow path, with room for a busy machine
    again = make_synthetic()
    assert torch.equal(pair.train.images, again.train.images) and torch.equal(pair.test.images, again.test.images)
    assert pair.train.images.shape == (3000, 3, 16, 16) and pair.test.images.shape == (1000, 3, 16, 16)
    assert pair.train.class_counts().tolist() == [300] * 10 and pair.test.class_counts().tolist() == [100] * 10
    assert pair.train.classes == [f"class{k}" for k in range(10)]
    assert load_dataset("synthetic", image_size=8).train.images.shape == (3000, 3, 8, 8)


def balanced_accuracy(model: torch.nn.Module, data) -> float:
    with torch.no_grad():
        predicted = model(data.normalize(data.images)).argmax(1)
    recalls = [(predicted[data.labels == k] == k).float().mean() for k in range(data.num_classes)]
    return torch.stack(recalls).mean().item()


@pytest.fixture
def one_thread():
    """Small convolutions only lose from intra-op threads, badly so on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_synthetic_needs_training_and_a_small_cnn_learns_it() -> None:
    pair = make_synthetic()
    centroids = torch.stack([pair.train.images[pair.train.labels == k].float().mean(0) for k in range(10)])
    residual = pair.train.images.float() - centroids[pair.train.labels]
    assert residual.std() > 30  # strong per-image noise: no image is a copy of its template
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 10),
    )
    assert balanced_accuracy(model, pair.test) < 0.3
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        for batch in torch.randperm(len(pair.train)).split(64):
            logits = model(pair.train.normalize(pair.train.images[batch]))
            loss = torch.nn.functional.cross_entropy(logits, pair.train.labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert 0.9 < balanced_accuracy(model, pair.test) < 1.0


# ----------------------------------------------------------------------------- registry


def test_registry_lists_every_dataset() -> None:
    names = [name for name, _ in list_datasets()]
    assert names == ["fmnist", "cifar10", "cifar100", "svhn", "cinic10", "imagenet_lt", "inat", "imagefolder",
                     "imagefolder_lt", "synthetic", "synthetic_cifar10", "synthetic_cifar100"]
    assert names == list(DATASETS)
    assert all(description and "\n" not in description for _, description in list_datasets())


def test_registry_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    message = error_of("mnist")
    assert "unknown dataset 'mnist'" in message and "cifar10" in message and "synthetic" in message

    message = error_of("svhn")
    assert "svhn" in message and "data.root=DIR" in message and "FEDLT_DATA" in message

    message = error_of("cifar10", tmp_path, image_size=64)
    assert "32x32" in message and "data.image_size=64" in message

    monkeypatch.setenv("FEDLT_DATA", str(tmp_path))  # no svhn/ below it: FEDLT_DATA itself is used
    message = error_of("svhn")
    assert f"in {tmp_path};" in message and "train_32x32.mat" in message



@pytest.mark.parametrize("name", ["fmnist", "cifar10", "svhn", "cinic10", "imagenet_lt", "imagefolder"])
def test_a_data_folder_whose_name_is_too_long_is_a_data_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              name: str) -> None:
    """A path the system refuses to look up (a name longer than the file system allows) is named with its fix,
    where Path.is_dir raised the OSError through every loader."""
    too_long = tmp_path / ("x" * 300) / "data"
    message = error_of(name, too_long)
    assert f"data folder {too_long} cannot be looked up (File name too long)" in message
    assert "set data.root=DIR" in message
    monkeypatch.setenv("FEDLT_DATA", str(too_long))
    assert "set FEDLT_DATA=DIR" in error_of(name)

# ----------------------------------------------------------------------------- what training needs


def rewrite_cifar10(parent: Path, train_labels: list[int], test_labels: list[int]) -> None:
    """Replace every batch of a written CIFAR-10 folder: each training batch gets ``train_labels``.

    Protocol 4, because at protocol 2 Python writes an empty array's bytes as a call to a global.
    """
    folder = parent / "cifar-10-batches-py"
    for name, labels in [*((f"data_batch_{i}", train_labels) for i in range(1, 6)), ("test_batch", test_labels)]:
        x = RNG.integers(0, 256, (len(labels), 3072), dtype=np.uint8)
        with (folder / name).open("wb") as handle:
            pickle.dump({b"data": x, b"labels": labels}, handle, protocol=4)


def test_a_class_without_training_samples_is_a_data_error(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    rewrite_cifar10(tmp_path, list(range(9)), list(range(10)))  # no truck (class 9) in training
    assert load_dataset("cifar10", root=str(tmp_path)).num_classes == 10  # tiny files may lack classes
    message = error_of("cifar10", tmp_path, every_class=True)
    for fragment in ["cifar10: class 9 (truck) has no training samples", str(tmp_path), "has 10 classes",
                     "not cifar10's", "re-download"]:
        assert fragment in message
    # What a run does: before the fix the class count shrank to 9 and a ValueError followed.
    cfg = DataConfig(dataset="cifar10", root=str(tmp_path), imbalance_factor=1, num_clients=2)
    with pytest.raises(DataError, match=r"class 9 \(truck\) has no training samples"):
        build_federated_data(cfg, seed=0)


def test_a_class_without_test_samples_is_a_data_error(tmp_path: Path) -> None:
    """A test split lacking a class would report that class's accuracy as 0% and pull its shot group down."""
    write_cifar10(tmp_path)
    rewrite_cifar10(tmp_path, list(range(10)), list(range(9)))  # no truck (class 9) in the test split
    cfg = DataConfig(dataset="cifar10", root=str(tmp_path), imbalance_factor=1, num_clients=2)
    with pytest.raises(DataError, match=r"class 9 \(truck\) has no test samples"):
        build_federated_data(cfg, seed=0)


@pytest.mark.parametrize(
    ("name", "kwargs", "fragment"),
    [
        ("svhn", {}, "svhn: class 2 and 5 other classes have no training samples"),  # train digits 0, 1, 4, 9
        ("imagenet_lt", {"image_size": 8}, "imagenet_lt: class 1 and 1 other classes have no training samples"),
    ],
)
def test_every_class_applies_to_every_format(tmp_path: Path, name: str, kwargs: dict, fragment: str) -> None:
    root = tmp_path / name
    if name == "svhn":
        write_svhn(root)
    else:
        write_list_dataset(root, "ImageNet_LT_train.txt", "ImageNet_LT_test.txt")  # train labels 0, 2, 4 of 0..4
    message = error_of(name, root, every_class=True, **kwargs)
    assert fragment in message and str(root) in message


@pytest.mark.parametrize("which", ["test", "training"])
def test_an_empty_split_is_a_data_error(tmp_path: Path, which: str) -> None:
    write_cifar10(tmp_path)
    labels = list(range(10))
    if which == "test":
        rewrite_cifar10(tmp_path, train_labels=labels, test_labels=[])
    else:
        rewrite_cifar10(tmp_path, train_labels=[], test_labels=labels)
    message = error_of("cifar10", tmp_path)  # data.root is narrowed to the cifar-10-batches-py/ it holds
    assert f"cifar10: the {which} set in {tmp_path / 'cifar-10-batches-py'} is empty (0 images)" in message
    # Before the fix an empty test set trained and reported accuracy NaN.
    cfg = DataConfig(dataset="cifar10", root=str(tmp_path), imbalance_factor=1, num_clients=2)
    with pytest.raises(DataError, match=f"the {which} set in .* is empty"):
        build_federated_data(cfg, seed=0)


def test_an_empty_split_is_caught_for_other_formats_too(tmp_path: Path) -> None:
    write_fmnist(tmp_path / "fm", n_train=0)
    assert "fmnist: the training set in" in error_of("fmnist", tmp_path / "fm")


# ----------------------------------------------------------------------------- inputs that once crashed or misread


def test_cifar_labels_must_be_integers_and_numpy_pickles_load(tmp_path: Path) -> None:
    """A float label would be truncated into another class: refused. Arrays pickled at protocol 5 and
    labels held as numpy integers (how a re-saved batch looks) load."""
    write_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    x = RNG.integers(0, 256, (2, 3072), dtype=np.uint8)
    dump(folder / "data_batch_2", {b"data": x, b"labels": [0.7, 1.7]})
    assert "b'labels' in" in error_of("cifar10", tmp_path) and "data_batch_2" in error_of("cifar10", tmp_path)
    with (folder / "data_batch_2").open("wb") as handle:
        pickle.dump({b"data": x, b"labels": [np.int64(3), np.int64(9)]}, handle, protocol=5)
    pair = load_dataset("cifar10", root=str(tmp_path))
    assert pair.train.labels[2:4].tolist() == [3, 9]
    assert np.array_equal(pair.train.images[2:4].reshape(2, -1).numpy(), x)


def test_an_empty_cifar_folder_is_named_as_empty_not_as_missing_inside_itself(tmp_path: Path) -> None:
    (tmp_path / "cifar-10-batches-py").mkdir()  # data.root=DIR narrows to DIR/cifar-10-batches-py
    message = error_of("cifar10", tmp_path)
    assert message.startswith(f"cifar10: {tmp_path / 'cifar-10-batches-py'} holds none of data_batch_1") and \
        "no cifar-10-batches-py/ in" not in message
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"")  # some of it: what is missing is named
    assert error_of("cifar10", tmp_path).startswith("cifar10: missing data_batch_2, data_batch_3, data_batch_4, "
                                                     f"data_batch_5, test_batch, batches.meta in {tmp_path}")


def test_cifar_binary_errors_name_the_file_at_fault(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        label = 12 if name == "data_batch_3.bin" else 1
        np.concatenate([np.full((2, 1), label, np.uint8), RNG.integers(0, 256, (2, 3072), dtype=np.uint8)],
                       axis=1).tofile(folder / name)
    assert f"missing batches.meta.txt in {folder}" in error_of("cifar10", tmp_path)  # not "no cifar-10-batches-py/"
    (folder / "batches.meta.txt").write_text("\n".join(str(i) for i in range(10)))
    assert f"label 12 in {folder / 'data_batch_3.bin'} is outside [0, 10)" in error_of("cifar10", tmp_path)


@pytest.mark.parametrize("kind", ["cell", "complex"])
def test_svhn_labels_that_are_not_numbers_are_refused(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "svhn"
    write_svhn(root)
    x = RNG.integers(0, 256, (32, 32, 3, 2), dtype=np.uint8)
    if kind == "cell":
        y = np.empty((2, 1), dtype=object)
        y[0, 0], y[1, 0] = 3.0, 4.0
    else:
        y = np.array([[3.0 + 1j], [4.0]])
    scipy.io.savemat(root / "test_32x32.mat", {"X": x, "y": y})
    message = error_of("svhn", root)
    assert "y in" in message and "test_32x32.mat" in message and "expected numeric labels 1..10" in message


def test_fedlt_data_may_name_the_fashion_mnist_folder_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FEDLT_DATA=DIR with the IDX files in DIR reads them, as data.root=DIR does, and never the system copy."""
    from fedlt.data import registry

    system = tmp_path / "system"
    write_fmnist(system, n_train=9)
    monkeypatch.setitem(registry.DATASETS, "fmnist", dataclasses.replace(registry.DATASETS["fmnist"],
                                                                          default_root=system))
    write_fmnist(tmp_path / "mine", n_train=5)
    monkeypatch.setenv("FEDLT_DATA", str(tmp_path / "mine"))
    assert len(load_dataset("fmnist").train) == 5
    (tmp_path / "others").mkdir()
    monkeypatch.setenv("FEDLT_DATA", str(tmp_path / "others"))  # other datasets only: the system copy
    assert len(load_dataset("fmnist").train) == 9


def test_without_the_debian_package_set_up_s_download_in_data_is_read(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/setup.sh downloads Fashion-MNIST into data/ when apt cannot install it; a shell without its
    FEDLT_DATA (the quick start's) still finds it there, and only when the system copy is missing."""
    from fedlt.data import registry

    system = tmp_path / "system"
    monkeypatch.setitem(registry.DATASETS, "fmnist", dataclasses.replace(registry.DATASETS["fmnist"],
                                                                          default_root=system))
    monkeypatch.delenv("FEDLT_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=f"data folder {system} does not exist"):
        load_dataset("fmnist")
    write_fmnist(tmp_path / "data" / "fashion-mnist", n_train=5)
    assert len(load_dataset("fmnist").train) == 5
    write_fmnist(system, n_train=9)  # installed system-wide: that copy, as before
    assert len(load_dataset("fmnist").train) == 9


def test_sixteen_bit_images_are_scaled_not_clipped(tmp_path: Path) -> None:
    path = tmp_path / "deep.png"
    Image.fromarray(np.full((4, 4), 30000, np.uint16)).save(path)
    assert Image.open(path).mode.startswith("I;16")
    assert np.asarray(common.read_rgb("cinic10", path, "fix")).tolist()[0][0] == [117, 117, 117]  # 30000 >> 8
    Image.fromarray(np.full((4, 4), 0.5, np.float32)).save(tmp_path / "float.tiff")
    with pytest.raises(DataError, match="32-bit pixels"):
        common.read_rgb("cinic10", tmp_path / "float.tiff", "fix")


def test_list_files_with_a_byte_order_mark_or_absurd_labels(tmp_path: Path) -> None:
    root = tmp_path / "imagenet"
    write_list_dataset(root, "ImageNet_LT_train.txt", "ImageNet_LT_test.txt")
    train_list, test_list = root / "ImageNet_LT_train.txt", root / "ImageNet_LT_test.txt"
    train_list.write_bytes(b"\xef\xbb\xbf" + train_list.read_bytes())  # saved by a Windows editor
    assert load_dataset("imagenet_lt", root=str(root), image_size=8).train.labels.tolist() == [0, 0, 2, 4]
    test_list.write_text("val/x.jpg 4\nval/y.jpg 9223372036854775808\n")
    assert f"line 2 of {test_list} has label 9223372036854775808" in error_of("imagenet_lt", root, image_size=8)
    test_list.write_text("val/x.jpg 4\nval/y.jpg 1000000\n")  # would name a million classes
    assert f"line 2 of {test_list} has label 1000000, above any class count" in error_of("imagenet_lt", root,
                                                                                         image_size=8)


@pytest.mark.parametrize("listed", ["val/loop.jpg", "val/x.jpg/y.jpg", "val/" + "n" * 300 + ".jpg", "val/a\x00b.jpg"],
                         ids=["symlink-loop", "under-a-file", "name-too-long", "nul-byte"])
def test_a_listed_path_the_system_cannot_look_up_is_a_missing_image(tmp_path: Path, listed: str) -> None:
    """A corrupt list line whose path cannot even be looked up (a symlink loop, a file as a folder, a
    name too long, a NUL byte) is named as a missing image, not a traceback from the cache's key."""
    root = tmp_path / "imagenet"
    write_list_dataset(root, "ImageNet_LT_train.txt", "ImageNet_LT_test.txt")
    os.symlink("loop.jpg", root / "val" / "loop.jpg")
    test_list = root / "ImageNet_LT_test.txt"
    test_list.write_text(f"val/x.jpg 4\n{listed} 1\n")
    message = error_of("imagenet_lt", root, image_size=8)
    assert "1 of the 2 images ImageNet_LT_test.txt lists are missing" in message, message


def test_deeply_nested_annotation_json_is_a_data_error(tmp_path: Path) -> None:
    root = tmp_path / "inat"
    root.mkdir()
    (root / "train2018.json").write_text("[" * 100000 + "]" * 100000)
    (root / "val2018.json").write_text("{}")
    message = error_of("inat", root, image_size=8)
    assert "train2018.json is not a COCO-style annotation file" in message and "RecursionError" in message


def test_a_source_long_tailed_as_distributed_is_federated_as_it_is(tmp_path: Path) -> None:
    """ImageNet-LT's training list is long-tailed already: long-tail subsampling took its smallest class
    as the head's size, so any IF above it was refused and IF=1 left a few images per class, balanced."""
    from fedlt.config import build_config
    from fedlt.data.federated import build_federated_data
    from fedlt.reporting.collect import setting_label
    from fedlt.run_parts import check_config

    root = tmp_path / "imagenet"
    sizes = [8, 4, 2, 2, 1]  # the training list's own long tail (IF 8)
    train = [(f"train/c{c}/{i}.jpg", c) for c, n in enumerate(sizes) for i in range(n)]
    test = [(f"val/{c}.jpg", c) for c in range(5)]
    for rel, label in train + test:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (10, 10), (40 * label, 10, 10)).save(root / rel)
    (root / "ImageNet_LT_train.txt").write_text("".join(f"{rel} {label}\n" for rel, label in train))
    (root / "ImageNet_LT_test.txt").write_text("".join(f"{rel} {label}\n" for rel, label in test))
    tree = {"data": {"dataset": "imagenet_lt", "root": str(root), "image_size": 8, "num_clients": 2,
                     "partition": "iid", "imbalance_factor": 100}, "fl": {"participation": 1.0}}
    data = build_federated_data(build_config(tree).data, 0)
    assert torch.bincount(data.train.labels).tolist() == sizes  # all of it, whatever data.imbalance_factor says
    half = build_federated_data(build_config({**tree, "data": {**tree["data"], "train_fraction": 0.5}}).data, 0)
    assert torch.bincount(half.train.labels).tolist() == [4, 2, 1, 1, 1]
    with pytest.raises(ConfigError, match="imagenet_lt is long-tailed as distributed, .*; drop data.class_order"):
        check_config(build_config({**tree, "data": {**tree["data"], "class_order": "shuffled"}}))
    label = setting_label({}, build_config(tree).dump())
    assert label.startswith("imagenet_lt, as distributed, iid, 2 clients")


@pytest.mark.parametrize("names", [None, 10, b"abcdefghij"])
def test_cifar_class_names_that_are_no_list_of_names_are_refused(tmp_path: Path, names) -> None:
    """A batches.meta whose label_names was None or a number ended in a traceback; bytes gave the classes
    the names '97', '98', ... (its byte values)."""
    write_cifar10(tmp_path)
    dump(tmp_path / "cifar-10-batches-py" / "batches.meta", {b"label_names": names})
    message = error_of("cifar10", tmp_path)
    assert "b'label_names' in " in message and "batches.meta is not a list of class names" in message


def test_an_unwritable_cache_costs_one_warning_line_and_the_data_still_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A cache folder that cannot be made (here: under a file) only costs the decoding time: the dataset loads,
    and stderr gets one line naming the folder and the fix, no warning traceback."""
    root = tmp_path / "imagenet"
    write_list_dataset(root, "ImageNet_LT_train.txt", "ImageNet_LT_test.txt")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("FEDLT_CACHE", str(tmp_path / "a-file" / "cache"))
    data = load_dataset("imagenet_lt", root=str(root), image_size=8)
    assert data.train.labels.tolist() == [0, 0, 2, 4]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2  # one per split
    assert all(line.startswith(f"fedlt: warning: could not write the data cache {tmp_path / 'a-file' / 'cache'}/")
               and line.endswith("set FEDLT_CACHE to a writable folder") for line in lines), lines


def test_images_larger_than_the_memory_available_are_refused_before_any_is_made(tmp_path, monkeypatch):
    """A data.image_size the config allows (up to 1024) can ask for more memory than there is: the
    synthetic images, and a list dataset's decoded ones, are refused in one line before allocation."""
    from fedlt.data.sources import common

    monkeypatch.setattr(common, "available_memory", lambda: 10**9)
    with pytest.raises(DataError, match=re.escape("synthetic: 4000 images at 512x512 px need about 15.7 GB of memory, "
                                                  "more than the 1.0 GB available; use a smaller data.image_size")):
        load_dataset("synthetic", image_size=512)
    assert load_dataset("synthetic", image_size=16).train.images.shape[-1] == 16
    never = lambda path: pytest.fail("decoded an image")  # noqa: E731
    with pytest.raises(DataError, match=r"^imagenet_lt: 1000 images at 1024x1024 px need about 3\.1 GB of memory"):
        common.decode_all([tmp_path / "x.jpg"] * 1000, never, (3, 1024, 1024), "imagenet_lt")
    monkeypatch.setattr(common, "available_memory", lambda: None)  # not Linux: not checked
    common.check_memory("imagenet_lt", 1000, (3, 1024, 1024))


@pytest.mark.parametrize("limit, usage, cache, expected", [
    ("4000000000", "3000000000", None, 10**9),  # a container's limit leaves less than MemAvailable says
    ("4000000000", "3900000000", "3400000000", 2 * 10**9),  # most of the use is reclaimable page cache
    ("4000000000", "3900000000", "400000000", 5 * 10**8),
    ("max", "3000000000", None, 2 * 10**9),     # cgroup v2 without a limit: MemAvailable
    ("9223372036854771712", "1", None, 2 * 10**9),  # cgroup v1 without a limit (its huge default)
    ("1000", "2000", None, 0),                  # over the limit already
    (None, None, None, 2 * 10**9),              # no cgroup files: MemAvailable
])
def test_available_memory_is_capped_by_a_containers_memory_limit(tmp_path, monkeypatch, limit, usage, cache,
                                                                 expected):
    from fedlt.data.sources import common

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       9999999 kB\nMemAvailable:   1953125 kB\n")  # 2e9 bytes
    files = (tmp_path / "memory.max", tmp_path / "memory.current", tmp_path / "memory.stat", "inactive_file")
    if limit is not None:
        files[0].write_text(limit + "\n")
        files[1].write_text(usage + "\n")
    if cache is not None:
        files[2].write_text(f"anon 12345\nfile 999\ninactive_file {cache}\nactive_file 7\n")
    real_path = common.Path
    monkeypatch.setattr(common, "Path", lambda p: meminfo if p == "/proc/meminfo" else real_path(p))
    monkeypatch.setattr(common, "CGROUP_MEMORY", (files,))
    assert common.available_memory() == expected


# ----------------------------------------------------------------------------- a user's own image folders


def write_image_folders(root: Path, classes=("owl", "cat", "dog"), counts=(6, 2, 1), side: int = 8,
                        splits=("train", "test", "val")) -> dict[str, np.ndarray]:
    """RGB PNGs in ROOT/<split>/<class>/, class c's pixels all equal to 40 c + i; returns each split's labels."""
    labels = {}
    for split in splits:
        rows = []
        for c, name in enumerate(sorted(classes)):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(counts[c] if split == "train" else 2):
                Image.fromarray(np.full((side, side, 3), 40 * c + i, np.uint8)).save(folder / f"{name}{i}.png")
                rows.append(c)
        labels[split] = np.array(rows)
    return labels


def test_a_users_image_folders_load_as_a_dataset_with_sorted_classes_and_declared_statistics(tmp_path) -> None:
    from fedlt.data.declaration import declared_dataset

    write_image_folders(tmp_path)
    pair = load_dataset("imagefolder", root=str(tmp_path), image_size=8, with_val=True, every_class=True)
    assert pair.train.classes == ["cat", "dog", "owl"] and pair.train.num_classes == 3
    assert pair.train.class_counts().tolist() == [6, 2, 1] and pair.test.class_counts().tolist() == [2, 2, 2]
    assert pair.val.class_counts().tolist() == [2, 2, 2]
    assert tuple(pair.train.images.shape) == (9, 3, 8, 8) and pair.train.images.dtype == torch.uint8
    # a row's pixels are its class's: labels follow the sorted folder names
    assert all(int(x[0, 0, 0]) // 40 == int(y) for x, y in zip(pair.train.images, pair.train.labels))
    declared = declared_dataset(DataConfig(dataset="imagefolder", image_size=8, classes=["cat", "dog", "owl"]))
    assert (declared.mean, declared.std, declared.channels) == (pair.train.mean, pair.train.std, 3)
    __import__("shutil").rmtree(tmp_path / "val")
    assert error_of("imagefolder", tmp_path, image_size=8, with_val=True).startswith(
        f"imagefolder: no val/ in {tmp_path}, so it has no validation split of its own; add val/<class>/")


def test_a_users_image_folders_read_upper_case_suffixes(tmp_path) -> None:
    """Cameras and Windows tools write X.JPG, X.JPEG, X.PNG (or X.Jpeg): images like any other, in train and test."""
    write_image_folders(tmp_path, counts=(2, 2, 2), splits=("train", "test"))
    added = {("train", "cat", "IMG_0001.JPG"): 200, ("train", "dog", "photo.JPEG"): 220,
             ("train", "owl", "scan.PNG"): 240, ("test", "cat", "shot.Jpeg"): 180, ("test", "owl", "Scan.PNG"): 160}
    for (split, name, file), value in added.items():
        kind = "PNG" if file.lower().endswith(".png") else "JPEG"
        Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(tmp_path / split / name / file, kind, quality=95)
    pair = load_dataset("imagefolder", root=str(tmp_path), image_size=8)
    assert pair.train.class_counts().tolist() == [3, 3, 3] and pair.test.class_counts().tolist() == [3, 2, 3]
    for (split, name, _), value in added.items():
        data = pair.train if split == "train" else pair.test
        rows = [k for k, image in enumerate(data.images) if abs(int(image[0, 4, 4]) - value) <= 4]
        assert len(rows) == 1 and data.labels[rows[0]] == data.classes.index(name), (split, name, rows)


def test_a_users_image_folders_train_a_federation(tmp_path) -> None:
    import fedlt

    write_image_folders(tmp_path / "data", counts=(12, 12, 12), splits=("train", "test"))
    res = fedlt.run(None, overrides=["data.dataset=imagefolder", f"data.root={tmp_path / 'data'}", "data.image_size=8",
                                     "data.imbalance_factor=4", "data.num_clients=3", "fl.rounds=1", "run.threads=1",
                                     f"run.out_dir={tmp_path / 'runs'}"], quiet=True)
    assert res.summary["class_names"] == ["cat", "dog", "owl"] and res.summary["train_class_counts"] == [12, 6, 3]
    assert res.summary["final"]["acc"] is not None
    # 12 images at most: no class is many-shot by the papers' counts, and the report says how to move them
    assert "many = classes none" in (res.run_dir / "report.md").read_text()
    assert "(a group is empty: eval.many_threshold and eval.few_threshold move the counts, eval.shot_rule=cumulative" \
           in (res.run_dir / "report.md").read_text()



def test_a_long_tailed_folders_report_names_no_imbalance_factor_it_did_not_apply(tmp_path) -> None:
    """imagefolder_lt keeps its folders' own long tail: its run's report said IF=4 (or the default 100)."""
    import fedlt

    write_image_folders(tmp_path / "data", counts=(12, 6, 3), splits=("train", "test"))
    res = fedlt.run(None, overrides=["data.dataset=imagefolder_lt", f"data.root={tmp_path / 'data'}",
                                     "data.image_size=8", "data.imbalance_factor=4", "data.num_clients=3",
                                     "fl.rounds=1", "run.threads=1", f"run.out_dir={tmp_path / 'runs'}"], quiet=True)
    assert res.summary["train_class_counts"] == [12, 6, 3]
    report = (res.run_dir / "report.md").read_text()
    assert "long-tailed as distributed, dirichlet partition" in report and "IF=" not in report


def test_eval_accuracy_top1_weighs_an_unbalanced_test_set_by_its_images(tmp_path) -> None:
    """A test/ of 2, 2 and 6 images: acc is the mean of the per-class accuracies by default and the share of
    images right with eval.accuracy=top1 (the same training, so the same per-class accuracies)."""
    import fedlt

    write_image_folders(tmp_path / "data", counts=(12, 12, 12), splits=("train", "test"))
    for i in range(2, 6):
        Image.fromarray(np.full((8, 8, 3), 80 + i, np.uint8)).save(tmp_path / "data" / "test" / "owl" / f"more{i}.png")
    runs = {accuracy: fedlt.run(None, overrides=[
        "data.dataset=imagefolder", f"data.root={tmp_path / 'data'}", "data.image_size=8", "data.num_clients=3",
        "data.imbalance_factor=4", "fl.rounds=1", "run.threads=1", f"eval.accuracy={accuracy}", f"run.out_dir={tmp_path / accuracy}"], quiet=True)
        for accuracy in ("class_mean", "top1")}
    per_class = runs["top1"].summary["final"]["per_class_acc"]
    assert len(set(per_class)) > 1  # else both readings coincide and nothing is tested
    assert runs["class_mean"].summary["final"]["per_class_acc"] == per_class
    assert runs["class_mean"].summary["final"]["acc"] == pytest.approx(sum(per_class) / 3)
    assert runs["top1"].summary["final"]["acc"] == pytest.approx((2 * per_class[0] + 2 * per_class[1] + 6 * per_class[2]) / 10)

@pytest.mark.parametrize("damage, fragment", [
    (lambda root: __import__("shutil").rmtree(root / "test"), "imagefolder: no test/ in {root}; pass data.root=DIR"),
    (lambda root: (root / "test" / "emu").mkdir(),
     "imagefolder: unknown class folder {root}/test/emu; every split has train/'s: cat, dog, owl"),
    (lambda root: Image.new("L", (8, 8)).save(root / "train" / "cat" / "grey.png"),
     "imagefolder: image {root}/train/cat/grey.png has 1 channel(s) (mode L), expected 3 (mode RGB); save it as an "
     "RGB image"),
    (lambda root: Image.new("P", (8, 8)).save(root / "train" / "cat" / "palette.png"),
     "imagefolder: image {root}/train/cat/palette.png has 1 channel(s) (mode P) (a palette image), expected 3 (mode "
     "RGB); save it as an RGB image"),

    (lambda root: Image.new("RGB", (9, 8)).save(root / "test" / "dog" / "wide.png"),
     "imagefolder: image {root}/test/dog/wide.png is 9x8, expected 8x8; images are not resized, resize it or give "
     "data.image_size the side every image has"),
    (lambda root: (root / "train" / "cat" / "notes.txt").write_text("x"),
     "imagefolder: {root}/train/cat/notes.txt is not a .png/.jpg/.jpeg image; convert or remove it"),
])
def test_a_users_image_folders_name_what_is_wrong_in_one_line(tmp_path, damage, fragment) -> None:
    write_image_folders(tmp_path, splits=("train", "test"))
    damage(tmp_path)
    assert error_of("imagefolder", tmp_path, image_size=8).startswith(fragment.format(root=tmp_path))


def test_a_class_missing_from_a_users_test_folder_says_where_to_add_it(tmp_path) -> None:
    write_image_folders(tmp_path, splits=("train", "test"))
    __import__("shutil").rmtree(tmp_path / "test" / "dog")
    assert error_of("imagefolder", tmp_path, image_size=8, every_class=True) == (
        f"imagefolder: class 1 (dog) has no test samples in {tmp_path}, but imagefolder has 3 classes; add test "
        f"images of that class to {tmp_path}/test/dog/")


def test_a_users_long_tailed_folders_keep_every_image_and_validation_comes_from_where_it_is(tmp_path) -> None:
    """imagefolder long-tails a balanced train/ (IF=1 trims every class to the smallest); imagefolder_lt keeps
    a long tail as it is. data.val_from=auto takes val/ where it exists, else holds images out."""
    write_image_folders(tmp_path, counts=(40, 20, 6), splits=("train", "test"))
    cfg = dict(root=str(tmp_path), image_size=8, num_clients=2, partition="iid")
    trimmed = build_federated_data(DataConfig(dataset="imagefolder", imbalance_factor=1, **cfg), seed=0)
    assert trimmed.train.class_counts().tolist() == [6, 6, 6]
    kept = build_federated_data(DataConfig(dataset="imagefolder_lt", **cfg), seed=0)
    assert kept.train.class_counts().tolist() == [40, 20, 6]
    held = build_federated_data(DataConfig(dataset="imagefolder", imbalance_factor=2, val_per_class=1, **cfg), seed=0)
    assert held.val_source == "train" and held.val.class_counts().tolist() == [1, 1, 1]
    assert build_federated_data(DataConfig(dataset="imagefolder_lt", val_per_class=1, **cfg), seed=0).val_source == "test"
    write_image_folders(tmp_path / "v", counts=(4, 4, 4), splits=("val",))
    (tmp_path / "v" / "val").rename(tmp_path / "val")
    own = build_federated_data(DataConfig(dataset="imagefolder", imbalance_factor=2, val_per_class=1, **cfg), seed=0)
    assert own.val_source == "dataset"


def test_a_users_class_folders_are_named_as_they_are(tmp_path) -> None:
    """Folder names a file system allows but fedlt's export would escape (%, :) are the user's class names."""
    write_image_folders(tmp_path, classes=("50%off", "a:b", "plain"), counts=(2, 2, 2), splits=("train", "test"))
    pair = load_dataset("imagefolder", root=str(tmp_path), image_size=8)
    assert pair.train.classes == ["50%off", "a:b", "plain"]


def test_every_refused_image_of_a_split_is_counted_in_its_one_line(tmp_path) -> None:
    """A folder with many bad images was fixed one run at a time: the first was named, the rest unseen."""
    write_image_folders(tmp_path, splits=("train", "test"))
    for name in ("a", "b", "c", "d", "e"):
        Image.new("RGB", (9, 8)).save(tmp_path / "train" / "cat" / f"wide-{name}.png")
    (tmp_path / "train" / "dog" / "zz-broken.png").write_bytes(b"not a png")
    message = error_of("imagefolder", tmp_path, image_size=8)
    assert message.startswith(f"imagefolder: image {tmp_path}/train/cat/wide-a.png is 9x8, expected 8x8; ")
    assert message.endswith("; images are not resized, resize it or give data.image_size the side every image has "
                            "(5 more image(s) are refused too: cat/wide-b.png, cat/wide-c.png, cat/wide-d.png and 2 more)")
    assert "\n" not in message


def test_a_file_the_system_will_not_let_fedlt_read_is_named_with_its_permissions_as_the_fix(tmp_path, monkeypatch):
    """A file fedlt may not read (another account's, mode 600) was called corrupt: "extract it again",
    "replace it with a valid PNG". A fresh copy would not help; its permissions are the fix."""
    from fedlt.data.sources import imagefolder

    path = tmp_path / "train2018.json"
    path.write_text("{}")
    image = tmp_path / "a.png"
    Image.new("RGB", (4, 4)).save(image)

    def refused(self_or_path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self_or_path))

    monkeypatch.setattr(Path, "read_bytes", refused)
    monkeypatch.setattr(Path, "read_text", refused)
    monkeypatch.setattr(Image, "open", refused)
    cases = [lambda: listfile._parse_annotations(listfile.INAT2018, path),
             lambda: listfile._read_text(listfile.IMAGENET_LT, path),  # a list file
             lambda: common.read_rgb("imagenet_lt", image, "download it again"),
             lambda: imagefolder._decode(image, 3, 4, "node data")]
    for read, where in zip(cases, (path, path, image, image)):
        with pytest.raises(DataError) as err:
            read()
        assert str(err.value).endswith(f"cannot read {where} (Permission denied); give the account running fedlt "
                                       "read access to it"), err.value


def test_the_registry_knows_each_built_in_datasets_class_count():
    """``DatasetInfo.classes`` (read before any file, e.g. for SFD's note at 100 classes) is the count its
    description names and, for the generated datasets, the count they load with; folders leave it unknown."""
    from fedlt.data.registry import DATASETS, load_dataset

    for name, info in DATASETS.items():
        if name.startswith("imagefolder"):
            assert info.classes is None, name
            continue
        assert f"{info.classes} classes" in info.description, name
    for name in ("synthetic", "synthetic_cifar10", "synthetic_cifar100"):
        pair = load_dataset(name, image_size=2)
        assert len(pair.train.classes) == DATASETS[name].classes == int(pair.train.labels.max()) + 1, name
