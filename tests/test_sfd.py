"""SFD: ABBL losses, SAFS synthesis and its statistics round, and the method end to end."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fedlt
from conftest import pooled_client_features, run_capturing_stats
from fedlt.calibration.math.rff import random_fourier_features, rff_frequencies
from fedlt.calibration.math.safs import (
    SynthesisOptions, align_mean_cov, cholesky_factor, synthesis_loss, synthesize, synthetic_counts,
)
from fedlt.calibration.math.stats import class_feature_sums, class_moments
from fedlt.calibration.wrapper import STATS_QUERY
from fedlt.errors import ConfigError, FedltError
from fedlt.methods.sfd_losses import adaptive_ce, adaptive_logit_offset, adaptive_supcon, released_supcon

@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: a second thread only adds synchronisation (badly so on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


FAST_SAFS = {"safs_max_per_class": 300, "safs_min_per_class": 200, "safs_steps": 10, "safs_rff_dim": 200,
             "safs_finetune_epochs": 2}


def random_cov(d: int, rank: int, gen: torch.Generator) -> torch.Tensor:
    a = torch.randn(d, rank, generator=gen, dtype=torch.float64)
    return a @ a.T / rank


@pytest.mark.parametrize("d", [1, 3, 16, 64])
def test_aligner_gives_exactly_the_target_mean_and_covariance(d):
    gen = torch.Generator().manual_seed(d)
    mean = torch.randn(d, generator=gen, dtype=torch.float64) * 3
    cov = random_cov(d, d + 2, gen)
    raw = torch.rand(4 * d + 10, d, generator=gen, dtype=torch.float64) ** 3  # skewed, far from the target
    z = align_mean_cov(raw, mean, cholesky_factor(cov, 0.0), eps=0.0)
    assert torch.allclose(z.mean(dim=0), mean, atol=1e-10)
    assert torch.allclose(torch.cov(z.T).reshape(d, d), cov, atol=1e-10)
    # with the default eps the covariance is that of cov + eps I, up to O(eps)
    z = align_mean_cov(raw, mean, cholesky_factor(cov, 1e-5), eps=1e-5)
    assert torch.allclose(z.mean(dim=0), mean, atol=1e-10)
    assert torch.allclose(torch.cov(z.T).reshape(d, d), cov, atol=1e-3)


def test_aligner_handles_a_singular_target_and_refuses_too_few_rows():
    gen = torch.Generator().manual_seed(0)
    cov = random_cov(8, 3, gen)  # fewer samples than dimensions: singular
    with pytest.raises(FedltError, match="not positive definite"):
        cholesky_factor(cov - 1e-3 * torch.eye(8, dtype=torch.float64), 0.0)
    z = align_mean_cov(torch.randn(50, 8, generator=gen, dtype=torch.float64), torch.zeros(8, dtype=torch.float64),
                       cholesky_factor(cov, 1e-5), eps=1e-5)
    assert torch.allclose(torch.cov(z.T), cov + 1e-5 * torch.eye(8, dtype=torch.float64), atol=1e-3)
    with pytest.raises(ValueError, match="at least 2 rows"):
        align_mean_cov(torch.zeros(1, 8), torch.zeros(8), cholesky_factor(cov, 1e-5))


def rbf_mmd2(u: torch.Tensor, v: torch.Tensor, gamma: float) -> float:
    """Eq. 2 with the exact kernel."""
    k = lambda a, b: torch.exp(-gamma * torch.cdist(a, b) ** 2)  # noqa: E731
    return float(k(u, u).mean() + k(v, v).mean() - 2 * k(u, v).mean())


def test_random_feature_mmd_is_close_to_the_exact_rbf_mmd():
    gen = torch.Generator().manual_seed(0)
    d, gamma = 6, 0.1
    u = torch.randn(40, d, generator=gen, dtype=torch.float64)
    w = rff_frequencies(d, 20000, gamma, seed=7)
    assert torch.equal(w, rff_frequencies(d, 20000, gamma, seed=7))  # clients rebuild it from the seed
    assert not torch.equal(w, rff_frequencies(d, 20000, gamma, seed=8))
    phi_u = random_fourier_features(u, w)
    kernel = torch.exp(-gamma * torch.cdist(u, u) ** 2)
    assert (phi_u @ phi_u.T - kernel).abs().max() < 0.03
    for shift in (0.3, 1.0, 2.0):
        v = torch.randn(30, d, generator=gen, dtype=torch.float64) * 1.5 + shift
        exact = rbf_mmd2(u, v, gamma)
        approx = float((phi_u.mean(0) - random_fourier_features(v, w).mean(0)).pow(2).sum())
        assert approx == pytest.approx(exact, rel=0.1, abs=2e-3)


def test_a_ce_gives_a_missing_class_a_repulsive_gradient_iff_beta_pi_positive():
    counts = torch.tensor([5, 3, 0, 2])
    gen = torch.Generator().manual_seed(0)
    targets = torch.tensor([0, 1, 3, 0, 1])
    grads = {}
    for beta_pi in (1.0, 0.5, 0.0):
        logits = torch.randn(5, 4, generator=gen).requires_grad_(True)
        adaptive_ce(logits, targets, adaptive_logit_offset(counts, beta_pi, gamma=0.1)).backward()
        grads[beta_pi] = logits.grad[:, 2]
    assert (grads[1.0] > 1e-3).all() and (grads[0.5] > 1e-3).all()
    assert torch.equal(grads[0.0], torch.zeros(5))  # plain logit adjustment: exactly none (Appendix A.1)
    # pi of the missing class is beta_pi * the smallest present count; gamma = 0 is plain CE
    assert adaptive_logit_offset(counts, 0.5, 1.0)[2] == pytest.approx(math.log(1.0))
    logits = torch.randn(5, 4, generator=gen)
    assert adaptive_ce(logits, targets, adaptive_logit_offset(counts, 1.0, 0.0)) == F.cross_entropy(logits, targets)
    with pytest.raises(ValueError, match="beta_pi"):
        adaptive_logit_offset(counts, 1.5)


def eq7_reference(h, y, tau, log_n, anchor_positive=False):
    """Eq. 7 written out per anchor; positives A(i) with the anchor as printed (``anchor_positive``) or
    without it, as Khosla et al.'s (the ``paper`` form); log_n None: the standard SCL."""
    losses = []
    for i in range(len(y)):
        pos = [a for a in range(len(y)) if (anchor_positive or a != i) and y[a] == y[i]]
        if not pos:
            continue
        den = sum(torch.exp(h[i] @ h[b] / tau + (log_n[y[b]] if log_n is not None else 0.0))
                  for b in range(len(y)) if b != i)
        losses.append(-sum(torch.log(torch.exp(h[i] @ h[a] / tau) / den) for a in pos) / len(pos))
    return sum(losses) / len(losses)


def test_a_scl_is_standard_scl_for_equal_counts_and_has_eq7_gradients():
    gen = torch.Generator().manual_seed(0)
    y = torch.tensor([0, 1, 0, 2, 1, 1, 3, 0])  # class 3 has no positive: skipped as an anchor
    h = F.normalize(torch.randn(8, 5, generator=gen, dtype=torch.float64), dim=1).requires_grad_(True)
    equal = torch.full((4,), math.log(7.0), dtype=torch.float64)
    scl = eq7_reference(h, y, 0.07, None)
    assert adaptive_supcon(h, y, 0.07, equal).item() == pytest.approx(scl.item(), rel=1e-12)
    assert adaptive_supcon(h, y, 0.07, None).item() == pytest.approx(scl.item(), rel=1e-12)
    # unequal counts: the loss differs from SCL, and its gradient is exactly Eq. 7's
    log_n = torch.log(torch.tensor([50.0, 5.0, 20.0, 1.0], dtype=torch.float64))
    ours = adaptive_supcon(h, y, 0.07, log_n)
    assert abs(ours.item() - scl.item()) > 1e-3
    (g_ours,) = torch.autograd.grad(ours, h)
    (g_eq7,) = torch.autograd.grad(eq7_reference(h, y, 0.07, log_n), h)
    assert torch.allclose(g_ours, g_eq7, atol=1e-10)
    assert adaptive_supcon(h[:3], torch.tensor([0, 1, 2]), 0.07, log_n).item() == 0.0


def test_eq7_as_printed_counts_the_anchor_among_its_positives_so_a_lone_anchor_learns():
    """A(i) = {a | y_a = y_i} holds i: its term repels the anchor from every other sample, so class 3's
    lone sample, which Khosla et al.'s positives skip, has a gradient; the gradients are Eq. 7's."""
    gen = torch.Generator().manual_seed(2)
    y = torch.tensor([0, 1, 0, 2, 1, 1, 3, 0])
    h = F.normalize(torch.randn(8, 5, generator=gen, dtype=torch.float64), dim=1).requires_grad_(True)
    log_n = torch.log(torch.tensor([50.0, 5.0, 20.0, 1.0], dtype=torch.float64))
    for counts in (log_n, None):
        (g_ours,) = torch.autograd.grad(adaptive_supcon(h, y, 0.07, counts, anchor_positive=True), h)
        (g_eq7,) = torch.autograd.grad(eq7_reference(h, y, 0.07, counts, anchor_positive=True), h)
        assert torch.allclose(g_ours, g_eq7, atol=1e-10)
    # a batch of lone samples: Khosla et al.'s positives leave nothing to learn, Eq. 7's repel them
    pair = h[[0, 1]].detach().requires_grad_(True)
    (g_without,) = torch.autograd.grad(adaptive_supcon(pair, y[[0, 1]], 0.07, log_n), pair)
    (g_with,) = torch.autograd.grad(adaptive_supcon(pair, y[[0, 1]], 0.07, log_n, anchor_positive=True), pair)
    assert torch.equal(g_without, torch.zeros_like(pair)) and g_with.norm() > 1
    with_anchor = adaptive_supcon(h, y, 0.07, log_n, anchor_positive=True)
    # the value: Eq. 7 less each anchor's constant log n_yi (Delta as log(n_yb / n_yi)), over all 8 anchors
    printed = eq7_reference(h, y, 0.07, log_n, anchor_positive=True)
    assert with_anchor.item() == pytest.approx((printed - log_n[y].mean()).item(), rel=1e-12)
    assert adaptive_supcon(h[:1], y[:1], 0.07, log_n, anchor_positive=True).item() == 0.0


def released_reference(h, y, tau, log_n):
    """The released code's A-SCL written out per anchor: Delta on other-class samples only, the anchor
    among its own positives, every anchor counted."""
    losses = []
    for i in range(len(y)):
        pos = [a for a in range(len(y)) if y[a] == y[i]]  # i included
        den = sum(torch.exp(h[i] @ h[b] / tau + (log_n[y[b]] if log_n is not None and y[b] != y[i] else 0.0))
                  for b in range(len(y)) if b != i)
        losses.append(-sum(h[i] @ h[a] / tau - torch.log(den) for a in pos) / len(pos))
    return sum(losses) / len(losses)


def test_released_a_scl_matches_its_definition_and_differs_from_eq7():
    gen = torch.Generator().manual_seed(1)
    y = torch.tensor([0, 1, 0, 2, 1, 1, 3, 0])  # class 3's sample is an anchor with itself as positive
    h = F.normalize(torch.randn(8, 5, generator=gen, dtype=torch.float64), dim=1).requires_grad_(True)
    log_n = torch.log(torch.tensor([50.0, 5.0, 20.0, 1.0], dtype=torch.float64))
    for counts in (log_n, None):
        ours, ref = released_supcon(h, y, 0.07, counts), released_reference(h, y, 0.07, counts)
        assert ours.item() == pytest.approx(ref.item(), rel=1e-12)
        (g_ours,) = torch.autograd.grad(ours, h)
        (g_ref,) = torch.autograd.grad(released_reference(h, y, 0.07, counts), h)
        assert torch.allclose(g_ours, g_ref, atol=1e-10)
    (g_paper,) = torch.autograd.grad(adaptive_supcon(h, y, 0.07, log_n), h)
    (g_released,) = torch.autograd.grad(released_supcon(h, y, 0.07, log_n), h)
    assert (g_paper - g_released).abs().max() > 1e-3
    assert released_supcon(h[:1], y[:1], 0.07, log_n).item() == 0.0


def test_sfd_trains_with_the_released_a_scl_by_default_and_eq7_on_request(tmp_path):
    released = fedlt.run(tiny(tmp_path, run={"out_dir": str(tmp_path), "name": "released", "threads": 1}), quiet=True)
    eq7 = fedlt.run(tiny(tmp_path, method_args={"scl_form": "eq7"},
                         run={"out_dir": str(tmp_path), "name": "eq7", "threads": 1}), quiet=True)
    assert released.metrics[0]["train_loss"] != eq7.metrics[0]["train_loss"]
    assert released.summary["method_args"]["scl_form"] == "released"
    assert eq7.summary["method_args"]["scl_form"] == "eq7"


def test_synthetic_counts_follow_the_size_rank():
    counts = synthetic_counts(torch.tensor([100.0, 50.0, 50.0, 10.0, 0.0, 30.0]), largest=2000, smallest=600)
    assert counts.tolist() == [600, 1067, 1067, 2000, 0, 1533]
    assert synthetic_counts(torch.tensor([4.0, 4.0])).tolist() == [2000, 2000]
    # default bank sizes: the paper's 2000/600 on 512-d features, scaled to the feature dim
    from fedlt.calibration.calibrators import CalibrationArgs, safs_bank_sizes

    assert safs_bank_sizes(CalibrationArgs(), 512) == (2000, 600)
    assert safs_bank_sizes(CalibrationArgs(), 128) == (500, 150)
    assert safs_bank_sizes(CalibrationArgs(safs_max_per_class=100), 128) == (100, 100)


def test_safs_matches_moments_and_lowers_the_synthesis_loss():
    """Real post-ReLU features: synthetic ones keep their mean/covariance and the optimised
    bank has a lower L_MMD + L_ARR than the aligned random start."""
    gen = torch.Generator().manual_seed(0)
    d, n = 6, 400
    real = [F.relu(torch.randn(n, d, generator=gen) * 2 + c) for c in (0.0, 1.0)]
    z, y = torch.cat(real), torch.tensor([0] * n + [1] * n)
    mean, cov, count = class_moments(class_feature_sums(z, y, 2))
    w = rff_frequencies(d, 400, 0.05, seed=3)
    rff_mean = class_feature_sums(random_fourier_features(z, w.float()), y, 2, second_moment=False)["sum"] / n
    per_class = torch.tensor([200, 200])
    losses = {}
    for steps in (0, 30):
        feats, labels, losses[steps] = synthesize(mean, cov, rff_mean, w, per_class, torch.Generator().manual_seed(1),
                                                  SynthesisOptions(steps=steps, lr=1.0))
        assert feats.shape == (400, d) and labels.tolist() == [0] * 200 + [1] * 200
        for c in (0, 1):
            zc = feats[labels == c].double()
            assert torch.allclose(zc.mean(0), mean[c], atol=1e-4)
            assert torch.allclose(torch.cov(zc.T), cov[c], atol=1e-3)
    for c in (0, 1):
        assert losses[30][c] < 0.7 * losses[0][c]
    # without the aligner the bank is the synthetic set and nothing pins its moments
    feats, labels, _ = synthesize(mean, cov, rff_mean, w, per_class, torch.Generator().manual_seed(1),
                                  SynthesisOptions(steps=0, aligner=False))
    assert not torch.allclose(feats[labels == 1].double().mean(0), mean[1], atol=0.1)
    assert synthesis_loss(-torch.ones(2, 3), None, None, mmd=False, arr=True).item() == 3.0


def tiny(tmp_path, **top) -> dict:
    cfg = {
        "seed": 1, "method": "sfd",
        "data": {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 6},
        "fl": {"rounds": 2, "participation": 0.5, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "eval": {"every": 2},
        "calibration_args": dict(FAST_SAFS),
        "run": {"out_dir": str(tmp_path), "threads": 1},
    }
    cfg.update(top)
    return cfg


def test_sfd_end_to_end_uploads_sums_only_and_reports_safs_and_uncalibrated(tmp_path):
    """Two rounds of method=sfd: the model keeps its encoder/head split with the projector in the
    encoder; the statistics round uploads per-class sums only, and their merge equals the
    statistics (moments and mean random features) of the pooled features."""
    from fedlt.api import prepare
    from fedlt.config import build_config

    sim = prepare(build_config(tiny(tmp_path)))
    server = sim.server
    assert {k.split(".")[0] for k in server.model.state_dict()} == {"encoder", "head"}
    result, captured = run_capturing_stats(sim, tmp_path / "run")
    final = result.summary["final"]
    assert result.summary["calibration"] == ["safs"]
    assert final["variants"].keys() == {"uncalibrated"}
    assert final["acc"] != final["variants"]["uncalibrated"]["acc"]
    stats = result.summary["messages"][f"query:{STATS_QUERY}"]
    assert {k: v["shape"] for k, v in stats["from_client"]["payload"].items()} == {
        "class_sums/count": [10], "class_sums/sum": [10, 128], "class_sums/sum_outer": [10, 128, 128],
        "rff_sums/count": [10], "rff_sums/sum": [10, 200]}
    assert {"rff_seed", "rff_dim", "rff_gamma"} <= set(stats["to_client"]["payload"])
    assert result.summary["messages"]["fit"]["to_client"]["payload"]["sfd/scl_weight"]["value"] == 0.1

    z, y = pooled_client_features(sim, 6, 2)
    for key, value in class_feature_sums(z, y, 10).items():
        assert torch.allclose(captured["class_sums"][key], value, rtol=1e-9, atol=1e-6)
    w = rff_frequencies(128, 200, 0.01, server.calibrators[0].rff_seed).float()
    pooled_rff = class_feature_sums(random_fourier_features(z, w), y, 10, second_moment=False)
    assert torch.allclose(captured["rff_sums"]["sum"], pooled_rff["sum"], atol=1e-4)
    projected = sim.worker.encoder.project(z[:4])
    assert projected.shape == (4, 32) and torch.allclose(projected.norm(dim=1), torch.ones(4))


def test_sfd_composes_with_user_calibrations_and_validates_knobs(tmp_path):
    from fedlt.api import prepare
    from fedlt.config import build_config
    from fedlt.methods.sfd import SFDArgs, scl_weight_at

    sim = prepare(build_config(tiny(tmp_path, calibration=["oracle", "safs"])))
    assert [c.name for c in sim.server.calibrators] == ["safs", "oracle"]
    assert scl_weight_at(SFDArgs(), 10, 1, 50) == pytest.approx(0.1)
    assert scl_weight_at(SFDArgs(), 100, 1, 50) == pytest.approx(1.0)
    assert scl_weight_at(SFDArgs(), 10, 26, 50) == pytest.approx(0.05)
    assert scl_weight_at(SFDArgs(scl_weight=0.0), 10, 1, 50) == 0.0
    with pytest.raises(ConfigError, match="method_args.beta_pi"):
        prepare(build_config(tiny(tmp_path, method_args={"beta_pi": 2})))
    with pytest.raises(ConfigError, match="calibration_args.safs_rff_dim"):
        prepare(build_config(tiny(tmp_path, calibration_args={"safs_rff_dim": 301})))
    with pytest.raises(ConfigError, match="safs_min_per_class"):
        prepare(build_config(tiny(tmp_path, calibration_args={"safs_min_per_class": 3000, "safs_max_per_class": 2000})))
    with pytest.raises(ConfigError, match="fixes its own training objective"):
        prepare(build_config(tiny(tmp_path, loss={"name": "la"})))


def test_each_scl_form_selects_its_a_scl():
    """method_args.scl_form reaches the loss it names: released, Eq. 7 as printed, Khosla et al.'s positives."""
    from fedlt.methods.sfd import SUPCON_FORMS, SFDArgs

    gen = torch.Generator().manual_seed(3)
    y = torch.tensor([0, 1, 0, 2, 1, 1, 3, 0])
    h = F.normalize(torch.randn(8, 5, generator=gen, dtype=torch.float64), dim=1)
    log_n = torch.log(torch.tensor([50.0, 5.0, 20.0, 1.0], dtype=torch.float64))
    assert SUPCON_FORMS["released"](h, y, 0.07, log_n).item() == pytest.approx(
        released_reference(h, y, 0.07, log_n).item(), rel=1e-12)
    printed = eq7_reference(h, y, 0.07, log_n, anchor_positive=True) - log_n[y].mean()
    assert SUPCON_FORMS["eq7"](h, y, 0.07, log_n).item() == pytest.approx(printed.item(), rel=1e-12)
    assert SUPCON_FORMS["paper"](h, y, 0.07, None).item() == pytest.approx(eq7_reference(h, y, 0.07, None).item(),
                                                                           rel=1e-12)
    assert set(SUPCON_FORMS) == set(SFDArgs.model_fields["scl_form"].annotation.__args__)


def test_a_scl_weight_above_the_papers_lr_is_noted_before_the_run(capsys):
    """SFD's A-SCL weight 1 (its default at 100 classes) at fl.lr=0.05 ends the CNN at chance: the run says
    so before it starts, naming the paper's lr; its own pairings and a gradient clip say nothing."""
    from fedlt.api import _note_unread
    from fedlt.config import load_config
    from fedlt.run_parts import method_notes

    def notes(*overrides):
        return method_notes(load_config(None, ["method=sfd", *overrides]))

    assert notes("data.dataset=synthetic_cifar100") == [
        "method sfd: A-SCL weight 1 at round 1 (the paper's at 100 classes) is paired in the paper with lr 0.01, "
        "under this run's fl.lr=0.05; at fl.lr=0.05 it cut SFD's accuracy at 100 classes from 76.92% to 28.29% "
        "(docs/results/sfd-100-classes.md); set fl.lr=0.01 or fl.grad_clip=1.0"]
    assert notes("data.dataset=cifar100", "fl.lr=0.01") == []
    assert notes("data.dataset=cifar100", "fl.lr=0.05", "fl.grad_clip=1.0") == []
    assert notes("data.dataset=fmnist", "fl.lr=0.05") == []  # beta_1 = 0.1 at 10 classes
    assert "under this run's fl.lr=0.1;" in notes("data.dataset=fmnist", "fl.lr=0.1", "method_args.scl_weight=2")[0]
    assert notes("data.dataset=cifar100", "fl.lr=0.05", "method_args.scl_weight=0.1") == []
    # image folders: the class count comes from data.classes, unknown without it
    assert notes("data.dataset=imagefolder", "fl.lr=0.05") == []
    assert len(notes("data.dataset=imagefolder", "fl.lr=0.05", f"data.classes=[{','.join(f'c{k}' for k in range(100))}]")) == 1
    assert method_notes(load_config(None, ["method=fedavg", "data.dataset=cifar100"])) == []
    _note_unread(load_config(None, ["method=sfd", "data.dataset=cifar100"]), quiet=True)
    assert capsys.readouterr().err == ""
    _note_unread(load_config(None, ["method=sfd", "data.dataset=cifar100"]), quiet=False)
    assert capsys.readouterr().err.startswith("note: method sfd: A-SCL weight 1 at round 1")
