"""CCVR's virtual representations: features sampled from per-class Gaussians.

Luo et al., "No Fear of Heterogeneity: Classifier Calibration for Federated Learning with
Non-IID Data" (CCVR), NeurIPS 2021: the server approximates each class's feature distribution
by ``N(mean_c, cov_c)`` from the clients' aggregated statistics and re-trains the classifier on
samples drawn from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedlt.calibration.math.stats import rounding_scale

MAX_JITTER_TRIES = 6
"""Cholesky attempts, the jitter growing tenfold each time (eps to 1e5 * eps).

Estimated covariances are singular or indefinite only by rounding, so a few attempts suffice;
a matrix that needs more is not a covariance and is reported instead of silently flattened.
"""


def _cholesky_with_jitter(cov: torch.Tensor, eps: float) -> torch.Tensor:
    """Cholesky factor of ``cov + jitter I``, starting at ``jitter = eps`` and growing tenfold.

    Covariances estimated from fewer samples than dimensions are singular (and rounding can make
    them slightly indefinite); the jitter makes them positive definite. Where no absolute jitter up
    to ``1e5 * eps`` does, the ladder is tried again from ``eps`` times the covariance's
    :func:`~fedlt.calibration.math.stats.rounding_scale`.
    """
    eye = torch.eye(cov.shape[0], dtype=cov.dtype, device=cov.device)
    scale = rounding_scale(cov)
    starts = [eps] if scale is None else [eps, eps * scale]
    for start in starts:
        jitter = start
        for _ in range(MAX_JITTER_TRIES):
            factor, info = torch.linalg.cholesky_ex(cov + jitter * eye)
            if int(info) == 0:
                return factor
            jitter *= 10.0
    raise ValueError(f"covariance is not positive definite even with jitter {jitter / 10.0:g} on the diagonal")


def sample_class_gaussians(
    mean: torch.Tensor,
    cov: torch.Tensor,
    counts_per_class: torch.Tensor | Sequence[int],
    generator: torch.Generator,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``counts_per_class[c]`` samples from ``N(mean_c, cov_c + eps I)`` for every class.

    Returns float32 features (sum of counts, d) and int64 labels, on ``mean``'s device, grouped
    by class in class order; classes with count 0 are skipped. Sampling is ``mean + L x`` with
    ``L`` the Cholesky factor (float64) and ``x`` standard normal drawn from ``generator`` on the
    generator's device, so a seed gives the same samples whatever the tensors' device.
    """
    if mean.dim() != 2 or cov.shape != (mean.shape[0], mean.shape[1], mean.shape[1]):
        raise ValueError(f"expected mean (C, d) and cov (C, d, d), got {tuple(mean.shape)} and {tuple(cov.shape)}")
    counts = torch.as_tensor(counts_per_class).tolist()
    if len(counts) != mean.shape[0] or any(n < 0 for n in counts):
        raise ValueError(f"counts_per_class must be {mean.shape[0]} non-negative ints, got {counts}")
    dim = mean.shape[1]
    features, labels = [], []
    for c, n in enumerate(counts):
        if n == 0:
            continue
        factor = _cholesky_with_jitter(cov[c].to(torch.float64), eps)
        noise = torch.randn(n, dim, generator=generator, device=generator.device, dtype=torch.float64)
        # float32 at once: the joined features are the only other copy (what a run is checked to hold)
        features.append((mean[c].to(torch.float64) + noise.to(mean.device) @ factor.T).to(torch.float32))
        labels.append(torch.full((n,), c, dtype=torch.int64, device=mean.device))
    if not features:
        return torch.zeros(0, dim, device=mean.device), torch.zeros(0, dtype=torch.int64, device=mean.device)
    return torch.cat(features), torch.cat(labels)
