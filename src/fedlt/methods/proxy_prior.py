"""GBME's proxy prior and client grouping, as plain functions of tensors (Zeng et al., ICCV 2023).

* LPI (Definition 1, Eq. 4): per class i, ``Omega_i = sum_j -grad w_ij`` of the final FC layer.
  A head made of several FC layers (GBME's experts) is one matrix here: the experts' weight
  matrices side by side, so j runs over every expert's inputs.
* GPI (Definition 2, Eq. 5): ``Pi_i = sum_k n_k/n * 1(Omega_i^k > 0) * Omega_i^k``.
* The released code's GPI instead: each LPI read as estimated class counts (entries <= 0 set to
  1e-5, normalised, times n_k, rounded), summed over the clients, each class at least 5.
* Grouping (Eq. 6): clients ranked by ``cos(Omega^k, Pi)``, the ranking cut into M groups.
* Selection (Sec. 3.3, Fig. 2(b)): expert i is trained by ``round(alpha*R)`` clients drawn from
  its group and ``R - round(alpha*R)`` drawn from the clients outside it.
* GBME-p (Sec. 3.4, Theorem 2): Gaussian mechanism ``sigma = c * Delta / epsilon`` with
  ``c = sqrt(2 ln(1.25/delta))`` (the theorem asks c^2 > 2 ln(1.25/delta); the bound is taken). It holds for
  epsilon < 1 only; above it that sigma can be too small for the stated epsilon.
* Accounting (Balle & Wang 2018, "Improving the Gaussian mechanism for differential privacy",
  Theorem 8): the exact delta of Gaussian noise sigma at epsilon, for every epsilon; from it the
  epsilon a sigma actually achieves at a delta, and the smallest sigma that achieves a stated
  (epsilon, delta) (their analytic calibration).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch


def local_proxy(fc_gradient: torch.Tensor) -> torch.Tensor:
    """Eq. 4: the negative FC-weight gradient summed over the layer's inputs, one value per class."""
    if fc_gradient.dim() != 2:
        raise ValueError(f"the FC gradient must be (classes, inputs), got shape {tuple(fc_gradient.shape)}")
    return -fc_gradient.sum(dim=1)


def global_proxy(lpis: dict[int, torch.Tensor], num_samples: dict[int, int]) -> torch.Tensor:
    """Eq. 5: sample-weighted sum of the clients' LPIs, each keeping only its positive entries."""
    n = sum(num_samples[k] for k in lpis)
    if n <= 0:
        raise ValueError("the clients hold no samples: the global proxy is undefined")
    total = torch.zeros_like(next(iter(lpis.values())), dtype=torch.float64)
    for k in sorted(lpis):
        omega = lpis[k].double()
        total += (num_samples[k] / n) * omega * (omega > 0)
    return total


def estimated_counts(lpi: torch.Tensor, num_samples: int) -> torch.Tensor:
    """The released code's reading of one LPI as class counts: entries <= 0 become 1e-5, so a
    class the client seems to lack counts as (nearly) absent; the vector is normalised, scaled to
    the client's n_k and rounded (half to even, as numpy)."""
    omega = lpi.double()
    share = torch.where(omega > 0, omega, torch.full_like(omega, 1e-5))
    return torch.round(share / share.sum() * num_samples)


def count_proxy(lpis: dict[int, torch.Tensor], num_samples: dict[int, int], floor: float = 5.0) -> torch.Tensor:
    """The released code's GPI: the clients' :func:`estimated_counts` summed, each class raised to
    at least ``floor`` (5) so that no class gets a zero prior."""
    if not lpis:
        raise ValueError("no client uploaded an LPI: the global proxy is undefined")
    total = sum(estimated_counts(lpis[k], num_samples[k]) for k in sorted(lpis))
    return total.clamp_min(floor)


def cosine_scores(vectors: dict[int, torch.Tensor], reference: torch.Tensor) -> dict[int, float]:
    """Eq. 6: cosine similarity of every client's vector to the reference (0 for a zero vector)."""
    ref = reference.double()
    out = {}
    for k, v in vectors.items():
        v = v.double()
        denom = float(v.norm() * ref.norm())
        out[k] = float(v @ ref) / denom if denom > 0 else 0.0
    return out


def rank_groups(scores: dict[int, float], num_groups: int) -> list[list[int]]:
    """Clients sorted by score (highest first, ties by id) and cut into ``num_groups`` contiguous,
    near-equal groups, so clients of close similarity share a group."""
    if not 1 <= num_groups <= len(scores):
        raise ValueError(f"cannot form {num_groups} non-empty groups from {len(scores)} clients")
    ranked = sorted(scores, key=lambda k: (-scores[k], k))
    return [list(map(int, part)) for part in np.array_split(np.array(ranked, dtype=np.int64), num_groups)]


def random_groups(clients: list[int], num_groups: int, rng: np.random.Generator) -> list[list[int]]:
    """The ``random`` grouping of Table 10: a seeded permutation cut into near-equal groups."""
    if not 1 <= num_groups <= len(clients):
        raise ValueError(f"cannot form {num_groups} non-empty groups from {len(clients)} clients")
    order = rng.permutation(np.array(sorted(clients), dtype=np.int64))
    return [sorted(map(int, part)) for part in np.array_split(order, num_groups)]


def split_quota(alpha: float, per_expert: int) -> tuple[int, int]:
    """(from its group, from the others) for one expert: ``round(alpha * R)`` (half up) and the rest."""
    inside = int(math.floor(alpha * per_expert + 0.5))
    return inside, per_expert - inside


def select_for_experts(groups: list[list[int]], alpha: float, per_expert: int,
                       rng: np.random.Generator) -> dict[int, list[int]]:
    """Client -> experts it trains this round. For each expert i, ``split_quota`` clients are drawn
    without replacement from group i and from the clients outside it; a client drawn for several
    experts trains them all in one local training. When a side has too few clients, the quota is
    filled from the other side (e.g. M = 1, where no client is outside the group)."""
    everyone = sorted(c for g in groups for c in g)
    chosen: dict[int, list[int]] = {}
    for expert, group in enumerate(groups):
        members = sorted(group)
        others = sorted(set(everyone) - set(members))
        inside, outside = split_quota(alpha, min(per_expert, len(everyone)))
        inside, outside = min(inside, len(members)), min(outside, len(others))
        short = min(per_expert, len(everyone)) - inside - outside
        if short > 0:  # top up from whichever side still has clients
            extra_in = min(short, len(members) - inside)
            inside, outside = inside + extra_in, outside + short - extra_in
        picks = list(rng.choice(members, size=inside, replace=False)) if inside else []
        picks += list(rng.choice(others, size=outside, replace=False)) if outside else []
        for cid in picks:
            chosen.setdefault(int(cid), []).append(expert)
    return {cid: sorted(experts) for cid, experts in sorted(chosen.items())}


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """Theorem 2: ``sigma = sqrt(2 ln(1.25/delta)) * sensitivity / epsilon``."""
    if epsilon <= 0 or not 0 < delta < 1 or sensitivity <= 0:
        raise ValueError(f"need epsilon > 0, 0 < delta < 1, sensitivity > 0; got {epsilon}, {delta}, {sensitivity}")
    return math.sqrt(2.0 * math.log(1.25 / delta)) * sensitivity / epsilon


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _normal_pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _mills_ratio(z: float) -> float:
    """``Phi(-z) / phi(z)`` for z >= 0. Directly while both are far from underflow; beyond, by
    Laplace's continued fraction ``1 / (z + 1 / (z + 2 / (z + 3 / ...)))``, which converges fast there."""
    if z < 20.0:
        return _normal_cdf(-z) / _normal_pdf(z)
    t = z
    for k in range(60, 0, -1):
        t = z + k / t
    return 1.0 / t


def gaussian_delta(epsilon: float, sigma: float, sensitivity: float) -> float:
    """Balle & Wang (2018), Theorem 8: the smallest delta for which N(0, sigma^2) noise on a query of
    L2 sensitivity Delta is (epsilon, delta)-DP: ``Phi(a - b) - e^epsilon Phi(-a - b)`` with
    ``a = Delta / (2 sigma)``, ``b = epsilon sigma / Delta``. As ``e^epsilon phi(a + b) = phi(a - b)``,
    the second term is ``phi(a - b) * Phi(-a - b) / phi(a + b)``: no e^epsilon to overflow at large epsilon."""
    a, b = sensitivity / (2.0 * sigma), epsilon * sigma / sensitivity
    return max(_normal_cdf(a - b) - _normal_pdf(a - b) * _mills_ratio(a + b), 0.0)


def _check_privacy(delta: float, *positive: float) -> None:
    if not 0 < delta < 1 or min(positive) <= 0:
        raise ValueError(f"need 0 < delta < 1 and positive epsilon, sigma, sensitivity; got delta={delta}, {positive}")


def epsilon_achieved(sigma: float, delta: float, sensitivity: float) -> float:
    """The smallest epsilon for which N(0, sigma^2) noise is (epsilon, delta)-DP: the root of
    :func:`gaussian_delta` = delta (it falls as epsilon grows), by bisection; 0 if even epsilon=0 holds."""
    _check_privacy(delta, sigma, sensitivity)
    if gaussian_delta(0.0, sigma, sensitivity) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while gaussian_delta(hi, sigma, sensitivity) > delta:
        lo, hi = hi, 2.0 * hi
    return _bisect(lambda eps: gaussian_delta(eps, sigma, sensitivity) > delta, lo, hi, lambda x, y: (x + y) / 2)


def analytic_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """Balle & Wang's analytic calibration: the smallest sigma whose exact delta at epsilon
    (:func:`gaussian_delta`, falling as sigma grows) is at most delta, by bisection on log sigma."""
    _check_privacy(delta, epsilon, sensitivity)
    # Theorem 2's sigma past the doubles (a tiny epsilon) would halve forever as inf / 2: start at the largest double
    hi = min(gaussian_sigma(epsilon, delta, sensitivity), sys.float_info.max)
    while gaussian_delta(epsilon, hi, sensitivity) > delta:
        hi *= 2.0
    lo = hi / 2.0
    while gaussian_delta(epsilon, lo, sensitivity) <= delta:
        lo, hi = lo / 2.0, lo
    return _bisect(lambda s: gaussian_delta(epsilon, s, sensitivity) > delta, lo, hi, lambda x, y: math.sqrt(x * y))


def _bisect(too_small, lo: float, hi: float, middle) -> float:
    """The boundary between ``lo`` (too_small) and ``hi`` (not), to the float resolution; returns
    the side that is not too small, so the guarantee it stands for holds."""
    for _ in range(2000):
        mid = middle(lo, hi)
        if not lo < mid < hi:
            break
        lo, hi = (mid, hi) if too_small(mid) else (lo, mid)
    return hi


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of two vectors (nan when one is constant)."""
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    denom = float(a.norm() * b.norm())
    return float(a @ b) / denom if denom > 0 else float("nan")
