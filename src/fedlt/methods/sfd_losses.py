"""The two local losses of SFD's adaptive bi-branch learning (ABBL; Zhang et al. KDD 2025, 4.1).

- **A-CE** (Eq. 5-6): logit adjustment ``CE(logits + gamma log pi)`` on the client's class
  counts, except that a class the client lacks gets ``pi = beta_pi * (smallest present count)``
  instead of 0. Plain logit adjustment puts ``log 0 = -inf`` on a missing class, whose softmax
  share, and hence its repulsive gradient, is then exactly 0 on that client (Appendix A.1).
- **A-SCL** (Eq. 7): supervised contrastive loss on L2-normalised projections in which every
  other sample ``b`` of the denominator is weighted by its class count, ``exp(s_ib + log n_yb)``,
  so head-class negatives repel more.

Eq. 7's positives are ``A(i) = {a | y_a = y_i}``, the anchor itself among them (its term is
``s_ii - log sum_{b != i} exp(s_ib + Delta_yb)``: a repulsion from every other sample, so an anchor
alone with its class in the batch still learns), and the loss is averaged over every anchor
(``anchor_positive=True``, ``method_args.scl_form=eq7``). The earlier default read the positives as
Khosla et al. 2020 do, without the anchor, skipping anchors with no other sample of their class
(``scl_form=paper``). ``Delta`` is applied as ``log(n_yb / n_yi)``: for one anchor this only
subtracts the constant ``log n_yi`` from Eq. 7, so the gradients are Eq. 7's, and A-SCL is then
exactly the standard SCL when all counts are equal.
The released code's A-SCL (:func:`released_supcon`, ``scl_form=released``, the default: it produced
the paper's numbers) also counts the anchor among its positives and every anchor, but adds ``Delta``
to other-class samples only.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def adaptive_prior(class_counts: np.ndarray | torch.Tensor, beta_pi: float = 1.0) -> torch.Tensor:
    """Eq. 6: ``pi_c = n_c`` for present classes, ``beta_pi * min_{n>0} n`` for missing ones (float64,
    on the host: the counts are the host's, an array or a CPU tensor, checked without a device wait)."""
    if not 0 <= beta_pi <= 1:
        raise ValueError(f"beta_pi must lie in [0, 1], got {beta_pi}")
    if not (np.asarray(class_counts) > 0).any():
        raise ValueError("a client without samples has no prior")
    n = torch.as_tensor(class_counts).to(torch.float64)
    present = n > 0
    return torch.where(present, n, beta_pi * torch.where(present, n, torch.inf).min())  # no mask: no wait


def adaptive_logit_offset(class_counts: np.ndarray | torch.Tensor, beta_pi: float = 1.0, gamma: float = 0.1) -> torch.Tensor:
    """``gamma * log pi`` (float32), the offset A-CE adds to the logits; ``-inf`` for a class with
    ``pi = 0`` (``beta_pi = 0``: plain logit adjustment), 0 everywhere when ``gamma = 0`` (plain CE)."""
    pi = adaptive_prior(class_counts, beta_pi)
    if gamma == 0:
        return torch.zeros_like(pi, dtype=torch.float32)
    return (gamma * torch.log(pi)).to(torch.float32)  # log 0 = -inf: zero softmax share, zero gradient


def adaptive_ce(logits: torch.Tensor, targets: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Eq. 5: ``CE(logits + offset)`` with the offset of :func:`adaptive_logit_offset`."""
    return F.cross_entropy(logits + offset.to(device=logits.device, dtype=logits.dtype), targets)


def adaptive_supcon(projections: torch.Tensor, labels: torch.Tensor, temperature: float = 0.07,
                    log_counts: torch.Tensor | None = None, anchor_positive: bool = False) -> torch.Tensor:
    """Eq. 7 on L2-normalised ``projections`` (B, p); ``log_counts`` (C,) = ``log n_c`` of the client
    (None: the standard supervised contrastive loss); ``anchor_positive``: the anchor among its own
    positives, as Eq. 7's A(i) has it (False: Khosla et al.'s). See the module docstring."""
    if projections.dim() != 2 or labels.shape != (projections.shape[0],):
        raise ValueError(f"expected projections (B, p) and labels (B,), got {tuple(projections.shape)} and "
                         f"{tuple(labels.shape)}")
    b = projections.shape[0]
    sim = projections @ projections.T / temperature
    if log_counts is not None:
        delta = log_counts.to(device=sim.device, dtype=sim.dtype)[labels]
        sim = sim + (delta[None, :] - delta[:, None])  # log(n_yb / n_yi)
    self_mask = torch.eye(b, dtype=torch.bool, device=sim.device)
    log_prob = sim - torch.logsumexp(sim.masked_fill(self_mask, float("-inf")), dim=1, keepdim=True)
    positive = (labels[:, None] == labels[None, :]) & (torch.ones_like(self_mask) if anchor_positive else ~self_mask)
    num_pos = positive.sum(dim=1)
    anchors = num_pos > 0
    if b < 2:
        return projections.sum() * 0.0  # no pair in the batch: nothing to contrast
    # the mean over anchors, written without selecting them (a selection waits for the device);
    # no anchor at all gives 0 with zero gradient
    per_anchor = (log_prob * positive).sum(dim=1) / num_pos.clamp_min(1)
    return -(per_anchor * anchors).sum() / anchors.sum().clamp_min(1)


def released_supcon(projections: torch.Tensor, labels: torch.Tensor, temperature: float = 0.07,
                    log_counts: torch.Tensor | None = None) -> torch.Tensor:
    """The released code's A-SCL on L2-normalised ``projections``: ``log n_yb`` added to the other-class
    pairs only (same-class pairs stay as they are, in the denominator too), the anchor counted among
    its own positives, the mean over every anchor; ``log_counts`` None: that loss without ``Delta``."""
    if projections.dim() != 2 or labels.shape != (projections.shape[0],):
        raise ValueError(f"expected projections (B, p) and labels (B,), got {tuple(projections.shape)} and "
                         f"{tuple(labels.shape)}")
    b = projections.shape[0]
    if b < 2:
        return projections.sum() * 0.0  # no pair in the batch: nothing to contrast
    sim = projections @ projections.T / temperature
    same = labels[:, None] == labels[None, :]
    if log_counts is not None:
        delta = log_counts.to(device=sim.device, dtype=sim.dtype)[labels]
        sim = sim + delta[None, :] * ~same
    self_mask = torch.eye(b, dtype=torch.bool, device=sim.device)
    log_prob = sim - torch.logsumexp(sim.masked_fill(self_mask, float("-inf")), dim=1, keepdim=True)
    return -((log_prob * same).sum(dim=1) / same.sum(dim=1)).mean()
