"""Random Fourier features of the RBF kernel, built from a shared seed.

SFD (Zhang et al. KDD 2025, Eq. 3-4) compares the synthetic and the real feature distribution
of a class by the MMD of the RBF kernel ``k(u, v) = exp(-gamma ||u - v||^2)``. The exact MMD
needs every pair of real samples, which clients cannot share; with random features
``phi(z) = sqrt(2/D) [cos(W z), sin(W z)]`` (``W``: D/2 frequencies) the kernel becomes an inner
product, ``k(u, v) ~ <phi(u), phi(v)>``, so the MMD becomes the distance between the classes'
*mean* random features — and a mean is a sum over clients (see :mod:`.stats`).

Every client must use the same ``W``: the server sends only a seed, and :func:`rff_frequencies`
draws ``W`` from it on the CPU in float64 (so the draw does not depend on the client's device).
The frequencies are orthogonal random features (Yu et al., NeurIPS 2016), as in the SFD code:
blocks of a Haar-random orthogonal matrix whose rows are rescaled by chi-distributed norms, so
each row is marginally ``N(0, 2 gamma I)`` (the RBF's spectral density) while rows in one block
are exactly orthogonal, which lowers the variance of the kernel estimate.
"""

from __future__ import annotations

import math

import torch


def rff_frequencies(dim: int, num_features: int, gamma: float, seed: int) -> torch.Tensor:
    """The ``(num_features / 2, dim)`` float64 CPU frequency matrix ``W`` drawn from ``seed``.

    ``num_features`` is ``D``, the length of :func:`random_fourier_features`; it must be even
    (a sine and a cosine per frequency).
    """
    if dim < 1 or num_features < 2 or num_features % 2:
        raise ValueError(f"need dim >= 1 and an even num_features >= 2, got {dim} and {num_features}")
    if gamma <= 0:
        raise ValueError(f"RBF gamma must be > 0, got {gamma}")
    generator = torch.Generator().manual_seed(int(seed))
    rows = num_features // 2
    blocks = math.ceil(rows / dim)
    q, r = torch.linalg.qr(torch.randn(blocks, dim, dim, generator=generator, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r, dim1=1, dim2=2))[:, None, :]  # sign fix: Q is Haar-distributed
    norms = torch.randn(blocks, dim, dim, generator=generator, dtype=torch.float64).norm(dim=2)  # chi_dim
    # rows of each block: orthonormal directions with the lengths of Gaussian vectors
    return math.sqrt(2.0 * gamma) * (norms[:, :, None] * q.transpose(1, 2)).reshape(-1, dim)[:rows]


def random_fourier_features(z: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """``phi(z) = sqrt(2/D) [cos(z W^T), sin(z W^T)]`` (N, D) in ``z``'s dtype; differentiable.

    (Eq. 3 interleaves sines and cosines; the order of the coordinates changes nothing.)
    """
    if z.dim() != 2 or frequencies.dim() != 2 or z.shape[1] != frequencies.shape[1]:
        raise ValueError(f"expected z (N, d) and frequencies (D/2, d), got {tuple(z.shape)} and "
                         f"{tuple(frequencies.shape)}")
    projection = z @ frequencies.to(device=z.device, dtype=z.dtype).T
    scale = math.sqrt(1.0 / frequencies.shape[0])  # sqrt(2 / D) with D = 2 * rows
    return torch.cat([torch.cos(projection), torch.sin(projection)], dim=1) * scale
