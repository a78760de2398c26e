"""Batched image augmentation on the training device, driven by an explicit generator.

Training data lives on the device as tensors, so batches are augmented there, vectorised
over the batch, instead of per sample on the CPU. Every function takes a
``torch.Generator`` on the batch's device and never touches global RNG state, so a run
is reproducible from its seed.

Conventions for every function: the input is a float batch ``(B, C, H, W)`` with values
in ``[0, 1]`` and square images (``H == W``); the output has the same shape, dtype and
device, is clamped to ``[0, 1]``, and the input is never modified in place. Labels are
not touched.

The two views follow FedYoYo: a weak view (crop, flip, small rotation) and a strong view
(crop, flip, RandAugment, Cutout).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

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

MAX_MAGNITUDE = 10.0

_LUMA = (0.299, 0.587, 0.114)  # ITU-R 601-2, as PIL's "L" conversion


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


def _affine(x: Tensor, theta: Tensor) -> Tensor:
    """Warp each image by its own ``(2, 3)`` output-to-input map in normalised coordinates.

    Bilinear sampling with zero padding; ``align_corners=False`` makes the identity map
    sample pixel centres exactly, so a zero transform returns the input unchanged.
    """
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _rotate(x: Tensor, degrees: Tensor) -> Tensor:
    """Rotate each image about its centre by its own angle (degrees)."""
    rad = degrees * (math.pi / 180.0)
    cos, sin = torch.cos(rad), torch.sin(rad)
    zero = torch.zeros_like(rad)
    theta = torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1)
    return _affine(x, theta)


def _shear_translate(x: Tensor, shear: Tensor, shift: Tensor, axis: int) -> Tensor:
    """Shear (factor) and translate (fraction of the size) each image along one axis.

    ``axis`` 0 acts on x (columns), 1 on y (rows). A shift of ``f`` moves content by
    ``f * size`` pixels, i.e. ``2 f`` in normalised coordinates.
    """
    n = x.shape[0]
    theta = torch.eye(2, 3, dtype=x.dtype, device=x.device).repeat(n, 1, 1)
    theta[:, axis, 1 - axis] = shear
    theta[:, axis, 2] = -2.0 * shift
    return _affine(x, theta)


def _grayscale(x: Tensor) -> Tensor:
    """Per-pixel luma ``(B, 1, H, W)``; the channel itself for one-channel images."""
    if x.shape[1] != 3:
        return x.mean(dim=1, keepdim=True)
    weights = torch.tensor(_LUMA, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x * weights).sum(dim=1, keepdim=True)


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


def _sharpness_degenerate(x: Tensor) -> Tensor:
    """The image smoothed by PIL's 3x3 ``SMOOTH`` kernel, border pixels kept as they are."""
    b, c, h, w = x.shape
    kernel = torch.ones(3, 3, dtype=x.dtype, device=x.device)
    kernel[1, 1] = 5.0
    kernel = (kernel / kernel.sum()).view(1, 1, 3, 3)
    smoothed = F.conv2d(x.reshape(b * c, 1, h, w), kernel).reshape(b, c, h - 2, w - 2)
    degenerate = x.clone()
    degenerate[:, :, 1:-1, 1:-1] = smoothed
    return degenerate


def apply_op(x: Tensor, name: str, magnitude: float, generator: torch.Generator) -> Tensor:
    """Apply one RandAugment op (Cubuk et al., 2020) to every image of ``x``.

    ``magnitude`` is on the paper's 0..10 scale; ``m = magnitude / 10`` scales each op to
    its range below. Where marked, each image draws its own random sign.

    ========================  ================================================
    identity                  unchanged
    autocontrast              per-channel stretch to [0, 1] (no magnitude)
    equalize                  per-channel histogram equalisation (no magnitude)
    solarize                  invert pixels ``> 1 - m`` (none at 0, all > 0 at 10)
    posterize                 keep ``8 - round(4 m)`` bits (8 down to 4)
    contrast                  blend with the mean gray, factor ``1 +/- 0.9 m``
    brightness                blend with black, factor ``1 +/- 0.9 m``
    color                     blend with grayscale, factor ``1 +/- 0.9 m``;
                              identity for one-channel images
    sharpness                 blend with a 3x3-smoothed image, factor ``1 +/- 0.9 m``
    rotate                    ``+/- 30 m`` degrees
    shear_x, shear_y          shear factor ``+/- 0.3 m``
    translate_x, translate_y  shift ``+/- 0.3 m`` of the image size
    ========================  ================================================

    Geometric ops fill uncovered pixels with 0.
    """
    _check_batch(x)
    if name not in OP_NAMES:
        raise ValueError(f"unknown RandAugment op {name!r}; use one of {', '.join(OP_NAMES)}")
    if not 0.0 <= magnitude <= MAX_MAGNITUDE:
        raise ValueError(f"magnitude must be in [0, {MAX_MAGNITUDE:g}], got {magnitude}")
    m = magnitude / MAX_MAGNITUDE
    n = x.shape[0]

    if name == "identity":
        out = x
    elif name == "autocontrast":
        out = _autocontrast(x)
    elif name == "equalize":
        out = _equalize(x)
    elif name == "solarize":
        out = torch.where(x > 1.0 - m, 1.0 - x, x)
    elif name == "posterize":
        bits = 8 - round(4 * m)
        mask = (0xFF << (8 - bits)) & 0xFF
        out = torch.bitwise_and(_quantise(x), mask).to(x.dtype) / 255.0
    elif name in ("contrast", "brightness", "color", "sharpness"):
        factor = 1.0 + 0.9 * m * _signs(n, x, generator)
        if name == "contrast":
            degenerate = _grayscale(x).mean(dim=(1, 2, 3), keepdim=True).expand_as(x)
        elif name == "brightness":
            degenerate = torch.zeros_like(x)
        elif name == "color":
            degenerate = _grayscale(x).expand_as(x) if x.shape[1] == 3 else x
        else:
            degenerate = _sharpness_degenerate(x)
        out = _blend(degenerate, x, factor)
    elif name == "rotate":
        out = _rotate(x, 30.0 * m * _signs(n, x, generator))
    else:
        amount = 0.3 * m * _signs(n, x, generator)
        zero = torch.zeros_like(amount)
        axis = 0 if name.endswith("_x") else 1
        if name.startswith("shear"):
            out = _shear_translate(x, amount, zero, axis)
        else:
            out = _shear_translate(x, zero, amount, axis)
    return out.clamp(0.0, 1.0)


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


def random_rotation(x: Tensor, degrees: float, generator: torch.Generator) -> Tensor:
    """Rotate each image by an angle uniform in ``[-degrees, degrees]``.

    Bilinear interpolation, zero fill outside the source image.
    """
    _check_batch(x)
    angles = _uniform(x.shape[0], -degrees, degrees, x, generator)
    return _rotate(x, angles).clamp(0.0, 1.0)


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


def rand_augment(
    x: Tensor,
    generator: torch.Generator,
    num_ops: int = 2,
    magnitude: float = 9,
    ops: Sequence[str] = OP_NAMES,
) -> Tensor:
    """RandAugment (Cubuk et al., 2020): ``num_ops`` ops per image, each drawn uniformly.

    Every image draws its own ops from ``ops`` (default: all of :data:`OP_NAMES`) and all
    are applied at the same ``magnitude`` (0..10, see :func:`apply_op`). Images that drew
    the same op in a round are transformed together, so the loop runs over op types, not
    samples.
    """
    _check_batch(x)
    unknown = [name for name in ops if name not in OP_NAMES]
    if unknown or not ops:
        raise ValueError(f"ops must be a non-empty subset of {', '.join(OP_NAMES)}; got {ops}")
    out = x.clone()
    for _ in range(num_ops):
        choice = torch.randint(0, len(ops), (x.shape[0],), generator=generator, device=x.device)
        for k, name in enumerate(ops):
            idx = (choice == k).nonzero().squeeze(1)
            if idx.numel() and name != "identity":
                out[idx] = apply_op(out[idx], name, magnitude, generator)
    return out.clamp(0.0, 1.0)


def _crop_padding(x: Tensor) -> int:
    """Crop padding for a view: 4 for 32px images, 3 for 28px, never below 2."""
    return max(2, x.shape[-1] // 8)


def no_augmentation(x: Tensor, generator: torch.Generator, flip: bool = True) -> Tensor:
    """Return the batch unchanged."""
    return x


def weak_view(x: Tensor, generator: torch.Generator, flip: bool = True) -> Tensor:
    """FedYoYo's weak view: random crop, horizontal flip (if ``flip``), rotation up to 15 deg.

    Pass ``flip=False`` for data where mirroring changes the meaning (e.g. digits).
    """
    out = random_crop(x, _crop_padding(x), generator)
    if flip:
        out = random_flip(out, generator)
    return random_rotation(out, 15.0, generator)


def strong_view(
    x: Tensor, generator: torch.Generator, flip: bool = True, magnitude: float = 9, cutout_frac: float = 0.5
) -> Tensor:
    """FedYoYo's strong view: crop, flip (if ``flip``), RandAugment(2, ``magnitude``), Cutout.

    The cutout square's side is ``round(cutout_frac * H)``: 16px on 32px images at the default
    0.5, as in FedYoYo; 0 turns Cutout off.
    """
    out = random_crop(x, _crop_padding(x), generator)
    if flip:
        out = random_flip(out, generator)
    if magnitude > 0:
        out = rand_augment(out, generator, num_ops=2, magnitude=magnitude)
    return cutout(out, round(cutout_frac * x.shape[-1]), generator)


AUGMENTATIONS: dict[str, Augmentation] = {
    "none": no_augmentation,
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
