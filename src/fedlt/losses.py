"""Classification losses for long-tailed training.

Each loss is a pure function of ``logits`` (float, ``(B, C)``) and ``targets`` (int64,
``(B,)``) that returns the batch-mean loss. :func:`make_loss` builds a two-argument callable
from a config name, precomputing the class-dependent terms (log-prior, margins) once.

References
----------
- Menon et al., "Long-tail learning via logit adjustment", ICLR 2021.
- Ren et al., "Balanced Meta-Softmax for Long-Tailed Visual Recognition", NeurIPS 2020.
- Lin et al., "Focal Loss for Dense Object Detection", ICCV 2017.
- Cao et al., "Learning Imbalanced Datasets with Label-Distribution-Aware Margin Loss",
  NeurIPS 2019.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from fedlt.errors import ConfigError
from fedlt.transfer import to_device

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

PRIOR_FLOOR = 1e-8
"""Lower bound applied to the normalised class prior before taking its log.

A client often holds no sample of some classes, so its prior has exact zeros and
``log(0) = -inf`` would turn the loss and its gradients into NaN. ``1e-8`` is below ``1/N``
for any local dataset of fewer than 10^8 samples, so it never alters a class that is present,
while ``log(1e-8) ~ -18.4`` pushes an absent class's softmax share to ~1e-8 of what it
would be (its logit then gets almost no gradient, the intended behaviour) and stays far from
overflow even in float16.
"""

LOSSES: dict[str, str] = {
    "ce": "cross-entropy",
    "la": "logit-adjusted cross-entropy, CE(logits + tau*log prior) (Menon et al. 2021)",
    "bsm": "balanced softmax, CE(logits + log prior) (Ren et al. 2020)",
    "focal": "focal loss, -(1-p_t)^gamma log p_t (Lin et al. 2017)",
    "ldam": "label-distribution-aware margin loss, margins ~ n_c^(-1/4) (Cao et al. 2019)",
}
#: the losses built from the class counts (a prior or margins): the only ones ``loss.prior`` acts on
PRIOR_LOSSES = ("la", "bsm", "ldam")


def _check_batch(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be float (B, C), got {logits.dtype} {tuple(logits.shape)}")
    if targets.dtype != torch.int64 or targets.shape != (logits.shape[0],):
        raise ValueError(
            f"targets must be int64 (B,) with B={logits.shape[0]}, got {targets.dtype} {tuple(targets.shape)}"
        )


def _check_class_vector(vec: torch.Tensor, logits: torch.Tensor, what: str) -> None:
    if vec.shape != (logits.shape[1],):
        raise ValueError(f"{what} has shape {tuple(vec.shape)}, expected ({logits.shape[1]},) to match the logits")


def _as_vector(
    values: torch.Tensor | np.ndarray | Sequence[float], what: str, check: bool = True
) -> tuple[torch.Tensor, torch.device | None]:
    """Validated (unless ``check`` is false) float64 CPU copy of a per-class vector, and the device
    of the tensor it came from (None for host data: an array or a list).

    A tensor is read back, which waits for its device; host data never waits. float64 on CPU also
    works for backends without it (MPS).
    """
    if isinstance(values, torch.Tensor):
        device, vec = values.device, values.detach().cpu().to(torch.float64)
    else:  # a list of floats is read as float32 first, as torch reads it
        device, vec = None, torch.as_tensor(values).to(torch.float64, copy=True)
    if vec.dim() != 1 or vec.numel() == 0:
        raise ValueError(f"{what} must be a non-empty 1-D vector, got shape {tuple(vec.shape)}")
    if not check:
        return vec, device
    host = vec.numpy()
    if not np.isfinite(host).all() or (host < 0).any():
        raise ValueError(f"{what} must be finite and non-negative")
    if host.sum() <= 0:
        raise ValueError(f"{what} must have a positive entry")
    return vec, device


def _on(term: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A float32 host ``term`` on ``device`` (host data's terms stay on the host)."""
    return term.to(torch.float32) if device is None else term.to(device, torch.float32)


def log_prior(prior: torch.Tensor | np.ndarray | Sequence[float], check: bool = True) -> torch.Tensor:
    """``log(max(prior / sum(prior), PRIOR_FLOOR))`` as float32 on the prior's device (the host
    for an array or a list).

    The prior is normalised first, so raw class counts are accepted too; the logit-adjusted
    losses are unchanged by a constant shift of the log-prior, so only the floor cares.
    ``check=False`` skips the validation (finite, non-negative, a positive entry) for a caller
    that has validated what the prior is made of.
    """
    p, device = _as_vector(prior, "prior", check)
    return _on(torch.log((p / p.sum()).clamp_min(PRIOR_FLOOR)), device)


def _offset_ce(logits: torch.Tensor, targets: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """CE on ``logits + offset``, the common form of logit adjustment and balanced softmax."""
    _check_batch(logits, targets)
    _check_class_vector(offset, logits, "log-prior")
    return F.cross_entropy(logits + offset.to(dtype=logits.dtype), targets)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Plain softmax cross-entropy, the baseline every long-tail loss modifies."""
    _check_batch(logits, targets)
    return F.cross_entropy(logits, targets)


def logit_adjusted_ce(
    logits: torch.Tensor, targets: torch.Tensor, prior: torch.Tensor | Sequence[float], tau: float = 1.0
) -> torch.Tensor:
    """Logit-adjusted loss (Menon et al. 2021): CE on ``logits + tau * log(prior)``.

    Training with the prior added makes the raw logits estimate the balanced (prior-free)
    posterior; with ``tau = 1`` plain argmax at test time is then consistent for the
    balanced error. Zero prior entries are floored at :data:`PRIOR_FLOOR`. The prior is
    validated and logged on every call; in a training loop use :func:`make_loss`, which does
    that once.
    """
    return _offset_ce(logits, targets, tau * log_prior(prior).to(logits.device))


def balanced_softmax(
    logits: torch.Tensor, targets: torch.Tensor, prior: torch.Tensor | Sequence[float]
) -> torch.Tensor:
    """Balanced softmax (Ren et al. 2020): CE on ``logits + log(prior)``.

    Derived as the likelihood under the label-shifted (training) distribution; it is exactly
    :func:`logit_adjusted_ce` with ``tau = 1``.
    """
    return logit_adjusted_ce(logits, targets, prior, tau=1.0)


def focal_loss(logits: torch.Tensor, targets: torch.Tensor, gamma: float = 2.0) -> torch.Tensor:
    """Focal loss (Lin et al. 2017): mean of ``-(1 - p_t)^gamma * log p_t``.

    Down-weights well-classified samples so that the many easy head-class samples do not
    dominate the gradient. ``log p_t`` comes from ``log_softmax`` and ``1 - p_t`` from
    ``-expm1(log p_t)``, both accurate when ``p_t`` is close to 1.
    """
    if gamma < 0:
        raise ValueError(f"focal gamma must be >= 0, got {gamma}")
    _check_batch(logits, targets)
    logp_t = F.log_softmax(logits, dim=1).gather(1, targets[:, None]).squeeze(1)
    # Floor 1 - p_t at the dtype's smallest normal: at p_t == 1 the derivative of
    # x^gamma for 0 < gamma < 1 is infinite and would turn a zero gradient into NaN.
    one_minus_p = (-torch.expm1(logp_t)).clamp_min(torch.finfo(logp_t.dtype).tiny)
    return -(one_minus_p.pow(gamma) * logp_t).mean()


def ldam_margins(class_counts: torch.Tensor | np.ndarray | Sequence[float], max_margin: float = 0.5) -> torch.Tensor:
    """Per-class LDAM margins ``m_c ~ n_c^(-1/4)``, scaled so the largest equals ``max_margin``.

    Float32 on the counts' device (the host for an array or a list). A class with zero count gets
    ``max_margin`` (the limit of ``n^(-1/4)`` as ``n -> 0``, capped): a margin only shifts the
    target logit, so it is used only if samples of that class reach the loss anyway.
    """
    if max_margin <= 0:
        raise ValueError(f"LDAM max_margin must be > 0, got {max_margin}")
    n, device = _as_vector(class_counts, "class_counts")
    # the present classes packed (their indices found on the host copy): which classes share a SIMD
    # vector decides the last bit of the power
    present = torch.from_numpy(np.flatnonzero(n.numpy() > 0))
    raw = n.index_select(0, present).pow(-0.25)
    return _on(torch.full_like(n, max_margin).index_copy_(0, present, max_margin * (raw / raw.max())), device)


def _ldam_from_margins(
    logits: torch.Tensor, targets: torch.Tensor, margins: torch.Tensor, scale: float
) -> torch.Tensor:
    """LDAM with precomputed margins: only the target logit is shifted, by its class margin."""
    _check_batch(logits, targets)
    _check_class_vector(margins, logits, "LDAM margins")
    m_y = margins.to(dtype=logits.dtype)[targets]
    shift = torch.zeros_like(logits).scatter(1, targets[:, None], m_y[:, None])  # m_y at the target (vmap-safe)
    return F.cross_entropy(scale * (logits - shift), targets)


def ldam_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    class_counts: torch.Tensor | Sequence[float],
    max_margin: float = 0.5,
    scale: float = 1.0,
) -> torch.Tensor:
    """LDAM loss (Cao et al. 2019): CE on ``scale * (logits - m_y * onehot(y))``.

    Rare classes get larger margins ``m_c ~ n_c^(-1/4)`` (see :func:`ldam_margins`), which
    tightens their generalisation bound. The paper applies it to cosine logits in ``[-1, 1]``
    (normalised features and weights), which is why they need ``scale`` (30); on a plain linear
    head the logits are not bounded, so the default is 1 (``loss.ldam_scale``'s), and the scale is
    a temperature knob to tune. The paper's deferred re-weighting is not part of it.
    """
    if scale <= 0:
        raise ValueError(f"LDAM scale must be > 0, got {scale}")
    return _ldam_from_margins(logits, targets, ldam_margins(class_counts, max_margin).to(logits.device), scale)


def make_loss(
    name: str,
    *,
    prior: torch.Tensor | Sequence[float] | None = None,
    class_counts: torch.Tensor | Sequence[float] | None = None,
    tau: float = 1.0,
    focal_gamma: float = 2.0,
    ldam_max_margin: float = 0.5,
    ldam_scale: float = 1.0,
    device: torch.device | None = None,
) -> LossFn:
    """Build ``loss(logits, targets)`` for a name in :data:`LOSSES`.

    The log-prior (``la``, ``bsm``) and margins (``ldam``) are computed once here, on the
    host, and placed on ``device`` (default: the device of ``prior`` / ``class_counts``, the
    host for arrays). Pass host data (arrays) and the training device: the terms are then
    copied without making the host wait, where a tensor is read back (on a GPU, a wait per
    client). ``tau`` applies
    to ``la`` only (``bsm`` is ``tau = 1``). A missing
    ``prior`` or ``class_counts`` is a programming error (``ValueError``); an unknown name is
    a config error.
    """
    if name not in LOSSES:
        raise ConfigError(f"unknown loss {name!r}; use loss.name=<one of {', '.join(LOSSES)}>")
    if name == "ce":
        return cross_entropy
    if name in ("la", "bsm"):
        if prior is None:
            raise ValueError(f"loss {name!r} needs a class prior")
        offset = log_prior(prior)
        return partial(_offset_ce, offset=_placed(tau * offset if name == "la" else offset, device))
    if name == "focal":
        if focal_gamma < 0:
            raise ValueError(f"focal gamma must be >= 0, got {focal_gamma}")
        return partial(focal_loss, gamma=focal_gamma)
    if class_counts is None:
        raise ValueError("loss 'ldam' needs class_counts")
    if ldam_scale <= 0:
        raise ValueError(f"LDAM scale must be > 0, got {ldam_scale}")
    margins = ldam_margins(class_counts, ldam_max_margin)
    return partial(_ldam_from_margins, margins=_placed(margins, device), scale=ldam_scale)


def _placed(term: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """``term`` on ``device``: a host term is copied without making the host wait."""
    if device is None or term.device == torch.device(device):
        return term
    return to_device(term, device, term.dtype) if term.device.type == "cpu" else term.to(device)
