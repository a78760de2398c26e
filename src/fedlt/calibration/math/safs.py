"""SAFS: statistically aligned feature synthesis (SFD, Zhang et al. KDD 2025, Section 4.3).

From the federation's per-class feature statistics alone — mean, covariance and mean random
Fourier features (:mod:`.rff`), all formed from client sums — the server builds a set of
synthetic features per class on which the global classifier is then fine-tuned (Algorithm 1):

1. a memory bank of ``M_c`` standard-normal rows per class, ``M_c`` linear in the class's size
   rank from 2000 (rarest) to 600 (most frequent) (Appendix B; :func:`synthetic_counts`);
2. the MeanCov Aligner (Eq. 11-14; :func:`align_mean_cov`) whitens the bank with the Cholesky
   factor of its own covariance and recolours it with that of the target, so the synthetic
   features have exactly the target mean and covariance whatever the bank holds;
3. ``T`` SGD steps on the bank (through the aligner) minimising ``L_MMD + L_ARR``: the L1
   distance between the synthetic and the real mean random features (Eq. 15, matching what the
   first two moments miss) and a penalty on negative values, which post-ReLU features never
   have (Eq. 16; :func:`synthesis_loss`).

Choices where the paper is silent (the released code agrees unless noted): every step uses the
whole bank (Algorithm 1's "batch" is the bank); covariances are the unbiased (n - 1) estimates
on both sides (the released code's target covariance is the biased 1/n one); ``eps`` (1e-5,
Appendix B) is added to both the target and the bank's covariance (the released code adds 1e-6
to the bank's);
the bank and the features are float32, the d x d Cholesky factors and
triangular solves float64; ``L_ARR`` is summed over the
feature dimensions and averaged over the bank's rows; the bank's optimiser is SGD (lr 1.0,
momentum 0.9) with a cosine schedule over ``T = 100`` steps; classes of equal size share a rank
and, when all present classes have one size, every class gets the largest count; a class
without samples gets no synthetic features.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from fedlt.calibration.math.rff import random_fourier_features
from fedlt.calibration.math.stats import rounding_scale
from fedlt.errors import FedltError


@dataclass
class SynthesisOptions:
    """Algorithm 1's knobs and the ablation switches of the paper's Table 3."""

    steps: int = 100
    lr: float = 1.0
    momentum: float = 0.9
    eps: float = 1e-5
    aligner: bool = True  # False: "w/o MeanCov Aligner", the bank itself is the synthetic set
    mmd: bool = True  # False: "w/o L_MMD"
    arr: bool = True  # False: "w/o L_ARR"


def synthetic_counts(class_counts: torch.Tensor, largest: int = 2000, smallest: int = 600) -> torch.Tensor:
    """``M_c`` per class (int64): ``largest`` for the rarest present class, ``smallest`` for the most
    frequent, linear in the rank among the distinct class sizes in between, 0 for absent classes."""
    if largest < smallest or smallest < 1:
        raise ValueError(f"need largest >= smallest >= 1, got {largest} and {smallest}")
    counts = torch.as_tensor(class_counts).detach().cpu()
    out = torch.zeros(counts.shape[0], dtype=torch.int64)
    sizes = sorted(set(counts[counts > 0].tolist()))
    for rank, size in enumerate(sizes):
        frac = rank / (len(sizes) - 1) if len(sizes) > 1 else 0.0
        out[counts == size] = int(round(largest - frac * (largest - smallest)))
    return out


def cholesky_factor(cov: torch.Tensor, eps: float) -> torch.Tensor:
    """Lower Cholesky factor of ``cov + eps I`` in float64; a clear error when it does not exist."""
    eye = torch.eye(cov.shape[0], dtype=torch.float64, device=cov.device)
    factor, info = torch.linalg.cholesky_ex(cov.to(torch.float64) + eps * eye)
    if int(info) != 0:
        # found mid-run, after training: a FedltError (one line), not a refusal of the config before it
        raise FedltError(f"covariance + {eps:g} I is not positive definite; raise the SAFS eps "
                          "(calibration_args.safs_eps)")
    return factor


def scaled_cholesky_factor(cov: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`cholesky_factor` of ``cov + eps I``, or where that fails of ``cov + eps s I`` with ``s``
    its :func:`~fedlt.calibration.math.stats.rounding_scale`."""
    try:
        return cholesky_factor(cov, eps)
    except FedltError:
        scale = rounding_scale(cov)
        if scale is None:
            raise
        return cholesky_factor(cov, eps * scale)


def align_mean_cov(z_raw: torch.Tensor, target_mean: torch.Tensor, target_factor: torch.Tensor,
                   eps: float = 1e-5) -> torch.Tensor:
    """MeanCov Aligner, Eq. 11-14: ``(Z_raw - mu_raw) A^T + mu_g`` with ``A = L_g L_raw^{-1}``.

    ``target_factor`` is ``L_g`` (:func:`cholesky_factor` of the target covariance); ``L_raw`` is
    that of the rows' unbiased covariance plus ``eps I``. With ``eps = 0`` the result has exactly
    the target mean and (unbiased) covariance ``L_g L_g^T``. Differentiable w.r.t. ``z_raw``;
    the (n, d) products run in ``z_raw``'s dtype, the d x d factorisations in float64.
    """
    if z_raw.dim() != 2 or z_raw.shape[0] < 2:
        raise ValueError(f"the aligner needs at least 2 rows of (n, d) features, got {tuple(z_raw.shape)}")
    centered = z_raw - z_raw.mean(dim=0)
    try:
        raw_factor = cholesky_factor(centered.T @ centered / (z_raw.shape[0] - 1), eps)
    except FedltError:  # fewer rows than dimensions: float32 rounding of large features made it indefinite
        wide = centered.to(torch.float64)
        raw_factor = scaled_cholesky_factor(wide.T @ wide / (z_raw.shape[0] - 1), eps)
    # A = L_g L_raw^{-1} by forward substitution (X L_raw = L_g), not an explicit inverse
    a = torch.linalg.solve_triangular(raw_factor, target_factor.to(torch.float64), upper=False, left=False)
    return centered @ a.T.to(z_raw.dtype) + target_mean.to(z_raw.dtype)


def synthesis_loss(z: torch.Tensor, rff_target: torch.Tensor | None, frequencies: torch.Tensor | None,
                   mmd: bool = True, arr: bool = True) -> torch.Tensor:
    """``L_syn = L_MMD + L_ARR`` (Eq. 15-17) of one class's synthetic features ``z`` (M, d).

    ``L_MMD = || phi_g - mean_j phi(z_j) ||_1`` with the real mean random features ``phi_g``;
    ``L_ARR = mean_j sum_i max(0, -z_ji)``.
    """
    loss = z.new_zeros(())
    if mmd:
        w = frequencies.to(device=z.device, dtype=torch.float32)
        synthetic = random_fourier_features(z.to(torch.float32), w).mean(dim=0)
        loss = loss + (rff_target.to(device=z.device, dtype=torch.float32) - synthetic).abs().sum()
    if arr:
        loss = loss + (-z).clamp_min(0).sum(dim=1).mean()
    return loss


def synthesize_class(mean: torch.Tensor, cov: torch.Tensor, rff_target: torch.Tensor | None,
                     frequencies: torch.Tensor | None, count: int, generator: torch.Generator,
                     options: SynthesisOptions) -> tuple[torch.Tensor, float]:
    """Algorithm 1 for one class: ``count`` synthetic features (float32, on ``mean``'s device) and
    the final ``L_syn`` (NaN when nothing is optimised)."""
    device = mean.device
    if frequencies is not None:  # converted once, not every step
        frequencies = frequencies.to(device=device, dtype=torch.float32)
    bank = torch.randn(count, mean.shape[0], generator=generator, device=generator.device)
    bank = bank.to(device).requires_grad_(True)
    target_factor = scaled_cholesky_factor(cov, options.eps) if options.aligner else None

    def transform(raw: torch.Tensor) -> torch.Tensor:
        return align_mean_cov(raw, mean, target_factor, options.eps) if options.aligner else raw

    final = float("nan")
    if options.steps > 0 and (options.mmd or options.arr):
        optimizer = torch.optim.SGD([bank], lr=options.lr, momentum=options.momentum)
        with torch.enable_grad():
            for step in range(options.steps):
                for group in optimizer.param_groups:  # cosine annealing to 0 over the T steps
                    group["lr"] = options.lr * 0.5 * (1.0 + math.cos(math.pi * step / options.steps))
                loss = synthesis_loss(transform(bank), rff_target, frequencies, options.mmd, options.arr)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    with torch.no_grad():
        z = transform(bank.detach())
        if options.mmd or options.arr:
            final = float(synthesis_loss(z, rff_target, frequencies, options.mmd, options.arr))
    return z.to(torch.float32), final


def synthesize(mean: torch.Tensor, cov: torch.Tensor, rff_mean: torch.Tensor | None, frequencies: torch.Tensor | None,
               counts_per_class: torch.Tensor, generator: torch.Generator,
               options: SynthesisOptions | None = None, done: Callable[[int, int], None] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, dict[int, float]]:
    """Algorithm 1 for every class with a non-zero count: features (N, d) float32 and int64 labels,
    grouped by class, and each class's final ``L_syn``. ``rff_mean`` and ``frequencies`` may be
    None only when ``options.mmd`` is off. ``done(k, K)`` after each class: k of the K classes built."""
    options = options or SynthesisOptions()
    if options.mmd and (rff_mean is None or frequencies is None):
        raise ValueError("L_MMD needs the classes' mean random features and the frequencies")
    feats, labels, losses = [], [], {}
    counts = torch.as_tensor(counts_per_class).tolist()
    classes = sum(1 for n in counts if n)
    for c, n in enumerate(counts):
        if n == 0:
            continue
        if n < 2:
            raise ValueError(f"class {c}: the aligner needs at least 2 synthetic features, got {n}")
        z, losses[c] = synthesize_class(mean[c], cov[c], rff_mean[c] if rff_mean is not None else None,
                                        frequencies, int(n), generator, options)
        feats.append(z)
        labels.append(torch.full((int(n),), c, dtype=torch.int64, device=z.device))
        if done is not None:
            done(len(feats), classes)
    if not feats:
        raise ValueError("no class has synthetic features to build")
    return torch.cat(feats), torch.cat(labels), losses
