"""Batched image augmentation on the training device, driven by an explicit generator.

Training data lives on the device as tensors, so batches are augmented there, vectorised
over the batch, instead of per sample on the CPU. Every function takes a
``torch.Generator`` on the batch's device and never touches global RNG state, so a run
is reproducible from its seed.

Conventions for every function: the input is a float batch ``(B, C, H, W)`` with values
in ``[0, 1]`` and square images (``H == W``); the output has the same shape, dtype and
device, is clamped to ``[0, 1]``, and the input is never modified in place. Labels are
not touched. The views and the two policies also take uint8 batches and return uint8.

The two views follow FedYoYo: a weak view (crop, flip, small rotation) and a strong view
(crop, flip, RandAugment or AutoAugment's CIFAR-10 or SVHN policy, Cutout). Op ranges follow
torchvision's RandAugment/AutoAugment (:func:`op_parameter`); how the geometric ops resample
is chosen by name (:data:`INTERPOLATIONS`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from fedlt.data.autoaugment import AUTOAUGMENT_LEVELS, AUTOAUGMENT_POLICIES, CIFAR10_POLICY
from fedlt.errors import ConfigError

Augmentation = Callable[[Tensor, torch.Generator, bool], Tensor]

GEOMETRIC_OPS = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")
"""RandAugment ops that move pixels; all are the identity at magnitude 0."""

OP_NAMES = (
    "identity",
    "autocontrast",
    "equalize",
    "solarize",
    "posterize",
    "contrast",
    "brightness",
    "color",
    "sharpness",
) + GEOMETRIC_OPS
"""Every RandAugment op, in the order ``rand_augment`` indexes them."""

ALL_OPS = OP_NAMES + ("invert",)
"""Every op :func:`apply_op` knows: RandAugment's plus AutoAugment's ``invert``."""

RANDAUGMENT_BINS = 30
"""RandAugment magnitude ``M`` runs over 0..30; ``M`` is ``M / 30`` of each op's range."""

_FULL_RANGE = {
    "rotate": 30.0,  # degrees
    "shear_x": 0.3,  # shear factor
    "shear_y": 0.3,
    "translate_x": 150.0 / 331.0,  # fraction of the side (AutoAugment: 150 px on 331 px images)
    "translate_y": 150.0 / 331.0,
    "contrast": 0.9,  # enhance factor 1 +/- this
    "brightness": 0.9,
    "color": 0.9,
    "sharpness": 0.9,
}
SIGNED_OPS = frozenset(_FULL_RANGE)
"""Ops whose parameter each image negates with probability 1/2."""

INTERPOLATIONS = ("bilinear", "nearest", "bicubic", "released")
"""How rotations, shears and translations resample: one ``grid_sample`` mode for every op, or
``released`` as FedYoYo's released code (torchvision's ``RandomRotation`` and PIL's rotate and
translate default to nearest; its AutoAugment shears with PIL's bicubic). Bilinear smooths every
warped image, nearest keeps edges sharp. torch's bicubic is the cubic convolution with
``a = -0.75`` (PIL's uses ``-0.5``)."""

_LUMA = (0.299, 0.587, 0.114)  # ITU-R 601-2, as PIL's "L" conversion

SELECTIONS = ("index", "mask")
"""How the two policies apply an op to the images that drew it. ``index`` gathers those images and
transforms only them: their number is a device value, so on a GPU the host waits for it (once per
op and batch); on a CPU it costs nothing, and it is the random stream fedlt's committed results were
drawn with. ``mask`` transforms the whole batch and keeps the result where the op was drawn: no
wait, and every op of a policy step that shares a magnitude is one batched call, but each signed op
draws a sign for every image, so the stream (not the distribution) differs from ``index``."""


def selection_for(x: Tensor) -> str:
    """The :data:`SELECTIONS` entry a batch on ``x``'s device uses: ``index`` on a CPU, ``mask`` on
    an accelerator (whose random stream differs from the CPU's anyway)."""
    return "index" if x.device.type == "cpu" else "mask"


def _check_selection(select: str) -> None:
    if select not in SELECTIONS:
        raise ValueError(f"unknown selection {select!r}; use one of {', '.join(SELECTIONS)}")


def _apply_to_drawn(
    out: Tensor, drawn: Tensor, name: str, strength: float, generator: torch.Generator, interpolation: str, select: str
) -> Tensor:
    """``out`` with op ``name`` applied to the images where ``drawn`` (a boolean per image) is true."""
    if select == "mask":
        return torch.where(drawn[:, None, None, None], apply_op(out, name, strength, generator, interpolation), out)
    idx = drawn.nonzero().squeeze(1)
    if idx.numel():
        out[idx] = apply_op(out[idx], name, strength, generator, interpolation)
    return out


def _check_batch(x: Tensor) -> None:
    if x.ndim != 4 or not x.is_floating_point():
        raise ValueError(f"expected a float (B, C, H, W) batch, got {x.dtype} {tuple(x.shape)}")


def _uniform(n: int, low: float, high: float, x: Tensor, generator: torch.Generator) -> Tensor:
    """``n`` draws from U[low, high) in ``x``'s dtype and device."""
    u = torch.rand(n, generator=generator, device=x.device, dtype=x.dtype)
    return low + (high - low) * u


def _signs(n: int, x: Tensor, generator: torch.Generator) -> Tensor:
    """``n`` random signs (+1 or -1) in ``x``'s dtype and device."""
    bits = torch.randint(0, 2, (n,), generator=generator, device=x.device)
    return (2 * bits - 1).to(x.dtype)


def _check_interpolation(interpolation: str) -> None:
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"unknown interpolation {interpolation!r}; use one of {', '.join(INTERPOLATIONS)}")


def grid_mode(interpolation: str, op: str) -> str:
    """The ``grid_sample`` mode of geometric ``op`` (an entry of :data:`GEOMETRIC_OPS`) under
    ``interpolation`` (one of :data:`INTERPOLATIONS`)."""
    _check_interpolation(interpolation)
    if interpolation != "released":
        return interpolation
    return "bicubic" if op.startswith("shear") else "nearest"


def _affine(x: Tensor, theta: Tensor, mode: str) -> Tensor:
    """Warp each image by its own ``(2, 3)`` output-to-input map in normalised coordinates.

    ``grid_sample`` with ``mode`` and zero padding; ``align_corners=False`` makes the identity
    map sample pixel centres exactly, so a zero transform returns the input unchanged.
    """
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode=mode, padding_mode="zeros", align_corners=False)


def rotate(x: Tensor, degrees: Tensor, interpolation: str = "bilinear") -> Tensor:
    """Rotate each image about its centre by its own angle (degrees, counter-clockwise as
    displayed), resampled by ``interpolation`` (:func:`grid_mode`), zero fill."""
    _check_batch(x)
    mode = grid_mode(interpolation, "rotate")
    rad = degrees.to(x.dtype) * (math.pi / 180.0)
    cos, sin = torch.cos(rad), torch.sin(rad)
    zero = torch.zeros_like(rad)
    theta = torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1)
    return _affine(x, theta, mode).clamp(0.0, 1.0)


def _shear_translate(x: Tensor, shear: Tensor, shift: Tensor, axis: int, mode: str) -> Tensor:
    """Shear (factor) and translate (fraction of the size) each image along one axis.

    ``axis`` 0 acts on x (columns), 1 on y (rows). A shift of ``f`` moves content by
    ``f * size`` pixels, i.e. ``2 f`` in normalised coordinates.
    """
    n = x.shape[0]
    theta = torch.eye(2, 3, dtype=x.dtype, device=x.device).repeat(n, 1, 1)
    theta[:, axis, 1 - axis] = shear
    theta[:, axis, 2] = -2.0 * shift
    return _affine(x, theta, mode)


def _grayscale(x: Tensor) -> Tensor:
    """Per-pixel luma ``(B, 1, H, W)``; the channel itself for one-channel images."""
    if x.shape[1] != 3:
        return x.mean(dim=1, keepdim=True)
    return (x * _luma_weights(x.device, x.dtype)).sum(dim=1, keepdim=True)


@functools.lru_cache(maxsize=8)
def _luma_weights(device: torch.device, dtype: torch.dtype) -> Tensor:
    """:data:`_LUMA` as a ``(1, 3, 1, 1)`` tensor, copied to a device once (a copy from the host
    makes a GPU's host wait)."""
    return torch.tensor(_LUMA, dtype=dtype, device=device).view(1, 3, 1, 1)


def _blend(degenerate: Tensor, x: Tensor, factor: Tensor) -> Tensor:
    """``degenerate + factor * (x - degenerate)`` per sample, as PIL's ``ImageEnhance``."""
    f = factor.view(-1, 1, 1, 1)
    return degenerate + f * (x - degenerate)


def _quantise(x: Tensor) -> Tensor:
    """Values in ``[0, 1]`` as int64 levels ``0..255``."""
    return (x.clamp(0.0, 1.0) * 255.0).round().long()


def _autocontrast(x: Tensor) -> Tensor:
    """Stretch each channel of each image to span ``[0, 1]`` (PIL ``ImageOps.autocontrast``).

    Constant channels are left unchanged.
    """
    low = x.amin(dim=(2, 3), keepdim=True)
    high = x.amax(dim=(2, 3), keepdim=True)
    span = high - low
    stretched = (x - low) / span.clamp_min(torch.finfo(x.dtype).eps)
    return torch.where(span > 0, stretched, x)


def _equalize(x: Tensor) -> Tensor:
    """Histogram-equalise each channel of each image on 256 levels (PIL ``ImageOps.equalize``).

    The lookup table maps level ``v`` to ``(#pixels below v + step // 2) // step`` with
    ``step = (#pixels - #pixels at the top occupied level) // 255``; channels with
    ``step == 0`` (nearly constant) are left unchanged, as in PIL.
    """
    b, c, h, w = x.shape
    levels = _quantise(x).reshape(b * c, h * w)
    hist = torch.zeros(b * c, 256, dtype=torch.long, device=x.device)
    hist.scatter_add_(1, levels, torch.ones_like(levels))
    top_count = hist.gather(1, levels.amax(dim=1, keepdim=True))
    step = (h * w - top_count) // 255
    below = hist.cumsum(dim=1) - hist
    lut = ((below + step // 2) // step.clamp_min(1)).clamp_max(255)
    equalised = lut.gather(1, levels).to(x.dtype) / 255.0
    flat = x.reshape(b * c, h * w)
    return torch.where(step > 0, equalised, flat).reshape(b, c, h, w)


@functools.lru_cache(maxsize=8)
def _smooth_kernel(device: torch.device, dtype: torch.dtype) -> Tensor:
    """PIL's 3x3 ``SMOOTH`` kernel (1s around a 5, over 13) as a ``(1, 1, 3, 3)`` tensor, made on a
    device once: writing its centre from a Python number is a copy from the host, which makes a
    GPU's host wait at every sharpness op."""
    kernel = torch.ones(3, 3, dtype=dtype)
    kernel[1, 1] = 5.0
    return (kernel / kernel.sum()).view(1, 1, 3, 3).to(device)


def _sharpness_degenerate(x: Tensor) -> Tensor:
    """The image smoothed by PIL's 3x3 ``SMOOTH`` kernel, border pixels kept as they are."""
    b, c, h, w = x.shape
    smoothed = F.conv2d(x.reshape(b * c, 1, h, w), _smooth_kernel(x.device, x.dtype)).reshape(b, c, h - 2, w - 2)
    degenerate = x.clone()
    degenerate[:, :, 1:-1, 1:-1] = smoothed
    return degenerate


def op_parameter(name: str, strength: float) -> float:
    """The unsigned parameter of op ``name`` at ``strength`` (the fraction of its range, 0..1).

    torchvision's ranges: rotate ``30 s`` degrees; shear factor ``0.3 s``; translate
    ``(150/331) s`` of the side; contrast, brightness, color, sharpness factor ``1 +/- 0.9 s``
    (returns ``0.9 s``); solarize threshold ``1 - s``; posterize keeps ``8 - round(4 s)`` bits;
    0 for the ops without a magnitude.
    """
    if name not in ALL_OPS:
        raise ValueError(f"unknown op {name!r}; use one of {', '.join(ALL_OPS)}")
    if name == "posterize":
        return float(8 - round(4 * strength))
    if name == "solarize":
        return 1.0 - strength
    return _FULL_RANGE.get(name, 0.0) * strength


def apply_op(
    x: Tensor, name: str, strength: float, generator: torch.Generator, interpolation: str = "bilinear"
) -> Tensor:
    """Apply one op at ``strength`` (0..1 of its range, :func:`op_parameter`) to every image.

    Signed ops (:data:`SIGNED_OPS`) draw a sign per image. Solarize inverts pixels at or above
    the threshold; color is the identity on one-channel images; rotations and shears act about
    the centre, geometric ops resample by ``interpolation`` (:func:`grid_mode`) and fill
    uncovered pixels with 0.
    """
    _check_batch(x)
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"strength must be in [0, 1], got {strength}")
    _check_interpolation(interpolation)
    value = op_parameter(name, strength)
    if name in SIGNED_OPS:
        value = value * _signs(x.shape[0], x, generator)

    if name == "identity":
        out = x
    elif name == "invert":
        out = 1.0 - x
    elif name == "autocontrast":
        out = _autocontrast(x)
    elif name == "equalize":
        out = _equalize(x)
    elif name == "solarize":
        out = torch.where(x >= value, 1.0 - x, x)
    elif name == "posterize":
        mask = (0xFF << (8 - int(value))) & 0xFF
        out = torch.bitwise_and(_quantise(x), mask).to(x.dtype) / 255.0
    elif name in ("contrast", "brightness", "color", "sharpness"):
        if name == "contrast":
            degenerate = _grayscale(x).mean(dim=(1, 2, 3), keepdim=True).expand_as(x)
        elif name == "brightness":
            degenerate = torch.zeros_like(x)
        elif name == "color":
            degenerate = _grayscale(x).expand_as(x) if x.shape[1] == 3 else x
        else:
            degenerate = _sharpness_degenerate(x)
        out = _blend(degenerate, x, 1.0 + value)
    elif name == "rotate":
        out = rotate(x, value, interpolation)
    else:
        zero = torch.zeros_like(value)
        axis = 0 if name.endswith("_x") else 1
        mode = grid_mode(interpolation, name)
        if name.startswith("shear"):
            out = _shear_translate(x, value, zero, axis, mode)
        else:
            out = _shear_translate(x, zero, value, axis, mode)
    return out.clamp(0.0, 1.0)


def _accepts_uint8(view: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Let a float view take uint8 images too: scaled to [0, 1], augmented, rounded back."""

    @functools.wraps(view)
    def wrapper(x: Tensor, *args, **kwargs) -> Tensor:
        if x.dtype != torch.uint8:
            return view(x, *args, **kwargs)
        return view(x.float() / 255.0, *args, **kwargs).mul(255.0).round().to(torch.uint8)

    return wrapper


def random_crop(x: Tensor, padding: int, generator: torch.Generator) -> Tensor:
    """Zero-pad by ``padding`` and crop back to ``H x W`` at a random offset per image.

    The standard CIFAR crop (He et al., 2016); the per-image windows are gathered with
    advanced indexing, without a loop over samples.
    """
    _check_batch(x)
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    b, _, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    dy = torch.randint(0, 2 * padding + 1, (b,), generator=generator, device=x.device)
    dx = torch.randint(0, 2 * padding + 1, (b,), generator=generator, device=x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device))[:, :, None]
    cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, :]
    batch = torch.arange(b, device=x.device)[:, None, None]
    crops = padded.permute(0, 2, 3, 1)[batch, rows, cols]  # (B, H, W, C)
    return crops.permute(0, 3, 1, 2).contiguous().clamp(0.0, 1.0)


def random_flip(x: Tensor, generator: torch.Generator, p: float = 0.5) -> Tensor:
    """Flip each image horizontally with probability ``p``."""
    _check_batch(x)
    flip = torch.rand(x.shape[0], generator=generator, device=x.device) < p
    return torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x).clamp(0.0, 1.0)


def random_rotation(
    x: Tensor, degrees: float, generator: torch.Generator, interpolation: str = "bilinear"
) -> Tensor:
    """Rotate each image by an angle uniform in ``[-degrees, degrees]``, resampled by
    ``interpolation`` (:func:`grid_mode`), zero fill outside the source image."""
    _check_batch(x)
    angles = _uniform(x.shape[0], -degrees, degrees, x, generator)
    return rotate(x, angles, interpolation)


def cutout(x: Tensor, size: int, generator: torch.Generator) -> Tensor:
    """Zero one ``size x size`` square per image (DeVries & Taylor, 2017).

    The centre is uniform over the pixels, so squares near a border are clipped and
    smaller; a square fully inside the image covers exactly ``size**2`` pixels.
    """
    _check_batch(x)
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    b, _, h, w = x.shape
    cy = torch.randint(0, h, (b, 1, 1), generator=generator, device=x.device)
    cx = torch.randint(0, w, (b, 1, 1), generator=generator, device=x.device)
    top, left = cy - size // 2, cx - size // 2
    ys = torch.arange(h, device=x.device).view(1, h, 1)
    xs = torch.arange(w, device=x.device).view(1, 1, w)
    hole = (ys >= top) & (ys < top + size) & (xs >= left) & (xs < left + size)
    return x.masked_fill(hole[:, None], 0.0).clamp(0.0, 1.0)


@_accepts_uint8
def rand_augment(
    x: Tensor,
    generator: torch.Generator,
    num_ops: int = 2,
    magnitude: float = 9,
    ops: Sequence[str] = OP_NAMES,
    interpolation: str = "bilinear",
    select: str | None = None,
) -> Tensor:
    """RandAugment (Cubuk et al., 2020): ``num_ops`` ops per image, each drawn uniformly.

    Every image draws its own ops from ``ops`` (default: all of :data:`OP_NAMES`) and all
    are applied at ``magnitude`` ``M`` of :data:`RANDAUGMENT_BINS` (torchvision's scale: the
    usual ``M = 9`` is 30% of each op's range, e.g. rotations of +/-9 degrees). Images that drew
    the same op are transformed together (``select``, :data:`SELECTIONS`; default by device), so
    the loop runs over op types, not samples.
    """
    _check_batch(x)
    unknown = [name for name in ops if name not in ALL_OPS]
    if unknown or not ops:
        raise ValueError(f"ops must be a non-empty subset of {', '.join(ALL_OPS)}; got {ops}")
    if not 0.0 <= magnitude <= RANDAUGMENT_BINS:
        raise ValueError(f"magnitude must be in [0, {RANDAUGMENT_BINS}], got {magnitude}")
    _check_interpolation(interpolation)
    select = select or selection_for(x)
    _check_selection(select)
    strength = magnitude / RANDAUGMENT_BINS
    out = x.clone()
    for _ in range(num_ops):
        choice = torch.randint(0, len(ops), (x.shape[0],), generator=generator, device=x.device)
        for k, name in enumerate(ops):
            if name != "identity":
                out = _apply_to_drawn(out, choice == k, name, strength, generator, interpolation, select)
    return out.clamp(0.0, 1.0)


@_accepts_uint8
def auto_augment(
    x: Tensor, generator: torch.Generator, policy: Sequence = CIFAR10_POLICY, interpolation: str = "bilinear",
    select: str | None = None,
) -> Tensor:
    """AutoAugment (Cubuk et al., 2019): each image draws one sub-policy uniformly, and each of
    its two ``(op, probability, bin)`` steps fires with its probability at ``bin / 9`` of the
    op's range (:mod:`fedlt.data.autoaugment`; default: the CIFAR-10 policy). ``select``
    (:data:`SELECTIONS`, default by device): ``index`` applies each sub-policy's op to the images
    that drew it; ``mask`` applies each (op, bin) of a step once, to the images of every
    sub-policy that has it there."""
    _check_batch(x)
    _check_interpolation(interpolation)
    select = select or selection_for(x)
    _check_selection(select)
    n = x.shape[0]
    out = x.clone()
    choice = torch.randint(0, len(policy), (n,), generator=generator, device=x.device)
    for step in range(2):
        fire = torch.rand(n, generator=generator, device=x.device)
        if select == "mask":
            frozen = tuple(tuple(tuple(op) for op in sub_policy) for sub_policy in policy)
            probability, group, names = _policy_step_tables(frozen, step, x.device, fire.dtype)
            fired = fire < probability[choice]
            drawn_group = torch.where(fired, group[choice], -1)
            for g, (name, level) in enumerate(names):
                out = _apply_to_drawn(out, drawn_group == g, name, _bin_strength(level), generator, interpolation,
                                      select)
            continue
        for k, sub_policy in enumerate(policy):
            name, probability, level = sub_policy[step]
            if name != "identity":
                out = _apply_to_drawn(out, (choice == k) & (fire < probability), name, _bin_strength(level),
                                      generator, interpolation, select)
    return out.clamp(0.0, 1.0)


def _bin_strength(level: int | None) -> float:
    """An AutoAugment magnitude bin as the fraction of the op's range (``None``: an op without one)."""
    return 0.0 if level is None else level / (AUTOAUGMENT_LEVELS - 1)


@functools.lru_cache(maxsize=16)
def _policy_step_tables(policy: tuple, step: int, device: torch.device, dtype: torch.dtype
                        ) -> tuple[Tensor, Tensor, tuple]:
    """For one step of ``policy``: each sub-policy's probability (in ``dtype``, as the draws it is
    compared with) and (op, bin) group on ``device``, and the groups in order of first appearance
    (identity left out: its group is -1). Made once per policy and device, so a batch copies nothing
    from the host."""
    names: list[tuple[str, int | None]] = []
    group = []
    for sub_policy in policy:
        name, _, level = sub_policy[step]
        if name == "identity":
            group.append(-1)
            continue
        if (name, level) not in names:
            names.append((name, level))
        group.append(names.index((name, level)))
    probability = torch.tensor([sub_policy[step][1] for sub_policy in policy], dtype=dtype, device=device)
    return probability, torch.tensor(group, device=device), tuple(names)


STRONG_POLICIES = ("autoaugment", "randaugment")


def _crop_padding(x: Tensor) -> int:
    """Crop padding for a view: an eighth of the side, rounded down, at least 2 px. The CIFAR
    convention (4 px on 32 px, the released FedYoYo code on all its 32 px datasets) scaled to
    other sizes: 3 px on 28 px, 2 px on 16 px, 8 px on 64 px."""
    return max(2, x.shape[-1] // 8)


def no_augmentation(x: Tensor, generator: torch.Generator, flip: bool = True) -> Tensor:
    """Return the batch unchanged."""
    return x


@_accepts_uint8
def crop_flip(x: Tensor, generator: torch.Generator, flip: bool = True) -> Tensor:
    """The usual CIFAR training augmentation: random crop, horizontal flip (if ``flip``). CReFF's
    released code trains its clients with it (one window for a whole batch there; one per image here).

    Pass ``flip=False`` for data where mirroring changes the meaning (e.g. digits).
    """
    out = random_crop(x, _crop_padding(x), generator)
    return random_flip(out, generator) if flip else out


@_accepts_uint8
def crop_flip_cutout(x: Tensor, generator: torch.Generator, flip: bool = True) -> Tensor:
    """:func:`crop_flip`, then :func:`cutout` of half the side (16 px on 32 px): GBME's released
    code on CIFAR-100 (its Cutout zeroes the normalised image, i.e. fills with the mean colour;
    this one fills with black)."""
    return cutout(crop_flip(x, generator, flip), x.shape[-1] // 2, generator)


def random_resized_square_crop(x: Tensor, min_area: float, generator: torch.Generator) -> Tensor:
    """Crop a square holding a share of the image's area uniform in ``[min_area, 1]``, at a random
    position, and resize it back to ``H x W`` bilinearly, one crop per image: torchvision's
    ``RandomResizedCrop(scale=(min_area, 1), ratio=(1, 1))`` on square images (its side rounded
    as there; edges replicate, as a resize of the crop alone does)."""
    _check_batch(x)
    if not 0 < min_area <= 1:
        raise ValueError(f"min_area must be in (0, 1], got {min_area}")
    b, _, h, w = x.shape
    side = torch.round(torch.sqrt(_uniform(b, min_area, 1.0, x, generator) * (h * w))).clamp(1, min(h, w))
    top = torch.floor(torch.rand(b, generator=generator, device=x.device, dtype=x.dtype) * (h - side + 1))
    left = torch.floor(torch.rand(b, generator=generator, device=x.device, dtype=x.dtype) * (w - side + 1))
    zero = torch.zeros_like(side)
    # output [-1, 1] -> the crop's edges in the input's normalised coordinates (align_corners=False)
    theta = torch.stack([torch.stack([side / w, zero, (2 * left + side) / w - 1], 1),
                         torch.stack([zero, side / h, (2 * top + side) / h - 1], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False).clamp(0.0, 1.0)


@_accepts_uint8
def resized_crop_flip(x: Tensor, generator: torch.Generator, flip: bool = True) -> Tensor:
    """A square crop of 64-100% of the area resized back (:func:`random_resized_square_crop`), then
    a horizontal flip (if ``flip``): SFD's released code."""
    out = random_resized_square_crop(x, 0.64, generator)
    return random_flip(out, generator) if flip else out


@_accepts_uint8
def weak_view(x: Tensor, generator: torch.Generator, flip: bool = True, interpolation: str = "bilinear") -> Tensor:
    """FedYoYo's weak view: :func:`crop_flip`, then a rotation up to 15 deg resampled by
    ``interpolation`` (:data:`INTERPOLATIONS`)."""
    return random_rotation(crop_flip(x, generator, flip), 15.0, generator, interpolation)


@_accepts_uint8
def strong_view(
    x: Tensor,
    generator: torch.Generator,
    flip: bool = True,
    policy: str = "randaugment",
    magnitude: float = 9,
    cutout_frac: float = 0.5,
    interpolation: str = "bilinear",
    autoaugment_policy: str = "cifar10",
) -> Tensor:
    """FedYoYo's strong view: :func:`crop_flip`, a policy, Cutout.

    ``policy`` is ``randaugment`` (2 ops at ``magnitude`` of 30; 0: none; ``autoaugment_policy``
    unused) or ``autoaugment`` (the policy named ``autoaugment_policy`` in
    :data:`~fedlt.data.autoaugment.AUTOAUGMENT_POLICIES`: ``cifar10`` or ``svhn``; ``magnitude``
    unused); its geometric ops resample by ``interpolation`` (:data:`INTERPOLATIONS`). The cutout
    square's side is ``round(cutout_frac * H)``: 16px on 32px images at the default 0.5, as in
    FedYoYo and AutoAugment's CIFAR pipeline; 0 turns Cutout off.
    """
    if policy not in STRONG_POLICIES:
        raise ValueError(f"unknown strong policy {policy!r}; use one of {', '.join(STRONG_POLICIES)}")
    if autoaugment_policy not in AUTOAUGMENT_POLICIES:
        raise ValueError(f"unknown AutoAugment policy {autoaugment_policy!r}; use one of "
                         f"{', '.join(AUTOAUGMENT_POLICIES)}")
    _check_interpolation(interpolation)
    out = crop_flip(x, generator, flip)
    if policy == "autoaugment":
        out = auto_augment(out, generator, policy=AUTOAUGMENT_POLICIES[autoaugment_policy],
                           interpolation=interpolation)
    elif magnitude > 0:
        out = rand_augment(out, generator, num_ops=2, magnitude=magnitude, interpolation=interpolation)
    return cutout(out, round(cutout_frac * x.shape[-1]), generator)


AUGMENTATIONS: dict[str, Augmentation] = {
    "none": no_augmentation,
    "crop_flip": crop_flip,
    "crop_flip_cutout": crop_flip_cutout,
    "resized_crop_flip": resized_crop_flip,
    "weak": weak_view,
    "strong": strong_view,
}


def get_augmentation(name: str) -> Augmentation:
    """The augmentation registered as ``name`` in :data:`AUGMENTATIONS`."""
    try:
        return AUGMENTATIONS[name]
    except KeyError:
        names = ", ".join(AUGMENTATIONS)
        raise ConfigError(
            f"unknown augmentation {name!r}; use data.augment=<one of {names}>"
        ) from None
