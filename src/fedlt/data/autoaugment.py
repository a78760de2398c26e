"""AutoAugment's policies learned on reduced CIFAR-10 and on reduced SVHN (Cubuk et al., CVPR 2019,
Appendix), as data.

Each of a policy's 25 sub-policies is two ``(op, probability, magnitude bin)`` steps; the bin (0..9,
``None`` for ops without a magnitude: invert, autocontrast, equalize, whose bins the paper's tables
list although they are unused) indexes 10 evenly spaced values from 0 to the op's full range, so
bin ``b`` is ``b / 9`` of it: torchvision's ``AutoAugmentPolicy`` convention, also the common
PyTorch ports' (the original TensorFlow code used ``b / 10`` and unsigned enhance factors).
:func:`fedlt.data.augment.auto_augment` applies them; op names are
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
"""The 25 sub-policies of the policy found on reduced CIFAR-10, in the paper's order."""

SVHN_POLICY: tuple[tuple[Step, Step], ...] = (
    (("shear_x", 0.9, 4), ("invert", 0.2, None)),
    (("shear_y", 0.9, 8), ("invert", 0.7, None)),
    (("equalize", 0.6, None), ("solarize", 0.6, 6)),
    (("invert", 0.9, None), ("equalize", 0.6, None)),
    (("equalize", 0.6, None), ("rotate", 0.9, 3)),
    (("shear_x", 0.9, 4), ("autocontrast", 0.8, None)),
    (("shear_y", 0.9, 8), ("invert", 0.4, None)),
    (("shear_y", 0.9, 5), ("solarize", 0.2, 6)),
    (("invert", 0.9, None), ("autocontrast", 0.8, None)),
    (("equalize", 0.6, None), ("rotate", 0.9, 3)),
    (("shear_x", 0.9, 4), ("solarize", 0.3, 3)),
    (("shear_y", 0.8, 8), ("invert", 0.7, None)),
    (("equalize", 0.9, None), ("translate_y", 0.6, 6)),
    (("invert", 0.9, None), ("equalize", 0.6, None)),
    (("contrast", 0.3, 3), ("rotate", 0.8, 4)),
    (("invert", 0.8, None), ("translate_y", 0.0, 2)),
    (("shear_y", 0.7, 6), ("solarize", 0.4, 8)),
    (("invert", 0.6, None), ("rotate", 0.8, 4)),
    (("shear_y", 0.3, 7), ("translate_x", 0.9, 3)),
    (("shear_x", 0.1, 6), ("invert", 0.6, None)),
    (("solarize", 0.7, 2), ("translate_y", 0.6, 7)),
    (("shear_y", 0.8, 4), ("invert", 0.8, None)),
    (("shear_x", 0.7, 9), ("translate_y", 0.8, 3)),
    (("shear_y", 0.8, 5), ("autocontrast", 0.7, None)),
    (("shear_x", 0.7, 2), ("invert", 0.1, None)),
)
"""The 25 sub-policies of the policy found on reduced SVHN (Cubuk et al., "AutoAugment: Learning
Augmentation Strategies from Data", CVPR 2019, Appendix: its table of the policy found on reduced
SVHN), in the paper's order. The paper's bins of invert, equalize and autocontrast are dropped (``None``),
as in :data:`CIFAR10_POLICY`; sub-policy 15's ``translate_y`` has probability 0.0 in the table, so
it never fires."""

AUTOAUGMENT_POLICIES: dict[str, tuple[tuple[Step, Step], ...]] = {"cifar10": CIFAR10_POLICY, "svhn": SVHN_POLICY}
"""Every policy here by name, as ``strong_view``'s ``autoaugment_policy`` and FedYoYo's knob name them."""
