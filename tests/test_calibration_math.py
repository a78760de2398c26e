"""Calibration math (CCVR/FedNCM statistics, Fed3R, tau-norm, virtual features, re-training,
CReFF) checked against independent computations: torch.cov, lstsq, per-class autograd."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedlt.calibration.math import creff
from fedlt.calibration.math.classifiers import ncm_classifier, ridge_classifier, ridge_sums, tau_normalize
from fedlt.calibration.math.creff import (
    FederatedFeatures,
    aggregate_gradients,
    aggregate_held_gradients,
    held_class_gradients,
    matching_loss,
    per_class_gradients,
)
from fedlt.calibration.math.retrain import linear_init, retrain_linear
from fedlt.calibration.math.stats import add_sums, class_feature_sums, class_moments, merge_sums
from fedlt.calibration.math.virtual import sample_class_gaussians


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: intra-op threads only add synchronisation, which stalls badly
    (100x) when another process holds one of the machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def blobs(
    num_classes: int, dim: int, per_class: int | list[int], scale: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian blobs: class centres ~ N(0, scale^2 I), unit-variance noise around them."""
    g = gen(seed)
    centers = torch.randn(num_classes, dim, generator=g) * scale
    counts = per_class if isinstance(per_class, list) else [per_class] * num_classes
    labels = torch.repeat_interleave(torch.arange(num_classes), torch.tensor(counts))
    return centers[labels] + torch.randn(labels.shape[0], dim, generator=g), labels


def accuracy(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((x @ weight.T + bias).argmax(dim=1) == y).float().mean())


# Classes 0..3 with 40, 25, 1 and 0 samples: covers the count <= 1 cases.
COUNTS = [40, 25, 1, 0]


@pytest.fixture
def data() -> tuple[torch.Tensor, torch.Tensor]:
    return blobs(4, 6, COUNTS, scale=3.0, seed=0)


@pytest.fixture
def shards(data) -> list[torch.Tensor]:
    perm = torch.randperm(data[1].shape[0], generator=gen(1))
    return [perm[:10], perm[10:45], perm[45:]]


# ---------------------------------------------------------------- stats


def test_sums_merged_over_shards_equal_pooled_sums(data, shards):
    x, y = data
    merged = merge_sums([class_feature_sums(x[s], y[s], 4) for s in shards])
    pooled = class_feature_sums(x, y, 4)
    assert merged.keys() == pooled.keys() == {"count", "sum", "sum_outer"}
    assert all(v.dtype == torch.float64 for v in pooled.values())
    assert merged["count"].tolist() == [40.0, 25.0, 1.0, 0.0]
    for key in pooled:
        torch.testing.assert_close(merged[key], pooled[key], rtol=1e-12, atol=1e-10)
    first_only = class_feature_sums(x, y, 4, second_moment=False)
    assert first_only.keys() == {"count", "sum"}
    with pytest.raises(ValueError):
        add_sums(first_only, pooled)


def test_class_moments_equal_torch_mean_and_cov(data):
    x, y = data
    mean, cov, count = class_moments(class_feature_sums(x, y, 4))
    assert mean.dtype == cov.dtype == count.dtype == torch.float64
    for c in (0, 1):
        zc = x[y == c].double()
        torch.testing.assert_close(mean[c], zc.mean(dim=0), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cov[c], torch.cov(zc.T), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(mean[2], x[y == 2][0].double())  # one sample: its mean ...
    assert torch.count_nonzero(cov[2]) == 0  # ... but no covariance
    assert torch.count_nonzero(mean[3]) == 0 and torch.count_nonzero(cov[3]) == 0
    with pytest.raises(ValueError):
        class_moments(class_feature_sums(x, y, 4, second_moment=False))


# ---------------------------------------------------------------- closed-form heads


def test_ncm_classifier_uses_normalised_class_means(data):
    x, y = data
    mean, _, _ = class_moments(class_feature_sums(x, y, 4))
    weight, bias = ncm_classifier(mean)
    assert weight.dtype == bias.dtype == torch.float32
    torch.testing.assert_close(weight.norm(dim=1), torch.tensor([1.0, 1.0, 1.0, 0.0]))
    torch.testing.assert_close(weight[:3], F.normalize(mean[:3].float(), dim=1))
    assert torch.count_nonzero(bias) == 0
    raw, _ = ncm_classifier(mean, normalize=False)
    torch.testing.assert_close(raw, mean.float())


def test_ridge_classifier_equals_lstsq_and_shard_sums_equal_pooled(data, shards):
    x, y = data
    lam = 0.5
    parts = [ridge_sums(x[s], y[s], 4) for s in shards]
    gram, cross = ridge_sums(x, y, 4)
    torch.testing.assert_close(sum(p[0] for p in parts), gram, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(sum(p[1] for p in parts), cross, rtol=1e-12, atol=1e-10)
    weight, bias = ridge_classifier(gram, cross, lam=lam)
    # min ||Z W^T - Y||^2 + lam ||W||^2 as an ordinary least-squares problem on [Z; sqrt(lam) I].
    z = x.double()
    a = torch.cat([z, math.sqrt(lam) * torch.eye(z.shape[1], dtype=torch.float64)])
    rhs = torch.cat([F.one_hot(y, 4).double(), torch.zeros(z.shape[1], 4, dtype=torch.float64)])
    expected = torch.linalg.lstsq(a, rhs).solution.T
    assert weight.shape == (4, 6) and weight.dtype == torch.float32
    torch.testing.assert_close(weight, expected.float(), rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(bias) == 0


def test_tau_normalize():
    weight = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 0.5]])
    bias = torch.tensor([1.0, 2.0, 3.0])
    unit, zero_bias = tau_normalize(weight, bias, tau=1.0)
    torch.testing.assert_close(unit, torch.tensor([[0.6, 0.8], [0.0, 0.0], [0.0, 1.0]]))
    assert torch.count_nonzero(zero_bias) == 0
    same, _ = tau_normalize(weight, bias, tau=0.0)
    torch.testing.assert_close(same, weight)
    half, _ = tau_normalize(weight, bias, tau=0.5)
    torch.testing.assert_close(half[0], torch.tensor([3.0, 4.0]) / math.sqrt(5.0))


# ---------------------------------------------------------------- virtual features


def test_sample_class_gaussians_matches_moments_counts_and_seed():
    mean = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [5.0, 5.0, 5.0]], dtype=torch.float64)
    a = torch.tensor([[1.0, 0.0, 0.0], [0.5, 2.0, 0.0], [-0.3, 0.4, 0.7]], dtype=torch.float64)
    cov = torch.stack([a @ a.T, torch.eye(3, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.float64)])
    counts = [20000, 0, 7]
    x, y = sample_class_gaussians(mean, cov, counts, gen(3))
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.bincount(y, minlength=3).tolist() == counts
    x0 = x[y == 0].double()
    torch.testing.assert_close(x0.mean(dim=0), mean[0], rtol=0, atol=0.05)
    torch.testing.assert_close(torch.cov(x0.T), cov[0], rtol=0, atol=0.1)
    x2 = x[y == 2].double()  # zero covariance: only the eps jitter spreads the samples
    torch.testing.assert_close(x2, mean[2].expand(7, 3), rtol=0, atol=0.05)
    again, _ = sample_class_gaussians(mean, cov, counts, gen(3))
    assert torch.equal(x, again)
    other, _ = sample_class_gaussians(mean, cov, counts, gen(4))
    assert not torch.equal(x, other)


def test_sample_class_gaussians_joins_float32_parts(monkeypatch):
    """A run is refused when it cannot hold two float32 copies of CCVR's virtual features (the parts and
    their join, wrapper.check_features_fit). The parts were float64, joined in float64, then converted:
    at the join 4 times the features' bytes (measured 3x the peak memory), not 2."""
    joined, cat = [], torch.cat

    def counting_cat(tensors, *args, **kwargs):
        out = cat(tensors, *args, **kwargs)
        joined.append((out.dtype, sum(t.nbytes for t in tensors) + out.nbytes))
        return out

    monkeypatch.setattr(torch, "cat", counting_cat)
    mean, cov = torch.zeros(3, 4, dtype=torch.float64), torch.eye(4, dtype=torch.float64).expand(3, 4, 4)
    x, y = sample_class_gaussians(mean, cov, [30, 20, 10], gen(3))
    assert x.dtype == torch.float32
    assert dict(joined) == {torch.float32: 2 * x.nbytes, torch.int64: 2 * y.nbytes}


def test_sample_class_gaussians_singular_and_indefinite_covariance():
    u = torch.tensor([[1.0, 2.0, -1.0]], dtype=torch.float64) / math.sqrt(6.0)
    rank_one = u.T @ u  # singular: variance 1 along u, 0 across
    x, _ = sample_class_gaussians(torch.zeros(1, 3), rank_one[None], [4000], gen(5))
    along = x.double() @ u.T
    assert 0.9 < float(along.var()) < 1.1
    assert float((x.double() - along * u).abs().max()) < 0.05
    # An eigenvalue of -1e-4 (rounding in an estimated covariance) needs more than eps=1e-5 jitter.
    slightly_negative = torch.diag(torch.tensor([1.0, 1.0, -1e-4], dtype=torch.float64))
    x, _ = sample_class_gaussians(torch.zeros(1, 3), slightly_negative[None], [10], gen(5))
    assert torch.isfinite(x).all()
    with pytest.raises(ValueError):
        sample_class_gaussians(torch.zeros(1, 3), -10 * torch.eye(3)[None], [10], gen(5))


# ---------------------------------------------------------------- re-training


def test_retrain_linear_separates_blobs_and_is_deterministic():
    x, y = blobs(5, 16, 60, scale=5.0, seed=7)
    kwargs = dict(steps=150, lr=0.1, batch_size=32)
    weight, bias = retrain_linear(x, y, 5, generator=gen(8), **kwargs)
    assert weight.shape == (5, 16) and bias.shape == (5,) and weight.dtype == torch.float32
    assert accuracy(weight, bias, x, y) >= 0.99
    again = retrain_linear(x, y, 5, generator=gen(8), **kwargs)
    assert torch.equal(weight, again[0]) and torch.equal(bias, again[1])
    assert not torch.equal(weight, retrain_linear(x, y, 5, generator=gen(9), **kwargs)[0])


def test_a_retrain_batch_past_the_samples_is_all_of_them_even_past_64_bits():
    """calibration_args.retrain_batch_size (or safs_finetune_batch_size) of 2**64 passed validation and
    stopped CCVR, CReFF, the oracle and SAFS with torch's "Overflow when unpacking long long" traceback;
    a batch larger than the samples is the whole set, as at any size above them."""
    x, y = blobs(3, 8, 20, scale=5.0, seed=3)
    whole = retrain_linear(x, y, 3, generator=gen(4), steps=5, lr=0.1, batch_size=len(y))
    for batch in (len(y) + 1, 2**64):
        got = retrain_linear(x, y, 3, generator=gen(4), steps=5, lr=0.1, batch_size=batch)
        assert torch.equal(got[0], whole[0]) and torch.equal(got[1], whole[1])


def test_retrain_linear_init_and_balanced_sampling():
    x, y = blobs(3, 8, [200, 20, 4], scale=5.0, seed=10)
    init = linear_init(8, 3, gen(11))
    assert float(init[0].abs().max()) <= 1 / math.sqrt(8) and float(init[1].abs().max()) <= 1 / math.sqrt(8)
    kept = init[0].clone()
    unchanged = retrain_linear(x, y, 3, init=init, steps=0, lr=0.1, batch_size=16, generator=gen(12))
    assert torch.equal(unchanged[0], init[0]) and torch.equal(unchanged[1], init[1])
    weight, bias = retrain_linear(
        x, y, 3, init=init, steps=100, lr=0.1, batch_size=16, generator=gen(12), balanced=True
    )
    assert torch.equal(init[0], kept)  # the caller's init is not modified
    per_class = [accuracy(weight, bias, x[y == c], y[y == c]) for c in range(3)]
    assert min(per_class) >= 0.99


# ---------------------------------------------------------------- CReFF


@pytest.fixture
def classifier() -> tuple[torch.Tensor, torch.Tensor]:
    return linear_init(6, 4, gen(13))


def autograd_class_gradient(weight, bias, x, y) -> torch.Tensor:
    w = weight.clone().requires_grad_(True)
    b = bias.clone().requires_grad_(True)
    gw, gb = torch.autograd.grad(F.cross_entropy(x @ w.T + b, y), (w, b))
    return torch.cat([gw, gb[:, None]], dim=1)


def test_per_class_gradients_match_autograd(data, classifier, monkeypatch):
    x, y = data
    grads, present = per_class_gradients(*classifier, x, y, 4)
    assert grads.shape == (4, 4, 7) and grads.dtype == torch.float32
    assert present.tolist() == [True, True, True, False]
    for c in range(3):
        expected = autograd_class_gradient(*classifier, x[y == c], y[y == c])
        torch.testing.assert_close(grads[c], expected, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(grads[3]) == 0
    monkeypatch.setattr(creff, "GRADIENT_CHUNK_ELEMENTS", 4 * 7 * 3)  # chunks of 3 samples
    chunked, _ = per_class_gradients(*classifier, x, y, 4)
    torch.testing.assert_close(chunked, grads, rtol=1e-5, atol=1e-6)


def test_aggregate_gradients_is_unweighted_mean_over_holders():
    g = gen(14)
    a, b, c = (torch.randn(3, 3, 5, generator=g) for _ in range(3))
    clients = [
        (a, torch.tensor([True, True, False])),
        (b, torch.tensor([True, False, False])),
        (c, torch.tensor([False, True, False])),  # c[0] and c[2] are garbage and must be ignored
    ]
    agg, present = aggregate_gradients(clients)
    assert present.tolist() == [True, True, False]
    torch.testing.assert_close(agg[0], (a[0] + b[0]) / 2)
    torch.testing.assert_close(agg[1], (a[1] + c[1]) / 2)
    assert torch.count_nonzero(agg[2]) == 0
    alone, _ = aggregate_gradients(clients[1:])
    torch.testing.assert_close(alone[0], b[0])  # held by one client: that client's gradient


def test_matching_loss_hand_examples():
    eye = torch.eye(2)
    swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    g_fed = torch.stack([eye, eye])
    assert float(matching_loss(g_fed, g_fed.clone() * 3.0, [0, 1], bias="row")) == pytest.approx(0.0, abs=1e-6)
    assert float(matching_loss(g_fed, torch.stack([swap, eye]), [0], bias="row")) == pytest.approx(1.0)  # orthogonal rows
    assert float(matching_loss(g_fed, torch.stack([swap, -eye]), [0, 1], bias="row")) == pytest.approx(3.0)  # 1 + 2
    half = torch.stack([torch.tensor([[1.0, 0.0], [1.0, 0.0]]), eye])  # row 0 equal, row 1 orthogonal
    assert float(matching_loss(g_fed, half, torch.tensor([True, False]), bias="row")) == pytest.approx(0.5)
    zero_row = torch.stack([torch.tensor([[1.0, 0.0], [0.0, 0.0]]), eye])
    assert float(matching_loss(zero_row, g_fed, [0], bias="row")) == pytest.approx(0.5)  # zero row: cos 0, not NaN


def test_matching_loss_bias_terms_by_hand():
    """``released``: C weight rows plus the bias vector as one more term, over C; ``weights``: rows only."""
    g_agg = torch.tensor([[[1.0, 0.0, 1.0], [0.0, 1.0, -1.0]]])  # one class, C = 2, d = 2, bias last
    g_fed = torch.tensor([[[1.0, 0.0, -1.0], [0.0, 2.0, 1.0]]])  # weight rows parallel, bias opposite
    assert float(matching_loss(g_fed, g_agg, [0], bias="weights")) == pytest.approx(0.0, abs=1e-6)
    assert float(matching_loss(g_fed, g_agg, [0], bias="released")) == pytest.approx((0 + 0 + 2) / 2)
    with pytest.raises(ValueError):
        matching_loss(g_fed, g_agg, [0], bias="other")


def test_released_bias_term_takes_the_released_codes_feature_step():
    """The default ``released`` matching at lr 0.1 C is the authors' step at lr 0.1: per class, the
    sum of 1 - cos over the C weight rows plus one 1 - cos over the bias gradient, summed over the
    classes, with the classifier's gradients taken by autograd (written here from that description)."""
    C, d, m = 4, 12, 5
    weight, bias = torch.randn(C, d, generator=gen(3)) * 0.3, torch.randn(C, generator=gen(4)) * 0.3
    z, y = torch.relu(torch.randn(40, d, generator=gen(5))), torch.arange(40) % C
    g_agg, present = per_class_gradients(weight, bias, z, y, C)
    features = FederatedFeatures(C, m, d, gen(6), feature_lr=0.1 * C, momentum=0.0)
    start = features.features.detach().clone()
    f = start.clone().requires_grad_(True)
    w, b = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    total = torch.zeros(())
    for c in range(C):
        gw, gb = torch.autograd.grad(F.cross_entropy(f[c] @ w.T + b, torch.full((m,), c)), (w, b), create_graph=True)
        target_w, target_b = g_agg[c, :, :d], g_agg[c, :, d]
        total = total + (1 - (gw * target_w).sum(-1) / (gw.norm(dim=-1) * target_w.norm(dim=-1))).sum()
        total = total + 1 - (gb * target_b).sum() / (gb.norm() * target_b.norm())
    (grad,) = torch.autograd.grad(total, f)
    features.match(weight, bias, g_agg, present, 1)  # the default bias term
    step, expected = features.features.detach() - start, -0.1 * grad
    assert step.norm() > 1e-3  # a real step, not a no-op
    assert torch.allclose(step, expected, rtol=1e-4, atol=1e-6 * float(expected.abs().max()))
    row = FederatedFeatures(C, m, d, gen(6), feature_lr=0.1 * C, momentum=0.0)
    row.match(weight, bias, g_agg, present, 1, "row")  # fedlt's earlier reading: another step
    assert not torch.allclose(row.features.detach() - start, expected, rtol=1e-2)


def test_federated_features_gradients_equal_closed_form(classifier):
    feats = FederatedFeatures(4, 3, 6, gen(15))
    x, y = feats.features_and_labels()
    assert x.shape == (12, 6) and y.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    g_fed = feats.gradients(*classifier)
    assert g_fed.requires_grad
    torch.testing.assert_close(g_fed.detach(), per_class_gradients(*classifier, x, y, 4)[0], rtol=1e-5, atol=1e-6)


def test_federated_features_match_real_gradients_and_checkpoint():
    """A fixed random classifier; g_agg from 3 shards of real blob features (class 4 absent)."""
    x, y = blobs(5, 16, 100, scale=3.0, seed=16)
    x, y = x[y < 4], y[y < 4]
    weight, bias = linear_init(16, 5, gen(17))
    shards = torch.randperm(y.shape[0], generator=gen(18)).chunk(3)
    g_agg, present = aggregate_gradients([per_class_gradients(weight, bias, x[s], y[s], 5) for s in shards])
    assert present.tolist() == [True, True, True, True, False]
    # lr 10 because the mean-over-rows cosine loss has tiny gradients w.r.t. unit-scale features.
    feats = FederatedFeatures(5, 10, 16, gen(19), feature_lr=10.0)
    initial = feats.match(weight, bias, g_agg, present, steps=0)
    untouched = feats.features[4].detach().clone()
    halfway = feats.match(weight, bias, g_agg, present, steps=100)
    state = feats.state_dict()
    final = feats.match(weight, bias, g_agg, present, steps=100)
    print(f"matching loss: initial {initial:.3f}, after 100 steps {halfway:.4f}, after 200 {final:.4f}")
    assert initial > 2.0  # 4 classes of near-random cosines
    assert final < 0.05 and final < halfway
    assert torch.equal(feats.features[4].detach(), untouched)  # absent class: no gradient, no momentum
    restored = FederatedFeatures(5, 10, 16, gen(99), feature_lr=10.0)
    restored.load_state_dict(state)
    assert restored.match(weight, bias, g_agg, present, steps=100) == final
    assert torch.equal(restored.features, feats.features)
    with pytest.raises(ValueError):
        feats.match(weight, bias, g_agg, torch.zeros(5, dtype=torch.bool), steps=1)


def test_classifier_retrained_on_federated_features_rivals_real_features():
    """CReFF end to end on 5 overlapping unit-variance blobs in 16-d (centres ~ N(0, I)),
    200 samples per class split over 3 clients. Each of 3 rounds: clients send per-class
    gradients w.r.t. the current re-trained classifier, the server matches 10 federated
    features per class (100 steps) and re-trains a fresh classifier on them. Compared with a
    classifier re-trained on all the real features, evaluated on those real features."""
    x, y = blobs(5, 16, 200, scale=1.0, seed=20)
    real_w, real_b = retrain_linear(x, y, 5, steps=300, lr=0.1, batch_size=64, generator=gen(21))
    real_acc = accuracy(real_w, real_b, x, y)
    shards = torch.randperm(y.shape[0], generator=gen(22)).chunk(3)
    feats = FederatedFeatures(5, 10, 16, gen(23), feature_lr=10.0)
    init_x, init_y = feats.features_and_labels()
    unmatched_w, unmatched_b = retrain_linear(init_x, init_y, 5, steps=100, lr=0.1, batch_size=32, generator=gen(24))
    weight, bias = linear_init(16, 5, gen(25))
    for round_ in range(3):
        g_agg, present = aggregate_gradients([per_class_gradients(weight, bias, x[s], y[s], 5) for s in shards])
        feats.match(weight, bias, g_agg, present, steps=100)
        fx, fy = feats.features_and_labels()
        weight, bias = retrain_linear(fx, fy, 5, steps=100, lr=0.1, batch_size=32, generator=gen(26 + round_))
    fed_acc = accuracy(weight, bias, x, y)
    unmatched_acc = accuracy(unmatched_w, unmatched_b, x, y)
    print(f"accuracy: real {real_acc:.3f}, federated {fed_acc:.3f}, unmatched random features {unmatched_acc:.3f}")
    assert real_acc > 0.9
    assert fed_acc >= real_acc - 0.10
    assert unmatched_acc < 0.5  # the information comes from the matching


def test_creff_feature_momentum_zero_is_plain_sgd():
    """momentum 0 (the released code): every step is features - lr * grad of Eq. 6 at the current
    features; with momentum 0.5 (the default) the second step differs."""
    torch.manual_seed(0)
    weight, bias = torch.randn(3, 4), torch.randn(3)
    g_agg, present = torch.randn(3, 3, 5), torch.tensor([True, True, False])
    plain = FederatedFeatures(3, 2, 4, torch.Generator().manual_seed(1), feature_lr=0.3, momentum=0.0)
    heavy = FederatedFeatures(3, 2, 4, torch.Generator().manual_seed(1), feature_lr=0.3, momentum=0.5)
    for step in range(2):
        before = plain.features.detach().clone().requires_grad_(True)
        probe = FederatedFeatures(3, 2, 4, torch.Generator().manual_seed(1))
        probe.features = before
        grad, = torch.autograd.grad(matching_loss(probe.gradients(weight, bias), g_agg, present), before)
        plain.match(weight, bias, g_agg, present, steps=1)
        heavy.match(weight, bias, g_agg, present, steps=1)
        assert torch.allclose(plain.features.detach(), before.detach() - 0.3 * grad, atol=1e-6)
    assert not torch.allclose(plain.features, heavy.features, atol=1e-4)


@pytest.mark.parametrize("unit, expected", [("steps", 3), ("epochs", 3 * 2)])
def test_creff_retrain_unit_counts_optimizer_steps(tmp_path, unit, expected):
    """J = 3: three SGD steps, or three epochs over the 10 x 5 federated features in batches of 32
    (two batches each)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from fedlt.api import prepare
    from fedlt.config import build_config

    cfg = {"seed": 1, "method": "creff", "data": {"dataset": "synthetic", "num_clients": 4},
           "calibration_args": {"creff_features_per_class": 5, "creff_feature_steps": 2, "creff_retrain_steps": 3,
                                "creff_retrain_unit": unit},
           "run": {"out_dir": str(tmp_path), "threads": 1}}
    cal = prepare(build_config(cfg)).server.calibrators[0]
    d = cal.ctx.model.feature_dim
    cal.g_agg, cal.present = torch.randn(10, 10, d + 1), torch.ones(10, dtype=torch.bool)
    steps = []
    handle = register_optimizer_step_pre_hook(lambda opt, *_: steps.append(opt.param_groups[0]["params"][0].shape))
    try:
        cal.end_round(1, None)
    finally:
        handle.remove()
    assert steps.count((10, d)) == expected == cal.retrain_steps(50)
    assert steps.count((10, 5, d)) == 2  # the I feature steps are unaffected


def test_the_aligner_takes_fewer_rows_than_dimensions_of_large_features():
    """A class with fewer raw rows than feature dimensions has a rank-deficient covariance; in
    float32, features of ~1e3 make it indefinite by more than safs_eps, so it is formed in float64."""
    from fedlt.calibration.math.safs import align_mean_cov, cholesky_factor

    z = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 1e3 + 500
    centered = z - z.mean(dim=0)
    from fedlt.errors import FedltError

    with pytest.raises(FedltError, match="not positive definite"):
        cholesky_factor(centered.T @ centered / 3, 1e-5)  # what the float32 covariance gives
    out = align_mean_cov(z, torch.full((64,), 2.0), torch.eye(64, dtype=torch.float64))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    # the float32 centring leaves ~1e-4 (eps32 x 1.5e3) that the null directions scale by 1/sqrt(safs_eps) ~ 316
    assert torch.allclose(out.mean(dim=0), torch.full((64,), 2.0), atol=0.1)


def test_virtual_features_and_the_safs_target_from_features_grown_to_1e12():
    """A model whose weights grew without becoming NaN has features of ~1e12: float64 rounding of their
    covariance leaves eigenvalues of -1e8, beyond any absolute jitter; CCVR's sampling and SAFS's target
    factor take the jitter relative to the largest variance then, where the run ended in a traceback."""
    from fedlt.calibration.math.safs import SynthesisOptions, synthesize

    x = torch.relu(torch.randn(30, 64, generator=gen(0), dtype=torch.float64)) * 1e12  # fewer samples than dims
    mean, cov, _ = class_moments({"count": torch.tensor([30.0]), "sum": x.sum(0)[None], "sum_outer": (x.T @ x)[None]})
    assert float(torch.linalg.eigvalsh(cov[0]).min()) < -1e5 * 1e-5  # the absolute ladder's largest jitter
    feats, labels = sample_class_gaussians(mean, cov, [5], gen(1))
    assert feats.shape == (5, 64) and torch.isfinite(feats).all()
    z, _, _ = synthesize(mean, cov, None, None, torch.tensor([80]), gen(2), SynthesisOptions(steps=0, mmd=False))
    assert z.shape == (80, 64) and torch.isfinite(z).all()


def test_held_class_gradients_are_the_rows_of_the_classes_held_and_aggregate_in_place():
    """A client's gradients are (k, C, d+1) for the k classes it holds, not (C, C, d+1): at a thousand
    classes the full tensor is half a gigabyte per client. Summed in place, they give Eq. 4's mean."""
    weight, bias = linear_init(6, 50, gen(40))
    x, y = torch.randn(9, 6, generator=gen(41)), torch.tensor([7, 3, 7, 40, 3, 7, 40, 40, 3])
    classes, held = held_class_gradients(weight, bias, x, y, 50)
    assert classes.tolist() == [3, 7, 40] and held.shape == (3, 50, 7)
    for c, grad in zip(classes.tolist(), held):
        torch.testing.assert_close(grad, autograd_class_gradient(weight, bias, x[y == c], y[y == c]),
                                   rtol=1e-5, atol=1e-6)
    other = held_class_gradients(weight, bias, x[:3] * 2, y[:3], 50)  # holds 3 and 7
    agg, present = aggregate_held_gradients([(classes, held), other], 50)
    assert present.nonzero().flatten().tolist() == [3, 7, 40]
    torch.testing.assert_close(agg[7], (held[1] + other[1][1]) / 2)
    torch.testing.assert_close(agg[40], held[2])
    dense = aggregate_gradients([per_class_gradients(weight, bias, x, y, 50),
                                 per_class_gradients(weight, bias, x[:3] * 2, y[:3], 50)])
    torch.testing.assert_close(dense[0], agg)


def test_feature_matching_runs_in_chunks_of_classes_with_the_same_step(monkeypatch):
    """Eq. 6 is a sum over classes, so matching a few classes at a time takes the step of matching
    all at once, while the per-class classifier copies stay within GRADIENT_CHUNK_ELEMENTS."""
    C, d, m = 7, 5, 3
    weight, bias = torch.randn(C, d, generator=gen(42)), torch.randn(C, generator=gen(43))
    g_agg, present = per_class_gradients(weight, bias, torch.randn(30, d, generator=gen(44)), torch.arange(30) % 6, C)
    whole = FederatedFeatures(C, m, d, gen(45), feature_lr=0.7, momentum=0.5)
    whole_loss = whole.match(weight, bias, g_agg, present, steps=2)
    monkeypatch.setattr(creff, "GRADIENT_CHUNK_ELEMENTS", 2 * C * (d + 1 + m))  # two classes at a time
    sizes = []
    original = FederatedFeatures.gradients
    monkeypatch.setattr(FederatedFeatures, "gradients",
                        lambda self, w, b, classes=None: sizes.append(C if classes is None else classes.numel())
                        or original(self, w, b, classes))
    chunked = FederatedFeatures(C, m, d, gen(45), feature_lr=0.7, momentum=0.5)
    chunked_loss = chunked.match(weight, bias, g_agg, present, steps=2)
    assert max(sizes) == 2 and sum(sizes) == 3 * 6  # 2 steps + the final loss, over the 6 present classes
    torch.testing.assert_close(chunked.features, whole.features, rtol=1e-5, atol=1e-6)
    assert chunked_loss == pytest.approx(whole_loss, rel=1e-5)
