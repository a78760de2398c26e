"""FedYoYo (ASD, DLA, the effective-prior estimator, the server's prior), FedLC and FedDecorr."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fedlt
from fedlt.config import build_config
from fedlt.data import augment
from fedlt.data.autoaugment import CIFAR10_POLICY, SVHN_POLICY
from fedlt.errors import ConfigError
from fedlt.messages import Message, Reply
from fedlt.methods import fedyoyo
from fedlt.methods.base import ClientContext, ClientData, ServerContext, TrainSettings, clone_state
from fedlt.methods.feddecorr import decorrelation_loss
from fedlt.methods.fedlc import calibrated_ce, calibration_margins
from fedlt.methods.fedyoyo import (
    FedYoYoArgs, FedYoYoClient, FedYoYoServer, asd_loss, autoaugment_policy_for, dla_loss, effective_numbers,
    estimate_prior, fuse_priors, remixed_prior,
)
from fedlt.models import create_model
from fedlt.models.base import FedModel

C = 4


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- ASD and DLA ------------------------------------------------------------------------------
def test_asd_is_zero_for_identical_views_and_positive_otherwise():
    logits = 3 * torch.randn(16, C, generator=gen(1))
    targets = logits.argmax(dim=1)  # every teacher correct
    log_pi = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert asd_loss(logits, logits.clone(), targets, log_pi, 1.5).item() == pytest.approx(0.0, abs=1e-7)
    other = logits + torch.randn(16, C, generator=gen(2))
    assert asd_loss(logits, other, targets, log_pi, 1.5).item() > 1e-3


def test_asd_ignores_misclassified_teachers_and_never_trains_the_teacher():
    log_pi = torch.zeros(C)
    teacher = torch.tensor([[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0]], requires_grad=True)
    targets = torch.tensor([0, 1, 3])  # the third teacher predicts 2: misclassified
    student = torch.randn(3, C, generator=gen(3))
    base = asd_loss(teacher, student, targets, log_pi, 1.5)
    moved_wrong = student.clone()
    moved_wrong[2] = torch.tensor([9.0, -4.0, 1.0, 2.0])
    assert asd_loss(teacher, moved_wrong, targets, log_pi, 1.5).item() == pytest.approx(base.item(), abs=1e-7)
    moved_right = student.clone()
    moved_right[0] = torch.tensor([9.0, -4.0, 1.0, 2.0])
    assert asd_loss(teacher, moved_right, targets, log_pi, 1.5).item() != pytest.approx(base.item(), abs=1e-4)
    student.requires_grad_(True)
    asd_loss(teacher, student, targets, log_pi, 1.5).backward()
    assert teacher.grad is None
    assert torch.all(student.grad[2] == 0) and student.grad[0].abs().sum() > 0


def test_asd_correctness_uses_the_adjusted_prediction():
    """A prior that flips the teacher's argmax flips which samples teach."""
    teacher = torch.tensor([[1.0, 0.8, 0, 0]])
    student = torch.zeros(1, C)
    target = torch.tensor([1])
    assert asd_loss(teacher, student, target, torch.zeros(C), 1.0).item() == 0.0
    favour_1 = torch.log(torch.tensor([0.1, 0.7, 0.1, 0.1]))
    assert asd_loss(teacher, student, target, favour_1, 1.0).item() > 0.0
    # judged by the raw logits, the prior no longer decides who teaches
    assert asd_loss(teacher, student, target, favour_1, 1.0, teacher_filter="raw").item() == 0.0
    assert asd_loss(teacher, student, torch.tensor([0]), favour_1, 1.0, teacher_filter="raw").item() > 0.0


def test_dla_is_balanced_softmax_with_temperature():
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0]])
    pi = torch.tensor([0.5, 0.25, 0.125, 0.125])
    expected = -(math.log(0.25) + 0.5 / 1.5 - math.log(sum(p * math.exp(z / 1.5) for p, z in zip(pi.tolist(), logits[0].tolist()))))
    assert dla_loss(logits, torch.tensor([1]), pi.log(), 1.5).item() == pytest.approx(expected, rel=1e-6)


def test_dla_with_a_prior_scale_is_ce_on_logits_plus_scaled_log_prior():
    """ce_prior_scale=s: CE on f + s log pi, the temperature unused (the released code's 1.5)."""
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0]])
    pi = [0.5, 0.25, 0.125, 0.125]
    adjusted = [z + 1.5 * math.log(p) for z, p in zip(logits[0].tolist(), pi)]
    expected = -adjusted[1] + math.log(sum(math.exp(a) for a in adjusted))
    log_pi = torch.tensor(pi).log()
    for temperature in (1.0, 1.5, 4.0):
        assert dla_loss(logits, torch.tensor([1]), log_pi, temperature, 1.5).item() == pytest.approx(expected, rel=1e-6)
    assert dla_loss(logits, torch.tensor([1]), log_pi, 1.5, 1.5).item() != pytest.approx(
        dla_loss(logits, torch.tensor([1]), log_pi, 1.5).item(), rel=1e-3)


# fixed logits where the reversed KL and other temperatures give clearly different values
ASD_TEACHER = torch.tensor([[3.0, 0.5, -1.0, 0.2], [0.1, 2.5, 0.3, -0.4], [1.5, 1.4, 0.0, 0.0]])
ASD_STUDENT = torch.tensor([[0.5, 1.0, 0.8, -0.3], [-1.0, 0.2, 1.9, 0.6], [2.0, -1.0, 0.5, 0.3]])
ASD_PI = torch.tensor([0.4, 0.3, 0.2, 0.1])
ASD_TARGETS = torch.tensor([0, 1, 1])  # the third teacher predicts class 0: it does not teach


def _kl_reference(temperature: float, reverse: bool = False) -> torch.Tensor:
    """Per-sample KL(teacher || student) of Eq. 7's softmax, by ``F.kl_div`` (input: log q, target: log p)."""
    log_t = F.log_softmax(ASD_TEACHER / temperature + ASD_PI.log(), dim=1)
    log_s = F.log_softmax(ASD_STUDENT / temperature + ASD_PI.log(), dim=1)
    if reverse:
        log_t, log_s = log_s, log_t
    return F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(dim=1)


def test_asd_value_against_kl_div():
    kl = _kl_reference(1.5)
    expected_batch = (kl[0] + kl[1]).item() / 3
    got = asd_loss(ASD_TEACHER, ASD_STUDENT, ASD_TARGETS, ASD_PI.log(), 1.5).item()
    assert got == pytest.approx(expected_batch, rel=1e-5)
    # the test tells the direction and the temperature apart
    assert (_kl_reference(1.5, reverse=True)[:2].sum().item() / 3) != pytest.approx(got, rel=0.05)
    assert (_kl_reference(1.0)[:2].sum().item() / 3) != pytest.approx(got, rel=0.05)
    # asd_average=correct: the mean over the two teaching samples
    got_correct = asd_loss(ASD_TEACHER, ASD_STUDENT, ASD_TARGETS, ASD_PI.log(), 1.5, average="correct").item()
    assert got_correct == pytest.approx((kl[0] + kl[1]).item() / 2, rel=1e-5)


def test_asd_averages_by_hand_on_three_samples():
    """Two classes, uniform prior, T = 1. Teachers [ln 3, 0] give p = (3/4, 1/4); students [0, 0]
    give q = (1/2, 1/2), so KL = 3/4 ln(3/2) + 1/4 ln(1/2) = 0.130812. Teacher 2 is [0, ln 3] with
    label 1 and the same KL; teacher 3 is wrong (predicts 0, label 1) and does not teach."""
    ln3 = math.log(3.0)
    teacher = torch.tensor([[ln3, 0.0], [0.0, ln3], [ln3, 0.0]])
    student = torch.zeros(3, 2)
    targets = torch.tensor([0, 1, 1])
    kl = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert kl == pytest.approx(0.130812, abs=1e-6)
    log_pi = torch.log(torch.tensor([0.5, 0.5]))
    assert asd_loss(teacher, student, targets, log_pi, 1.0, average="batch").item() == pytest.approx(2 * kl / 3, rel=1e-6)
    assert asd_loss(teacher, student, targets, log_pi, 1.0, average="correct").item() == pytest.approx(kl, rel=1e-6)


def test_asd_average_correct_divides_by_the_teaching_samples_only():
    log_pi = torch.zeros(C)
    teacher = torch.tensor([[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0], [0, 0, 0, 5.0]])
    student = torch.randn(4, C, generator=gen(3))
    one_teaches = torch.tensor([0, 0, 0, 0])  # only the first teacher is right
    alone = asd_loss(teacher[:1], student[:1], one_teaches[:1], log_pi, 1.5).item()
    assert asd_loss(teacher, student, one_teaches, log_pi, 1.5, average="correct").item() == pytest.approx(alone, rel=1e-6)
    assert asd_loss(teacher, student, one_teaches, log_pi, 1.5, average="batch").item() == pytest.approx(alone / 4, rel=1e-6)
    nobody = torch.tensor([1, 2, 3, 0])
    assert asd_loss(teacher, student, nobody, log_pi, 1.5, average="correct").item() == 0.0


@pytest.mark.parametrize("args, average", [({}, "correct"), ({"asd_average": "batch"}, "batch")])
def test_client_averages_asd_as_configured(monkeypatch, args, average):
    """The default averages ASD over the teaching samples, as the released code's ``batchmean`` over them."""
    seen: list[str] = []
    real = fedyoyo.asd_loss
    monkeypatch.setattr(fedyoyo, "asd_loss", lambda *a: seen.append(a[-1]) or real(*a))
    ctx = _client_ctx({})
    FedYoYoClient(FedYoYoArgs(**args)).fit(ctx, Message(weights=clone_state(ctx.model), payload={
        "asd_weight": 4.0, "global_prior": torch.full((C,), 0.25)}))
    assert len(seen) == 4 and set(seen) == {average}


def test_fuse_priors_eq6_by_hand():
    pi_g, pi_k = torch.tensor([0.4, 0.3, 0.2, 0.1]), torch.tensor([0.1, 0.1, 0.1, 0.7])
    # (1 - 0.25) * pi_g + 0.25 * pi_k
    assert fuse_priors(pi_g, pi_k, 0.25).tolist() == pytest.approx([0.325, 0.25, 0.175, 0.25])
    assert fuse_priors(pi_g, pi_k, 0.0).tolist() == pytest.approx(pi_g.tolist())


def test_remixed_prior_compounds_to_the_local_prior():
    start, local = torch.tensor([0.4, 0.3, 0.2, 0.1]), torch.tensor([0.1, 0.1, 0.1, 0.7])
    assert torch.allclose(remixed_prior(start, local, 0.25, 1), fuse_priors(start, local, 0.25))  # batch 1: Eq. 6
    # batch 2: 0.75^2 = 0.5625 of the start left
    assert remixed_prior(start, local, 0.25, 2).tolist() == pytest.approx([0.26875, 0.2125, 0.15625, 0.3625])
    assert torch.allclose(remixed_prior(start, local, 0.1, 200), local, atol=1e-8)

# ---- the effective prior ----------------------------------------------------------------------
def test_effective_number_is_one_for_duplicates_and_m_for_orthogonal_samples():
    protos = torch.zeros(2, 8)
    orthogonal = torch.eye(8)[:5]
    dup = torch.ones(3, 8)
    eff = effective_numbers(torch.cat([orthogonal, dup]), torch.tensor([0] * 5 + [1] * 3), protos)
    assert eff.tolist() == pytest.approx([5.0, 1.0])
    # opposite samples would give 1/0: capped at the sample count; absent classes get 0
    opposite = torch.stack([torch.ones(8), -torch.ones(8)])
    assert effective_numbers(opposite, torch.tensor([0, 0]), torch.zeros(3, 8)).tolist() == pytest.approx([2.0, 0, 0])


def _batches(per_class: list[tuple[int, int]], num_batches: int, d: int = 32, seed: int = 0):
    """Batches where class c has n_c samples per batch made of g_c distinct feature vectors
    (n_c / g_c near-duplicate copies of each), spread around a class mean."""
    g = gen(seed)
    means = 3 * torch.randn(len(per_class), d, generator=g)
    out = []
    for _ in range(num_batches):
        feats, labels = [], []
        for c, (n, distinct) in enumerate(per_class):
            base = means[c] + torch.randn(distinct, d, generator=g)
            copies = base.repeat_interleave(n // distinct, dim=0)
            feats.append(copies + 1e-3 * torch.randn(copies.shape, generator=g))
            labels.append(torch.full((n,), c))
        out.append((torch.cat(feats), torch.cat(labels)))
    return out


def test_prior_estimator_orders_classes_by_samples_and_by_diversity():
    # class 0: 8 diverse samples per batch; 1: 2 diverse; 2: 8 samples but only 2 distinct ones
    prior = estimate_prior(_batches([(8, 8), (2, 2), (8, 2)], num_batches=6), num_classes=4)
    assert prior.sum().item() == pytest.approx(1.0)
    assert prior[3] == 0  # no samples
    # more samples -> larger; same count but redundant features -> smaller, like the rare class
    assert prior[0] > 2.5 * prior[1]
    assert prior[0] > 2.5 * prior[2]
    assert prior[2].item() == pytest.approx(prior[1].item(), rel=0.35)
    # the label distribution would rank class 2 with class 0
    assert estimate_prior([], 4) is None


# ---- server -----------------------------------------------------------------------------------
def _server(dataset: str = "synthetic", **args) -> FedYoYoServer:
    cfg = build_config({"data": {"dataset": dataset}, "method": "fedyoyo", "fl": {"rounds": 12}})
    model = create_model("cnn", C, in_channels=1)
    return FedYoYoServer(ServerContext(model=model, config=cfg, num_classes=C, num_clients=5,
                                       device=torch.device("cpu"), args=FedYoYoArgs(**args),
                                       make_model=lambda: create_model("cnn", C, in_channels=1)))


def _reply(server, prior, n) -> Reply:
    return Reply(weights=clone_state(server.model), num_samples=n, payload={"prior": torch.tensor(prior)})


def test_server_global_prior_is_the_weighted_mean_of_client_priors():
    server = _server()
    assert server.fit_message(1, 0).payload["global_prior"].tolist() == pytest.approx([0.25] * 4)
    p1, p2, p3 = [0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.4, 0.4], [0.25, 0.25, 0.25, 0.25]
    server.aggregate(1, {0: _reply(server, p1, 30), 1: _reply(server, p2, 10)})
    expected = (30 * torch.tensor(p1) + 10 * torch.tensor(p2)) / 40
    assert torch.allclose(server.global_prior, expected)
    assert torch.allclose(server.fit_message(2, 3).payload["global_prior"], expected)
    # round 2: client 1 reports again, client 2 for the first time; client 0's prior is remembered
    server.aggregate(2, {1: _reply(server, p3, 10), 2: _reply(server, p2, 60)})
    expected = (30 * torch.tensor(p1) + 10 * torch.tensor(p3) + 60 * torch.tensor(p2)) / 100
    assert torch.allclose(server.global_prior, expected)
    forgetful = _server(prior_memory=False)
    forgetful.aggregate(1, {0: _reply(forgetful, p1, 30)})
    forgetful.aggregate(2, {1: _reply(forgetful, p2, 10)})
    assert torch.allclose(forgetful.global_prior, torch.tensor(p2))


def _counts_replies(*counts) -> dict[int, Reply]:
    return {cid: Reply(payload={"class_counts": torch.tensor(c)}, num_samples=sum(c)) for cid, c in enumerate(counts)}


def test_true_counts_only_for_the_counts_prior_or_the_diagnostic_and_never_sent_to_clients():
    assert _server().next_query("setup", 0, [0, 1]) is None
    server = _server(prior_diagnostic=True)
    query = server.next_query("setup", 0, [0, 1])
    assert query.name == "class_counts"
    server.receive(query, _counts_replies([6, 2, 2, 0], [2, 2, 4, 2]))
    # truth [0.4, 0.2, 0.3, 0.1] vs the initial uniform prior: |diff| = [0.15, 0.05, 0.05, 0.15]
    assert server.metrics() == pytest.approx({"prior_tv": 0.2, "prior_l2": math.sqrt(0.05)})
    server.aggregate(1, {0: _reply(server, [0.4, 0.2, 0.3, 0.1], 10)})
    assert server.metrics()["prior_tv"] == pytest.approx(0.0, abs=1e-6)
    assert "class_counts" not in server.fit_message(2, 0).payload
    oracle = _server(prior_source="counts")
    oracle.receive(oracle.next_query("setup", 0, [0, 1]), _counts_replies([6, 2, 2, 0], [2, 2, 4, 2]))
    assert oracle.fit_message(1, 0).payload["global_prior"].tolist() == pytest.approx([0.4, 0.2, 0.3, 0.1])


def test_asd_weight_warms_up_linearly():
    server = _server(lam=4.0, warmup=0.5)  # 6 of 12 rounds
    assert [server.asd_weight(r) for r in (1, 3, 6, 12)] == pytest.approx([4 / 6, 2.0, 4.0, 4.0])
    assert _server(asd=False).asd_weight(12) == 0.0
    assert _server(warmup=0.0).asd_weight(1) == 4.0


@pytest.mark.parametrize("dataset, choice, expected", [
    ("svhn", "auto", "svhn"),  # the released code's policy on SVHN
    ("synthetic", "auto", "cifar10"),
    ("cifar10", "auto", "cifar10"),
    ("svhn", "cifar10", "cifar10"),  # a named policy overrides auto
    ("cifar100", "svhn", "svhn"),
])
def test_server_resolves_the_autoaugment_policy_from_the_dataset_and_sends_it(dataset, choice, expected):
    assert autoaugment_policy_for(choice, dataset) == expected
    assert _server(dataset, autoaugment_policy=choice).fit_message(1, 0).payload["autoaugment_policy"] == expected


def test_no_autoaugment_policy_is_sent_when_no_view_uses_autoaugment():
    assert "autoaugment_policy" not in _server("svhn", strong_policy="randaugment").fit_message(1, 0).payload
    assert "autoaugment_policy" not in _server("svhn", student_view="weak").fit_message(1, 0).payload
    assert _server("svhn", teacher_view="strong", student_view="weak").fit_message(1, 0).payload[
        "autoaugment_policy"] == "svhn"
    assert autoaugment_policy_for("auto", None) == "cifar10"  # a client that was not told


# ---- client -----------------------------------------------------------------------------------
def _client_ctx(state: dict, rnd: int = 1, cid: int = 3, model: torch.nn.Module | None = None) -> ClientContext:
    g = gen(7)
    images = torch.randint(0, 256, (40, 1, 28, 28), dtype=torch.uint8, generator=g)
    labels = torch.tensor([0] * 20 + [1] * 12 + [2] * 8)
    data = ClientData(images, labels, torch.arange(40), C, standardize=lambda x: (x - 0.5) / 0.5, hflip=False)
    model = model if model is not None else create_model("cnn", C, in_channels=1)
    return ClientContext(cid=cid, round=rnd, model=model, data=data, state=state,
                         train=TrainSettings(1, 10, 0.05, 0.9, 0.0, None), device=torch.device("cpu"), seed=0)


def test_client_fuses_the_prior_once_per_round_and_uploads_model_and_prior_only(monkeypatch):
    calls = []
    real = fedyoyo.fuse_priors

    def spy(pi_g, pi_k, gamma):
        calls.append((pi_g.clone(), pi_k.clone(), gamma))
        return real(pi_g, pi_k, gamma)

    monkeypatch.setattr(fedyoyo, "fuse_priors", spy)
    client = FedYoYoClient(FedYoYoArgs(gamma=0.3, prior="fused_estimate", prior_features="train"))
    pi_g = torch.tensor([0.1, 0.2, 0.3, 0.4])
    state: dict = {}
    ctx = _client_ctx(state)
    msg = Message(weights=clone_state(ctx.model), payload={"asd_weight": 4.0, "global_prior": pi_g})
    reply = client.fit(ctx, msg)
    assert reply.metrics["steps"] == 4  # 4 batches, one fusion
    assert len(calls) == 1 and calls[0][2] == 0.3 and torch.equal(calls[0][0], pi_g)
    # first participation: the local prior is the label distribution
    assert calls[0][1].tolist() == pytest.approx([0.5, 0.3, 0.2, 0.0])
    assert set(reply.payload) == {"prior"} and set(reply.weights) == set(ctx.model.state_dict())
    prior = reply.payload["prior"]
    assert prior.shape == (C,) and prior.sum().item() == pytest.approx(1.0) and prior[3] == 0
    assert torch.equal(state["prior"], prior)
    # next participation: fuses (once) with the estimate made during the previous one
    client.fit(_client_ctx(state, rnd=2), msg)
    assert len(calls) == 2 and torch.equal(calls[1][1], prior)


def test_client_views_use_the_configured_policy_magnitude_cutout_and_interpolation(monkeypatch):
    seen = []
    monkeypatch.setattr(fedyoyo, "strong_view", lambda x, g, flip, **kw: seen.append(kw) or x)
    monkeypatch.setattr(fedyoyo, "weak_view", lambda x, g, flip, **kw: seen.append(kw) or x)
    client = FedYoYoClient(FedYoYoArgs(strong_policy="randaugment", strong_magnitude=5, cutout=0.25,
                                       view_interpolation="released"))
    x = torch.rand(2, 1, 28, 28)
    assert torch.equal(client.view("strong")(x, gen(), False), x)
    assert torch.equal(client.view("weak")(x, gen(), False), x)
    default = FedYoYoClient(FedYoYoArgs())
    default.view("strong")(x, gen(), False)
    default.view("weak")(x, gen(), False)
    default.view("strong", "svhn")(x, gen(), False)  # the policy the server sent
    FedYoYoClient(FedYoYoArgs(autoaugment_policy="svhn")).view("strong")(x, gen(), False)
    assert seen == [{"policy": "randaugment", "magnitude": 5.0, "cutout_frac": 0.25, "interpolation": "released",
                     "autoaugment_policy": "cifar10"},
                    {"interpolation": "released"},
                    {"policy": "autoaugment", "magnitude": 9.0, "cutout_frac": 0.5, "interpolation": "released",
                     "autoaugment_policy": "cifar10"},
                    {"interpolation": "released"},
                    {"policy": "autoaugment", "magnitude": 9.0, "cutout_frac": 0.5, "interpolation": "released",
                     "autoaugment_policy": "svhn"},
                    {"policy": "autoaugment", "magnitude": 9.0, "cutout_frac": 0.5, "interpolation": "released",
                     "autoaugment_policy": "svhn"}]


def test_default_views_resample_as_the_released_code():
    """The default client's views are the augment module's views with the released code's resampling (nearest
    rotations and translations, bicubic shears), not its bilinear defaults; ``bilinear`` gives those."""
    from fedlt.data.augment import strong_view, weak_view

    x = torch.rand(8, 1, 28, 28, generator=gen(2))
    client = FedYoYoClient(FedYoYoArgs())
    released_weak = weak_view(x, gen(1), True, interpolation="released")
    assert torch.equal(client.view("weak")(x, gen(1), True), released_weak)
    assert torch.equal(client.view("strong")(x, gen(1), True),
                       strong_view(x, gen(1), True, policy="autoaugment", interpolation="released"))
    assert not torch.equal(released_weak, weak_view(x, gen(1), True))
    bilinear = FedYoYoClient(FedYoYoArgs(view_interpolation="bilinear")).view("weak")(x, gen(1), True)
    assert torch.equal(bilinear, weak_view(x, gen(1), True))


def test_client_views_are_seeded_per_round_and_client(monkeypatch):
    """The same (round, client) gives the same strong views; another round or client others."""
    real = fedyoyo.strong_view
    views: list[torch.Tensor] = []
    monkeypatch.setattr(fedyoyo, "strong_view", lambda *a, **kw: views.append(real(*a, **kw)) or views[-1])
    client = FedYoYoClient(FedYoYoArgs(asd=False))

    def first_strong_view(rnd: int, cid: int) -> torch.Tensor:
        views.clear()
        ctx = _client_ctx({}, rnd=rnd, cid=cid)
        client.fit(ctx, Message(weights=clone_state(ctx.model), payload={"asd_weight": 0.0,
                                                                         "global_prior": torch.full((C,), 0.25)}))
        return views[0]

    first = first_strong_view(1, 3)
    assert torch.equal(first, first_strong_view(1, 3))
    assert not torch.equal(first, first_strong_view(2, 3))
    assert not torch.equal(first, first_strong_view(1, 4))


def _recorded_log_priors(monkeypatch) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    real = fedyoyo.dla_loss
    monkeypatch.setattr(fedyoyo, "dla_loss", lambda logits, y, log_pi, *rest: seen.append(log_pi) or real(logits, y, log_pi, *rest))
    return seen


def test_local_remix_moves_the_prior_to_the_label_distribution_batch_by_batch(monkeypatch):
    seen = _recorded_log_priors(monkeypatch)
    client = FedYoYoClient(FedYoYoArgs(gamma=0.3))  # prior=local_remix is the default
    pi_g = torch.tensor([0.1, 0.2, 0.3, 0.4])
    labels = torch.tensor([0.5, 0.3, 0.2, 0.0])  # the context's label distribution
    ctx = _client_ctx({})
    reply = client.fit(ctx, Message(weights=clone_state(ctx.model), payload={"asd_weight": 4.0, "global_prior": pi_g}))
    assert len(seen) == 4  # one prior per batch
    for t, log_pi in enumerate(seen, start=1):
        expected = (0.7 ** t) * pi_g + (1 - 0.7 ** t) * labels
        assert log_pi.exp().tolist() == pytest.approx(expected.tolist(), rel=1e-5)
    # nothing new leaves the client: the model and its estimated prior, as with fused_estimate
    assert set(reply.payload) == {"prior"} and torch.equal(reply.payload["prior"], ctx.state["prior"])
    fused = FedYoYoClient(FedYoYoArgs(gamma=0.3, prior="fused_estimate", prior_features="train"))
    seen.clear()
    fused.fit(_client_ctx({}), Message(weights=clone_state(ctx.model), payload={"asd_weight": 4.0, "global_prior": pi_g}))
    assert all(torch.equal(log_pi, seen[0]) for log_pi in seen)
    assert seen[0].exp().tolist() == pytest.approx((0.7 * pi_g + 0.3 * labels).tolist(), rel=1e-5)


def test_clean_eval_prior_comes_from_the_received_model_in_eval_mode_on_clean_images(monkeypatch):
    estimates: list = []
    real_estimate = fedyoyo.estimate_prior
    monkeypatch.setattr(fedyoyo, "estimate_prior", lambda b, c: estimates.append(b) or real_estimate(b, c))
    fused: list = []
    real_fuse = fedyoyo.fuse_priors
    monkeypatch.setattr(fedyoyo, "fuse_priors", lambda g, k, gamma: fused.append(k) or real_fuse(g, k, gamma))
    client = FedYoYoClient(FedYoYoArgs(prior="fused_estimate", prior_features="clean_eval"))
    ctx = _client_ctx({})
    modes: list[bool] = []
    encoder = next(ctx.model.children())
    encoder.register_forward_hook(lambda module, inputs, output: modes.append(module.training))
    received = clone_state(ctx.model)
    reply = client.fit(ctx, Message(weights=received, payload={"asd_weight": 4.0, "global_prior": torch.full((C,), 0.25)}))

    assert len(estimates) == 1 and [len(y) for _, y in estimates[0]] == [10, 10, 10, 10]  # training batch size
    assert modes[:4] == [False] * 4 and all(modes[4:])  # eval mode, before training
    model = create_model("cnn", C, in_channels=1)
    model.load_state_dict(received)
    with torch.no_grad():
        x, y = ctx.data.batch(torch.arange(40))  # no generator: un-augmented
        clean = model.forward_features(x)
    got = torch.cat([f for f, _ in estimates[0]])
    match = torch.cdist(got, clean).argmin(dim=1)  # the batches are a shuffle of the client's samples
    assert sorted(match.tolist()) == list(range(40))
    torch.testing.assert_close(got, clean[match], atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.cat([lab for _, lab in estimates[0]]), y[match])
    # this estimate is uploaded and already this round's pi_k
    assert torch.equal(reply.payload["prior"], real_estimate(estimates[0], C)) and torch.equal(fused[0], reply.payload["prior"])


def _batchnorm_model() -> FedModel:
    """Features = BatchNorm of a linear map, with running statistics (mean 3, variance 1/4) far from
    any batch's: eval mode gives (z - 3) / 0.5, train mode z standardised per batch."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(8)
    bn.running_mean.fill_(3.0)
    bn.running_var.fill_(0.25)
    return FedModel(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 8), bn), 8, C)


@pytest.mark.parametrize("features", ["train", "clean_eval", None])
def test_prior_features_choose_the_forward_pass(monkeypatch, features):
    """clean_eval (the default, as released) estimates from the received model's eval-mode (running-statistics)
    features of the clean images; train from the training forward passes (batch statistics) of the teacher view."""
    estimates: list = []
    real_estimate = fedyoyo.estimate_prior
    monkeypatch.setattr(fedyoyo, "estimate_prior", lambda b, c: estimates.append(b) or real_estimate(b, c))
    ctx = _client_ctx({}, model=_batchnorm_model())
    received = clone_state(ctx.model)
    client = FedYoYoClient(FedYoYoArgs() if features is None else FedYoYoArgs(prior_features=features))
    reply = client.fit(ctx, Message(weights=received, payload={"asd_weight": 4.0, "global_prior": torch.full((C,), 0.25)}))
    assert len(estimates) == 1
    got = torch.cat([f for f, _ in estimates[0]])

    model = _batchnorm_model()
    model.load_state_dict(received)
    model.eval()
    with torch.no_grad():
        x, _ = ctx.data.batch(torch.arange(40))
        z = model.encoder[1](model.encoder[0](x))
        clean = model.forward_features(x)
    torch.testing.assert_close(clean, (z - 3.0) / math.sqrt(0.25 + 1e-5))  # eval mode: the running statistics
    if features != "train":
        match = torch.cdist(got, clean).argmin(dim=1)
        torch.testing.assert_close(got, clean[match], atol=1e-5, rtol=1e-5)
        assert got.mean().item() == pytest.approx(clean.mean().item(), abs=1e-5) and got.mean().item() < -3.0
    else:  # per-batch standardised: near zero mean, nowhere near the eval-mode features
        assert abs(got.mean().item()) < 0.5
        assert torch.cdist(got, clean).min().item() > 1.0
    assert torch.equal(reply.payload["prior"], real_estimate(estimates[0], C))


def test_client_without_dla_neither_estimates_nor_uploads():
    client = FedYoYoClient(FedYoYoArgs(dla=False))
    ctx = _client_ctx({})
    reply = client.fit(ctx, Message(weights=clone_state(ctx.model), payload={"asd_weight": 1.0}))
    assert reply.payload == {} and ctx.state == {} and math.isfinite(reply.metrics["train_loss"])


# ---- FedLC, FedDecorr -------------------------------------------------------------------------
def test_fedlc_calibrated_loss_by_hand():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    margins = calibration_margins(torch.tensor([16, 1, 81]), tau=1.0)
    assert margins.tolist() == pytest.approx([0.5, 1.0, 1 / 3])
    calibrated = [0.5, 1.0, 0.5 - 1 / 3]
    expected = -calibrated[0] + math.log(sum(math.exp(z) for z in calibrated))
    assert calibrated_ce(logits, torch.tensor([0]), margins).item() == pytest.approx(expected, rel=1e-6)


def test_fedlc_drops_absent_classes_from_the_local_softmax():
    margins = calibration_margins(torch.tensor([4, 0, 9]), tau=0.5)
    logits = torch.tensor([[0.3, 5.0, -0.2], [1.0, -1.0, 0.0]], requires_grad=True)
    loss = calibrated_ce(logits, torch.tensor([0, 2]), margins)
    loss.backward()
    present = calibrated_ce(logits[:, [0, 2]].detach(), torch.tensor([0, 1]), margins[[0, 2]])
    assert loss.item() == pytest.approx(present.item(), rel=1e-6)
    assert torch.isfinite(logits.grad).all() and torch.all(logits.grad[:, 1] == 0)
    assert calibration_margins(torch.tensor([4, 0]), tau=0.0).tolist() == [0.0, 0.0]


def test_fedlc_margins_take_the_power_of_the_present_classes_packed():
    """A CPU rounds a vector's SIMD body and its scalar tail differently: the margins are those of the
    present classes' counts packed (as the released results were made), not of every class at once,
    so a missing class never moves another one's margin by a bit."""
    counts = np.array([0] + [65] * 99)  # with the absent class, class 96 falls in a different part of the vector
    packed = torch.from_numpy(counts[1:]).float().pow(-0.25)
    margins = calibration_margins(counts, tau=1.0)
    assert torch.equal(margins[1:], packed) and margins[0] == math.inf


def test_feddecorr_term_small_for_decorrelated_and_large_for_collinear_features():
    d = 16
    white = torch.randn(4096, d, generator=gen(4))
    # decorrelated: only the diagonal of K survives, ||K||^2 / d^2 = 1 / d
    assert decorrelation_loss(white).item() == pytest.approx(1 / d, rel=0.05)
    collinear = torch.randn(64, 1, generator=gen(5)) * torch.linspace(0.5, 2.0, d)
    assert decorrelation_loss(collinear).item() == pytest.approx(1.0, rel=1e-3)
    assert decorrelation_loss(torch.randn(1, d)).item() == 0.0


def test_feddecorr_default_is_the_released_loss_about_batch_size_times_the_formula():
    """The released loss (the default) is the mean squared off-diagonal entry of Z^T Z over N: with the
    unbiased variance Z^T Z = (N - 1) K, so it is (N-1)^2/N times the formula's off-diagonal part over d(d-1)."""
    n, d = 32, 16
    feats = torch.randn(n, d, generator=gen(6), dtype=torch.float64) @ torch.randn(d, d, generator=gen(7),
                                                                                  dtype=torch.float64)
    paper, code = decorrelation_loss(feats, "paper"), decorrelation_loss(feats, "code")
    z = (feats - feats.mean(0)) / feats.std(0, unbiased=False)
    k = z.T @ z / n
    off_diagonal = k.pow(2).sum() - k.diagonal().pow(2).sum()
    # to the 1e-8 added to each variance (~10 here): rel 1e-6 leaves a wide margin
    assert paper.item() == pytest.approx(k.pow(2).sum().item() / d**2, rel=1e-6)
    assert code.item() == pytest.approx((n - 1) ** 2 / n * off_diagonal.item() / (d * (d - 1)), rel=1e-6)
    # white features: each off-diagonal entry of Z^T Z has variance ~N, so the released term is ~1 (a mean
    # of 2,016 independent chi-square(1) / 1 values here: standard deviation 0.03)
    white = torch.randn(4096, 64, generator=gen(8))
    assert decorrelation_loss(white, "code").item() == pytest.approx(1.0, abs=0.15)
    collinear = torch.randn(n, 1, generator=gen(5), dtype=torch.float64) * torch.linspace(0.5, 2.0, d)
    assert decorrelation_loss(collinear, "code").item() == pytest.approx((n - 1) ** 2 / n, rel=1e-6)
    assert decorrelation_loss(torch.randn(1, d), "code").item() == 0.0
    assert decorrelation_loss(torch.randn(n, 1), "code").item() == 0.0
    # the gradient, what training feels, is about N times the formula's
    grads = []
    for normalization in ("paper", "code"):
        x = feats.clone().requires_grad_(True)
        decorrelation_loss(x, normalization).backward()
        grads.append(x.grad.norm().item())
    assert 0.5 * n < grads[1] / grads[0] < 1.5 * n


# ---- end to end -------------------------------------------------------------------------------
def tiny(tmp_path, name: str, **over) -> dict:
    cfg = {
        "seed": 1, "run": {"out_dir": str(tmp_path), "name": name, "threads": 1},
        "data": {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 4},
        "model": {"name": "cnn"}, "eval": {"every": 1},
        "fl": {"rounds": 2, "participation": 0.5, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
    }
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("method", ["fedlc", "feddecorr", "fedyoyo"])
def test_two_round_runs(tmp_path, method):
    over = {"method_args": {"prior_diagnostic": True}} if method == "fedyoyo" else {}
    res = fedlt.run(tiny(tmp_path, method, method=method, **over), quiet=True)
    assert len(res.metrics) == 2 and all(math.isfinite(r["train_loss"]) for r in res.metrics)
    fit = res.summary["messages"]["fit"]
    if method == "fedyoyo":
        assert set(fit["from_client"]["payload"]) == {"prior"}
        # the diagnostic's true counts stay on the server
        assert set(fit["to_client"]["payload"]) == {"asd_weight", "global_prior", "autoaugment_policy"}
        assert all(0.0 <= r["prior_tv"] <= 1.0 for r in res.metrics)
    else:
        assert fit["from_client"]["payload"] == {} and fit["to_client"]["payload"] == {}


def _write_svhn(root, per_class: int) -> None:
    """SVHN's format-2 files (MATLAB v5, digit 0 stored as label 10), random pixels, every digit in both splits."""
    scipy_io = pytest.importorskip("scipy.io")
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", per_class), ("test", 2)):
        labels = np.repeat(np.arange(1, 11), n).astype(np.float64)[:, None]
        images = rng.integers(0, 256, (32, 32, 3, labels.shape[0]), dtype=np.uint8)
        scipy_io.savemat(root / f"{split}_32x32.mat", {"X": images, "y": labels})


@pytest.mark.parametrize("dataset, choice, expected", [
    ("synthetic", {}, "cifar10"),
    ("svhn", {}, "svhn"),
    ("svhn", {"autoaugment_policy": "cifar10"}, "cifar10"),
])
def test_the_strong_view_uses_svhns_policy_on_svhn(tmp_path, monkeypatch, dataset, choice, expected):
    """A whole run: the strong views of SVHN apply AutoAugment's SVHN policy unless a policy is named."""
    policies: list = []
    real = augment.auto_augment
    monkeypatch.setattr(augment, "auto_augment", lambda x, g, policy, **kw: policies.append(policy) or real(x, g, policy, **kw))
    data = {"dataset": dataset, "imbalance_factor": 1, "alpha": 0.5, "num_clients": 2}
    if dataset == "svhn":
        _write_svhn(tmp_path / "svhn", per_class=6)
        data["root"] = str(tmp_path / "svhn")
    else:
        data["image_size"] = 8
    cfg = tiny(tmp_path, dataset, method="fedyoyo", method_args=choice, data=data, eval={"every": 1, "personalized": False})
    cfg["fl"] = {**cfg["fl"], "rounds": 1, "participation": 1.0}
    fedlt.run(cfg, quiet=True)
    assert policies and all(p is {"cifar10": CIFAR10_POLICY, "svhn": SVHN_POLICY}[expected] for p in policies)


def test_config_errors():
    with pytest.raises(ConfigError, match="data.augment"):
        fedlt.run(tiny("/nonexistent", "x", method="fedyoyo", data={"dataset": "synthetic", "augment": "weak"}))
    with pytest.raises(ConfigError, match="fixes its own"):
        fedlt.run(tiny("/nonexistent", "x", method="fedlc", loss={"name": "la"}))
    with pytest.raises(ConfigError, match="no knob method_args.beta"):
        fedlt.run(tiny("/nonexistent", "x", method="fedyoyo", method_args={"beta": 0.1}))
    with pytest.raises(ConfigError, match="strong_magnitude.*randaugment"):
        fedlt.run(tiny("/nonexistent", "x", method="fedyoyo", method_args={"strong_magnitude": 5}))
    with pytest.raises(ConfigError, match="autoaugment_policy.*strong_policy=autoaugment only"):
        fedlt.run(tiny("/nonexistent", "x", method="fedyoyo",
                       method_args={"strong_policy": "randaugment", "autoaugment_policy": "svhn"}))
    with pytest.raises(ConfigError, match="autoaugment_policy"):
        fedlt.run(tiny("/nonexistent", "x", method="fedyoyo", method_args={"autoaugment_policy": "imagenet"}))
    fedlt.config.build_config({"method": "fedyoyo", "method_args": {"strong_policy": "randaugment",
                                                                    "autoaugment_policy": "auto"}})
    fedlt.config.build_config({"method": "fedyoyo", "method_args": {"strong_policy": "randaugment", "strong_magnitude": 27}})
