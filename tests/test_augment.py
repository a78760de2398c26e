"""Batched on-device augmentation: contracts, determinism and per-op behaviour."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from fedlt.data import augment
from fedlt.data.augment import (
    ALL_OPS,
    SELECTIONS,
    AUGMENTATIONS,
    GEOMETRIC_OPS,
    INTERPOLATIONS,
    OP_NAMES,
    SIGNED_OPS,
    apply_op,
    auto_augment,
    crop_flip,
    crop_flip_cutout,
    cutout,
    get_augmentation,
    grid_mode,
    op_parameter,
    rand_augment,
    random_crop,
    random_flip,
    random_resized_square_crop,
    random_rotation,
    resized_crop_flip,
    rotate,
    strong_view,
    weak_view,
)
from fedlt.data.autoaugment import AUTOAUGMENT_POLICIES, CIFAR10_POLICY, SVHN_POLICY
from fedlt.errors import ConfigError

SHAPES = [(4, 1, 28, 28), (4, 3, 32, 32)]

Fn = Callable[[Tensor, torch.Generator], Tensor]
FUNCTIONS: dict[str, Fn] = {
    "random_crop": lambda x, g: random_crop(x, 4, g),
    "random_flip": lambda x, g: random_flip(x, g),
    "random_rotation": lambda x, g: random_rotation(x, 30.0, g),
    "cutout": lambda x, g: cutout(x, 8, g),
    "rand_augment": lambda x, g: rand_augment(x, g),
    "auto_augment": lambda x, g: auto_augment(x, g),
    "crop_flip": lambda x, g: crop_flip(x, g),
    "crop_flip_noflip": lambda x, g: crop_flip(x, g, flip=False),
    "crop_flip_cutout": lambda x, g: crop_flip_cutout(x, g),
    "resized_crop_flip": lambda x, g: resized_crop_flip(x, g),
    "resized_crop_flip_noflip": lambda x, g: resized_crop_flip(x, g, flip=False),
    "weak_view": lambda x, g: weak_view(x, g),
    "weak_view_noflip": lambda x, g: weak_view(x, g, flip=False),
    "strong_view": lambda x, g: strong_view(x, g),
    "strong_view_noflip": lambda x, g: strong_view(x, g, flip=False),
    "strong_view_autoaugment": lambda x, g: strong_view(x, g, policy="autoaugment"),
    "none": lambda x, g: AUGMENTATIONS["none"](x, g, True),
}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def batch(shape: tuple[int, ...], seed: int = 123) -> Tensor:
    return torch.rand(shape, generator=gen(seed))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", FUNCTIONS)
def test_contract(name: str, shape: tuple[int, ...]) -> None:
    x = batch(shape)
    before = x.clone()
    out = FUNCTIONS[name](x, gen())
    assert out.shape == x.shape
    assert out.dtype == x.dtype
    assert out.device == x.device
    assert out.min() >= 0.0 and out.max() <= 1.0
    assert torch.equal(x, before)


@pytest.mark.parametrize("shape", [(32, 1, 28, 28), (32, 3, 32, 32)])
@pytest.mark.parametrize("name", [n for n in FUNCTIONS if n != "none"])
def test_seed_determinism(name: str, shape: tuple[int, ...]) -> None:
    x = batch(shape)
    fn = FUNCTIONS[name]
    assert torch.equal(fn(x, gen(1)), fn(x, gen(1)))
    assert not torch.equal(fn(x, gen(1)), fn(x, gen(2)))


def test_float64_keeps_dtype() -> None:
    x = batch((4, 3, 32, 32)).double()
    assert strong_view(x, gen()).dtype == torch.float64


def test_rejects_non_float_batch() -> None:
    with pytest.raises(ValueError, match="float"):
        random_flip(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), gen())


def test_crop_padding_zero_is_identity() -> None:
    x = batch((4, 3, 32, 32))
    assert torch.equal(random_crop(x, 0, gen()), x)


def test_crop_moves_single_pixel_within_padding() -> None:
    padding, y, x0 = 4, 10, 20
    x = torch.zeros(64, 1, 32, 32)
    x[:, :, y, x0] = 1.0
    out = random_crop(x, padding, gen())
    assert torch.equal(out.sum(dim=(1, 2, 3)), torch.ones(64))
    pos = out.flatten(1).argmax(dim=1)
    dy, dx = pos // 32 - y, pos % 32 - x0
    assert dy.abs().max() <= padding and dx.abs().max() <= padding
    assert len(set(zip(dy.tolist(), dx.tolist()))) > 10


def test_crop_fills_with_zeros() -> None:
    out = random_crop(torch.ones(64, 3, 16, 16), 2, gen())
    assert (out == 0).any()
    assert ((out == 0) | (out == 1)).all()


def test_flip_probabilities() -> None:
    x = batch((8, 3, 32, 32))
    assert torch.equal(random_flip(x, gen(), p=1.0), x.flip(-1))
    assert torch.equal(random_flip(x, gen(), p=0.0), x)
    mixed = random_flip(batch((64, 3, 8, 8)), gen())
    flipped = (mixed == batch((64, 3, 8, 8)).flip(-1)).flatten(1).all(dim=1)
    assert 0 < int(flipped.sum()) < 64


def test_rotation_zero_degrees_is_identity() -> None:
    x = batch((4, 3, 32, 32))
    torch.testing.assert_close(random_rotation(x, 0.0, gen()), x, atol=1e-5, rtol=0)


def test_rotation_keeps_centre_and_blanks_corners() -> None:
    x = torch.ones(16, 1, 32, 32)
    out = random_rotation(x, 45.0, gen())
    torch.testing.assert_close(out[:, :, 14:18, 14:18], x[:, :, 14:18, 14:18])
    assert (out[:, :, 0, 0] < 1).any()


@pytest.mark.parametrize("size", [1, 5, 8])
def test_cutout_zeroes_one_square(size: int) -> None:
    x = torch.ones(128, 3, 16, 16)
    out = cutout(x, size, gen())
    holes = out[:, 0] == 0
    assert torch.equal(holes[:, None].expand_as(out), out == 0)
    counts = holes.flatten(1).sum(dim=1)
    assert (counts > 0).all() and (counts <= size * size).all()
    rows, cols = holes.any(dim=2), holes.any(dim=1)
    assert torch.equal(counts, rows.sum(dim=1) * cols.sum(dim=1))
    assert (counts == size * size).any()


def test_cutout_of_half_size_on_32px() -> None:
    out = cutout(torch.ones(256, 3, 32, 32), 16, gen())
    counts = (out[:, 0] == 0).flatten(1).sum(dim=1)
    assert counts.max() == 256 and counts.min() >= 64


def test_rand_augment_changes_images() -> None:
    x = batch((32, 3, 32, 32))
    out = rand_augment(x, gen())
    changed = (out - x).abs().flatten(1).amax(dim=1) > 1e-3
    assert int(changed.sum()) >= 24


def test_rand_augment_geometric_magnitude_zero_is_identity() -> None:
    x = batch((16, 3, 32, 32))
    out = rand_augment(x, gen(), num_ops=3, magnitude=0, ops=GEOMETRIC_OPS)
    torch.testing.assert_close(out, x, atol=1e-5, rtol=0)


def test_rand_augment_rejects_unknown_op_and_magnitude() -> None:
    x = batch((2, 3, 8, 8))
    with pytest.raises(ValueError, match="subset"):
        rand_augment(x, gen(), ops=("rotate", "blur"))
    with pytest.raises(ValueError, match="magnitude"):
        rand_augment(x, gen(), magnitude=31)
    with pytest.raises(ValueError, match="strength"):
        apply_op(x, "rotate", 1.1, gen())
    with pytest.raises(ValueError, match="unknown"):
        apply_op(x, "blur", 0.5, gen())
    with pytest.raises(ValueError, match="strong policy"):
        strong_view(x, gen(), policy="trivialaugment")


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("name", ALL_OPS)
def test_each_op_contract(name: str, channels: int) -> None:
    x = batch((4, channels, 28, 28))
    before = x.clone()
    for strength in (0.0, 0.5, 1.0):
        out = apply_op(x, name, strength, gen())
        assert out.shape == x.shape and out.dtype == x.dtype
        assert out.min() >= 0.0 and out.max() <= 1.0
    assert torch.equal(x, before)


@pytest.mark.parametrize("name", ["solarize", "contrast", "brightness", "color", "sharpness"])
def test_photometric_ops_at_magnitude_zero_are_identity(name: str) -> None:
    x = batch((4, 3, 16, 16))
    torch.testing.assert_close(apply_op(x, name, 0.0, gen()), x, atol=1e-6, rtol=0)


def test_brightness_scales_by_0_1_or_1_9() -> None:
    x = batch((32, 3, 8, 8)) * 0.5
    out = apply_op(x, "brightness", 1.0, gen())
    ratio = (out / x).flatten(1)
    torch.testing.assert_close(ratio.amin(dim=1), ratio.amax(dim=1))
    factors = ratio[:, 0]
    assert torch.all(((factors - 0.1).abs() < 1e-4) | ((factors - 1.9).abs() < 1e-4))
    assert (factors < 1).any() and (factors > 1).any()


def test_solarize_inverts_pixels_at_or_above_the_threshold() -> None:
    x = batch((4, 3, 8, 8))
    x[:, :, 0, 0] = 0.0
    torch.testing.assert_close(apply_op(x, "solarize", 1.0, gen()), 1 - x)  # threshold 0: all
    out = apply_op(x, "solarize", 0.3, gen())  # threshold 0.7
    torch.testing.assert_close(out, torch.where(x >= 0.7, 1 - x, x))


def test_posterize_full_magnitude_keeps_four_bits() -> None:
    out = apply_op(batch((4, 3, 32, 32)), "posterize", 1.0, gen())
    levels = torch.unique((out * 255).round())
    assert len(levels) <= 16
    assert torch.all(levels % 16 == 0)


def test_autocontrast_spans_unit_range_per_channel() -> None:
    x = 0.3 + 0.2 * batch((4, 3, 16, 16))
    x[1, 2] = 0.5  # a constant channel stays as it is
    out = apply_op(x, "autocontrast", 0.5, gen())
    lo, hi = out.amin(dim=(2, 3)), out.amax(dim=(2, 3))
    lo[1, 2], hi[1, 2] = 0.0, 1.0
    torch.testing.assert_close(lo, torch.zeros(4, 3))
    torch.testing.assert_close(hi, torch.ones(4, 3))
    assert torch.equal(out[1, 2], x[1, 2])


def test_equalize_flattens_histogram() -> None:
    x = 0.4 + 0.2 * batch((2, 1, 32, 32))
    out = apply_op(x, "equalize", 0.5, gen())
    assert out.min() < 0.05 and out.max() > 0.95
    hist = torch.histc(out[0], bins=4, min=0, max=1)
    assert hist.min() > 0.15 * out[0].numel()
    order = x[0].flatten().argsort()
    assert (out[0].flatten()[order].diff() >= 0).all()
    constant = torch.full((1, 3, 8, 8), 0.25)
    assert torch.equal(apply_op(constant, "equalize", 0.5, gen()), constant)


def test_color_is_identity_on_gray_and_single_channel() -> None:
    gray = batch((4, 1, 16, 16))
    assert torch.equal(apply_op(gray, "color", 1.0, gen()), gray)
    rgb_gray = gray.expand(4, 3, 16, 16)
    torch.testing.assert_close(apply_op(rgb_gray, "color", 1.0, gen()), rgb_gray)
    rgb = batch((4, 3, 16, 16))
    assert not torch.allclose(apply_op(rgb, "color", 1.0, gen()), rgb)


@pytest.mark.parametrize("name, axis", [("translate_x", 1), ("translate_y", 0)])
def test_translate_full_range_shifts_by_150_of_331(name: str, axis: int) -> None:
    """331 px images as in the papers: full strength moves content by exactly 150 px."""
    x = torch.zeros(16, 1, 331, 331)
    x[:, :, 165, 165] = 1.0
    out = apply_op(x, name, 1.0, gen())
    pos = out[:, 0].flatten(1).argmax(dim=1)
    shift = (pos % 331 if axis == 1 else pos // 331) - 165
    other = (pos // 331 if axis == 1 else pos % 331) - 165
    assert torch.equal(shift.abs(), torch.full((16,), 150))
    assert (other == 0).all()
    assert (shift > 0).any() and (shift < 0).any()


def test_weak_view_without_flip_never_flips(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(64, 3, 32, 32)
    x[..., :16] = 1.0
    out = weak_view(x, gen(), flip=False)
    assert (out[..., :16].mean(dim=(1, 2, 3)) > out[..., 16:].mean(dim=(1, 2, 3)) + 0.3).all()
    flipped = weak_view(x, gen(), flip=True)
    assert (flipped[..., :16].mean(dim=(1, 2, 3)) < flipped[..., 16:].mean(dim=(1, 2, 3))).any()

    def forbidden(*args: object, **kwargs: object) -> Tensor:
        raise AssertionError("random_flip called with flip=False")

    monkeypatch.setattr(augment, "random_flip", forbidden)
    weak_view(x, gen(), flip=False)
    strong_view(x, gen(), flip=False)
    crop_flip(x, gen(), flip=False)


def test_crop_flip_is_the_weak_view_without_its_rotation() -> None:
    """crop_flip draws a window per image (an eighth of the side as padding: 3 px on 28 px) and a
    flip; the weak view is that, then a rotation from the same generator."""
    x = batch((16, 1, 28, 28))
    g = gen(3)
    expected = random_flip(random_crop(x, 3, g), g)
    assert torch.equal(crop_flip(x, gen(3)), expected)
    assert torch.equal(weak_view(x, gen(3)), random_rotation(expected, 15.0, g))
    windows = {tuple(crop_flip(torch.rand(1, 1, 8, 8, generator=gen(0)).expand(64, 1, 8, 8), gen(s))[i].flatten()[:3].tolist())
               for s in range(2) for i in range(64)}
    assert len(windows) > 4  # not one window for the whole batch


def test_strong_view_magnitude_and_cutout_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cutout side is ``round(cutout_frac * H)`` (16 on 32px, 14 on 28px by default) and
    magnitude 0 with no cutout leaves only the crop and flip."""
    sizes: list[int] = []
    real_cutout = augment.cutout
    monkeypatch.setattr(augment, "cutout", lambda x, size, g: sizes.append(size) or real_cutout(x, size, g))
    strong_view(batch((2, 3, 32, 32)), gen())
    strong_view(batch((2, 1, 28, 28)), gen())
    strong_view(batch((2, 1, 28, 28)), gen(), cutout_frac=0.25)
    assert sizes == [16, 14, 7]
    x = batch((8, 1, 28, 28))
    g = gen(5)
    expected = augment.random_flip(augment.random_crop(x, 3, g), g)
    assert torch.equal(strong_view(x, gen(5), magnitude=0, cutout_frac=0), expected)
    assert not torch.equal(strong_view(x, gen(5), magnitude=9, cutout_frac=0), expected)


def test_strong_view_batch_of_256_runs() -> None:
    out = strong_view(batch((256, 3, 32, 32)), gen())
    assert out.shape == (256, 3, 32, 32)


def test_registry() -> None:
    assert set(AUGMENTATIONS) == {"none", "crop_flip", "crop_flip_cutout", "resized_crop_flip", "weak", "strong"}
    assert get_augmentation("crop_flip") is crop_flip
    assert get_augmentation("weak") is weak_view
    assert get_augmentation("strong") is strong_view
    x = batch((2, 3, 8, 8))
    assert torch.equal(get_augmentation("none")(x, gen(), True), x)


def test_unknown_augmentation_is_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        get_augmentation("heavy")
    message = str(info.value)
    assert "\n" not in message
    assert "data.augment=" in message
    assert all(name in message for name in AUGMENTATIONS)


@pytest.mark.parametrize("view", ["weak", "strong"])
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_client_batch_views_keep_labels_shape_and_dtype(view: str, shape: tuple[int, ...]) -> None:
    """Through ``ClientData.batch`` the real views change the images, never the labels."""
    from fedlt.methods.base import ClientData

    images = torch.randint(0, 256, (10, *shape), dtype=torch.uint8, generator=gen(5))
    labels = torch.arange(10) % 3
    data = ClientData(images, labels, torch.tensor([9, 2, 4, 7]), 3, standardize=lambda x: x,
                      augment=get_augmentation(view), hflip=True)
    plain, plain_y = data.batch(torch.arange(4))
    x, y = data.batch(torch.arange(4), gen(0))
    assert torch.equal(y, labels[[9, 2, 4, 7]]) and torch.equal(y, plain_y)
    assert x.shape == plain.shape == (4, *shape) and x.dtype == plain.dtype == torch.float32
    assert not torch.equal(x, plain)


# ---- RandAugment and AutoAugment magnitudes (torchvision's op ranges) --------------------------
def test_op_parameters_at_randaugment_magnitude_9_and_30() -> None:
    """M of 30 bins: M=9 is 30% of each range, M=30 all of it."""
    at_9 = {name: op_parameter(name, 9 / 30) for name in ALL_OPS}
    expected = {
        "identity": 0.0, "autocontrast": 0.0, "equalize": 0.0, "invert": 0.0,
        "rotate": 9.0, "shear_x": 0.09, "shear_y": 0.09,
        "translate_x": 0.3 * 150 / 331, "translate_y": 0.3 * 150 / 331,
        "contrast": 0.27, "brightness": 0.27, "color": 0.27, "sharpness": 0.27,
        "posterize": 7.0, "solarize": 0.7,
    }
    assert at_9 == pytest.approx(expected)
    assert op_parameter("rotate", 1.0) == 30.0 and op_parameter("posterize", 1.0) == 4.0
    assert op_parameter("solarize", 1.0) == 0.0 and op_parameter("translate_x", 1.0) == pytest.approx(0.4532, abs=1e-4)
    assert SIGNED_OPS == {"rotate", "shear_x", "shear_y", "translate_x", "translate_y",
                          "contrast", "brightness", "color", "sharpness"}


def _record_rotations(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    angles: list[float] = []
    real = augment.rotate
    monkeypatch.setattr(augment, "rotate", lambda x, deg, interp: angles.extend(deg.tolist()) or real(x, deg, interp))
    return angles


@pytest.mark.parametrize("select", SELECTIONS)
def test_rand_augment_m9_rotates_by_plus_or_minus_9_degrees(monkeypatch: pytest.MonkeyPatch, select: str) -> None:
    angles = _record_rotations(monkeypatch)
    rand_augment(batch((64, 1, 28, 28)), gen(), num_ops=1, magnitude=9, ops=("rotate",), select=select)
    assert len(angles) == 64 and {round(a, 6) for a in angles} == {-9.0, 9.0}
    x = batch((64, 3, 8, 8)) * 0.5
    ratio = (rand_augment(x, gen(), num_ops=1, magnitude=9, ops=("brightness",), select=select) / x).flatten(1)[:, 0]
    assert torch.all(((ratio - 0.73).abs() < 1e-4) | ((ratio - 1.27).abs() < 1e-4))


def test_autoaugment_cifar10_table_is_the_published_policy() -> None:
    assert len(CIFAR10_POLICY) == 25 and all(len(sub) == 2 for sub in CIFAR10_POLICY)
    assert CIFAR10_POLICY[:4] == (
        (("invert", 0.1, None), ("contrast", 0.2, 6)),
        (("rotate", 0.7, 2), ("translate_x", 0.3, 9)),
        (("sharpness", 0.8, 1), ("sharpness", 0.9, 3)),
        (("shear_y", 0.5, 8), ("translate_y", 0.7, 9)),
    )
    assert CIFAR10_POLICY[14] == (("solarize", 0.5, 2), ("invert", 0.0, None))
    assert CIFAR10_POLICY[22] == (("autocontrast", 0.9, None), ("solarize", 0.8, 3))
    assert CIFAR10_POLICY[24] == (("translate_y", 0.7, 9), ("autocontrast", 0.9, None))
    for name, probability, level in (step for sub in CIFAR10_POLICY for step in sub):
        assert name in ALL_OPS and 0.0 <= probability <= 1.0
        assert (level is None) == (name in ("invert", "autocontrast", "equalize"))
        assert level is None or 0 <= level <= 9


def test_autoaugment_svhn_table_is_the_published_policy() -> None:
    """The policy found on reduced SVHN (Cubuk et al., CVPR 2019, Appendix), spot-checked entry by entry."""
    assert len(SVHN_POLICY) == 25 and all(len(sub) == 2 for sub in SVHN_POLICY)
    assert SVHN_POLICY[:3] == (
        (("shear_x", 0.9, 4), ("invert", 0.2, None)),
        (("shear_y", 0.9, 8), ("invert", 0.7, None)),
        (("equalize", 0.6, None), ("solarize", 0.6, 6)),
    )
    assert SVHN_POLICY[14] == (("contrast", 0.3, 3), ("rotate", 0.8, 4))
    assert SVHN_POLICY[15] == (("invert", 0.8, None), ("translate_y", 0.0, 2))
    assert SVHN_POLICY[20] == (("solarize", 0.7, 2), ("translate_y", 0.6, 7))
    assert SVHN_POLICY[24] == (("shear_x", 0.7, 2), ("invert", 0.1, None))
    ops = {name for sub in SVHN_POLICY for name, _, _ in sub}
    assert ops == {"shear_x", "shear_y", "translate_x", "translate_y", "rotate", "invert", "equalize",
                   "autocontrast", "solarize", "contrast"}  # no colour, brightness, sharpness or posterize
    assert AUTOAUGMENT_POLICIES == {"cifar10": CIFAR10_POLICY, "svhn": SVHN_POLICY}


@pytest.mark.parametrize("name", ["cifar10", "svhn"])
def test_every_autoaugment_policy_is_25_pairs_of_valid_steps(name: str) -> None:
    policy = AUTOAUGMENT_POLICIES[name]
    assert len(policy) == 25 and all(len(sub) == 2 for sub in policy)
    for op, probability, level in (step for sub in policy for step in sub):
        assert op in ALL_OPS and 0.0 <= probability <= 1.0
        assert (level is None) == (op in ("invert", "autocontrast", "equalize"))  # the ops without a magnitude
        assert level is None or (isinstance(level, int) and 0 <= level <= 9)
        op_parameter(op, augment._bin_strength(level))  # every bin is a valid strength of its op


@pytest.mark.parametrize("select", SELECTIONS)
def test_auto_augment_bins_map_to_ninths_of_the_range(monkeypatch: pytest.MonkeyPatch, select: str) -> None:
    """Bin b is b/9 of the range: (rotate, bin 2) turns by 20/3 degrees, either way."""
    angles = _record_rotations(monkeypatch)
    policy = ((("rotate", 1.0, 2), ("invert", 0.0, None)),)
    auto_augment(batch((64, 1, 8, 8)), gen(), policy=policy, select=select)
    assert {round(a, 5) for a in angles} == {round(-20 / 3, 5), round(20 / 3, 5)}
    x = batch((8, 3, 16, 16))
    posterized = auto_augment(x, gen(), policy=((("posterize", 1.0, 7), ("identity", 1.0, None)),), select=select)
    assert torch.equal(posterized, apply_op(x, "posterize", 7 / 9, gen()))  # 8 - round(28/9) = 5 bits
    assert torch.all((posterized * 255).round() % 8 == 0)


@pytest.mark.parametrize("select", SELECTIONS)
def test_auto_augment_steps_fire_with_their_probability_and_sub_policies_uniformly(select: str) -> None:
    x = torch.full((4000, 1, 2, 2), 0.25)
    fired = auto_augment(x, gen(), policy=((("invert", 0.3, None), ("identity", 1.0, None)),), select=select)
    assert ((fired == 0.75).flatten(1).all(1) | (fired == 0.25).flatten(1).all(1)).all()
    assert (fired[:, 0, 0, 0] == 0.75).float().mean().item() == pytest.approx(0.3, abs=0.03)
    half = ((("invert", 1.0, None), ("identity", 1.0, None)), (("identity", 1.0, None), ("identity", 1.0, None)))
    halved = auto_augment(x, gen(), policy=half, select=select)
    assert (halved[:, 0, 0, 0] == 0.75).float().mean().item() == pytest.approx(0.5, abs=0.03)
    # the second step composes with the first
    twice = ((("invert", 1.0, None), ("invert", 1.0, None)),)
    assert torch.equal(auto_augment(x, gen(), policy=twice, select=select), x)


#: the CIFAR-10 policy without its signed ops (a sign is drawn per image under mask selection, per
#: drawn image under index selection): both selections then draw the same random numbers
UNSIGNED_POLICY = tuple(sub for sub in CIFAR10_POLICY if not {op for op, _, _ in sub} & SIGNED_OPS)
UNSIGNED_OPS = tuple(op for op in OP_NAMES if op not in SIGNED_OPS)


@pytest.mark.parametrize("policy", ["autoaugment", "randaugment"])
def test_mask_selection_transforms_each_image_as_index_selection_does(policy: str) -> None:
    """Per image, an op applied to the whole batch and kept where drawn is the op applied to the
    images that drew it (sub-policies sharing an op and bin in one call included)."""
    x = batch((64, 3, 16, 16))
    run = ((lambda select: auto_augment(x, gen(5), policy=UNSIGNED_POLICY, select=select)) if policy == "autoaugment"
           else (lambda select: rand_augment(x, gen(5), num_ops=2, magnitude=20, ops=UNSIGNED_OPS, select=select)))
    assert len(UNSIGNED_POLICY) >= 8 and len(UNSIGNED_OPS) == 5
    indexed, masked = run("index"), run("mask")
    assert (indexed - x).abs().flatten(1).amax(dim=1).gt(1e-3).sum() >= 32  # most images changed
    torch.testing.assert_close(masked, indexed, atol=1e-6, rtol=0)


def test_mask_selection_never_waits_for_the_device() -> None:
    """What a GPU runs: no host synchronisation in either policy, where index selection has one per op."""
    from fedlt.bench.host_syncs import HostSyncs

    x = batch((32, 3, 16, 16))
    counts = {}
    for select in SELECTIONS:
        auto_augment(x, gen(), select=select)  # the policy's tables and constants are made once per device
        rand_augment(x, gen(), select=select)
        with HostSyncs() as syncs:
            auto_augment(x, gen(), select=select)
            rand_augment(x, gen(), select=select)
        counts[select] = dict(syncs.calls)
    assert counts["mask"] == {} and sum(counts["index"].values()) >= 50 + 26
    with pytest.raises(ValueError, match="unknown selection 'gather'; use one of index, mask"):
        auto_augment(x, gen(), select="gather")
    assert augment.selection_for(x) == "index"  # the CPU keeps the stream committed results were drawn with


def test_strong_view_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    """autoaugment runs the CIFAR-10 policy and no RandAugment; randaugment the reverse."""
    calls: list[str] = []
    real_auto, real_rand = augment.auto_augment, augment.rand_augment
    monkeypatch.setattr(augment, "auto_augment", lambda x, g, **kw: calls.append("auto") or real_auto(x, g, **kw))
    monkeypatch.setattr(augment, "rand_augment", lambda x, g, **kw: calls.append(f"rand{kw['magnitude']}") or real_rand(x, g, **kw))
    x = batch((4, 3, 32, 32))
    strong_view(x, gen(), policy="autoaugment", magnitude=20)
    strong_view(x, gen(), policy="randaugment", magnitude=20)
    assert calls == ["auto", "rand20"]


def test_strong_view_applies_the_named_autoaugment_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """``autoaugment_policy`` picks the table auto_augment receives: CIFAR-10's by default, SVHN's by name."""
    policies: list = []
    real = augment.auto_augment
    monkeypatch.setattr(augment, "auto_augment", lambda x, g, policy, **kw: policies.append(policy) or real(x, g, policy, **kw))
    x = batch((8, 3, 32, 32))
    strong_view(x, gen(), policy="autoaugment")
    svhn = strong_view(x, gen(), policy="autoaugment", autoaugment_policy="svhn")
    cifar = strong_view(x, gen(), policy="autoaugment", autoaugment_policy="cifar10")
    strong_view(x, gen(), policy="randaugment", autoaugment_policy="svhn")  # unused under RandAugment
    assert policies == [CIFAR10_POLICY, SVHN_POLICY, CIFAR10_POLICY]
    assert svhn.shape == x.shape and not torch.equal(svhn, cifar)
    with pytest.raises(ValueError, match="unknown AutoAugment policy 'imagenet'; use one of cifar10, svhn"):
        strong_view(x, gen(), policy="autoaugment", autoaugment_policy="imagenet")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["rand_augment", "auto_augment", "weak_view", "strong_view", "strong_view_autoaugment"])
def test_uint8_in_uint8_out(name: str, shape: tuple[int, ...]) -> None:
    """A uint8 batch is augmented as its [0, 1] floats and rounded back."""
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen(3))
    out = FUNCTIONS[name](images, gen(1))
    assert out.dtype == torch.uint8 and out.shape == images.shape
    expected = (FUNCTIONS[name](images.float() / 255, gen(1)) * 255).round().to(torch.uint8)
    assert torch.equal(out, expected)


# ---- interpolation of the geometric ops ---------------------------------------------------------
def _dot(row: int, col: int) -> Tensor:
    """A 5x5 image, 0 everywhere but one pixel at 1."""
    x = torch.zeros(1, 1, 5, 5)
    x[0, 0, row, col] = 1.0
    return x


def _cubic(t: float, a: float = -0.75) -> float:
    """The cubic-convolution weight of a tap at distance ``|t| <= 1`` (torch's bicubic, a = -0.75)."""
    t = abs(t)
    return (a + 2) * t**3 - (a + 3) * t**2 + 1


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear", "bicubic", "released"])
def test_rotation_by_90_degrees_moves_a_pixel_exactly(interpolation: str) -> None:
    """Every sample lands on a pixel centre: (row 1, col 3) turns counter-clockwise to (1, 1)."""
    out = rotate(_dot(1, 3), torch.tensor([90.0]), interpolation)
    torch.testing.assert_close(out, _dot(1, 1), atol=1e-6, rtol=0)


def test_rotation_by_45_degrees_by_hand() -> None:
    """The pixel one right of the centre turns to (0.71, -0.71) px from the centre. Output pixel
    (row 1, col 3) samples the input at (1.41, 0) px, (1, 2) and (2, 3) at (0.71, -+0.71) px."""
    x, angle = _dot(2, 3), torch.tensor([45.0])
    assert torch.equal(rotate(x, angle, "nearest"), _dot(1, 3))  # moved, still one pixel at 1
    r = math.sqrt(0.5)
    bilinear = (2 - math.sqrt(2)) * _dot(1, 3) + (r * (1 - r)) * (_dot(1, 2) + _dot(2, 3))
    torch.testing.assert_close(rotate(x, angle, "bilinear"), bilinear, atol=1e-6, rtol=0)  # spread: peak 0.59
    bicubic = rotate(x, angle, "bicubic")
    assert bicubic[0, 0, 1, 3].item() == pytest.approx(_cubic(math.sqrt(2) - 1), abs=1e-5)  # 0.70
    assert bicubic[0, 0, 1, 2].item() == pytest.approx(_cubic(1 - r) * _cubic(r), abs=1e-5)  # 0.27
    assert bicubic.min() == 0.0  # negative lobes clamped


def test_grid_modes_of_each_interpolation() -> None:
    assert INTERPOLATIONS == ("bilinear", "nearest", "bicubic", "released")
    released = {op: grid_mode("released", op) for op in GEOMETRIC_OPS}
    assert released == {"rotate": "nearest", "translate_x": "nearest", "translate_y": "nearest",
                        "shear_x": "bicubic", "shear_y": "bicubic"}
    assert {grid_mode(mode, op) for mode in ("bilinear", "nearest", "bicubic") for op in GEOMETRIC_OPS} == {
        "bilinear", "nearest", "bicubic"}
    assert all(grid_mode(mode, "shear_y") == mode for mode in ("bilinear", "nearest", "bicubic"))
    x = batch((2, 1, 8, 8))
    for call in (lambda: rotate(x, torch.zeros(2), "area"), lambda: weak_view(x, gen(), interpolation="linear"),
                 lambda: apply_op(x, "invert", 0.0, gen(), "area"), lambda: strong_view(x, gen(), interpolation="area"),
                 lambda: auto_augment(x, gen(), interpolation="area")):
        with pytest.raises(ValueError, match="unknown interpolation '(area|linear)'; use one of bilinear"):
            call()


def test_released_shear_is_bicubic_and_translate_nearest() -> None:
    x = batch((16, 1, 28, 28))
    for op, mode in (("shear_x", "bicubic"), ("shear_y", "bicubic"), ("translate_x", "nearest"), ("rotate", "nearest")):
        released = apply_op(x, op, 0.7, gen(4), "released")
        assert torch.equal(released, apply_op(x, op, 0.7, gen(4), mode)), op
        assert not torch.equal(released, apply_op(x, op, 0.7, gen(4), "bilinear")), op


def _laplacian(x: Tensor) -> float:
    """Mean |4-neighbour Laplacian| over the interior pixels: how sharp the images are."""
    lap = (4 * x[..., 1:-1, 1:-1] - x[..., :-2, 1:-1] - x[..., 2:, 1:-1] - x[..., 1:-1, :-2] - x[..., 1:-1, 2:])
    return lap.abs().mean().item()


def test_nearest_weak_view_keeps_binary_images_binary_and_sharp() -> None:
    """Nearest (and the released code's views) copy pixels, bilinear blends them: on 0/1 images
    the weak view then has grey values and a Laplacian well below the original's."""
    x = (batch((64, 1, 28, 28), seed=9) > 0.5).float()
    sharp = weak_view(x, gen(2), flip=False, interpolation="released")
    assert ((sharp == 0) | (sharp == 1)).all()
    assert torch.equal(sharp, weak_view(x, gen(2), flip=False, interpolation="nearest"))
    blurred = weak_view(x, gen(2), flip=False)
    assert ((blurred > 0.05) & (blurred < 0.95)).float().mean() > 0.2
    assert _laplacian(blurred) < 0.8 * _laplacian(x) < _laplacian(sharp)


def test_strong_view_passes_its_interpolation_to_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real = augment.apply_op
    monkeypatch.setattr(augment, "apply_op", lambda x, name, s, g, interp: seen.append(interp) or real(x, name, s, g, interp))
    strong_view(batch((32, 1, 28, 28)), gen(), policy="autoaugment", interpolation="released")
    strong_view(batch((32, 1, 28, 28)), gen(), policy="randaugment", interpolation="nearest")
    assert set(seen) == {"released", "nearest"} and seen[0] == "released" and seen[-1] == "nearest"


# ---- data.hflip --------------------------------------------------------------------------------
def _left_bright(n: int) -> Tensor:
    """uint8 images, white on the left half and black on the right: a flip swaps the halves."""
    images = torch.zeros(n, 1, 28, 28, dtype=torch.uint8)
    images[..., :14] = 255
    return images


@pytest.mark.parametrize("setting, registry, expected", [
    ("auto", True, True), ("auto", False, False), (True, False, True), (False, True, False)])
def test_data_hflip_overrides_the_dataset_setting(monkeypatch: pytest.MonkeyPatch, setting, registry, expected) -> None:
    from dataclasses import replace

    from fedlt.config import load_config
    from fedlt.data.federated import build_federated_data
    from fedlt.data.registry import DATASETS

    monkeypatch.setitem(DATASETS, "synthetic", replace(DATASETS["synthetic"], hflip=registry))
    override = {"auto": "auto", True: "true", False: "false"}[setting]
    cfg = load_config(None, ["data.dataset=synthetic", "data.num_clients=4", f"data.hflip={override}"])
    assert cfg.data.hflip == setting
    assert build_federated_data(cfg.data, seed=0).hflip is expected


def test_data_hflip_false_never_flips_a_training_image() -> None:
    """Through a client of a federation built with data.hflip=false, the weak view never mirrors:
    the left half stays brighter in every image; with true about half are mirrored."""
    from fedlt.config import load_config
    from fedlt.data.federated import build_federated_data
    from fedlt.methods.base import ClientData

    mirrored = {}
    for flips in ("false", "true"):
        cfg = load_config(None, ["data.dataset=synthetic", "data.num_clients=4", f"data.hflip={flips}"])
        federation = build_federated_data(cfg.data, seed=0)
        data = ClientData(_left_bright(400), torch.zeros(400, dtype=torch.long), torch.arange(400), 10,
                          standardize=lambda x: x, augment=weak_view, hflip=federation.hflip)
        x, _ = data.batch(torch.arange(400), gen(6))
        left, right = x[..., :14].mean(dim=(1, 2, 3)), x[..., 14:].mean(dim=(1, 2, 3))
        mirrored[flips] = (right > left).float().mean().item()
    assert mirrored["false"] == 0.0
    assert mirrored["true"] == pytest.approx(0.5, abs=0.1)


def test_data_hflip_rejects_other_values() -> None:
    from fedlt.config import build_config

    for bad in ("maybe", 1, None):
        with pytest.raises(ConfigError) as info:
            build_config({"data": {"hflip": bad}})
        assert str(info.value) == f"invalid config value data.hflip: {bad!r} is not a flip setting; use auto, true or false"


def test_crop_flip_cutout_is_crop_flip_then_a_hole_of_half_the_side():
    x = batch((8, 3, 32, 32))
    g = gen(4)
    assert torch.equal(crop_flip_cutout(x, gen(4)), cutout(crop_flip(x, g), 16, g))


def test_resized_square_crop_covers_the_drawn_share_of_the_area_and_resizes_it_back():
    """The whole area (min_area 1) is the identity; a smaller square is a zoom: on a horizontal
    ramp the output's range shrinks to the crop's, by the crop's side over the image's."""
    x = batch((4, 3, 16, 16))
    assert torch.allclose(random_resized_square_crop(x, 1.0, gen()), x, atol=1e-6)
    ramp = torch.linspace(0, 1, 64).expand(256, 1, 64, 64).contiguous()
    out = random_resized_square_crop(ramp, 0.64, gen(1))
    spans = (out[..., 0, -1] - out[..., 0, 0]).flatten()  # the first row's rise: about the crop's side / 64
    assert (spans > 0.8 * 0.99 - 0.02).all() and (spans <= 1.0 + 1e-6).all()
    assert spans.min() < 0.85 and spans.max() > 0.97  # sides spread over sqrt(0.64) .. 1 of the image
    assert len({round(v, 3) for v in out[:, 0, 0, 0].tolist()}) > 20  # positions differ per image
    with pytest.raises(ValueError, match="min_area"):
        random_resized_square_crop(x, 0.0, gen())


@pytest.mark.parametrize("augment, view", [("weak", "weak_view"), ("strong", "strong_view")])
def test_data_interpolation_resamples_a_clients_augmentation(augment, view) -> None:
    """A client's batches under data.augment=weak or strong are the view resampled as data.interpolation says:
    bilinear by default, the released code's (nearest, bicubic shears) when asked, and the two differ."""
    import fedlt.data.augment as augment_module
    from fedlt.config import load_config
    from fedlt.engine.clients import ClientRuntime
    from fedlt.run_parts import setup_parts

    x = torch.rand(16, 1, 28, 28, generator=gen(3))
    made = {}
    for interpolation in ("bilinear", "released"):
        cfg = load_config(None, ["data.dataset=synthetic", "data.num_clients=4", f"data.augment={augment}",
                                 f"data.interpolation={interpolation}"])
        aug = ClientRuntime(cfg, *setup_parts(cfg)).context(0, 1, {}).data.augment
        made[interpolation] = aug(x, gen(5), True)
        expected = getattr(augment_module, view)(x, gen(5), True, interpolation=interpolation)
        assert torch.equal(made[interpolation], expected), interpolation
    assert torch.equal(made["bilinear"], getattr(augment_module, view)(x, gen(5), True))
    assert not torch.equal(made["bilinear"], made["released"])


def test_data_interpolation_is_refused_where_the_augmentation_does_not_resample() -> None:
    from fedlt.config import build_config

    for augment in ("none", "crop_flip"):
        with pytest.raises(ConfigError) as info:
            build_config({"data": {"augment": augment, "interpolation": "nearest"}})
        assert str(info.value) == (
            f"invalid config value data: data.interpolation=nearest resamples only data.augment=weak or strong "
            f"(data.augment={augment} has no rotation, shear or translation); remove it, or use one of those "
            "(FedYoYo's own views resample as method_args.view_interpolation says)")
    assert build_config({"data": {"augment": "crop_flip"}}).data.interpolation == "bilinear"


def test_the_configs_interpolations_are_the_augment_modules() -> None:
    from typing import get_args

    from fedlt.config import DataConfig

    assert get_args(DataConfig.model_fields["interpolation"].annotation) == INTERPOLATIONS
