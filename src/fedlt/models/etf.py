"""Fixed neural-collapse classifiers: the simplex ETF and FedLoGe's sparse SSE-C.

Neural collapse predicts that a well-trained classifier's class vectors form a simplex
equiangular tight frame (ETF): equal norms and the largest possible equal pairwise angle,
``arccos(-1/(C-1))``. Fixing the classifier to that geometry from the start (FedETF, FedLoGe)
removes the classifier bias that heterogeneous, long-tailed clients would otherwise learn.

FedLoGe's SSE-C (Xiao et al., ICLR 2024, Eq. 2-5) zeroes a random fraction ``beta`` of the ETF's
entries and re-optimises the remaining ones so that the sparse matrix is again (nearly) an ETF:
equal norms ``gamma`` and a maximal minimum angle. Rows here are class vectors (``nn.Linear``
layout, ``(C, d)``); the paper writes the transpose.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from fedlt.errors import ConfigError


def simplex_etf(feature_dim: int, num_classes: int, generator: torch.Generator) -> torch.Tensor:
    """``sqrt(C/(C-1)) (I - 11^T/C) U^T``, rows of unit norm, ``U`` a random ``d x C`` orthonormal
    basis (Eq. 2). Needs ``d >= C``."""
    if feature_dim < num_classes:
        raise ValueError(f"a simplex ETF needs feature_dim >= num_classes, got {feature_dim} < {num_classes}")
    gauss = torch.randn(feature_dim, num_classes, generator=generator, device=generator.device, dtype=torch.float64)
    basis, _ = torch.linalg.qr(gauss)  # (d, C) orthonormal columns
    centering = torch.eye(num_classes, dtype=torch.float64, device=basis.device) - 1.0 / num_classes
    etf = math.sqrt(num_classes / (num_classes - 1)) * basis @ centering  # (d, C)
    return etf.T.contiguous().float()


def check_etf_width(feature_dim: int, num_classes: int, model_name: str) -> None:
    """A config error (before any run directory exists) when the model is too narrow for an ETF."""
    if feature_dim < num_classes:
        raise ConfigError(f"a simplex ETF of {num_classes} classes needs a feature width >= {num_classes}; "
                          f"model {model_name} has {feature_dim}: choose a model at least that wide (`fedlt models` "
                          "gives each one's feature width)")


def sparsity_mask(shape: tuple[int, int], sparsity: float, generator: torch.Generator) -> torch.Tensor:
    """A 0/1 float mask with exactly ``round(sparsity * numel)`` zeros at random positions."""
    if not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    numel = shape[0] * shape[1]
    zeros = round(sparsity * numel)
    mask = torch.ones(numel, device=generator.device)
    mask[torch.randperm(numel, generator=generator, device=generator.device)[:zeros]] = 0.0
    return mask.view(shape)


def sse_c_loss(weight: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Eq. 5: equal-norm loss ``sum_c (||w_c . s_c|| - gamma)^2`` (Eq. 3) minus the mean over
    classes of the angle to the nearest other class vector (Eq. 4, the max-min-angle loss)."""
    w = weight * mask
    norms = w.norm(dim=1)
    norm_loss = ((norms - gamma) ** 2).sum()
    unit = w / norms.clamp_min(1e-12)[:, None]
    cos = unit @ unit.T
    cos = cos - 3.0 * torch.eye(cos.shape[0], device=cos.device)  # exclude j == i from the max
    nearest = cos.max(dim=1).values.clamp(-1 + 1e-7, 1 - 1e-7)  # arccos' gradient is infinite at +-1
    return norm_loss - torch.arccos(nearest).mean()


#: beta1 of SSE-C's Adam (torch's default): its first step is lr / (1 - beta1)
SSE_ADAM_BETA1 = 0.9


def build_sse_c(
    feature_dim: int, num_classes: int, *, sparsity: float, gamma: float, steps: int, lr: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SSE-C as ``(weight (C, d), mask)``: ETF init, sparsity mask, then ``steps`` of Adam on
    :func:`sse_c_loss` over the unmasked entries only (masked ones stay exactly zero).

    With ``sparsity = 0`` and ``steps = 0`` this is the dense ETF scaled to norm ``gamma``.
    """
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    etf = simplex_etf(feature_dim, num_classes, generator)
    mask = sparsity_mask(tuple(etf.shape), sparsity, generator)
    weight = (gamma * etf * mask).clone().requires_grad_(True)
    if steps > 0:
        optimizer = torch.optim.Adam([weight], lr=lr, betas=(SSE_ADAM_BETA1, 0.999))
        with torch.enable_grad(), _one_cpu_thread():
            for _ in range(steps):
                loss = sse_c_loss(weight, mask, gamma)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                weight.grad.mul_(mask)  # Adam then never moves a masked entry (its moments stay 0)
                optimizer.step()
    return (weight.detach() * mask).contiguous(), mask


@contextmanager
def _one_cpu_thread() -> Iterator[None]:
    """The matrices are tiny: extra CPU threads only add synchronisation (measured 10-30x slower
    with two threads on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def classifier_geometry(weight: torch.Tensor) -> dict[str, float]:
    """Norm mean/variance and pairwise angles (degrees) of class vectors, as in FedLoGe's Table 6."""
    w = weight.detach().double()
    norms = w.norm(dim=1)
    unit = w / norms.clamp_min(1e-12)[:, None]
    c = w.shape[0]
    iu = torch.triu_indices(c, c, offset=1)
    angles = torch.rad2deg(torch.arccos((unit @ unit.T)[iu[0], iu[1]].clamp(-1, 1)))
    return {
        "norm_mean": norms.mean().item(),
        "norm_var": norms.var(unbiased=False).item(),
        "angle_min": angles.min().item(),
        "angle_mean": angles.mean().item(),
        "angle_var": angles.var(unbiased=False).item(),
        "sparsity": (w == 0).double().mean().item(),
    }


def etf_angle(num_classes: int) -> float:
    """The simplex ETF's pairwise angle in degrees, ``arccos(-1/(C-1))``."""
    return math.degrees(math.acos(-1.0 / (num_classes - 1)))


class FixedLinear(nn.Module):
    """A linear classifier whose weight and bias are buffers: they travel with the state dict
    (so the server can broadcast them) but no optimiser ever updates them."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(out_features, in_features))
        self.register_buffer("bias", torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
