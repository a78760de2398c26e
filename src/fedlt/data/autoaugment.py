"""AutoAugment's policy learned on reduced CIFAR-10 (Cubuk et al., CVPR 2019, Appendix), as data.

Each of the 25 sub-policies is two ``(op, probability, magnitude bin)`` steps; the bin (0..9,
``None`` for ops without a magnitude) indexes 10 evenly spaced values from 0 to the op's full
range, so bin ``b`` is ``b / 9`` of it: torchvision's ``AutoAugmentPolicy.CIFAR10`` convention,
also the common PyTorch ports' (the original TensorFlow code used ``b / 10`` and unsigned
enhance factors). :func:`fedlt.data.augment.auto_augment` applies it; op names are
:data:`fedlt.data.augment.OP_NAMES` plus ``invert``.
"""

from __future__ import annotations

AUTOAUGMENT_LEVELS = 10
"""Magnitude bins of the AutoAugment search space: bin ``b`` is ``b / 9`` of an op's range."""

Step = tuple[str, float, int | None]

CIFAR10_POLICY: tuple[tuple[Step, Step], ...] = (
    (("invert", 0.1, None), ("contrast", 0.2, 6)),
    (("rotate", 0.7, 2), ("translate_x", 0.3, 9)),
    (("sharpness", 0.8, 1), ("sharpness", 0.9, 3)),
    (("shear_y", 0.5, 8), ("translate_y", 0.7, 9)),
    (("autocontrast", 0.5, None), ("equalize", 0.9, None)),
    (("shear_y", 0.2, 7), ("posterize", 0.3, 7)),
    (("color", 0.4, 3), ("brightness", 0.6, 7)),
    (("sharpness", 0.3, 9), ("brightness", 0.7, 9)),
    (("equalize", 0.6, None), ("equalize", 0.5, None)),
    (("contrast", 0.6, 7), ("sharpness", 0.6, 5)),
    (("color", 0.7, 7), ("translate_x", 0.5, 8)),
    (("equalize", 0.3, None), ("autocontrast", 0.4, None)),
    (("translate_y", 0.4, 3), ("sharpness", 0.2, 6)),
    (("brightness", 0.9, 6), ("color", 0.2, 8)),
    (("solarize", 0.5, 2), ("invert", 0.0, None)),
    (("equalize", 0.2, None), ("autocontrast", 0.6, None)),
    (("equalize", 0.2, None), ("equalize", 0.6, None)),
    (("color", 0.9, 9), ("equalize", 0.6, None)),
    (("autocontrast", 0.8, None), ("solarize", 0.2, 8)),
    (("brightness", 0.1, 3), ("color", 0.7, 0)),
    (("solarize", 0.4, 5), ("autocontrast", 0.9, None)),
    (("translate_y", 0.9, 9), ("translate_y", 0.7, 9)),
    (("autocontrast", 0.9, None), ("solarize", 0.8, 3)),
    (("equalize", 0.8, None), ("invert", 0.1, None)),
    (("translate_y", 0.7, 9), ("autocontrast", 0.9, None)),
)
"""The 25 sub-policies, in the paper's order."""
