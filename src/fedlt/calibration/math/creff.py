"""CReFF: classifier re-training with federated features.

Shang et al., "Federated Learning on Heterogeneous and Long-Tailed Data via Classifier
Re-Training with Federated Features", IJCAI 2022, Section 3. Clients send, per class they hold,
the mean gradient of the cross-entropy w.r.t. the current re-trained classifier (Eq. 3); the
server averages them over the clients holding the class (Eq. 4) and optimises a small set of
learnable, class-balanced "federated features" so that their gradients (Eq. 5) match the real
ones in cosine (Eq. 6); a classifier re-trained on them (Eq. 7, :mod:`.retrain`) then follows
the path of one re-trained on the real features.

A class's gradient is stored as a ``C x (d+1)`` matrix: row ``j`` is ``[dL/dW_j, dL/db_j]``,
the weight gradient of classifier row ``j`` with the bias gradient appended as a last column,
so one tensor carries both. How the bias enters the cosines of Eq. 6 is :func:`matching_loss`'s
``bias``: by default as the authors' code, one extra item next to the C weight rows.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fedlt.calibration.math.stats import validate_features

COSINE_EPS = 1e-8
"""Lower bound on each row norm in the cosine of Eq. 6.

It only acts on rows of norm below 1e-8, i.e. (numerically) zero rows, whose cosine becomes 0
and dissimilarity 1 instead of NaN; clamping each norm separately, rather than adding eps to
their product, leaves the cosine of small but genuine gradients (a confident classifier's)
untouched.
"""

GRADIENT_CHUNK_ELEMENTS = 1 << 24
"""Bound on the size of the per-sample outer products built at once by :func:`per_class_gradients`."""


def _check_classifier(weight: torch.Tensor, bias: torch.Tensor, num_classes: int, dim: int) -> None:
    if weight.shape != (num_classes, dim) or bias.shape != (num_classes,):
        raise ValueError(
            f"classifier must be ({num_classes}, {dim}) and ({num_classes},), "
            f"got {tuple(weight.shape)} and {tuple(bias.shape)}"
        )


def held_class_gradients(
    weight: torch.Tensor, bias: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 3 for the classes the labels hold: those classes (k,) and their mean CE gradients w.r.t.
    the classifier, ``(k, C, d+1)``, the size of a client's message (a ``C x C x (d+1)`` tensor
    would be gigabytes at a thousand classes, mostly for classes the client does not hold).

    For one sample, ``dCE/dlogits = softmax - onehot`` and the gradient of row ``j`` is that
    residual's ``j``-th entry times ``[z, 1]``; the per-class means are accumulated with
    ``index_add_`` over chunks of samples (bounding memory to ``GRADIENT_CHUNK_ELEMENTS``).
    """
    validate_features(features, labels, num_classes)
    _check_classifier(weight, bias, num_classes, features.shape[1])
    z = features.detach().to(torch.float32)
    w = weight.detach().to(device=z.device, dtype=torch.float32)
    b = bias.detach().to(device=z.device, dtype=torch.float32)
    residual = torch.softmax(z @ w.T + b, dim=1) - F.one_hot(labels, num_classes).to(torch.float32)
    z1 = torch.cat([z, torch.ones_like(z[:, :1])], dim=1)
    classes, slot = torch.unique(labels, return_inverse=True)
    grads = torch.zeros(classes.numel(), num_classes, z1.shape[1], dtype=torch.float32, device=z.device)
    chunk = max(1, GRADIENT_CHUNK_ELEMENTS // (num_classes * z1.shape[1]))
    for start in range(0, z.shape[0], chunk):
        stop = start + chunk
        grads.index_add_(0, slot[start:stop], residual[start:stop, :, None] * z1[start:stop, None, :])
    count = torch.bincount(slot, minlength=classes.numel())
    return classes, grads / count.to(torch.float32)[:, None, None]


def per_class_gradients(
    weight: torch.Tensor, bias: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`held_class_gradients` in the ``(C, C, d+1)`` layout (zeros for absent classes) with
    the ``present`` (C,) mask."""
    classes, held = held_class_gradients(weight, bias, features, labels, num_classes)
    grads = held.new_zeros(num_classes, *held.shape[1:])
    present = torch.zeros(num_classes, dtype=torch.bool, device=held.device)
    grads[classes], present[classes] = held, True
    return grads, present


def aggregate_held_gradients(
    client_gradients: Iterable[tuple[torch.Tensor, torch.Tensor]], num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 4: per class, the unweighted mean of the gradients of the clients that hold it.

    Unweighted by design: clients send no class counts (part of CReFF's privacy argument). Each
    client's ``(classes, grads)`` (:func:`held_class_gradients`) is added in place, so the memory
    is one ``(C, C, d+1)`` sum, not one per client. Returns ``g_agg`` (C, C, d+1), zero for classes
    no client holds, and ``present_any`` (C,).
    """
    total = holders = None
    for classes, grads in client_gradients:
        if total is None:
            total = grads.new_zeros(num_classes, *grads.shape[1:])
            holders = torch.zeros(num_classes, dtype=grads.dtype, device=grads.device)
        if grads.shape[1:] != total.shape[1:] or classes.shape != grads.shape[:1]:
            raise ValueError(f"client gradients {tuple(grads.shape)} of {classes.numel()} classes do not match "
                             f"{tuple(total.shape)}")
        classes = classes.to(total.device)
        total.index_add_(0, classes, grads.to(total.device))
        holders.index_add_(0, classes, torch.ones_like(classes, dtype=total.dtype))
    if total is None:
        raise ValueError("aggregate_gradients needs at least one client's gradients")
    return total.div_(holders.clamp_min(1)[:, None, None]), holders > 0


def aggregate_gradients(
    client_gradients: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`aggregate_held_gradients` of gradients in the ``(C, C, d+1)`` layout with their masks."""
    if not client_gradients:
        raise ValueError("aggregate_gradients needs at least one client's gradients")
    shape = client_gradients[0][0].shape
    for grads, present in client_gradients:
        if grads.shape != shape or present.shape != shape[:1]:
            raise ValueError(f"client gradients {tuple(grads.shape)} do not match {tuple(shape)}")
    held = ((present.nonzero().flatten(), grads[present]) for grads, present in client_gradients)
    return aggregate_held_gradients(held, shape[0])


BIAS_TERMS = ("released", "row", "weights")
"""How the bias gradient enters Eq. 6 (:func:`matching_loss`)."""


def _dissimilarity(fed: torch.Tensor, agg: torch.Tensor) -> torch.Tensor:
    """``1 - cos`` along the last dimension (see ``COSINE_EPS``)."""
    dot = (fed * agg).sum(dim=-1)
    return 1.0 - dot / (fed.norm(dim=-1).clamp_min(COSINE_EPS) * agg.norm(dim=-1).clamp_min(COSINE_EPS))


def matching_loss(g_fed: torch.Tensor, g_agg: torch.Tensor, classes: torch.Tensor | Sequence[int],
                  bias: str = "released") -> torch.Tensor:
    """Eq. 6 summed over ``classes``: ``sum_c (1/C) sum_j (1 - cos(g_fed[c, j], g_agg[c, j]))``.

    Each class contributes the paper's ``D`` (a mean over the ``C`` classifier rows); classes are
    summed, as in the paper's objective over all classes, so the loss scale grows with the number
    of classes matched. ``classes`` is a list of class indices or a (C,) bool mask. See
    ``COSINE_EPS`` for zero rows. Differentiable w.r.t. ``g_fed``.

    ``bias`` (the last column of the ``(C, C, d+1)`` layout): ``released``, the authors' code: the
    rows are the weight gradients alone and the bias gradient (a C-vector) is one more term, so a
    class contributes ``(sum_j (1 - cos_j) + (1 - cos_bias)) / C`` and an lr of ``0.1 C`` on it is
    exactly the released code's step at lr 0.1; ``row``: the bias gradient is one more column of
    every row (fedlt's earlier reading); ``weights``: the paper's ``C x d`` gradient, the bias
    left out.
    """
    if g_fed.shape != g_agg.shape or g_fed.dim() != 3:
        raise ValueError(f"expected two (C, C, d+1) gradients, got {tuple(g_fed.shape)} and {tuple(g_agg.shape)}")
    if bias not in BIAS_TERMS:
        raise ValueError(f"bias must be one of {BIAS_TERMS}, got {bias!r}")
    index = torch.as_tensor(classes, device=g_fed.device)
    index = torch.nonzero(index).flatten() if index.dtype == torch.bool else index.long()
    fed, agg = g_fed[index], g_agg[index].to(g_fed.dtype)
    if bias == "row":
        return _dissimilarity(fed, agg).mean(dim=-1).sum()
    rows = _dissimilarity(fed[..., :-1], agg[..., :-1])  # (k, C): the weight rows
    if bias == "weights":
        return rows.mean(dim=-1).sum()
    return ((rows.sum(dim=-1) + _dissimilarity(fed[..., -1], agg[..., -1])) / rows.shape[-1]).sum()


class FederatedFeatures:
    """CReFF's learnable federated features ``S`` (C, m, d) and their persistent optimiser.

    The features are created once (standard normal, from ``generator``) and refined every round
    by :meth:`match`; one SGD optimiser lives across rounds so its momentum carries over, and
    :meth:`state_dict` checkpoints both. The default ``momentum`` 0.5 is the feature optimiser of
    gradient-matching dataset condensation (Zhao et al., ICLR 2021), whose matching loss CReFF
    adopts; CReFF's calibrator passes its own knobs (plain SGD, as the paper and its code). The
    authors' code sums the cosine dissimilarities over the C rows where Eq. 6 (and
    :func:`matching_loss`) averages them, so its lr of 0.1 corresponds to ``feature_lr = 0.1 * C``
    here. Classes absent from a round get no matching gradient (only residual momentum moves them).
    """

    def __init__(
        self,
        num_classes: int,
        per_class: int,
        dim: int,
        generator: torch.Generator,
        *,
        feature_lr: float = 0.1,
        momentum: float = 0.5,
        device: torch.device | str | None = None,
    ) -> None:
        if num_classes < 1 or per_class < 1 or dim < 1:
            raise ValueError(f"need num_classes, per_class, dim >= 1, got {num_classes}, {per_class}, {dim}")
        init = torch.randn(num_classes, per_class, dim, generator=generator, device=generator.device)
        self.features = init.to(device if device is not None else generator.device).requires_grad_(True)
        self.optimizer = torch.optim.SGD([self.features], lr=feature_lr, momentum=momentum)

    def gradients(self, weight: torch.Tensor, bias: torch.Tensor, classes: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 5 for ``classes`` (default: every class): ``g_fed`` (k, C, d+1), differentiable
        w.r.t. the features.

        The fixed classifier is copied once per class (``k`` independent copies), so a single
        ``autograd.grad`` of the summed per-class losses yields each class's own gradient;
        ``create_graph=True`` keeps the graph for differentiating the matching loss.
        """
        num_classes, per_class, dim = self.features.shape
        _check_classifier(weight, bias, num_classes, dim)
        device = self.features.device
        classes = torch.arange(num_classes, device=device) if classes is None else classes.to(device)
        k = classes.numel()
        w = weight.detach().to(device=device, dtype=torch.float32).repeat(k, 1, 1).requires_grad_(True)
        b = bias.detach().to(device=device, dtype=torch.float32).repeat(k, 1).requires_grad_(True)
        with torch.enable_grad():
            logits = torch.baddbmm(b[:, None, :], self.features[classes], w.transpose(1, 2))
            targets = classes.repeat_interleave(per_class)
            losses = F.cross_entropy(logits.reshape(-1, num_classes), targets, reduction="none")
            grad_w, grad_b = torch.autograd.grad(losses.view(k, per_class).mean(dim=1).sum(), (w, b),
                                                 create_graph=True)
        return torch.cat([grad_w, grad_b[:, :, None]], dim=2)

    def _class_chunks(self, present: torch.Tensor) -> list[torch.Tensor]:
        """The present classes in chunks whose gradients and logits stay near ``GRADIENT_CHUNK_ELEMENTS``
        values: Eq. 6 is a sum over classes, each depending on its own features only, so chunks
        give the same step while the memory stays bounded at any number of classes."""
        num_classes, per_class, dim = self.features.shape
        size = max(1, GRADIENT_CHUNK_ELEMENTS // (num_classes * (dim + 1 + per_class)))
        return list(present.nonzero().flatten().split(size))

    def _matching_loss(self, weight: torch.Tensor, bias: torch.Tensor, target: torch.Tensor,
                       present: torch.Tensor, bias_term: str, backward: bool) -> float:
        """Eq. 6 over the present classes, chunk by chunk, its gradient accumulated when ``backward``."""
        total = 0.0
        for chunk in self._class_chunks(present):
            loss = matching_loss(self.gradients(weight, bias, chunk), target[chunk],
                                 torch.ones(chunk.numel(), dtype=torch.bool, device=chunk.device), bias_term)
            if backward:
                loss.backward(inputs=[self.features])
            total += float(loss.detach())
        return total

    def match(
        self, weight: torch.Tensor, bias: torch.Tensor, g_agg: torch.Tensor, present: torch.Tensor, steps: int,
        bias_term: str = "released",
    ) -> float:
        """Optimise the features for ``steps`` steps on Eq. 6 against ``g_agg`` for the present classes.

        ``(weight, bias)`` is the classifier the clients' gradients were computed with, held
        fixed; ``bias_term`` is :func:`matching_loss`'s ``bias``. Returns the matching loss of the
        features after the last step.
        """
        device = self.features.device
        present = present.to(device)
        if not bool(present.any()):
            raise ValueError("no class is present: there is nothing to match")
        target = g_agg.detach().to(device=device, dtype=torch.float32)
        with torch.enable_grad():
            for _ in range(steps):
                self.optimizer.zero_grad(set_to_none=True)
                self._matching_loss(weight, bias, target, present, bias_term, backward=True)
                self.optimizer.step()
            return self._matching_loss(weight, bias, target, present, bias_term, backward=False)

    def features_and_labels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The features as a (C*m, d) training set, class-major, with their int64 labels."""
        num_classes, per_class, dim = self.features.shape
        labels = torch.arange(num_classes, device=self.features.device).repeat_interleave(per_class)
        return self.features.detach().reshape(-1, dim).clone(), labels

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of the features and optimiser state (momentum buffers), for checkpoints.

        Deep-copied: ``Optimizer.state_dict`` returns the live buffers, which later steps would
        modify in place.
        """
        return {"features": self.features.detach().clone(), "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` snapshot into these features (same shape) and optimiser."""
        features = state["features"]
        if features.shape != self.features.shape:
            raise ValueError(f"checkpointed features {tuple(features.shape)} do not match {tuple(self.features.shape)}")
        with torch.no_grad():
            self.features.copy_(features)
        self.optimizer.load_state_dict(state["optimizer"])
