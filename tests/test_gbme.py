"""GBME / GBME-p (proxy prior, grouping, selection, experts, privacy), SCAFFOLD and FedAvgM."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fedlt
from fedlt.config import build_config
from fedlt.data.sources.synthetic import make_synthetic
from fedlt.errors import ConfigError
from fedlt.messages import Message, Reply
from fedlt.methods.base import ClientContext, ClientData, TrainSettings, clone_state
from fedlt.methods.gbme import (
    DIAG_KEY, LPI_QUERY, GBMEArgs, GBMEClient, fixed_fc_gradient, per_sample_fc_gradients,
)
from fedlt.methods.proxy_prior import (
    analytic_sigma, epsilon_achieved, gaussian_delta, gaussian_sigma, global_proxy, random_groups, rank_groups,
    select_for_experts, split_quota,
)
from fedlt.models import create_model
from fedlt.models.multi_expert import multi_expert_model

COUNTS = [160, 80, 40, 20, 10, 0, 0, 0, 0, 0]


def tiny(tmp_path, **top) -> dict:
    cfg = {
        "seed": 2,
        "data": {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 6},
        "fl": {"rounds": 2, "participation": 0.5, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "eval": {"every": 1, "personalized": False},
        "run": {"out_dir": str(tmp_path), "checkpoint_every": 0, "threads": 1},
    }
    cfg.update(top)
    return cfg


def client_ctx(model, counts=COUNTS, lr=0.05, seed=0) -> ClientContext:
    """A client holding exactly ``counts`` synthetic samples per class."""
    train = make_synthetic().train
    labels = train.labels
    rows = torch.cat([torch.nonzero(labels == c).flatten()[:n] for c, n in enumerate(counts)])
    data = ClientData(train.images, labels, rows, 10, train.standardize)
    return ClientContext(cid=0, round=0, model=model, data=data, state={},
                         train=TrainSettings(1, 16, lr, 0.9, 5e-4, None), device=torch.device("cpu"), seed=seed)


# ---- proxy information ----------------------------------------------------------------------
def test_lpi_orders_classes_like_their_counts():
    torch.manual_seed(0)
    model = create_model("cnn", 10, in_channels=3, image_size=16)
    state = clone_state(model)
    lpi = GBMEClient(GBMEArgs(ensemble=False, lpi_pass="fixed")).lpi(client_ctx(model), Message(weights=state))
    held = [c for c, n in enumerate(COUNTS) if n > 0]
    assert lpi.shape == (10,)
    # held classes ordered exactly like their counts, and above every absent class
    assert torch.argsort(lpi[held], descending=True).tolist() == list(range(len(held)))
    assert float(lpi[held].min()) > float(lpi[5:].max())
    # the default pass (mean gradient along one SGD epoch, as the released code) equals the
    # single-point one when the epoch barely moves the model
    epoch = GBMEClient(GBMEArgs(ensemble=False)).lpi(client_ctx(model, lr=1e-4),
                                                                        Message(weights=state))
    assert float(np.corrcoef(epoch.numpy(), lpi.numpy())[0, 1]) > 0.95


def test_gpi_is_the_weighted_sum_of_positive_lpi_entries():
    lpis = {0: torch.tensor([3.0, -1.0, 0.5]), 1: torch.tensor([-2.0, 4.0, 1.0]), 5: torch.tensor([1.0, 1.0, -7.0])}
    n = {0: 10, 1: 30, 5: 60}
    expected = torch.tensor([0.1 * 3 + 0.6 * 1, 0.3 * 4 + 0.6 * 1, 0.1 * 0.5 + 0.3 * 1], dtype=torch.float64)
    assert torch.allclose(global_proxy(lpis, n), expected)


def test_grouping_covers_every_client_once_in_rank_order():
    scores = {c: s for c, s in enumerate([0.1, 0.9, 0.5, 0.7, 0.2, 0.95, 0.3])}
    groups = rank_groups(scores, 3)
    assert groups == [[5, 1, 3], [2, 6], [4, 0]]  # highest similarity first, near-equal sizes
    rnd = random_groups(list(range(20)), 3, np.random.default_rng(0))
    for gs in (groups, rnd):
        flat = [c for g in gs for c in g]
        assert all(gs) and len(gs) == 3 and sorted(flat) == sorted(set(flat))
    assert sorted(c for g in rnd for c in g) == list(range(20))
    with pytest.raises(ValueError, match="non-empty"):
        rank_groups(scores, 8)


def test_selection_counts_per_expert_and_alpha_extremes():
    groups = [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19]]
    rng = np.random.default_rng(1)
    for alpha, per_expert in [(0.6, 5), (0.5, 4), (1.0, 3), (0.0, 3)]:
        inside, outside = split_quota(alpha, per_expert)
        picks = select_for_experts(groups, alpha, per_expert, rng)
        for e, group in enumerate(groups):
            trainers = [c for c, ex in picks.items() if e in ex]
            assert len(trainers) == per_expert
            assert sum(c in group for c in trainers) == inside and sum(c not in group for c in trainers) == outside
    assert split_quota(0.6, 5) == (3, 2) and split_quota(0.5, 3) == (2, 1)
    # alpha = 1: every expert trained by its own group only, each client at most once
    picks = select_for_experts(groups, 1.0, 4, rng)
    assert all(len(ex) == 1 and c in groups[ex[0]] for c, ex in picks.items()) and len(picks) == 12
    # alpha = 0: each selected client updates an expert of another group
    picks = select_for_experts(groups, 0.0, 4, rng)
    assert all(c not in groups[e] for c, ex in picks.items() for e in ex)
    # one group (M = 1): the quota comes from it whatever alpha says
    assert len(select_for_experts([list(range(6))], 0.3, 4, rng)) == 4


# ---- multi-expert training ----------------------------------------------------------------
def test_frozen_experts_are_unchanged_and_not_uploaded():
    torch.manual_seed(0)
    model = multi_expert_model("resnet8", 10, 3, num_experts=3, width=0.25)
    sent = clone_state(model)
    ctx = client_ctx(model, counts=[12, 8, 4, 0, 0, 0, 0, 0, 0, 0])
    ctx.loss_config = fedlt.load_config(None, ["loss.name=bsm"]).loss
    reply = GBMEClient(GBMEArgs()).fit(ctx, Message(weights=sent, payload={"experts": torch.tensor([1])}))
    after = model.state_dict()
    for e in (0, 2):  # parameters and BatchNorm statistics alike
        assert all(torch.equal(after[k], sent[k]) for k in model.expert_keys(e))
    changed = lambda keys: any(not torch.equal(after[k], sent[k]) for k in keys if after[k].is_floating_point())
    assert changed(model.expert_keys(1)) and changed(model.shared_keys())
    assert set(reply.weights) == set(model.shared_keys()) | set(model.expert_keys(1))
    assert all(p.requires_grad for p in model.parameters()) and not model._frozen  # reset for the next client


@pytest.mark.parametrize("mode", ["all", "trainers"])
def test_expert_aggregation_all_counts_untrained_experts_as_sent_trainers_averages_over_trainers(tmp_path, mode):
    from fedlt.api import prepare

    cfg = tiny(tmp_path, method="gbme", loss={"name": "bsm"}, method_args={"expert_aggregation": mode})
    sim = prepare(build_config(cfg))
    model = sim.server.model
    shared, e0, e1, e2 = model.shared_keys()[0], *(model.expert_keys(e)[0] for e in range(3))
    for key in (shared, e0, e1, e2):  # a known broadcast value: every entry 0
        model.state_dict()[key].zero_()
    ones = lambda k, v: torch.full_like(model.state_dict()[k], v)
    replies = {  # client 0 trained expert 0, client 1 experts 0 and 1; nobody expert 2
        0: Reply(weights={shared: ones(shared, 1.0), e0: ones(e0, 1.0)}, num_samples=10),
        1: Reply(weights={shared: ones(shared, 4.0), e0: ones(e0, 4.0), e1: ones(e1, 2.0)}, num_samples=30),
    }
    sim.server.aggregate(1, replies)
    now = model.state_dict()
    assert torch.allclose(now[shared], ones(shared, 3.25)) and torch.allclose(now[e0], ones(e0, 3.25))
    # expert 1: Alg. 1's FedAvg counts client 0's copy as the zeros it received (30 * 2 / 40 = 1.5);
    # averaged over its trainers only it is client 1's 2.0
    assert torch.allclose(now[e1], ones(e1, 1.5 if mode == "all" else 2.0))
    assert torch.equal(now[e2], ones(e2, 0.0))  # nobody trained expert 2: unchanged either way


def test_gpi_prior_lifts_zero_entries_to_the_floor_and_keeps_the_rest(tmp_path):
    from fedlt.api import prepare
    from fedlt.losses import log_prior

    server = prepare(build_config(tiny(tmp_path, method="gbme", loss={"name": "bsm"}))).server
    server.gpi = torch.tensor([0.5, 0.2, 0.04, 0.0, 0.0, 0.1, 0.06, 0.05, 0.03, 0.02], dtype=torch.float64)
    prior = server.gpi_prior()
    assert prior[3] == prior[4] == 0.02 and torch.equal(prior[server.gpi > 0], server.gpi[server.gpi > 0])
    assert bool(torch.isfinite(log_prior(prior)).all()) and float(log_prior(prior)[3]) > -5
    server.args = server.args.model_copy(update={"gpi_floor": 0.0})  # Eq. 5 as is: the loss's 1e-8 floor
    assert float(log_prior(server.gpi_prior())[3]) == pytest.approx(math.log(1e-8))


# ---- GBME-p -------------------------------------------------------------------------------
def test_gbme_p_noise_scale_and_clipping_match_theorem_2():
    assert gaussian_sigma(10, 0.03, 1.0) == pytest.approx(math.sqrt(2 * math.log(1.25 / 0.03)) / 10)
    assert gaussian_sigma(5, 1e-5, 2.0) == pytest.approx(2 * math.sqrt(2 * math.log(1.25e5)) / 5)
    torch.manual_seed(0)
    model = multi_expert_model("cnn", 10, 3, num_experts=3)
    ctx = client_ctx(model)
    n = len(ctx.data)
    clean = fixed_fc_gradient(ctx, clip=0.5, sigma=0.0)
    sigma = gaussian_sigma(5.0, 0.03, 0.5)
    noisy = fixed_fc_gradient(ctx, clip=0.5, sigma=sigma)
    assert clean.shape == (10, 3 * 96)
    assert float((noisy - clean).std()) * n == pytest.approx(sigma, rel=0.05)  # entry noise sigma, then / n_k
    x, y = ctx.data.batch(torch.arange(n))
    raw = per_sample_fc_gradients(model, x, y).flatten(1).norm(dim=1)
    assert float(raw.min()) > 0.5  # clipping is active, so the bound below is the clip's doing
    assert float(clean.norm()) * n <= 0.5 * n + 1e-4


def exact_delta(epsilon: float, sigma: float, sensitivity: float) -> float:
    """Balle & Wang (2018), Theorem 8, evaluated as written at 50 digits (e^epsilon cannot overflow there)."""
    import mpmath

    with mpmath.workdps(50):
        a, b = mpmath.mpf(sensitivity) / (2 * sigma), mpmath.mpf(epsilon) * sigma / sensitivity
        return float(mpmath.ncdf(a - b) - mpmath.exp(epsilon) * mpmath.ncdf(-a - b))


@pytest.mark.parametrize("epsilon, sigma, sensitivity", [
    (0.0, 1.0, 1.0), (0.5, 1.0, 1.0), (5.0, 0.5462, 1.0), (12.0, 0.2731, 1.0), (3.0, 0.8, 2.0),
    (722.0, 1 / 38, 1.0),  # a = b = 19: e^epsilon overflows a float, the mechanism's delta is ~0.49
])
def test_exact_delta_of_the_gaussian_mechanism_is_balle_and_wang_theorem_8(epsilon, sigma, sensitivity):
    assert gaussian_delta(epsilon, sigma, sensitivity) == pytest.approx(exact_delta(epsilon, sigma, sensitivity),
                                                                        rel=1e-9, abs=1e-15)


def test_epsilon_achieved_and_the_analytic_sigma():
    for epsilon in (5.0, 10.0, 100.0, 1e6):  # the classical sigma at the epsilons the docs report
        sigma = gaussian_sigma(epsilon, 0.03, 1.0)
        achieved = epsilon_achieved(sigma, 0.03, 1.0)
        assert exact_delta(achieved, sigma, 1.0) == pytest.approx(0.03, abs=1e-9)
    assert epsilon_achieved(gaussian_sigma(5, 0.03, 1.0), 0.03, 1.0) == pytest.approx(4.44, abs=0.005)
    assert epsilon_achieved(gaussian_sigma(10, 0.03, 1.0), 0.03, 1.0) == pytest.approx(12.79, abs=0.005)
    assert epsilon_achieved(gaussian_sigma(100, 0.03, 1.0), 0.03, 1.0) == pytest.approx(738.18, abs=0.005)
    for epsilon in (0.1, 0.5, 0.9):  # Theorem 2's range: the classical sigma keeps its promise
        for delta in (0.03, 1e-5):
            classical = gaussian_sigma(epsilon, delta, 1.0)
            assert epsilon_achieved(classical, delta, 1.0) <= epsilon
            assert analytic_sigma(epsilon, delta, 1.0) < classical
    for epsilon, sensitivity in ((10.0, 1.0), (10.0, 2.0), (0.5, 1.0)):
        sigma = analytic_sigma(epsilon, 0.03, sensitivity)
        assert epsilon_achieved(sigma, 0.03, sensitivity) == pytest.approx(epsilon, rel=1e-9)
        assert exact_delta(epsilon, sigma, sensitivity) <= 0.03 + 1e-12
        assert exact_delta(epsilon, sigma * (1 - 1e-6), sensitivity) > 0.03  # and it is the smallest such sigma
    assert epsilon_achieved(100.0, 0.03, 1.0) == 0.0  # noise this large is 0-DP at delta = 0.03


def test_gbme_p_noise_is_seeded_in_simulations_and_from_the_system_on_nodes_with_their_own_data():
    torch.manual_seed(0)
    model = create_model("cnn", 10, in_channels=3)
    msg = Message(weights=clone_state(model))
    ctx = client_ctx(model, counts=[8, 4, 2, 1, 1, 0, 0, 0, 0, 0])

    def lpi(source: str, node_data: bool = False) -> torch.Tensor:
        ctx.node_data = node_data
        return GBMEClient(GBMEArgs(dp_epsilon=1.0, dp_noise=source)).lpi(ctx, msg)

    seeded = lpi("seeded")
    assert torch.equal(lpi("seeded"), seeded) and torch.equal(lpi("auto"), seeded)  # a simulation repeats
    assert not torch.equal(lpi("system"), lpi("system"))  # the same seed, fresh noise each time
    assert not torch.equal(lpi("auto", node_data=True), lpi("auto", node_data=True))
    assert not torch.equal(lpi("auto", node_data=True), seeded)


def test_seeded_noise_is_refused_on_nodes_that_hold_their_own_data(tmp_path):
    from fedlt.run_parts import check_config

    def node_run(**args) -> dict:
        return tiny(tmp_path, method="gbme", loss={"name": "bsm"}, engine="flower", flower={"node_data": True},
                    method_args={"dp_epsilon": 5, **args})

    for calibration in ([], ["ccvr"]):  # a calibration's wrapper asks the method too
        with pytest.raises(ConfigError, match=r"dp_noise=seeded .* use method_args.dp_noise=system \(or auto\)$"):
            check_config(build_config({**node_run(dp_noise="seeded"), "calibration": calibration}))
    check_config(build_config(node_run(dp_noise="system")))
    from fedlt.engine.clients import ClientRuntime
    from fedlt.run_parts import setup_parts

    cfg = build_config(node_run())  # auto: a node's client context says where it runs, so its noise is the system's
    assert ClientRuntime(cfg, *setup_parts(cfg)).context(0, 1, {}).node_data
    cfg = build_config(tiny(tmp_path, method="gbme", loss={"name": "bsm"}, method_args={"dp_epsilon": 5}))
    assert not ClientRuntime(cfg, *setup_parts(cfg)).context(0, 1, {}).node_data


def test_gbme_p_records_the_epsilon_its_sigma_achieves(tmp_path):
    def run(**args):
        cfg = tiny(tmp_path, method="gbme", loss={"name": "bsm"}, method_args={"dp_epsilon": 10, **args})
        cfg["data"]["num_clients"], cfg["fl"]["rounds"] = 4, 1
        return fedlt.run(cfg, quiet=True).metrics[-1]

    classical = run()
    assert classical["dp_epsilon_achieved"] == pytest.approx(epsilon_achieved(gaussian_sigma(10, 0.03, 1.0), 0.03, 1.0))
    assert classical["dp_theorem_applies"] == 0.0 and classical["dp_sensitivity"] == 1.0
    replace_one = run(dp_calibration="analytic", dp_adjacency="replace")
    assert replace_one["dp_sensitivity"] == 2.0 and replace_one["dp_sigma"] == analytic_sigma(10, 0.03, 2.0)
    assert replace_one["dp_epsilon_achieved"] == pytest.approx(10.0, rel=1e-9)
    assert "dp_theorem_applies" not in replace_one  # Theorem 2 is not what calibrated it
    # no client computes an LPI (its own prior, random groups): no noise is added, so no privacy figure
    no_lpi = run(prior="local", grouping="random")
    assert not any(key.startswith("dp_") for key in no_lpi)


def test_config_errors():
    with pytest.raises(ConfigError, match="loss.name"):
        fedlt.run(tiny("/nonexistent", method="gbme"), quiet=True)
    with pytest.raises(ConfigError, match="lpi_pass"):
        fedlt.run(tiny("/nonexistent", method="gbme", loss={"name": "bsm"},
                       method_args={"dp_epsilon": 5, "lpi_pass": "epoch"}), quiet=True)


def test_a_proxy_that_is_no_prior_stops_in_one_line_before_round_1(tmp_path):
    """A non-finite LPI (the pass diverged at fl.lr=3e38, or a cosine scale of 3e38 overflowed the logits)
    or Eq. 5's GPI with no positive entry (a cosine scale of 1e-45 zeroes every FC gradient) gave a class prior
    that every client's loss refused in round 1 with a ValueError / RuntimeError traceback."""
    from typer.testing import CliRunner

    from fedlt.cli import app

    out = tmp_path / "runs"
    base = ["run", "data.dataset=synthetic", "data.num_clients=4", "fl.rounds=1", "run.threads=1", "method=gbme",
            "loss.name=bsm", f"run.out_dir={out}", "--quiet"]
    diverged = "fedlt: error: training diverged in GBME's LPI pass (the setup stage, before round 1): the local " \
               "proxy of 4 client(s) (client 0 first) is not finite; "
    for knobs, line in [
        (["fl.lr=3e38", "method_args.expert_head=linear"], diverged + "lower fl.lr (now 3e+38)"),
        (["method_args.cosine_scale=3e38"],
         diverged + "lower fl.lr (now 0.05), or lower method_args.cosine_scale (now 3e+38)"),
        (["method_args.cosine_scale=1e-45", "method_args.gpi_counts=proxy"],
         "fedlt: error: GBME's global proxy (GPI) has no positive entry: every client's local proxy was zero or "
         "negative (as under a tiny method_args.cosine_scale, now 1e-45), so it is no class prior; raise "
         "cosine_scale or use method_args.gpi_counts=released or method_args.prior=local")]:
        result = CliRunner().invoke(app, [*base, *knobs])
        assert result.exit_code == 2 and result.stderr.strip().splitlines() == [line], result.stderr
        assert not out.exists() or list(out.iterdir()) == []


def test_the_analytic_sigma_of_a_tiny_epsilon_ends():
    """Theorem 2's sigma of dp_epsilon=1e-300 and dp_clip=3e38 is past the doubles (inf): the analytic
    calibration's bracket halved inf forever, so GBME-p hung before round 1."""
    import subprocess
    import sys

    code = ("from fedlt.methods.proxy_prior import analytic_sigma as a; "
            "print(a(1e-300, 0.03, 3e38), a(1e-300, 0.9999999999, 3e38))")
    import os
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(fedlt.__file__).parents[1])}  # this checkout's fedlt
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    big, near_one = map(float, done.stdout.split())
    assert 3.4e39 < big < 4.5e39 and 1e37 < near_one < 3e37  # about 3e38 / (2 x 0.0376) and 3e38 / (2 x 6.5)
    assert analytic_sigma(1e-300, 0.9999999999, 3e38) == near_one


# ---- end to end and baselines -------------------------------------------------------------
def test_gbme_and_gbme_p_end_to_end(tmp_path):
    # joint_warmup=0: per-expert selection from round 1 (in a joint round every client uploads every expert)
    res = fedlt.run(tiny(tmp_path, method="gbme", loss={"name": "bsm"},
                         method_args={"diagnose_gpi": True, "joint_warmup": 0}), quiet=True)
    last = res.metrics[-1]
    assert math.isfinite(last["loss"]) and -1 <= last[DIAG_KEY] <= 1
    assert 0 <= last["diag_nonprivate_gpi_tv"] <= 1 and last["diag_nonprivate_gpi_tail_ratio"] >= 0
    # R = the round's clients (50% of 6 = 3) for EVERY expert (Alg. 1, Sec. 3.3), not 3 / M = 1
    assert all(last[f"expert{e}_trainers"] == 3 for e in range(3))
    assert 3 <= last["trainers"] <= 6
    msgs = res.summary["messages"]
    assert msgs[f"query:{LPI_QUERY}"]["from_client"]["payload"]["lpi"]["shape"] == [10]
    assert msgs["fit"]["to_client"]["payload"]["prior"]["shape"] == [10]
    full = msgs["fit"]["to_client"]["model_bytes"]
    assert last["comm"]["down_model"] == last["trainers"] * full
    # 3 trainers an expert among 3 to 6 clients: some train fewer than all three, and upload only those
    assert msgs["fit"]["from_client"]["model_bytes"] <= full and last["comm"]["up_model"] < last["trainers"] * full

    dp_run = fedlt.run(tiny(tmp_path, method="gbme", loss={"name": "bsm"},
                            method_args={"dp_epsilon": 10, "diagnose_gpi": True}), quiet=True)
    dp = dp_run.metrics[-1]
    assert dp["dp_sigma"] == pytest.approx(gaussian_sigma(10, 0.03, 1.0)) and dp["dp_theorem_applies"] == 0.0
    assert dp["dp_epsilon"] == 10 and dp["dp_delta"] == 0.03 and math.isfinite(dp["loss"])
    # the summary alone says how the run was made: privacy parameters and the GPI diagnostic
    server = dp_run.summary["final"]["server_metrics"]
    assert server["dp_sigma"] == dp["dp_sigma"] and server["dp_epsilon"] == 10 and server[DIAG_KEY] == dp[DIAG_KEY]
    assert "acc" not in server and "comm" not in server and "train_loss" not in server
    assert "dp_sigma" in (dp_run.run_dir / "report.md").read_text()


def test_gbme_without_ensemble_is_fedavg_with_that_prior(tmp_path):
    fedavg = fedlt.run(tiny(tmp_path, loss={"name": "bsm", "prior": "global"}), quiet=True)
    gbme = fedlt.run(tiny(tmp_path, method="gbme", loss={"name": "bsm"},
                          method_args={"ensemble": False, "prior": "global"}), quiet=True)
    assert [m["loss"] for m in gbme.metrics] == pytest.approx([m["loss"] for m in fedavg.metrics], rel=1e-6)


def test_scaffold_with_zero_variates_is_fedavg_then_differs(tmp_path):
    fedavg = fedlt.run(tiny(tmp_path), quiet=True).metrics
    scaffold = fedlt.run(tiny(tmp_path, method="scaffold"), quiet=True)
    assert scaffold.metrics[0]["loss"] == pytest.approx(fedavg[0]["loss"], rel=1e-5)  # round 1: c = c_i = 0
    assert scaffold.metrics[1]["loss"] != pytest.approx(fedavg[1]["loss"], rel=1e-5)  # round 2: variates act
    up = scaffold.summary["messages"]["fit"]
    n_params = sum(p.numel() for p in create_model("cnn", 10, 3, 16).parameters())
    assert up["to_client"]["payload"]["c_global"]["shape"] == [n_params]
    assert up["from_client"]["payload"]["delta_c"]["shape"] == [n_params]


def test_scaffold_variate_is_option_two_under_plain_sgd_and_survives_momentum(tmp_path):
    """c_i+ = the mean step gradient: with plain SGD exactly option II's c_i - c + (x - y)/(K lr);
    with momentum 0.9 (where option II's formula is 10x too large) the run stays finite."""
    from fedlt.api import prepare
    from fedlt.methods.scaffold import STATE_KEY, param_vector

    cfg = tiny(tmp_path, method="scaffold")
    cfg["fl"] = {**cfg["fl"], "momentum": 0.0, "weight_decay": 0.001}
    sim = prepare(build_config(cfg))
    sim.server.c = 0.01 * torch.randn(sim.server.c.shape, generator=torch.Generator().manual_seed(0)).to(sim.device)
    msg = sim.server.fit_message(1, 0)
    start = sim._new_model()
    start.load_state_dict(msg.weights, strict=False)
    ctx = sim._context(0, 1)
    reply = sim.client.fit(ctx, msg)
    steps = reply.metrics["steps"]
    option_two = -sim.server.c + (param_vector(start) - param_vector(ctx.model)) / (steps * 0.05)  # c_i = 0
    # each of the K float32 steps rounds the weights by eps/2 of their size: x - y is known to K eps max|w|,
    # option II to eps max|w| / lr (x4 for the sums); weight decay's share (1e-3 w, ~2e-4) lies far outside
    tol = 4 * torch.finfo(torch.float32).eps * float(torch.maximum(param_vector(start).abs(),
                                                                   param_vector(ctx.model).abs()).max()) / 0.05
    assert steps > 1 and torch.allclose(ctx.state[STATE_KEY], option_two, rtol=0, atol=tol)
    heavy = fedlt.run(tiny(tmp_path, method="scaffold", fl={**tiny(tmp_path)["fl"], "rounds": 4, "momentum": 0.9},
                           seed=1), quiet=True)
    assert all(math.isfinite(m["train_loss"]) for m in heavy.metrics)
    assert all(m["train_loss"] > 0 for m in heavy.metrics)  # the task loss (CE), without the correction


def test_fedavgm_with_zero_momentum_is_fedavg(tmp_path):
    fedavg = fedlt.run(tiny(tmp_path), quiet=True).metrics
    zero = fedlt.run(tiny(tmp_path, method="fedavgm", method_args={"beta": 0.0}), quiet=True).metrics
    momentum = fedlt.run(tiny(tmp_path, method="fedavgm"), quiet=True).metrics
    assert [m["loss"] for m in zero] == pytest.approx([m["loss"] for m in fedavg], rel=1e-5)
    assert momentum[1]["loss"] != pytest.approx(fedavg[1]["loss"], rel=1e-5)


# ---- values of the proxy, cosine heads and the lr warm-up --------------------------------------
def hand_model(head: torch.nn.Module):
    """A multi-expert model whose features are its 2-d input, so the FC gradient is hand-computable."""
    from torch import nn
    from fedlt.models.multi_expert import MultiExpertEncoder, MultiExpertHead, MultiExpertModel

    return MultiExpertModel(MultiExpertEncoder(nn.Identity(), [nn.Identity()]), MultiExpertHead([head], 2), 2)


def test_per_sample_fc_gradient_and_lpi_hand_values_for_cosine_and_linear_heads():
    from torch import nn
    from fedlt.methods.proxy_prior import local_proxy
    from fedlt.models.multi_expert import CosineLinear

    h, y = torch.tensor([[3.0, 4.0]]), torch.tensor([0])
    cosine = CosineLinear(2, 2, scale=2.0)
    linear = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        cosine.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
        linear.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
    # cosine: logits 2 * (0.6, 0.8); dL/dw_c = (p_c - y_c) s (h^ - cos_c w^_c) / ||w_c||, p_0 - 1 = -p_1
    p1 = 1 / (1 + math.exp(-0.4))
    expected = torch.tensor([[0.0, -p1 * 2 * 0.8], [p1 * 2 * 0.6 / 2, 0.0]])
    g = per_sample_fc_gradients(hand_model(cosine), h, y)
    assert torch.allclose(g[0], expected, atol=1e-6)
    assert torch.allclose(local_proxy(g.sum(0)), torch.tensor([p1 * 1.6, -p1 * 0.6]), atol=1e-6)  # Eq. 4
    # linear: logits (3, 8); dL/dW_c = (p_c - y_c) h with p_0 - 1 = -p_1, so the LPI is 7 p_1 (1, -1)
    q1 = 1 / (1 + math.exp(-5.0))
    g = per_sample_fc_gradients(hand_model(linear), h, y)
    assert torch.allclose(g[0], torch.tensor([[-q1 * 3, -q1 * 4], [q1 * 3, q1 * 4]]), atol=1e-6)
    assert torch.allclose(local_proxy(g.sum(0)), 7 * q1 * torch.tensor([1.0, -1.0]), atol=1e-5)


@pytest.mark.parametrize("head", ["cosine", "linear"])
def test_fixed_pass_fc_gradient_equals_a_per_sample_backward_loop(head):
    torch.manual_seed(0)
    model = multi_expert_model("cnn", 10, 3, num_experts=2, width=0.25, head=head)
    ctx = client_ctx(model, counts=[5, 3, 2, 1, 0, 0, 0, 0, 0, 0])
    mean = fixed_fc_gradient(ctx, clip=None, sigma=0.0)
    x, y = ctx.data.batch(torch.arange(len(ctx.data)))
    model.eval()
    names = [n for n, p in sorted(model.head.named_parameters()) if p.dim() == 2]
    params = dict(model.head.named_parameters())
    total = torch.zeros_like(mean)
    for i in range(len(y)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        total += torch.cat([params[n].grad for n in names], dim=1)
    assert torch.allclose(mean, total / len(y), atol=1e-6)
    # Eq. 4 through the client's own query: minus the row sums of that mean gradient
    lpi = GBMEClient(GBMEArgs(lpi_pass="fixed")).lpi(ctx, Message(weights=clone_state(model)))
    assert torch.allclose(lpi, -(total / len(y)).sum(1), atol=1e-5)


def test_fixed_pass_at_many_classes_builds_bounded_chunks_of_per_sample_gradients(monkeypatch):
    """At 2,000 classes 256 samples' (C, H) gradients would be 33M floats (8,142 classes: 134M); the
    pass takes fewer samples at a time, to the same mean gradient as one pass of 256-sample chunks."""
    from fedlt.methods import gbme

    torch.manual_seed(0)
    model = multi_expert_model("cnn", 2000, 3, num_experts=2, width=0.25)
    ctx = client_ctx(model)  # 310 samples: more than one chunk either way
    built = []

    def recorded(*args):
        g = per_sample_fc_gradients(*args)
        built.append(g.numel())
        return g

    monkeypatch.setattr(gbme, "per_sample_fc_gradients", recorded)
    mean = fixed_fc_gradient(ctx, clip=0.5, sigma=0.0)
    assert max(built) <= 1 << 24 and sum(built) == len(ctx.data) * 2000 * 64
    monkeypatch.setattr(gbme, "PER_SAMPLE_CHUNK_ELEMENTS", 1 << 40)  # 256 samples a chunk
    # each entry is a float32 sum of 310 clipped terms (|g| <= 0.5), divided by 310: rounding ~310 * 2^-24
    assert torch.allclose(mean, fixed_fc_gradient(ctx, clip=0.5, sigma=0.0), rtol=0, atol=310 * 2**-24)


def test_cosine_head_logits_are_scale_times_cosine_and_the_default_expert_head():
    from fedlt.methods.gbme import make_gbme_model
    from fedlt.models.multi_expert import CosineLinear

    torch.manual_seed(0)
    head, h = CosineLinear(6, 4, scale=30.0), torch.randn(5, 6)
    expected = 30 * torch.nn.functional.cosine_similarity(h[:, None, :], head.weight[None], dim=2)
    assert torch.allclose(head(h), expected, atol=1e-5)
    cfg = build_config({"data": {"dataset": "synthetic"}, "method": "gbme", "loss": {"name": "bsm"},
                        "method_args": {"cosine_scale": 12.0}})
    heads = make_gbme_model(cfg, 10, 3, 16).head.heads  # the CNN too gets cosine heads by default
    assert all(isinstance(e, CosineLinear) and e.scale == 12.0 for e in heads)
    assert GBMEArgs().warmup() == 5.0 and GBMEArgs(expert_head="linear").warmup() == 0.0


def test_lr_warmup_ramps_linearly_over_the_first_rounds_steps():
    from fedlt.methods.gbme import lr_warmup
    from fedlt.training.sequential import steps_per_epoch

    def lrs(rnd, rounds, steps=4):
        w = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([w], lr=0.1)
        seen = []
        with lr_warmup(rnd, steps, rounds):
            for _ in range(steps):
                w.grad = torch.ones(1)
                opt.step()
                seen.append(opt.param_groups[0]["lr"])
        return seen

    assert lrs(1, 2) == pytest.approx([0.1 * i / 8 for i in (1, 2, 3, 4)])
    assert lrs(2, 2) == pytest.approx([0.1 * (4 + i) / 8 for i in (1, 2, 3, 4)])
    assert lrs(3, 2) == lrs(1, 0) == [0.1] * 4  # after the warm-up, and without one
    assert lrs(2, 1.5) == pytest.approx([0.1 * min(1, (1 + i / 4) / 1.5) for i in (1, 2, 3, 4)])
    assert (steps_per_epoch(65, 32), steps_per_epoch(64, 32), steps_per_epoch(10, 32)) == (2, 2, 1)


def test_joint_warmup_trains_every_expert_with_the_engines_clients(tmp_path):
    from fedlt.api import prepare

    cfg = tiny(tmp_path, method="gbme", loss={"name": "bsm"}, method_args={"joint_warmup": 0.5})
    cfg["fl"] = {**cfg["fl"], "rounds": 4}
    server = prepare(build_config(cfg)).server
    server.groups = [[0, 1], [2, 3], [4, 5]]
    assert server.select_clients(2, [1, 4, 5]) == [1, 4, 5]  # rounds 1-2 of 4: joint
    assert server.selection == {1: [0, 1, 2], 4: [0, 1, 2], 5: [0, 1, 2]}
    server.select_clients(3, [1, 4, 5])  # then per expert: each expert's trainers from the rule
    assert all(sum(e in ex for ex in server.selection.values()) == 3 for e in range(3))
    assert any(len(ex) < 3 for ex in server.selection.values())


def test_gpi_diagnostics_values():
    from fedlt.methods.gbme import DIAG_TAIL_KEY, DIAG_TV_KEY, gpi_diagnostics

    counts = torch.tensor([4.0, 2.0, 1.0, 1.0])  # true prior (.5, .25, .125, .125); tail = classes 2, 3
    d = gpi_diagnostics(torch.tensor([3.0, 1.0, 0.0, 0.0]), counts)
    assert d[DIAG_TV_KEY] == pytest.approx(0.25) and d[DIAG_TAIL_KEY] == 0.0
    d = gpi_diagnostics(torch.tensor([1.0, 1.0, 1.0, 1.0]), counts)
    assert d[DIAG_TV_KEY] == pytest.approx(0.25) and d[DIAG_TAIL_KEY] == pytest.approx(2.0)
    d = gpi_diagnostics(counts * 3, counts)
    assert d[DIAG_TV_KEY] == pytest.approx(0.0) and d[DIAG_TAIL_KEY] == pytest.approx(1.0)
    assert d[DIAG_KEY] == pytest.approx(1.0)


def test_receive_hands_other_queries_on_and_stops(tmp_path):
    """A query GBME does not ask goes up the class hierarchy, and GBME leaves it there: a server
    composed of GBME and a method that asks its own query receives that query intact."""
    from fedlt.api import prepare
    from fedlt.messages import Query
    from fedlt.methods.base import Server
    from fedlt.methods.gbme import GBMEServer

    class Tally(Server):
        def receive(self, query, replies):
            if query.name != "tally":
                return super().receive(query, replies)
            self.tally = sum(int(r.payload["count"]) for r in replies.values())

    class Composed(GBMEServer, Tally):
        pass

    ctx = prepare(build_config(tiny(tmp_path, method="gbme", loss={"name": "bsm"}))).server.ctx
    server = Composed(ctx)
    server.receive(Query("tally", {}), {0: Reply(payload={"count": 3}, num_samples=10),
                                        1: Reply(payload={"count": 4}, num_samples=20)})
    assert server.tally == 7
    assert server.lpis is None and server.client_counts is None and server.num_samples == {}
    with pytest.raises(NotImplementedError, match="unknown"):  # nobody asked it: the base class says so
        server.receive(Query("unknown", {}), {})


# ---- the released code's readings: per-expert loss, LPI steps, count estimate ----------------
def two_expert_model():
    """2 experts x 3 classes on 3-d inputs: a shared linear layer (identity), identity expert blocks
    and bias-free linear heads W_0 = I, W_1 = 2 I, so expert e's logits are (e + 1) x."""
    from torch import nn
    from fedlt.models.multi_expert import MultiExpertEncoder, MultiExpertHead, MultiExpertModel

    shared = nn.Linear(3, 3, bias=False)
    heads = [nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)]
    with torch.no_grad():
        shared.weight.copy_(torch.eye(3))
        heads[0].weight.copy_(torch.eye(3))
        heads[1].weight.copy_(2 * torch.eye(3))
    return MultiExpertModel(MultiExpertEncoder(shared, [nn.Identity(), nn.Identity()]), MultiExpertHead(heads, 3), 3)


def test_per_expert_loss_hand_values_and_its_gradient_reaches_only_the_trained_expert():
    from fedlt.losses import make_loss
    from fedlt.methods.gbme import per_expert_loss

    model = two_expert_model()
    x, y = torch.tensor([[1.0, 0.0, -1.0]]), torch.tensor([0])
    bsm = make_loss("bsm", prior=torch.tensor([3.0, 2.0, 1.0]))  # prior (1/2, 1/3, 1/6)
    e = math.e
    # BSM(v, 0) = -v_0 - log pi_0 + log sum_c pi_c exp(v_c), v = (k, 0, -k): -k + log((3 e^k + 2 + e^-k) / 3)
    first, second = -1 + math.log((3 * e + 2 + 1 / e) / 3), -2 + math.log((3 * e ** 2 + 2 + e ** -2) / 3)
    mean = -1.5 + math.log((3 * e ** 1.5 + 2 + e ** -1.5) / 3)  # Eq. 7: the mean logits (1.5, 0, -1.5)
    assert bsm(model(x), y).item() == pytest.approx(mean, rel=1e-6)
    assert per_expert_loss(model, bsm, [0, 1], False)(x, y).item() == pytest.approx(first + second, rel=1e-6)
    assert per_expert_loss(model, bsm, [1], False)(x, y).item() == pytest.approx(second, rel=1e-6)
    trained = per_expert_loss(model, bsm, [1], True)(x, y)  # per-expert phase: x M = 2
    assert trained.item() == pytest.approx(2 * second, rel=1e-6)
    trained.backward()
    shared, head0, head1 = model.encoder.shared.weight, *(h.weight for h in model.head.heads)
    assert head0.grad is None  # expert 0 is not in the graph: nothing reaches it or, through it, the backbone
    # dL/dW_1 = M (q - e_y) h^T, q = softmax(v_1 + log pi); dL/dW_shared = W_1^T M (q - e_y) x^T
    q = torch.softmax(torch.tensor([2.0, 0.0, -2.0]) + torch.log(torch.tensor([3.0, 2.0, 1.0]) / 6), 0)
    delta = 2 * (q - torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(head1.grad, torch.outer(delta, x[0]), atol=1e-6)
    assert torch.allclose(shared.grad, torch.outer(2 * delta, x[0]), atol=1e-6)
    model.zero_grad(set_to_none=True)
    bsm(model(x), y).backward()  # Eq. 7: both heads and the backbone through both, each expert's logits / M
    q7 = torch.softmax(torch.tensor([1.5, 0.0, -1.5]) + torch.log(torch.tensor([3.0, 2.0, 1.0]) / 6), 0)
    assert torch.allclose(head1.grad, torch.outer((q7 - torch.tensor([1.0, 0.0, 0.0])) / 2, x[0]), atol=1e-6)
    assert head0.grad is not None and float(head0.grad.abs().sum()) > 0.1
    # the model's own experts' logits are the ones its mean is made of
    logits = model.expert_logits(x, [0, 1])
    assert torch.allclose(torch.stack(logits).mean(0), model(x)) and torch.allclose(logits[1], 2 * x)


def test_per_expert_loss_phase_flag_is_sent_only_with_that_loss(tmp_path):
    from fedlt.api import prepare
    from fedlt.methods.gbme import PHASE_KEY

    def server(**args):
        cfg = tiny(tmp_path, method="gbme", loss={"name": "bsm"}, method_args={"joint_warmup": 0.5, **args})
        cfg["fl"] = {**cfg["fl"], "rounds": 4}
        s = prepare(build_config(cfg)).server
        s.groups, s.gpi = [[0, 1], [2, 3], [4, 5]], torch.ones(10, dtype=torch.float64)
        return s

    default, released = server(), server(expert_loss="per_expert")
    for s in (default, released):
        s.select_clients(2, [1, 4, 5])  # joint round
    assert PHASE_KEY not in default.fit_message(2, 1).payload and released.fit_message(2, 1).payload[PHASE_KEY] is False
    cid = released.select_clients(3, [1, 4, 5])[0]  # per-expert round
    assert released.fit_message(3, cid).payload[PHASE_KEY] is True


def test_per_expert_training_scales_the_trained_experts_loss_by_m():
    """A client's per-expert fit is the fit of M x (the loss on its expert's logits): the same
    weights as training on that loss by hand, frozen experts unchanged."""
    from fedlt.losses import make_loss
    from fedlt.methods.gbme import PHASE_KEY
    from fedlt.training.sequential import train_local

    torch.manual_seed(0)
    model = multi_expert_model("cnn", 10, 3, num_experts=3, width=0.25)
    sent = clone_state(model)
    prior = torch.tensor([5.0, 4, 3, 3, 2, 2, 1, 1, 1, 1])
    ctx = client_ctx(model, counts=[12, 8, 4, 0, 0, 0, 0, 0, 0, 0])
    ctx.loss_config = fedlt.load_config(None, ["loss.name=bsm"]).loss
    msg = Message(weights=sent, payload={"experts": torch.tensor([1]), "prior": prior, PHASE_KEY: True})
    reply = GBMEClient(GBMEArgs(expert_loss="per_expert", warmup_rounds=0)).fit(ctx, msg)
    model.load_state_dict(sent)
    model.set_trainable_experts([1])
    bsm = make_loss("bsm", prior=prior)
    train_local(client_ctx(model, counts=[12, 8, 4, 0, 0, 0, 0, 0, 0, 0]),
                lambda x, y: 3 * bsm(model.expert_logits(x, [1])[0], y),
                params=[p for p in model.parameters() if p.requires_grad])
    by_hand = model.state_dict()
    assert all(torch.allclose(reply.weights[k], by_hand[k], atol=1e-6) for k in reply.weights)
    moved = [k for k in model.shared_keys() if not torch.equal(reply.weights[k], sent[k])]
    assert moved and all(torch.equal(by_hand[k], sent[k]) for k in model.expert_keys(0) + model.expert_keys(2))


def test_lpi_steps_caps_the_epoch_pass_at_its_first_steps():
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from fedlt.methods.gbme import fc_weights
    from fedlt.training.sequential import steps_per_epoch
    from fedlt.training.sequential import epoch_batches

    torch.manual_seed(0)
    model = multi_expert_model("cnn", 10, 3, num_experts=2, width=0.25)
    sent = clone_state(model)

    def lpi(**args):
        steps = []
        handle = register_optimizer_step_post_hook(lambda *_: steps.append(1))
        try:
            out = GBMEClient(GBMEArgs(num_experts=2, **args)).lpi(client_ctx(model), Message(weights=sent))
        finally:
            handle.remove()
        return out, len(steps)

    whole, whole_steps = lpi()
    assert whole_steps == steps_per_epoch(sum(COUNTS), 16) == 20
    two, two_steps = lpi(lpi_steps=2)
    assert two_steps == 2 and not torch.allclose(two, whole, atol=1e-3)
    capped, capped_steps = lpi(lpi_steps=50)  # a cap beyond the epoch: the whole epoch, bit for bit
    assert capped_steps == 20 and torch.equal(capped, whole)
    # one step: minus the row sums of the FC gradient of the epoch's first batch at the received model
    one, _ = lpi(lpi_steps=1)
    ctx = client_ctx(model)
    model.load_state_dict(sent)
    rows = next(epoch_batches(len(ctx.data), 16, ctx.generator()))
    x, y = ctx.data.batch(rows, ctx.generator(purpose=1))
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    expected = -torch.cat([w.grad for w in fc_weights(model)], dim=1).sum(1)
    assert torch.allclose(one, expected, atol=1e-6)


def test_released_count_estimate_hand_values():
    from fedlt.methods.proxy_prior import count_proxy, estimated_counts

    a, b = torch.tensor([3.0, 1.0, -2.0, 0.0, -1.0]), torch.tensor([-1.0, 2.0, 1.0, 4.0, -3.0])
    # a, n=50: entries <= 0 -> 1e-5, shares (3, 1, 1e-5, 1e-5, 1e-5) / 4.00003 -> 37.4997, 12.4999, ~0
    assert estimated_counts(a, 50).tolist() == [37.0, 12.0, 0.0, 0.0, 0.0]
    # b, n=21: (1e-5, 2, 1, 4, 1e-5) / 7.00002 -> 0, 5.99998, 2.99999, 11.99997, 0
    assert estimated_counts(b, 21).tolist() == [0.0, 6.0, 3.0, 12.0, 0.0]
    assert estimated_counts(torch.tensor([3.0, 5.0]), 4).tolist() == [2.0, 2.0]  # 1.5, 2.5: half to even, as numpy
    # summed (37, 18, 3, 12, 0), each class raised to 5
    assert count_proxy({0: a, 7: b}, {0: 50, 7: 21}).tolist() == [37.0, 18.0, 5.0, 12.0, 5.0]


def test_released_counts_become_the_gpi_the_prior_and_the_grouping_reference(tmp_path):
    from fedlt.api import prepare
    from fedlt.messages import Query

    server = prepare(build_config(tiny(tmp_path, method="gbme", loss={"name": "bsm"}))).server  # the default
    a, b = torch.tensor([3.0, 1.0, -2.0, 0.0, -1.0]), torch.tensor([-1.0, 2.0, 1.0, 4.0, -3.0])
    server.receive(Query(LPI_QUERY, {}), {0: Reply(payload={"lpi": a}, num_samples=50),
                                          7: Reply(payload={"lpi": b}, num_samples=21)})
    assert server.gpi.tolist() == [37.0, 18.0, 5.0, 12.0, 5.0]
    assert torch.equal(server.gpi_prior(), server.gpi)  # no zero left for gpi_floor
    w, v = 50 / 71, 21 / 71  # Eq. 5 (gpi_counts=proxy): positive entries weighted by n_k / n
    eq5 = torch.tensor([3 * w, w + 2 * v, v, 4 * v, 0.0], dtype=torch.float64)
    # GBME-p (the fixed pass) forms the same released estimate by default, and Eq. 5 on request
    for args, expected in [({"gpi_counts": "proxy"}, eq5),
                           ({"dp_epsilon": 10.0}, torch.tensor([37.0, 18.0, 5.0, 12.0, 5.0], dtype=torch.float64)),
                           ({"dp_epsilon": 10.0, "gpi_counts": "proxy"}, eq5)]:
        other = prepare(build_config(tiny(tmp_path, method="gbme", loss={"name": "bsm"}, method_args=args))).server
        other.receive(Query(LPI_QUERY, {}), {0: Reply(payload={"lpi": a}, num_samples=50),
                                             7: Reply(payload={"lpi": b}, num_samples=21)})
        assert torch.allclose(other.gpi, expected)


def test_released_options_end_to_end_with_the_gpi_distance(tmp_path):
    res = fedlt.run(tiny(tmp_path, method="gbme", loss={"name": "bsm"},
                         method_args={"expert_loss": "per_expert", "lpi_steps": 2, "gpi_counts": "released",
                                      "diagnose_gpi": True, "joint_warmup": 0.5}), quiet=True)
    server = res.summary["final"]["server_metrics"]
    assert all(math.isfinite(m["loss"]) for m in res.metrics)
    assert 0 < server["diag_nonprivate_gpi_tv"] < 1 and -1 <= server[DIAG_KEY] <= 1
    assert 0 < server["diag_nonprivate_gpi_prior_max_log_ratio"] < 20


def test_prior_log_error_is_the_largest_logit_bias_of_the_prior_the_loss_reads():
    from fedlt.methods.gbme import prior_log_error

    counts = torch.tensor([4.0, 2.0, 1.0, 1.0, 0.0])  # true prior (.5, .25, .125, .125); class 4 absent
    # q = (.5, .25, .21875, .03125, 0): class 3 at a quarter of its share, log 4; the absent class is not scored
    assert prior_log_error(torch.tensor([4.0, 2.0, 1.75, 0.25, 0.0]), counts) == pytest.approx(math.log(4), rel=1e-6)
    assert prior_log_error(counts * 7, counts) == pytest.approx(0.0, abs=1e-6)
    # a zero entry is read as the loss reads it, at the 1e-8 floor: log(0.125 / 1e-8)
    assert prior_log_error(torch.tensor([4.0, 2.0, 2.0, 0.0, 0.0]), counts) == pytest.approx(
        math.log(0.125 / 1e-8), rel=1e-6)


@pytest.mark.parametrize("backend", ["sequential", "graphed"])
def test_sequential_expert_aggregation_runs_one_sub_round_per_expert_from_the_last_ones_model(tmp_path, backend):
    """expert_aggregation=sequential (the released code): a per-expert round is M sub-rounds. Expert i's
    trainers (its selection) receive the model sub-round i-1 produced and train expert i only; the
    whole model is then their FedAvg; the fit phase itself trains no one. The round's train loss is
    its sub-rounds'."""
    from fedlt.api import prepare
    from fedlt.methods.aggregation import weighted_average
    from fedlt.methods.gbme import EXPERT_FIT_QUERY

    cfg = tiny(tmp_path, method="gbme", loss={"name": "bsm"}, fl={**tiny(tmp_path)["fl"], "rounds": 1},
               method_args={"expert_aggregation": "sequential", "joint_warmup": 0}, run={
                   **tiny(tmp_path)["run"], "backend": backend})
    sim = prepare(build_config(cfg))
    server, seen, fits = sim.server, [], []
    receive, exchange = server.receive, sim._exchange

    def recording_receive(query, replies):
        if query.name == EXPERT_FIT_QUERY:
            seen.append((query, replies, {k: v.clone() for k, v in server.model.state_dict().items()}))
        receive(query, replies)
        if query.name == EXPERT_FIT_QUERY:
            seen[-1] += ({k: v.clone() for k, v in server.model.state_dict().items()},)

    def recording_exchange(kind, rnd, messages):
        messages = list(messages)
        if kind == "fit":
            fits.append(messages)
        return exchange(kind, rnd, messages)

    server.receive, sim._exchange = recording_receive, recording_exchange
    sim.setup()
    metrics = sim.fit_round(1)
    assert len(seen) == 3 and fits in ([], [[]])  # three experts; nobody trains in the fit phase
    for expert, (query, replies, before, after) in enumerate(seen):
        assert sorted(query.messages) == sorted(c for c, ex in server.selection.items() if expert in ex)
        for msg in query.messages.values():
            assert msg.payload["experts"].tolist() == [expert]
            assert all(torch.equal(msg.weights[k], before[k]) for k in msg.weights)  # the previous sub-round's model
        for reply in replies.values():  # the backbone and expert i, nothing of the frozen experts
            assert set(reply.weights) == set(server.model.shared_keys()) | set(server.model.expert_keys(expert))
        average = weighted_average(replies)
        assert all(torch.equal(after[k], average[k].to(after[k].dtype)) for k in average)
        frozen = [k for e in range(3) if e != expert for k in server.model.expert_keys(e)]
        assert all(torch.equal(after[k], before[k]) for k in frozen)
    losses = [(r.metrics["train_loss"], r.num_samples) for _, replies, _, _ in seen for r in replies.values()]
    assert metrics["train_loss"] == pytest.approx(sum(l * n for l, n in losses) / sum(n for _, n in losses))
    assert metrics["trainers"] == len(server.selection)


def test_option_config_errors():
    with pytest.raises(ConfigError, match="lpi_steps"):
        fedlt.run(tiny("/nonexistent", method="gbme", loss={"name": "bsm"},
                       method_args={"lpi_steps": 2, "lpi_pass": "fixed"}), quiet=True)
    with pytest.raises(ConfigError, match="lpi_steps"):
        fedlt.run(tiny("/nonexistent", method="gbme", loss={"name": "bsm"},
                       method_args={"lpi_steps": 2, "dp_epsilon": 5}), quiet=True)
    with pytest.raises(ConfigError, match="ensemble=true"):
        fedlt.run(tiny("/nonexistent", method="gbme", loss={"name": "bsm"},
                       method_args={"expert_loss": "per_expert", "ensemble": False}), quiet=True)
    with pytest.raises(ConfigError, match="lpi_steps"):
        fedlt.run(tiny("/nonexistent", method="gbme", loss={"name": "bsm"}, method_args={"lpi_steps": 0}), quiet=True)
    with pytest.raises(ConfigError, match="calibration=creff reads each client's fit reply, but method gbme under "
                                          "these options trains outside the fit phase"):  # CReFF would see no replies
        fedlt.run(tiny("/nonexistent", method="gbme", loss={"name": "bsm"}, calibration=["creff"],
                       method_args={"expert_aggregation": "sequential"}), quiet=True)
    from fedlt.run_parts import check_config

    check_config(build_config(tiny("/nonexistent", method="gbme", loss={"name": "bsm"}, calibration=["ccvr"],
                                   method_args={"expert_aggregation": "sequential"})))  # a post-hoc one reads no fit
    with pytest.raises(ConfigError, match="expert_aggregation=sequential runs one sub-round per expert"):
        fedlt.run(tiny("/nonexistent", method="gbme", loss={"name": "bsm"},
                       method_args={"expert_aggregation": "sequential", "ensemble": False}), quiet=True)
    with pytest.raises(ConfigError, match="gpi_counts"):
        fedlt.run(tiny("/nonexistent", method="gbme", loss={"name": "bsm"}, method_args={"gpi_counts": "x"}),
                  quiet=True)
