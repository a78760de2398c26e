"""Per-class feature statistics as additive sums.

Clients send sums (count, sum of z, sum of z z^T) rather than means and covariances because
sums add exactly over clients, and can therefore go through a plain or secure aggregate; the
server turns the pooled sums into class means and covariances (CCVR, Luo et al. NeurIPS 2021;
FedNCM, Legate et al. 2023). Accumulation is in float64: covariances are formed as
``sum_outer - n mean mean^T``, a difference of large numbers that loses float32 precision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Sums = dict[str, torch.Tensor]


def validate_features(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> None:
    """Check the ``features`` (N, d) float / ``labels`` (N,) int64 in [0, C) convention."""
    if features.dim() != 2 or not features.is_floating_point():
        raise ValueError(f"features must be float (N, d), got {features.dtype} {tuple(features.shape)}")
    if labels.dtype != torch.int64 or labels.shape != (features.shape[0],):
        raise ValueError(
            f"labels must be int64 (N,) with N={features.shape[0]}, got {labels.dtype} {tuple(labels.shape)}"
        )
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{int(labels.min())}, {int(labels.max())}]")


def class_feature_sums(
    features: torch.Tensor, labels: torch.Tensor, num_classes: int, second_moment: bool = True
) -> Sums:
    """Per-class ``count`` (C,), ``sum`` (C, d) and, if ``second_moment``, ``sum_outer`` (C, d, d).

    All float64, on the features' device. ``sum_outer[c]`` is the sum of ``z z^T`` over the
    class's samples (one matmul per present class, so memory stays O(C d^2), not O(N d^2)).
    """
    validate_features(features, labels, num_classes)
    z = features.detach().to(torch.float64)
    count = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    total = torch.zeros(num_classes, z.shape[1], dtype=torch.float64, device=z.device).index_add_(0, labels, z)
    sums = {"count": count, "sum": total}
    if second_moment:
        outer = torch.zeros(num_classes, z.shape[1], z.shape[1], dtype=torch.float64, device=z.device)
        for c in torch.nonzero(count).flatten().tolist():
            zc = z[labels == c]
            outer[c] = zc.T @ zc
        sums["sum_outer"] = outer
    return sums


def add_sums(a: Sums, b: Sums) -> Sums:
    """Entry-wise sum of two sums dicts (they must carry the same keys)."""
    if a.keys() != b.keys():
        raise ValueError(f"cannot add sums with different entries: {sorted(a)} vs {sorted(b)}")
    return {key: a[key] + b[key] for key in a}


def merge_sums(parts: Sequence[Sums]) -> Sums:
    """Entry-wise sum of a non-empty list of sums dicts, e.g. one per client."""
    if not parts:
        raise ValueError("merge_sums needs at least one sums dict")
    merged = dict(parts[0])
    for part in parts[1:]:
        merged = add_sums(merged, part)
    return merged


def class_moments(sums: Sums) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Class means (C, d), unbiased covariances (C, d, d) and counts (C,), float64.

    ``cov_c = (sum_outer_c - n_c mean_c mean_c^T) / (n_c - 1)``. A class with ``n_c <= 1`` has
    no covariance estimate and gets a zero matrix; a class with ``n_c = 0`` also gets a zero
    mean. The result is symmetrised to remove rounding asymmetry before any Cholesky.
    """
    if "sum_outer" not in sums:
        raise ValueError("class_moments needs second moments: build the sums with second_moment=True")
    count = sums["count"].to(torch.float64)
    mean = sums["sum"].to(torch.float64) / count.clamp_min(1.0)[:, None]
    scatter = sums["sum_outer"].to(torch.float64) - count[:, None, None] * mean[:, :, None] * mean[:, None, :]
    cov = torch.where(
        (count > 1)[:, None, None], scatter / (count - 1).clamp_min(1.0)[:, None, None], torch.zeros_like(scatter)
    )
    return mean, 0.5 * (cov + cov.transpose(1, 2)), count


def rounding_scale(cov: torch.Tensor) -> float | None:
    """The largest variance of ``cov`` where it is finite and above 1, else None. Rounding grows with
    the entries: features of size 1e12 (a model whose weights grew without becoming NaN) leave
    eigenvalues of -1e6 in a covariance that no absolute jitter covers, so a jitter is then taken
    relative to this; a covariance of entries below 1 has only the absolute one."""
    scale = float(cov.detach().diagonal().abs().max()) if cov.numel() else 0.0
    return scale if math.isfinite(scale) and scale > 1.0 else None
