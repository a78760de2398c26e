"""Closed-form and post-hoc linear heads.

Each returns ``(weight (C, d), bias (C,))`` in float32, the layout of ``nn.Linear``.

References
----------
- Legate et al., "Guiding The Last Layer in Federated Learning with Pre-Trained Models"
  (FedNCM), NeurIPS 2023.
- Fanì et al., "Accelerating Heterogeneous Federated Learning with Closed-form Classifiers"
  (Fed3R), ICML 2024.
- Kang et al., "Decoupling Representation and Classifier for Long-Tailed Recognition"
  (tau-norm), ICLR 2020.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedlt.calibration.math.stats import validate_features


def ncm_classifier(means: torch.Tensor, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """FedNCM: the class means are the classifier rows, bias 0.

    With ``normalize`` the rows are L2-normalised so that ``features @ weight.T`` ranks classes
    by cosine similarity to their mean; the caller is then expected to L2-normalise the
    features too (both when computing the means and at inference), as FedNCM does. A class
    with no samples has a zero mean (see :func:`~fedlt.calibration.math.stats.class_moments`) and
    keeps a zero row, i.e. a constant logit of 0.
    """
    if means.dim() != 2:
        raise ValueError(f"means must be (C, d), got {tuple(means.shape)}")
    weight = means.detach().to(torch.float32)
    if normalize:
        weight = F.normalize(weight, dim=1)
    return weight, torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)


def ridge_sums(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A client's Fed3R statistics: ``gram = Z^T Z`` (d, d) and ``cross = Z^T Y`` (d, C), float64.

    ``Y`` is the one-hot label matrix. Both are sums over samples, so the server adds them over
    clients and obtains exactly the statistics of the pooled data.
    """
    validate_features(features, labels, num_classes)
    z = features.detach().to(torch.float64)
    onehot = F.one_hot(labels, num_classes).to(torch.float64)
    return z.T @ z, z.T @ onehot


def ridge_classifier(
    gram: torch.Tensor, cross: torch.Tensor, lam: float = 0.01
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fed3R: the ridge-regression classifier ``W^T = (G + lam I)^{-1} B``, bias 0.

    ``G`` and ``B`` are the pooled :func:`ridge_sums`; the solve is in float64.
    """
    if gram.dim() != 2 or gram.shape[0] != gram.shape[1] or cross.dim() != 2 or cross.shape[0] != gram.shape[0]:
        raise ValueError(f"expected gram (d, d) and cross (d, C), got {tuple(gram.shape)} and {tuple(cross.shape)}")
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam}")
    g = gram.to(torch.float64)
    eye = torch.eye(g.shape[0], dtype=torch.float64, device=g.device)
    solution = torch.linalg.solve(g + lam * eye, cross.to(torch.float64))
    weight = solution.T.contiguous().to(torch.float32)
    return weight, torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)


def tau_normalize(weight: torch.Tensor, bias: torch.Tensor, tau: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """tau-norm: ``w_c / ||w_c||^tau``, which shrinks the large-norm rows of head classes.

    ``tau = 0`` leaves the weights unchanged, ``tau = 1`` makes every row unit-norm. The bias
    is set to zero, as in the standard tau-normalised classifier (the bias carries the same
    head-class prior that the normalisation removes). Zero rows stay zero.
    """
    if weight.dim() != 2 or bias.shape != (weight.shape[0],):
        raise ValueError(f"expected weight (C, d) and bias (C,), got {tuple(weight.shape)} and {tuple(bias.shape)}")
    w = weight.detach().to(torch.float32)
    norms = w.norm(dim=1, keepdim=True)
    return torch.where(norms > 0, w / norms.pow(tau), torch.zeros_like(w)), torch.zeros_like(w[:, 0])
