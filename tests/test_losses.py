"""Losses against numbers worked out by hand with math.log/exp."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedlt.errors import ConfigError
from fedlt.losses import (
    LOSSES,
    balanced_softmax,
    cross_entropy,
    focal_loss,
    ldam_loss,
    ldam_margins,
    logit_adjusted_ce,
    make_loss,
)

PRIOR = (0.7, 0.2, 0.1)
COUNTS = (1000, 100, 10)


def t(rows: list[list[float]], grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=grad)


def y(*labels: int) -> torch.Tensor:
    return torch.tensor(labels, dtype=torch.int64)


def hand_ce(row: list[float], label: int) -> float:
    return math.log(sum(math.exp(v) for v in row)) - row[label]


def random_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 3, generator=g, dtype=torch.float64) * 3, torch.randint(0, 3, (16,), generator=g)


def test_cross_entropy_hand_value() -> None:
    # sample 0: log(e + e^2 + 1) - 2; sample 1: log(e^0.5 + e^-1 + e^3) - 3
    expected = (
        math.log(math.e + math.e**2 + 1) - 2 + math.log(math.exp(0.5) + math.exp(-1) + math.exp(3)) - 3
    ) / 2
    assert cross_entropy(t([[1, 2, 0], [0.5, -1, 3]]), y(1, 2)).item() == pytest.approx(expected, rel=1e-12)


def test_logit_adjustment_special_cases() -> None:
    logits, labels = random_batch()
    ce = cross_entropy(logits, labels)
    assert logit_adjusted_ce(logits, labels, PRIOR, tau=1.0).item() == pytest.approx(
        balanced_softmax(logits, labels, PRIOR).item(), rel=1e-12
    )
    assert logit_adjusted_ce(logits, labels, (1 / 3, 1 / 3, 1 / 3)).item() == pytest.approx(ce.item(), rel=1e-6)
    assert logit_adjusted_ce(logits, labels, PRIOR, tau=0.0).item() == pytest.approx(ce.item(), rel=1e-12)
    # the prior is normalised first, so raw counts give the same loss
    assert logit_adjusted_ce(logits, labels, (70, 20, 10)).item() == pytest.approx(
        logit_adjusted_ce(logits, labels, PRIOR).item(), rel=1e-6
    )


def test_logit_adjustment_hand_values() -> None:
    # exp(z_c + tau*log p_c) = p_c^tau * exp(z_c); logits (1, 2, 0), target 0
    e = math.e
    tau1 = math.log(0.7 * e + 0.2 * e**2 + 0.1) - math.log(0.7 * e)
    tau_half = math.log(0.7**0.5 * e + 0.2**0.5 * e**2 + 0.1**0.5) - math.log(0.7**0.5 * e)
    assert logit_adjusted_ce(t([[1, 2, 0]]), y(0), PRIOR).item() == pytest.approx(tau1, rel=1e-6)
    assert logit_adjusted_ce(t([[1, 2, 0]]), y(0), PRIOR, tau=0.5).item() == pytest.approx(tau_half, rel=1e-6)


@pytest.mark.parametrize("name", ["la", "bsm"])
def test_zero_prior_entry_is_finite(name: str) -> None:
    loss_fn = make_loss(name, prior=(0.5, 0.5, 0.0))
    logits = t([[1, 2, 0], [0, 1, 5]], grad=True)
    loss = loss_fn(logits, y(0, 2))  # second target is the absent class itself
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(logits.grad).all()
    # the absent class is pushed out of the softmax, so its logit gets ~no gradient from sample 0
    assert abs(logits.grad[0, 2].item()) < 1e-6


def test_focal_gamma_zero_is_ce() -> None:
    logits, labels = random_batch()
    assert focal_loss(logits, labels, gamma=0.0).item() == pytest.approx(cross_entropy(logits, labels).item(), rel=1e-12)


def test_focal_hand_value() -> None:
    # logits (0, ln 3): p = (1/4, 3/4)
    row = [0.0, math.log(3)]
    expected = (-(0.25**2) * math.log(0.75) - (0.75**2) * math.log(0.25)) / 2
    assert focal_loss(t([row, row]), y(1, 0), gamma=2.0).item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0, 5.0])
def test_focal_below_ce(gamma: float) -> None:
    logits, labels = random_batch()
    for i in range(len(labels)):
        row, label = logits[i : i + 1], labels[i : i + 1]
        assert focal_loss(row, label, gamma).item() <= cross_entropy(row, label).item()
    assert focal_loss(logits, labels, gamma).item() < cross_entropy(logits, labels).item()


def test_focal_confident_sample_has_finite_grad() -> None:
    # p_t rounds to exactly 1; d/dx x^0.5 is infinite at 0 and must not leak a NaN
    logits = torch.tensor([[60.0, 0.0]], requires_grad=True)
    focal_loss(logits, y(0), gamma=0.5).backward()
    assert torch.isfinite(logits.grad).all()


def test_ldam_margins() -> None:
    m = ldam_margins(COUNTS, max_margin=0.5)
    assert m.max().item() == 0.5
    assert m[2].item() == 0.5
    expected = [0.5 * (10 / n) ** 0.25 for n in COUNTS]
    assert m.tolist() == pytest.approx(expected, rel=1e-6)
    ratios = (m * torch.tensor(COUNTS, dtype=torch.float32) ** 0.25).tolist()
    assert ratios == pytest.approx([ratios[0]] * 3, rel=1e-6)


def test_ldam_zero_count_gets_max_margin() -> None:
    assert ldam_margins((100, 0, 10), max_margin=0.4).tolist() == pytest.approx([0.4 * 0.1**0.25, 0.4, 0.4])


def test_ldam_margins_come_from_the_present_classes_packed() -> None:
    """The present classes' margins are their counts' arithmetic (in float64, rounded once to float32)
    whatever the absent classes between them; an absent class gets max_margin. (On the AVX512 CPU
    measured, a count's float64 power does not depend on its place in a SIMD vector, so there this
    cannot tell packed from unpacked: FedLC's float32 twin in test_fedyoyo.py can.)"""
    counts = np.arange(100) % 7 * 13  # every seventh class absent
    n = torch.from_numpy(counts[counts > 0]).double()
    packed = (0.5 * (n.pow(-0.25) / n.pow(-0.25).max())).float()
    margins = ldam_margins(counts, max_margin=0.5)
    assert torch.equal(margins[torch.from_numpy(counts > 0)], packed) and bool((margins[counts == 0] == 0.5).all())


def test_ldam_hand_value_and_only_target_shifted() -> None:
    # target 2 has margin 0.5: scaled logits 30 * (0.2, 0.1, -0.3 - 0.5) = (6, 3, -24)
    logits = t([[0.2, 0.1, -0.3]], grad=True)
    loss = ldam_loss(logits, y(2), COUNTS, max_margin=0.5, scale=30.0)
    assert loss.item() == pytest.approx(math.log(math.exp(6) + math.exp(3) + math.exp(-24)) + 24, rel=1e-6)
    loss.backward()
    z = sum(math.exp(v) for v in (6, 3, -24))
    q = [math.exp(v) / z for v in (6, 3, -24)]
    expected_grad = [30 * q[0], 30 * q[1], 30 * (q[2] - 1)]
    assert logits.grad[0].tolist() == pytest.approx(expected_grad, rel=1e-6)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_builder_matches_functions_and_grads_flow(name: str) -> None:
    logits, labels = random_batch(1)
    logits.requires_grad_(True)
    direct = {
        "ce": lambda: cross_entropy(logits, labels),
        "la": lambda: logit_adjusted_ce(logits, labels, PRIOR, tau=0.7),
        "bsm": lambda: balanced_softmax(logits, labels, PRIOR),
        "focal": lambda: focal_loss(logits, labels, gamma=1.5),
        "ldam": lambda: ldam_loss(logits, labels, COUNTS, max_margin=0.3, scale=10.0),
    }[name]()
    built = make_loss(
        name, prior=PRIOR, class_counts=COUNTS, tau=0.7, focal_gamma=1.5, ldam_max_margin=0.3, ldam_scale=10.0
    )(logits, labels)
    assert built.item() == pytest.approx(direct.item(), rel=1e-12)
    built.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert logits.grad.abs().sum().item() > 0


def test_unknown_name_is_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        make_loss("softmax")
    msg = str(info.value)
    assert "\n" not in msg and "'softmax'" in msg and "loss.name=" in msg
    assert all(name in msg for name in LOSSES)


@pytest.mark.parametrize("name", ["la", "bsm"])
def test_missing_prior_raises(name: str) -> None:
    with pytest.raises(ValueError, match="prior"):
        make_loss(name)


def test_missing_counts_raises() -> None:
    with pytest.raises(ValueError, match="class_counts"):
        make_loss("ldam")


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="prior"):
        make_loss("la", prior=(0.5, -0.1, 0.6))
    with pytest.raises(ValueError, match="log-prior"):
        make_loss("bsm", prior=(0.5, 0.5))(t([[1, 2, 0]]), y(0))
    with pytest.raises(ValueError, match="targets"):
        cross_entropy(t([[1, 2, 0]]), torch.tensor([0], dtype=torch.int32))
