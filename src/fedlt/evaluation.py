"""Evaluation protocol: balanced test accuracy with many/medium/few-shot groups, per-class
accuracy, and personalized accuracy on local test sets.

Shot groups are defined on the *training* counts of the federation, and the rule used is
returned as text so every report states it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedlt import fused
from fedlt.config import EvalConfig
from fedlt.data.dataset import ImageDataset
from fedlt.errors import ConfigError
from fedlt.models.base import FedModel

GROUPS = ("many", "medium", "few")
#: the accuracy figures of one model on one evaluation set; on the validation set each is prefixed ``val_``
HEADLINE_METRICS = ("acc", "many_acc", "medium_acc", "few_acc", "loss")


@dataclass
class ShotGroups:
    classes: dict[str, list[int]]
    rule: str


def shot_groups(train_counts: np.ndarray, cfg: EvalConfig, client_counts: np.ndarray | None = None,
                test_size: int = 0) -> ShotGroups:
    """Split classes into many/medium/few-shot by their training-sample counts.

    ``count`` rule: many > many_threshold >= medium >= few_threshold > few, with defaults from our
    papers: 100/20 for 100+ classes (CIFAR-100, ImageNet-LT), 1000/200 otherwise (SFD's CIFAR-10).
    ``cumulative`` rule (FedLoGe's text): classes sorted by count; those before 75% of all samples
    are many-shot, before 95% medium, the rest few. ``cumulative_local`` (FedLoGe's released code):
    the same shares of what the clients' local test sets would hold of each class, client k's
    ``floor(n_kc / N * test_size)``: the floors drop classes spread thinly over clients, which
    moves classes from many to few (``client_counts``: the (K, C) partition counts).
    """
    counts = np.asarray(train_counts)
    c = len(counts)
    if cfg.shot_rule in ("cumulative", "cumulative_local"):
        of = "training count"
        if cfg.shot_rule == "cumulative_local":
            if client_counts is None:
                raise ConfigError("eval.shot_rule=cumulative_local needs every client's class counts, which a real "
                                  "federation's server does not hold; use eval.shot_rule=cumulative")
            shares = np.asarray(client_counts, dtype=np.float64) / max(int(np.sum(client_counts)), 1)
            counts = np.floor(shares * test_size).astype(np.int64).sum(axis=0)  # the code's int(n_kc / N * size)
            if counts.sum() == 0:  # every group would be many-shot: nothing to split by
                raise ConfigError(f"eval.shot_rule=cumulative_local: each client's share of a test set of {test_size} "
                                  "images floors to 0 images of every class, so no class has a local test total; "
                                  "use eval.shot_rule=cumulative")
            of = f"its clients' local test sets (floor(n_kc / N x {test_size}) summed over clients)"
        order = np.argsort(-counts, kind="stable")
        before = np.concatenate([[0], np.cumsum(counts[order])[:-1]]) / max(counts.sum(), 1)
        label = np.where(before < 0.75, 0, np.where(before < 0.95, 1, 2))
        groups = {g: sorted(int(k) for k in order[label == i]) for i, g in enumerate(GROUPS)}
        return ShotGroups(groups, f"{cfg.shot_rule}: classes sorted by {of}; many = first 75% of samples, "
                                  "medium = up to 95%, few = the rest")
    default_many, default_few = (100, 20) if c >= 100 else (1000, 200)
    many_t = cfg.many_threshold if cfg.many_threshold is not None else default_many
    few_t = cfg.few_threshold if cfg.few_threshold is not None else default_few
    if few_t > many_t:  # else a class with few_t > count > many_t would be both many- and few-shot
        raise ConfigError(
            f"eval.few_threshold={few_t} is above eval.many_threshold={many_t} (unset ones default to "
            f"{default_few} and {default_many} for {c} classes); set eval.few_threshold <= eval.many_threshold"
        )
    groups = {
        "many": [k for k in range(c) if counts[k] > many_t],
        "medium": [k for k in range(c) if few_t <= counts[k] <= many_t],
        "few": [k for k in range(c) if counts[k] < few_t],
    }
    return ShotGroups(groups, f"count: many > {many_t}, medium {few_t}..{many_t}, few < {few_t} training samples per class")


@torch.no_grad()
def predict(model: torch.nn.Module, data: ImageDataset, batch_size: int, indices: torch.Tensor | None = None,
            features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample (correct: bool, loss: float) of ``model`` on ``data`` (optionally a subset);
    ``features``: every image's encoder features (:class:`SharedEncoderFeatures`), to which only the
    model's head is applied."""
    model.eval()
    rows = torch.arange(len(data), device=data.labels.device) if indices is None else indices
    correct, losses = [], []
    for start in range(0, rows.numel(), batch_size):
        idx = rows[start:start + batch_size]
        if features is None:
            logits = model(data.normalize(data.images[idx]))
        else:
            logits = model.forward_head(features[idx])
        y = data.labels[idx]
        correct.append(logits.argmax(1) == y)
        losses.append(F.cross_entropy(logits.float(), y, reduction="none"))
    if not correct:
        empty = torch.zeros(0, device=rows.device)
        return empty.bool(), empty
    return torch.cat(correct), torch.cat(losses)


class SharedEncoderFeatures:
    """The evaluation set's encoder features, made once for the models that share an encoder.

    The models an evaluation compares often differ only in their heads: a calibration changes only
    the global model's, and FedRep, FedPer, FedRoD and FedLoGe personalize only heads. Their set goes
    through the shared encoder once, in batches of ``eval.batch_size`` from its first image (as
    :func:`predict` batches the whole set), and each model applies its head to its rows. Which models
    take this path never depends on what was evaluated before (a worker process sees its own clients),
    so a figure is the same on every backend; an image's features can differ in the last bit from
    those of a batch of another size (a CPU's kernels for a few images round differently), so a
    local test set's predictions equal its whole model's up to float rounding. What it holds (the
    set's features, images x feature width, and a copy of the encoder) is freed when the evaluation
    phase ends (in a worker process, at its next other message).
    """

    def __init__(self) -> None:
        self._encoder: tuple[type, list[torch.Tensor]] | None = None
        self._features: torch.Tensor | None = None

    def clear(self) -> None:
        self._encoder = self._features = None

    def of(self, model: FedModel, data: ImageDataset, batch_size: int) -> torch.Tensor:
        """``data``'s features under ``model``'s encoder (made unless the last call's encoder was equal);
        ``model`` must be one that :func:`head_of_features` accepts."""
        kind, encoder = type(model.encoder), list(model.encoder.state_dict(keep_vars=True).values())
        if self._encoder is None or self._encoder[0] is not kind or not equal(encoder, self._encoder[1]):
            self._encoder, self._features = (kind, fused.clones(encoder)), None
        if self._features is None:
            self._features = encode(model, data, batch_size)
        return self._features


def head_of_features(model: torch.nn.Module) -> bool:
    """Whether ``model``'s logits are its head applied to its encoder's features, an image's features
    independent of the other images of its batch (no batch statistics in eval mode), uncompiled."""
    cls = type(model)
    return (cls.forward is FedModel.forward and cls.forward_features is FedModel.forward_features
            and getattr(model, "_compiled_call_impl", None) is None
            and not any(isinstance(m, nn.modules.batchnorm._BatchNorm) and not m.track_running_stats
                        for m in model.encoder.modules()))


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether the tensors are equal pair by pair (NaN never equals): one wait for a device, not one a pair."""
    if len(a) != len(b) or any(x.shape != y.shape or x.dtype != y.dtype for x, y in zip(a, b)):
        return False
    if not a:
        return True
    differs = [(x != y.to(x.device)).any() for x, y in zip(a, b)]
    return not bool(torch.stack([d.to(differs[0].device) for d in differs]).any())


@torch.no_grad()
def encode(model: FedModel, data: ImageDataset, batch_size: int) -> torch.Tensor:
    """Every image's encoder features, in eval mode, in batches of ``batch_size``."""
    model.eval()
    if not len(data):
        return torch.zeros(0, model.feature_dim, device=data.images.device)
    return torch.cat([model.forward_features(data.normalize(data.images[i:i + batch_size]))
                      for i in range(0, len(data), batch_size)])


def global_metrics(correct: torch.Tensor, losses: torch.Tensor, labels: torch.Tensor, groups: ShotGroups,
                   num_classes: int, accuracy: str = "class_mean") -> dict:
    """Overall / per-class / shot-group accuracy (in %) and mean loss on the test set. ``acc`` is the
    plain accuracy on a balanced set; on a set whose classes differ in size (SVHN's own test split) it
    is the mean of the per-class accuracies, the figure a balanced set of those classes would give,
    unless ``accuracy="top1"`` (``eval.accuracy``) asks for the plain share of images classified right."""
    hits = torch.bincount(labels, weights=correct.double(), minlength=num_classes)
    totals = torch.bincount(labels, minlength=num_classes).double()
    per_class = (100 * hits / totals.clamp(min=1)).cpu().tolist()
    measured = [a for a, n in zip(per_class, totals.tolist()) if n > 0]
    balanced = totals[totals > 0].unique().numel() <= 1
    out = {
        "acc": 100 * correct.double().mean().item() if balanced or accuracy == "top1" else float(np.mean(measured)),
        "loss": losses.double().mean().item(),
        "per_class_acc": [round(a, 4) for a in per_class],
    }
    for name, classes in groups.classes.items():
        out[f"{name}_acc"] = float(np.mean([per_class[k] for k in classes])) if classes else None
    return out


def per_class_counts(correct: torch.Tensor, losses: torch.Tensor, labels: torch.Tensor, num_classes: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(correct, samples, loss sum) per class, float64: what a node reports of one model on its own
    test split, so that sums over nodes give the federation's figures."""
    hits = torch.bincount(labels, weights=correct.double(), minlength=num_classes)
    totals = torch.bincount(labels, minlength=num_classes).double()
    loss = torch.bincount(labels, weights=losses.double(), minlength=num_classes)
    return hits, totals, loss


def count_metrics(hits: torch.Tensor, totals: torch.Tensor, loss: torch.Tensor, groups: ShotGroups,
                  accuracy: str = "class_mean") -> dict:
    """:func:`global_metrics` from per-class sums (federated evaluation). ``acc`` is the mean of the
    per-class accuracies over the classes that have test samples: on a balanced test set it is the
    same figure as the plain accuracy, on the nodes' own (unbalanced) test splits it weighs every
    class equally as a balanced test set would; ``accuracy="top1"``: the pooled share classified right."""
    present = totals > 0
    per_class = (100 * hits / totals.clamp(min=1)).cpu().tolist()
    class_mean = float(np.mean([a for a, p in zip(per_class, present.tolist()) if p])) if present.any() else None
    out = {
        "acc": (100 * hits.sum() / totals.sum()).item() if present.any() and accuracy == "top1" else class_mean,
        "loss": (loss.sum() / totals.sum()).item() if present.any() else None,
        "per_class_acc": [round(a, 4) for a in per_class],
    }
    for name, classes in groups.classes.items():
        seen = [per_class[k] for k in classes if present[k]]
        out[f"{name}_acc"] = float(np.mean(seen)) if seen else None
    return out


def validation_metrics(model: torch.nn.Module, val: ImageDataset, groups: ShotGroups, batch_size: int,
                       features: torch.Tensor | None = None) -> dict:
    """``val_acc`` and the shot groups' ``val_*_acc`` of ``model`` on the validation set: what
    choices are made on, so that the test set is read once. ``features``: as :func:`predict`'s."""
    return validation_figures(*predict(model, val, batch_size, features=features), val, groups)


def validation_figures(correct: torch.Tensor, losses: torch.Tensor, val: ImageDataset, groups: ShotGroups) -> dict:
    """:func:`validation_metrics` from a model's per-sample predictions on the validation set."""
    metrics = global_metrics(correct, losses, val.labels, groups, val.num_classes)
    return {f"val_{k}": metrics[k] for k in HEADLINE_METRICS}


def local_accuracy(correct: torch.Tensor) -> float | None:
    """One client's accuracy in percent on its local set (None when the set is empty)."""
    return 100 * correct.double().mean().item() if correct.numel() else None


def mean_local_accuracy(correct_per_client: list[torch.Tensor]) -> float | None:
    """Personalized accuracy: the arithmetic mean over clients (with a local test set) of their accuracy."""
    accs = [local_accuracy(c) for c in correct_per_client if c.numel() > 0]
    return float(np.mean(accs)) if accs else None


def mean_of_summed_accuracies(replies: list, prefix: str, suffix: str = "") -> float | None:
    """The mean over clients of the accuracies their replies carry as ``PREFIX_sumSUFFIX`` (100 x
    accuracy) and ``PREFIX_nSUFFIX`` (1, or 0 for a client without the local set). A reply is one
    client's or the secure sum of several; either way the sums over the count, which for one client
    a reply is :func:`mean_local_accuracy`'s mean to the last digit."""
    sums, counts = f"{prefix}_sum{suffix}", f"{prefix}_n{suffix}"
    answered = [r.payload for r in replies if float(r.payload.get(counts, 0)) > 0]
    if not answered:
        return None
    total = np.add.reduce(np.array([float(p[sums]) for p in answered], dtype=np.float64))
    return float(total / sum(float(p[counts]) for p in answered))


def personalized_figures(replies: list, with_val: bool) -> dict:
    """``pm_acc`` (and ``val_pm_acc`` where the run has local validation sets) from the clients'
    evaluation replies (their summable accuracy entries, or one secure sum of them), ``pm_nonfinite``
    where some clients' personalized models are NaN, and ``pm_variants``: the same for each other
    personal reading they answered (``pm_sum/NAME``)."""
    def figures(suffix: str) -> dict:
        out = {"pm_acc": mean_of_summed_accuracies(replies, "pm", suffix)}
        if with_val:
            out["val_pm_acc"] = mean_of_summed_accuracies(replies, "val_pm", suffix)
        nonfinite = round(sum(float(r.payload.get(f"pm_nonfinite{suffix}", 0)) for r in replies))
        if nonfinite:
            out["pm_nonfinite"] = nonfinite
        return out

    names = sorted({k.removeprefix("pm_sum/") for r in replies for k in r.payload if k.startswith("pm_sum/")})
    out = figures("")
    if names:
        out["pm_variants"] = {name: figures("/" + name) for name in names}
    return out
