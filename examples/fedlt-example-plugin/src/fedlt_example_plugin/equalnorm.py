"""equalnorm: the learned linear head with every class's weight row rescaled to the rows' mean norm
and its bias removed.

On long-tailed data the rows of frequent classes grow longer and their biases larger, which
tilts predictions towards them; this removes both preferences after training, asks clients for
nothing, and keeps the head's overall scale (unlike tau-norm with tau=1, which makes rows unit).
"""

from __future__ import annotations

import torch

from fedlt.calibration.calibrators import Calibrator, linear_head, weight_and_bias


class EqualNorm(Calibrator):
    """equalnorm: learned head's class rows rescaled to their mean norm, bias removed (after training)"""

    name = "equalnorm"
    acts_on = "learned_linear"  # refused (before training) for a method whose model has no learned linear head

    def finish(self, stats, head) -> None:
        weight, bias = weight_and_bias(head)
        norms = weight.norm(dim=1, keepdim=True).clamp_min(1e-12)
        self._head = linear_head(weight / norms * norms.mean(), torch.zeros_like(bias))
