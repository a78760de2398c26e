"""FedLoGe: SSE-C broadcast, Algorithm 1's three heads, GA-FR / LA-FR, personal-head privacy, resume."""

from __future__ import annotations

import pytest
import torch

import fedlt
from conftest import run_until_crash_in_round_3
from fedlt.errors import ConfigError
from fedlt.methods.fedloge import FedLoGeArgs, FedLoGeClient, ga_fr, global_head, la_fr
from fedlt.models.etf import classifier_geometry, etf_angle
from fedlt.results import TIMING_KEYS

FAST_SSE_C = {"sse_steps": 300, "sse_lr": 1e-3}


def tiny(tmp_path, name="run", **method_args) -> dict:
    return {
        "seed": 2, "method": "fedloge", "method_args": {**FAST_SSE_C, **method_args},
        "data": {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 4},
        "fl": {"rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "eval": {"every": 1},
        "run": {"out_dir": str(tmp_path), "name": name, "checkpoint_every": 1, "threads": 1},
    }


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def test_ga_fr_gives_unit_rows_with_the_same_directions():
    psi = torch.randn(10, 32) * torch.linspace(0.1, 5, 10)[:, None]
    out = ga_fr(psi)
    assert torch.allclose(out.norm(dim=1), torch.ones(10), atol=1e-6)
    assert torch.allclose(torch.cosine_similarity(out, psi, dim=1), torch.ones(10), atol=1e-6)


def test_la_fr_gives_the_personal_norms_and_the_global_directions():
    psi = torch.randn(10, 32) * torch.linspace(0.1, 5, 10)[:, None]
    phi = torch.randn(10, 32) * torch.linspace(3, 0.2, 10)[:, None]
    out = la_fr(psi, phi)
    assert torch.allclose(out.norm(dim=1), phi.norm(dim=1), atol=1e-5)
    assert torch.allclose(torch.cosine_similarity(out, psi, dim=1), torch.ones(10), atol=1e-6)


def test_la_fr_raw_is_eq_7_as_written():
    """``la_fr_psi=raw``: psi_c itself times ||phi_kc||, so psi's long-tailed norms multiply in."""
    psi = torch.randn(10, 32) * torch.linspace(0.1, 5, 10)[:, None]
    phi = torch.randn(10, 32) * torch.linspace(3, 0.2, 10)[:, None]
    out = la_fr(psi, phi, raw=True)
    assert torch.allclose(out.norm(dim=1), psi.norm(dim=1) * phi.norm(dim=1), rtol=1e-5)
    assert torch.equal(out, psi * phi.norm(dim=1, keepdim=True))


def test_raw_la_fr_changes_only_the_personal_models_and_is_refused_where_unused(tmp_path):
    """The released code's realignment step (phi_k + psi_c ||phi_kc||, absent classes masked) trains the
    same and evaluates the same global model; only PM changes. Where no LA-FR head is built, the knob
    would do nothing and is refused."""
    unit = fedlt.run(tiny(tmp_path, "unit", personal_head="realigned_plus_phi", la_fr_psi="unit"), quiet=True)
    raw = fedlt.run(tiny(tmp_path, "raw", personal_head="realigned_plus_phi", la_fr_psi="raw"), quiet=True)
    for a, b in zip(unit.metrics, raw.metrics):
        assert a["train_loss"] == b["train_loss"] and a["acc"] == b["acc"] and a["variants"] == b["variants"]
    assert [r["pm_acc"] for r in unit.metrics] != [r["pm_acc"] for r in raw.metrics]
    for bad in ({"la_fr": False}, {"personal_head": "psi_plus_phi"}):
        with pytest.raises(ConfigError, match=r"^invalid method_args for method fedloge: la_fr_psi=raw chooses "
                                              r"LA-FR's psi, which this personal head does not use; .*la_fr_psi$"):
            fedlt.run(tiny(tmp_path, "bad", la_fr_psi="raw", **bad), quiet=True)


def spy_on_fit(monkeypatch) -> list[dict]:
    """Record, for every fit call, the client's state before and after and the reply it sent."""
    calls = []
    original = FedLoGeClient.fit

    def fit(self, ctx, msg):
        before = {k: v.clone() for k, v in ctx.state.items()}
        reply = original(self, ctx, msg)
        calls.append({"cid": ctx.cid, "round": ctx.round, "before": before,
                      "after": {k: v.clone() for k, v in ctx.state.items()}, "reply": reply,
                      "sse_c": msg.weights["head.fixed.weight"].clone()})
        return reply

    monkeypatch.setattr(FedLoGeClient, "fit", fit)
    return calls


def test_personal_heads_persist_across_rounds_and_never_reach_the_server(tmp_path, monkeypatch):
    calls = spy_on_fit(monkeypatch)
    res = fedlt.run(tiny(tmp_path), quiet=True)
    assert len(calls) == 8  # 4 clients x 2 rounds
    for call in calls:
        reply, phi = call["reply"], call["after"]["personal/phi/weight"]
        assert set(call["after"]) == {"personal/phi/weight"}  # bias-free personal head, nothing else kept
        # the upload is the backbone and psi only: no personal entry, no copy of phi's values
        assert all(k.startswith(("encoder.", "head.aux.")) for k in reply.weights)
        assert "head.aux.weight" in reply.weights and not reply.payload
        sent = [v for v in (*reply.weights.values(), *reply.payload.values()) if isinstance(v, torch.Tensor)]
        assert not any(v.shape == phi.shape and torch.allclose(v, phi) for v in sent)
    by_client = {}
    for call in calls:
        by_client.setdefault(call["cid"], []).append(call)
    for first, second in by_client.values():
        assert first["before"] == {}  # starts without a personal head ...
        # ... and the second round starts from exactly what the first one stored (evaluation in between)
        assert torch.equal(second["before"]["personal/phi/weight"], first["after"]["personal/phi/weight"])
        assert not torch.equal(second["after"]["personal/phi/weight"], second["before"]["personal/phi/weight"])
    # every client receives the same sparse SSE-C in every round
    sse_c = calls[0]["sse_c"]
    assert all(torch.equal(c["sse_c"], sse_c) for c in calls)
    assert classifier_geometry(sse_c)["sparsity"] == pytest.approx(0.6, abs=1e-9)
    final = res.summary["final"]
    assert final["acc"] is not None and final["pm_acc"] is not None
    assert set(final["variants"]) == {"psi_ga_fr", "psi_raw"}  # the default GM is the SSE-C itself
    # the fixed head is never uploaded: up-model bytes are the model minus the SSE-C's weight and bias
    up = res.summary["messages"]["fit"]["from_client"]["model_bytes"]
    down = res.summary["messages"]["fit"]["to_client"]["model_bytes"]
    assert down - up == (10 * 128 + 10) * 4


def test_realignments_change_only_evaluation(tmp_path):
    """GA-FR, LA-FR and the generic head act after training: switching them leaves training
    identical, the GM without GA-FR equals the raw-psi variant of the run with it, the GM with the
    fixed head its SSE-C variant, and LA-FR changes only PM."""
    full = fedlt.run(tiny(tmp_path, "full", generic_head="psi"), quiet=True)  # the paper's GM: GA-FR(psi)
    no_ga = fedlt.run(tiny(tmp_path, "no_ga", ga_fr=False, generic_head="psi"), quiet=True)
    no_la = fedlt.run(tiny(tmp_path, "no_la", la_fr=False, generic_head="psi"), quiet=True)
    fixed = fedlt.run(tiny(tmp_path, "fixed"), quiet=True)  # the default: the released code's GM, the SSE-C
    for a, b, c, d in zip(full.metrics, no_ga.metrics, no_la.metrics, fixed.metrics):
        assert a["train_loss"] == b["train_loss"] == c["train_loss"] == d["train_loss"]
        assert b["acc"] == a["variants"]["psi_raw"]["acc"] and a["acc"] == b["variants"]["psi_ga_fr"]["acc"]
        assert b["pm_acc"] == a["pm_acc"] and c["acc"] == a["acc"]
        assert d["acc"] == a["variants"]["sse_c"]["acc"] and d["variants"]["psi_ga_fr"]["acc"] == a["acc"]
        assert d["variants"]["psi_raw"] == a["variants"]["psi_raw"] and d["pm_acc"] == a["pm_acc"]
    assert set(fixed.summary["final"]["variants"]) == {"psi_ga_fr", "psi_raw"}
    assert [r["pm_acc"] for r in no_la.metrics] != [r["pm_acc"] for r in full.metrics]


def test_dense_etf_ablation_and_code_variant(tmp_path, monkeypatch):
    calls = spy_on_fit(monkeypatch)
    etf = fedlt.run(tiny(tmp_path, "etf", classifier="etf", personal_head="realigned_plus_phi",
                         finetune_epochs=1), quiet=True)
    geo = classifier_geometry(calls[0]["sse_c"])
    assert geo["sparsity"] == 0 and geo["angle_min"] == pytest.approx(etf_angle(10), abs=1e-3)
    assert geo["norm_mean"] == pytest.approx(1.0, abs=1e-5)  # the default gamma, the paper's
    assert set(etf.summary["final"]["variants"]) == {"psi_ga_fr", "psi_raw"}  # the GM is the ETF itself
    assert etf.summary["final"]["pm_acc"] is not None
    with pytest.raises(ConfigError, match=r"^invalid method_args for method fedloge: .*; set la_fr=true$"):
        fedlt.run(tiny(tmp_path, "bad", la_fr=False, personal_head="realigned_plus_phi"), quiet=True)
    with pytest.raises(ConfigError, match="loss"):
        fedlt.run({**tiny(tmp_path, "bad2"), "loss": {"name": "bsm"}}, quiet=True)


def test_resume_restores_personal_heads(tmp_path, monkeypatch):
    """Personal heads are checkpointed with the engine's client state: a run cut after round 2 and
    resumed ends exactly where an uninterrupted one does."""
    cfg = {**tiny(tmp_path / "a", "full"), "fl": {**tiny(tmp_path)["fl"], "rounds": 3}}
    full = fedlt.run(cfg, quiet=True)
    cut_cfg = {**cfg, "run": {**cfg["run"], "out_dir": str(tmp_path / "b"), "name": "cut"}}
    run_until_crash_in_round_3(cut_cfg, monkeypatch)
    ckpt = torch.load(tmp_path / "b" / "cut" / "checkpoint.pt", weights_only=True)
    assert all("personal/phi/weight" in s for s in ckpt["clients"].values()) and len(ckpt["clients"]) == 4
    resumed = fedlt.resume(tmp_path / "b" / "cut", quiet=True)
    assert without_timing(resumed.metrics) == without_timing(full.metrics)


def test_global_head_drops_psi_bias_only_with_ga_fr():
    psi, bias = torch.randn(10, 16) * 3, torch.randn(10)
    weight, b = global_head(psi, bias, realign=True)
    assert b is None and torch.allclose(weight.norm(dim=1), torch.ones(10), atol=1e-6)
    weight, b = global_head(psi, bias, realign=False)
    assert torch.equal(weight, psi) and torch.equal(b, bias)


def test_head_bias_is_uploaded_for_psi_and_kept_locally_for_phi(tmp_path, monkeypatch):
    calls = spy_on_fit(monkeypatch)
    seen = []
    original = FedLoGeClient.personalize

    def personalize(self, ctx, msg):
        original(self, ctx, msg)
        if "personal/phi/bias" in ctx.state and self.args.personal_head == "realigned" and self.args.la_fr_psi == "unit":
            seen.append((ctx.model.head.fixed.bias.clone(), ctx.state["personal/phi/bias"].clone()))

    monkeypatch.setattr(FedLoGeClient, "personalize", personalize)
    res = fedlt.run(tiny(tmp_path, head_bias=True), quiet=True)
    for call in calls:
        assert set(call["after"]) == {"personal/phi/weight", "personal/phi/bias"}
        assert "head.aux.bias" in call["reply"].weights
        assert not any(torch.equal(v, call["after"]["personal/phi/bias"]) for v in call["reply"].weights.values())
    # the personalized model predicts with phi_k's own bias (LA-FR touches only the class vectors)
    assert seen and all(torch.equal(model_bias, phi_bias) and phi_bias.abs().sum() > 0 for model_bias, phi_bias in seen)
    assert res.summary["final"]["pm_acc"] is not None


def test_head_lr_scale_changes_the_heads_and_never_the_backbone(tmp_path, monkeypatch):
    """psi and phi_k learn on detached features, so their step size cannot move the backbone."""
    calls = spy_on_fit(monkeypatch)
    fedlt.run(tiny(tmp_path, "one"), quiet=True)
    fedlt.run(tiny(tmp_path, "small", head_lr_scale=0.1), quiet=True)
    half = len(calls) // 2
    for a, b in zip(calls[:half], calls[half:]):
        enc = [k for k in a["reply"].weights if k.startswith("encoder.")]
        assert enc and all(torch.equal(a["reply"].weights[k], b["reply"].weights[k]) for k in enc)
        assert not torch.allclose(a["reply"].weights["head.aux.weight"], b["reply"].weights["head.aux.weight"])
        assert not torch.allclose(a["after"]["personal/phi/weight"], b["after"]["personal/phi/weight"])


def test_gamma_auto_sets_the_sse_c_norm_to_the_initial_backbones_mean_feature_norm(tmp_path):
    from fedlt.api import prepare
    from fedlt.config import build_config
    from fedlt.methods.fedloge import NORM_QUERY

    sim = prepare(build_config(tiny(tmp_path, gamma="auto", classifier="etf")))  # dense: norms exactly gamma
    assert not bool(sim.server.model.head.fixed.weight.any())  # no SSE-C before the clients' norms
    initial = sim._new_model()
    initial.load_state_dict(sim.server.model.state_dict())
    initial.train()
    with torch.no_grad():  # the norm every client measures, pooled over all their data
        norms = [initial.forward_features(sim._context(c, 0).data.batch(torch.arange(len(sim._context(c, 0).data)))[0])
                 .norm(dim=1) for c in range(4)]
    expected = float(torch.cat(norms).mean())
    sim.setup()
    assert sim.server.gamma == pytest.approx(expected, rel=1e-5) and sim.server.metrics()["sse_c_gamma"] == sim.server.gamma
    row_norms = sim.server.model.head.fixed.weight.norm(dim=1)
    assert torch.allclose(row_norms, torch.full_like(row_norms, expected), rtol=1e-5)
    sent = sim.message_record[f"query:{NORM_QUERY}"]["from_client"]["payload"]
    # the record keeps the first reply of each kind: a float, the first client's own mean norm
    assert sent["feature_norm"]["bytes"] == 8 and isinstance(sent["feature_norm"]["value"], float)
    assert sent["feature_norm"]["value"] == pytest.approx(float(norms[0].mean()), rel=1e-5)
    # under secure aggregation the server gets only the weighted mean, and the same gamma
    cfg = tiny(tmp_path, name="secure", gamma="auto", classifier="etf")
    secure = prepare(build_config({**cfg, "secagg": {"enabled": True}}))
    secure.setup()
    assert secure.server.gamma == pytest.approx(expected, rel=1e-5)
    assert f"query:{NORM_QUERY}" not in secure.secure.in_clear


@pytest.mark.parametrize("model,given,expected", [("cnn", None, 1.0), ("resnet8", None, 1.0), ("cnn", 4, 4.0),
                                                  ("resnet8", 2.5, 2.5)])
def test_default_gamma_is_the_papers_on_every_model_and_a_given_gamma_wins(tmp_path, model, given, expected):
    from fedlt.api import prepare
    from fedlt.config import build_config

    args = {"classifier": "etf"} if given is None else {"classifier": "etf", "gamma": given}  # dense: norms exactly gamma
    sim = prepare(build_config({**tiny(tmp_path, **args), "model": {"name": model}}))
    assert sim.server.gamma is None  # built in the setup stage, which shows progress when it takes long
    sim.setup()
    assert sim.server.gamma == expected and sim.server.metrics()["sse_c_gamma"] == expected
    row_norms = sim.server.model.head.fixed.weight.norm(dim=1)
    assert torch.allclose(row_norms, torch.full_like(row_norms, expected), rtol=1e-5)


def one_client_fit(reading: str, epochs: int, lr: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """psi and phi_k after ``epochs`` local steps on one sample: features h = (2, 0), label 0,
    both heads start at all-ones (equal logits), the SSE-C is zero (no gradient to the backbone)."""
    from fedlt.messages import Message
    from fedlt.methods.base import ClientContext, ClientData, TrainSettings, clone_state
    from fedlt.methods.fedloge import FedLoGeArgs, FedLoGeHead
    from fedlt.models import FedModel

    model = FedModel(torch.nn.Flatten(), 2, 2, FedLoGeHead(2, 2))
    with torch.no_grad():
        model.head.aux.weight.fill_(1.0)
    data = ClientData(torch.tensor([[[[255, 0]]]], dtype=torch.uint8), torch.tensor([0]), torch.tensor([0]), 2,
                      lambda x: 2 * x)
    ctx = ClientContext(0, 1, model, data, {"personal/phi/weight": torch.ones(2, 2)},
                        TrainSettings(epochs, 1, lr, 0.9, 5e-4, None), torch.device("cpu"), 0)
    reply = FedLoGeClient(FedLoGeArgs(head_optimizer=reading)).fit(ctx, Message(weights=clone_state(model)))
    return reply.weights["head.aux.weight"], ctx.state["personal/phi/weight"]


@pytest.mark.parametrize("reading,one_step,two_steps", [
    # run: lr 0.05, momentum 0.9, weight decay 5e-4 (as before the knob). Step 1: gradient
    # (p - e_0) h^T = [[-1, 0], [1, 0]] at p = (0.5, 0.5); w -= 0.05 * (g + 5e-4 * 1).
    # Step 2: logits differ by 2 * (1.049975 - 0.949975) = 0.2, g_00 = 2 * (sigmoid(0.2) - 1)
    # = -0.900332; buffer = 0.9 * buffer_1 + g + 5e-4 * w. (Values to 9 decimals, from the same
    # recursion in float64: the tolerance is then all float32's, a few ulps of 1.)
    ("run", [[1.049975, 0.999975], [0.949975, 0.999975]], [[1.139942851, 0.999927501], [0.859912150, 0.999927501]]),
    # released: lr 0.03, momentum 0.5, no weight decay: w -= 0.03 * g; step 2 at a logit gap of
    # 0.12, buffer = 0.5 * buffer_1 + g; columns without gradient never move.
    ("released", [[1.03, 1.0], [0.97, 1.0]], [[1.073202157, 1.0], [0.926797843, 1.0]]),
])
def test_head_optimizer_steps_psi_and_phi_by_the_hand_computed_sgd_update(reading, one_step, two_steps):
    for epochs, expected in ((1, one_step), (2, two_steps)):
        for head in one_client_fit(reading, epochs):
            assert torch.allclose(head, torch.tensor(expected), atol=1e-6, rtol=0), (reading, epochs, head)


def test_released_head_optimizer_ignores_the_runs_learning_rate_and_schedule(tmp_path):
    for head, other in zip(one_client_fit("released", 2), one_client_fit("released", 2, lr=0.0123)):
        assert torch.equal(head, other)
    with pytest.raises(ConfigError, match="head_optimizer"):
        fedlt.run(tiny(tmp_path, "bad", head_optimizer="adam"), quiet=True)


def personalized_model(args: dict, state: dict, lr: float = 0.05, base_lr: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The classifier (weight, bias) a client's personalized model predicts with; its data: one
    sample of class 0 (class 1 absent); psi = diag(1, 2), the received SSE-C = 3 * identity."""
    from fedlt.messages import Message
    from fedlt.methods.base import ClientContext, ClientData, TrainSettings, clone_state
    from fedlt.methods.fedloge import FedLoGeArgs, FedLoGeHead
    from fedlt.models import FedModel

    model = FedModel(torch.nn.Flatten(), 2, 2, FedLoGeHead(2, 2, args.get("head_bias", False)))
    with torch.no_grad():
        model.head.aux.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
        model.head.fixed.weight.copy_(3 * torch.eye(2))
        if model.head.aux.bias is not None:
            model.head.aux.bias.copy_(torch.tensor([0.3, -0.3]))
    data = ClientData(torch.tensor([[[[255, 0]]]], dtype=torch.uint8), torch.tensor([0]), torch.tensor([0]), 2,
                      lambda x: 2 * x)
    ctx = ClientContext(0, 5, model, data, dict(state), TrainSettings(1, 1, lr, 0.0, 0.0, None, base_lr),
                        torch.device("cpu"), 0)
    FedLoGeClient(FedLoGeArgs(**args)).personalize(ctx, Message(weights=clone_state(model)))
    return model.head.fixed.weight.detach().clone(), model.head.fixed.bias.detach().clone()


def personalized_head(args: dict, state: dict, lr: float = 0.05, base_lr: float | None = None) -> torch.Tensor:
    return personalized_model(args, state, lr, base_lr)[0]


def test_a_client_that_never_trained_is_evaluated_with_the_global_model():
    """No phi_k yet: the personalized model is the GM, whichever head the GM reads (the SSE-C by
    default, GA-FR(psi) with generic_head=psi)."""
    assert torch.equal(personalized_head({}, {}), 3 * torch.eye(2))
    assert torch.equal(personalized_head({"generic_head": "psi"}, {}), torch.eye(2))


def test_fine_tuning_at_evaluation_steps_at_the_runs_lr_not_the_decayed_one():
    """finetune_epochs after LA-FR: one SGD step on (h = (2, 0), label 0) at fl.lr, however far the
    schedule has decayed the round's lr; finetune_lr overrides it."""
    phi = {"personal/phi/weight": torch.ones(2, 2)}
    tune = {"finetune_epochs": 1, "personal_head": "realigned"}
    at_base = personalized_head(tune, phi, lr=0.05)
    assert torch.equal(personalized_head(tune, phi, lr=1e-6, base_lr=0.05), at_base)
    # LA-FR head: rows (sqrt 2, 0), (0, sqrt 2); gradient (p - e_0) h^T with p = softmax((2 sqrt 2, 0))
    p0 = torch.sigmoid(torch.tensor(2 * 2 ** 0.5)).item()
    expected = torch.tensor([[2 ** 0.5 + 0.05 * 2 * (1 - p0), 0.0], [-0.05 * 2 * (1 - p0), 2 ** 0.5]])
    assert torch.allclose(at_base, expected, atol=1e-6, rtol=0)
    assert torch.equal(personalized_head({**tune, "finetune_lr": 0.01}, phi, lr=1e-6, base_lr=0.05),
                       personalized_head(tune, phi, lr=0.01))
    assert not torch.equal(personalized_head(tune, phi, lr=1e-6), at_base)


def test_the_released_codes_personal_output_adds_the_raw_psi_and_phi_and_masks_absent_classes():
    phi = {"personal/phi/weight": torch.tensor([[0.5, 0.0], [0.0, 0.25]])}
    weight, bias = personalized_model({"personal_head": "psi_plus_phi"}, phi)
    assert torch.equal(weight, torch.tensor([[1.5, 0.0], [0.0, 2.25]]))  # psi + phi_k: no LA-FR
    assert bias.tolist() == [0.0, -1e9]  # class 1: no sample on this client
    with_bias = {**phi, "personal/phi/bias": torch.tensor([0.1, 0.2])}
    _, bias = personalized_model({"personal_head": "psi_plus_phi", "head_bias": True}, with_bias)
    assert bias[0].item() == pytest.approx(0.3 + 0.1)  # psi's bias + phi_k's
    assert bias[1].item() <= -1e9 + 1e3  # still masked (float32 cannot show the -0.1 added to -1e9)
    with pytest.raises(ValueError, match="finetune_epochs=0"):
        FedLoGeArgs(personal_head="psi_plus_phi", finetune_epochs=1)
