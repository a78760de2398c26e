"""The vectorized backend equals sequential training, client by client and round by round."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import yaml

import fedlt
from conftest import assert_clients_equal_sequential_training
from fedlt.api import prepare
from fedlt.errors import ConfigError
from fedlt.messages import Message
from fedlt.methods.base import clone_state
from fedlt.training.batched import train_clients
from fedlt.training.graphed import GraphedTrainer


def config(tmp_path, *overrides: str):
    return fedlt.load_config(None, [
        "seed=1", "data.dataset=synthetic", "data.imbalance_factor=10", "data.num_clients=5", "fl.participation=0.8",
        "fl.local_epochs=1", "fl.rounds=2", "eval.every=1", f"run.out_dir={tmp_path}", "run.threads=1",
        "run.checkpoint_every=0", *overrides,
    ])


def graphed(model, contexts, starts, objectives):
    """The graphed backend's trainer (on a CPU: its step without capture, one client at a time)."""
    return GraphedTrainer(model, lanes=4).train(contexts, starts, objectives)


@pytest.mark.parametrize("trainer", [train_clients, graphed], ids=["vectorized", "graphed"])
@pytest.mark.parametrize("model,loss,extra", [
    ("resnet8", "ldam", ["data.augment=strong", "fl.grad_clip=0.5"]),  # BatchNorm, margins, augmentation, clipping
    ("cnn", "la", ["fl.local_epochs=2", "fl.weight_decay=0.01"]),
])
def test_batched_clients_equal_sequential_training_exactly(tmp_path, float64, model, loss, extra, trainer):
    sim = prepare(config(tmp_path, f"model.name={model}", f"loss.name={loss}", "fl.batch_size=16", "data.image_size=8",
                         *extra))
    assert sim.worker.head.weight.dtype == torch.float64
    msg = Message(weights=clone_state(sim.worker))
    cids = sim.schedule[0]
    contexts = [sim._context(c, 1) for c in cids]
    steps = {-(-len(ctx.data) // 16) for ctx in contexts}
    assert len(steps) > 1, "the test needs clients with unequal numbers of batches"
    batched = trainer(sim.worker, contexts, [dict(msg.weights)] * len(cids),
                      [sim.client.local_objective(ctx, msg) for ctx in contexts])
    assert_clients_equal_sequential_training(sim, msg, cids, batched, tol=1e-10)


@pytest.mark.parametrize("method,extra,together", [
    ("fedavg", ["loss.name=la"], "vectorized"),
    ("fedprox", ["method_args.mu=0.5"], "vectorized"),
    # BatchNorm; half the data and one evaluation: float64 convolutions are slow on CPU
    ("fedavg", ["model.name=resnet8", "data.image_size=8", "loss.name=bsm", "data.train_fraction=0.5", "eval.every=2"],
     "vectorized"),
    ("fedavg", ["loss.name=la"], "graphed"),
    ("fedprox", ["method_args.mu=0.5", "fl.lr_schedule=cosine"], "graphed"),  # a new learning rate each round
    ("fedlc", [], "vectorized"),  # per-client margins, infinite for the classes a client lacks
    # the fixed ETF a buffer of every client's model, left out of the reply; personalization adapts the ETF
    ("fedetf", ["method_args.adapt_iterations=2"], "vectorized"),
    ("fedper", [], "vectorized"),  # each client starts from its own head, loaded over the received weights
    ("centralized", ["data.partition=iid"], "vectorized"),  # the pooled data: one client, many steps
])
def test_vectorized_run_equals_sequential_run(tmp_path, float64, method, extra, together):
    runs = {}
    for backend in ("sequential", together):
        sim = prepare(config(tmp_path, f"method={method}", f"run.backend={backend}", *extra))
        assert sim.backend == backend
        states, aggregate = [], sim.server.aggregate  # capture the global model after each aggregation

        def spy(rnd, replies, aggregate=aggregate, states=states, sim=sim):
            aggregate(rnd, replies)
            states.append(clone_state(sim.server.model))

        sim.server.aggregate = spy
        (tmp_path / backend).mkdir()
        result = sim.run(tmp_path / backend, quiet=True)
        runs[backend] = (states, result)
    (seq_states, seq), (vec_states, vec) = runs["sequential"], runs[together]
    assert len(seq_states) == len(vec_states) == 2
    for seq_state, vec_state in zip(seq_states, vec_states):
        for name, value in seq_state.items():
            assert value.dtype in (torch.float64, torch.int64), name
            assert torch.allclose(vec_state[name], value, rtol=0, atol=1e-10), name
    assert [r["train_loss"] for r in vec.metrics] == pytest.approx([r["train_loss"] for r in seq.metrics], rel=1e-10)
    # models 1e-15 apart classify alike unless a test sample's top two logits tie within ~1e-14
    accuracies = lambda rows: [(r.get("acc"), r.get("pm_acc")) for r in rows]  # noqa: E731 (FedPer: no global model)
    assert accuracies(vec.metrics) == accuracies(seq.metrics) and accuracies(seq.metrics)[-1] != (None, None)
    assert json.loads((vec.run_dir / "summary.json").read_text())["backend"] == together
    assert vec.summary["communication_bytes"] == seq.summary["communication_bytes"]


def test_the_captured_sgd_update_equals_the_uncaptured_one_to_rounding(tmp_path, float64):
    """A captured step reads the learning rate from a tensor (so a schedule needs no new graphs):
    p + d * (-lr) rounds at most once more than torch.optim.SGD's p + (-lr) * d, nothing else differs."""
    from fedlt.losses import cross_entropy
    from fedlt.methods.base import TrainSettings
    from fedlt.training.graphed import Lane, _step_function

    sim = prepare(config(tmp_path))
    train = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-3, grad_clip=0.5)
    x, y = torch.randn(8, 3, 16, 16), torch.arange(8) % 10
    lanes = []
    for captured in (False, True):
        lane = Lane(copy.deepcopy(sim.worker), None)
        lane.neg_lr.fill_(-train.lr)
        step = _step_function(cross_entropy, {}, 0.0, train, captured)
        for _ in range(3):
            step(lane, x, y)
        lanes.append(lane)
    plain, captured = lanes
    assert float(captured.total) == pytest.approx(float(plain.total), rel=1e-12)
    for p, q in zip(plain.params, captured.params):
        assert torch.allclose(p, q, rtol=0, atol=1e-12)
    assert not all(torch.equal(p, q) for p, q in zip(sim.worker.parameters(), plain.params))  # it trained


def test_the_graphed_trainer_makes_each_client_only_when_a_lane_is_free(tmp_path, monkeypatch):
    """On a GPU the host makes the next clients' messages, contexts and objectives while the lanes
    train the first ones: the trainer takes a job from its iterator only when a lane needs one (here
    one lane: after the previous client's last step). A job whose step differs from the first one's is
    handed back untrained, and the others are trained exactly as the eager ``train`` trains them."""
    from dataclasses import replace

    sim = prepare(config(tmp_path, "fl.batch_size=16", "fl.participation=1.0"))
    msg = Message(weights=clone_state(sim.worker))
    cids = sim.schedule[0]
    contexts = [sim._context(c, 1) for c in cids]
    objectives = [sim.client.local_objective(ctx, msg) for ctx in contexts]
    objectives[1] = replace(objectives[1], prox_mu=0.5)  # another form of step: not in the first one's graphs
    events = []
    trainer = GraphedTrainer(sim.worker, lanes=1)
    run_step = trainer._run_step
    monkeypatch.setattr(trainer, "_run_step", lambda *args: (events.append("step"), run_step(*args))[1])

    def jobs():
        for k, (ctx, objective) in enumerate(zip(contexts, objectives)):
            events.append(k)
            yield ctx, dict(msg.weights), objective

    lazily = trainer.train_as_made(jobs())
    steps = [-(-len(ctx.data) // 16) for ctx in contexts]
    assert len(set(steps)) > 1 and all(steps)
    # job 0, its steps, jobs 1 (declined) and 2, the steps of 2, job 3, ...
    expected = [0]
    for k in range(1, len(cids)):
        expected += ["step"] * steps[k - 1] * (k - 1 != 1) + [k]
    assert events == expected + ["step"] * steps[-1]
    assert lazily[1] is None and len(lazily) == len(cids)
    fitting = [k for k in range(len(cids)) if k != 1]
    eager = GraphedTrainer(sim.worker, lanes=1).train([contexts[k] for k in fitting], [dict(msg.weights)] * len(fitting),
                                                       [objectives[k] for k in fitting])
    for k, (state, metrics, _) in zip(fitting, eager):
        assert lazily[k][1] == metrics and all(torch.equal(lazily[k][0][n], v) for n, v in state.items())
    with pytest.raises(ValueError, match="share the form of their step"):
        trainer.train(contexts, [dict(msg.weights)] * len(cids), objectives)


def test_a_calibrated_method_trains_together_and_its_payload_arrives(tmp_path):
    """CReFF (FedAvg calibrated by federated features): its clients' gradients, computed from the
    received model before training, ride on the fit replies of clients trained together. Without a
    GPU the graphed backend runs the very kernels sequential training runs, in the same order, so
    the runs agree to the last bit (float32, any CPU)."""
    creff = ["method=creff", "calibration_args.creff_features_per_class=5", "calibration_args.creff_feature_steps=5",
             "calibration_args.creff_retrain_steps=5"]
    runs = {}
    for backend in ("sequential", "graphed"):
        sim = prepare(config(tmp_path, *creff, f"run.backend={backend}"))
        assert sim.backend == backend
        received, aggregate = [], sim.server.aggregate

        def spy(rnd, replies, aggregate=aggregate, received=received):
            received.append({cid: sorted(r.payload) for cid, r in replies.items()})
            aggregate(rnd, replies)

        sim.server.aggregate = spy
        (tmp_path / backend).mkdir()
        runs[backend] = (sim.run(tmp_path / backend, quiet=True), clone_state(sim.server_model), received)
    (seq, seq_state, seq_payloads), (graphed, graphed_state, graphed_payloads) = runs.values()
    assert graphed_payloads == seq_payloads and any("creff/grads" in keys for keys in graphed_payloads[1].values())
    assert all(torch.equal(graphed_state[k], v) for k, v in seq_state.items())
    assert [r["acc"] for r in graphed.metrics] == [r["acc"] for r in seq.metrics]


@pytest.mark.parametrize("method,extra", [
    ("sfd", ["data.augment=weak", "fl.grad_clip=0.5", "calibration_args.safs_steps=5"]),  # a projector with BatchNorm
    # no contrastive branch: the projector is in the model but not in the loss, and has no gradient
    ("sfd", ["method_args.scl_weight=0", "calibration_args.safs_steps=5", "fl.momentum=0.9"]),
    ("fedloge", ["method_args.head_bias=true", "fl.grad_clip=0.5", "fl.weight_decay=0.01", "fl.lr_schedule=cosine",
                 "method_args.sse_steps=50"]),
    # psi's own SGD settings: no one step for all parameters, so these clients train one after another
    ("fedloge", ["method_args.head_optimizer=released", "method_args.sse_steps=50"]),
    # round 1 trains every expert, round 2 one expert per client (the others frozen); the lr warms up per step
    ("gbme", ["loss.name=bsm", "fl.grad_clip=0.5", "fl.weight_decay=0.01"]),
    ("gbme", ["loss.name=bsm", "method_args.expert_loss=per_expert"]),  # one after another
    # two views per image made outside the step, the log-prior re-mixed per step, the teacher features kept
    ("fedyoyo", ["fl.grad_clip=0.5", "fl.weight_decay=0.01"]),
    # the prior estimated before training (in eval mode), fused once; the CE of Eq. 7; teachers averaged
    ("fedyoyo", ["method_args.prior_features=clean_eval", "method_args.prior=fused_estimate",
                 "method_args.ce_prior_scale=null", "method_args.asd_average=correct"]),
    # the baselines of the papers' tables
    ("fedlc", ["fl.grad_clip=0.5"]),
    ("feddecorr", ["loss.name=bsm", "fl.weight_decay=0.01"]),  # the features' decorrelation, a per-client prior
    ("fedetf", ["fl.grad_clip=0.5", "method_args.adapt_iterations=1"]),  # the ETF not uploaded, adapted per client
    ("fedbabu", ["fl.grad_clip=0.5", "fl.weight_decay=0.01", "method_args.finetune_epochs=1"]),  # the body alone
    ("fedrod", ["fl.grad_clip=0.5", "fl.weight_decay=0.01"]),  # the personal head outside the model, kept
    # the personal head fitted client by client first, then the body through it; the head kept (12 clients
    # at alpha 0.01: two without data and two with one or two samples among those sampled)
    ("fedrep", ["fl.grad_clip=0.5", "fl.weight_decay=0.01", "method_args.head_epochs=2", "data.num_clients=12",
                "data.alpha=0.01"]),
    ("fedrep", ["method_args.global_head=false"]),  # the head never uploaded
    # the client's own part loaded over the received weights before training, kept after it
    ("fedbn", ["model.name=resnet8", "data.image_size=8", "method_args.global_bn=false"]),  # its BatchNorm
    ("fedper", ["fl.grad_clip=0.5"]),  # its head
    # the gradient corrected by the control variates, the new variate from the steps' own gradients
    ("scaffold", ["fl.rounds=3", "fl.grad_clip=0.5", "fl.weight_decay=0.01", "fl.momentum=0.9", "data.num_clients=12",
                  "data.alpha=0.01"]),
])
def test_a_seed_method_whose_loss_reads_the_model_trains_graphed_to_the_last_bit(tmp_path, method, extra):
    """SFD's projector, FedLoGe's three heads (phi_k a tensor outside the model, kept on the client),
    GBME's experts (frozen per client), FedYoYo's views, per-step prior and prior estimate, and the
    baselines' steps (FedRoD's personal head, FedBABU's frozen head, FedBN's and FedPer's own BatchNorm
    and head) in the graphed step: on a CPU the
    very kernels of sequential training in the same order, so every weight, personal head, client
    prior and metric (personalized accuracy included) is equal to the last bit."""
    runs = {}
    for backend in ("sequential", "graphed"):
        sim = prepare(config(tmp_path, f"method={method}", f"run.backend={backend}", *extra))
        assert sim.backend == backend
        (tmp_path / backend).mkdir()
        result = sim.run(tmp_path / backend, quiet=True)
        runs[backend] = (result, clone_state(sim.server_model), sim.client_states)
    (seq, seq_state, seq_clients), (graphed, graphed_state, graphed_clients) = runs.values()
    assert all(torch.equal(graphed_state[k], v) for k, v in seq_state.items())
    assert graphed_clients.keys() == seq_clients.keys()
    for cid, state in seq_clients.items():
        assert all(torch.equal(graphed_clients[cid][k], v) for k, v in state.items() if torch.is_tensor(v)), cid
    untimed = lambda rows: [{k: v for k, v in r.items() if k != "time_s"} for r in rows]  # noqa: E731
    assert untimed(graphed.metrics) == untimed(seq.metrics) and "pm_acc" in seq.metrics[-1]
    assert json.loads((graphed.run_dir / "summary.json").read_text())["backend"] == "graphed"


class _FakeStream:
    def __init__(self):
        self.waited = []  # the streams this one was told to wait for

    def wait_stream(self, other):
        self.waited.append(other)


@pytest.mark.parametrize("method,extra", [
    ("gbme", ["loss.name=bsm", "fl.rounds=3", "fl.grad_clip=0.5"]),  # trained sets per client, the rate per step
    ("fedloge", ["method_args.sse_steps=50", "fl.lr_schedule=cosine"]),  # phi_k outside the model
    ("fedyoyo", []),  # the log-prior written per step, the teacher features read per step (round 2 uses them)
    ("scaffold", ["fl.rounds=3"]),  # the offset per client, the gradient sums per step (no weight decay in them)
])
def test_the_gpu_path_of_the_graphed_trainer_run_on_a_cpu_with_replays_standing_in(tmp_path, float64, monkeypatch,
                                                                                    method, extra):
    """What only CUDA runs, short of the device: lanes on streams, a shape captured on its second use
    (warm-up steps and the capture itself undone, the state put back), a graph per batch size and
    trained set in one pool per lane, the rate read from a tensor and written per step. CUDA's calls
    are replaced by stand-ins and a replay by the step it captured, so the run must equal sequential
    training to float64 rounding (the captured update rounds p + d * (-lr), not p - lr * d)."""
    import contextlib

    from fedlt.training import graphed as module

    main, active, recorded = _FakeStream(), [], []

    @contextlib.contextmanager
    def on_stream(stream):
        active.append(stream)
        yield
        active.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: active[-1] if active else main)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", type("FakeGraph", (), {}))
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None, stream=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: recorded.append((self, stream)))
    captured, capture = [], module._capture

    def capture_and_replay(lane, step, x_in, y_in):
        graph = capture(lane, step, x_in, y_in)  # runs the warm-up and the "captured" step, then restores
        graph.replay = lambda: step(lane, x_in, y_in)
        captured.append((lane, x_in.shape[0]))
        return graph

    monkeypatch.setattr(module, "_capture", capture_and_replay)
    load = module._load

    def load_after_waiting(lane, *args):  # a client's start is made on the calling stream while lanes train
        assert lane.stream.waited[-1:] == [main], "a lane loaded a start before waiting for the stream that made it"
        lane.stream.waited.clear()
        load(lane, *args)

    monkeypatch.setattr(module, "_load", load_after_waiting)
    monkeypatch.setattr(module, "PACKED_ON", frozenset({"cpu"}))  # a state handed back as on a GPU
    packed, pack = [], module.fused.packed_clones  # each client's state as handed back, and its buffers
    monkeypatch.setattr(module.fused, "packed_clones", lambda tensors: packed.append(pack(tensors)) or packed[-1])
    handed = []  # SCAFFOLD's gradient sums, as the trainer hands them to the objective
    if method == "scaffold":
        from fedlt.methods.scaffold import ScaffoldClient

        objective_of = ScaffoldClient.local_objective

        def spied(self, ctx, msg):
            objective = objective_of(self, ctx, msg)
            done = objective.correction.done
            objective.correction.done = lambda sums, steps: (handed.extend(sums), done(sums, steps))
            return objective

        monkeypatch.setattr(ScaffoldClient, "local_objective", spied)
    runs = {}
    for backend in ("sequential", "graphed"):
        sim = prepare(config(tmp_path, f"method={method}", *extra, f"run.backend={backend}"))
        if backend == "graphed":
            handed.clear()  # the sequential run's sums were never on a stream
            sim.graphed = trainer = GraphedTrainer(sim.worker, lanes=1)
            trainer.capture = True
            trainer.lanes = [module.Lane(copy.deepcopy(sim.worker), _FakeStream(), _FakeStream()) for _ in range(3)]
        (tmp_path / backend).mkdir()
        runs[backend] = (sim.run(tmp_path / backend, quiet=True), clone_state(sim.server_model))
    (seq, seq_state), (graphed, graphed_state) = runs.values()
    for name, value in seq_state.items():
        assert torch.allclose(graphed_state[name], value, rtol=0, atol=1e-10), name
    assert [r["acc"] for r in graphed.metrics] == [r["acc"] for r in seq.metrics]
    lanes = [lane for lane in trainer.lanes if lane.graphs]
    assert len(lanes) == 3 and len({id(lane.pool) for lane in lanes}) == 3  # every lane captured, one pool each
    assert len(captured) == sum(len(lane.graphs) for lane in lanes)  # each shape captured once, then replayed
    assert all(uses == 1 for lane in lanes for key, uses in lane.uses.items() if key not in lane.graphs)
    # what a lane hands back (states, loss sums, extras, kept features) is marked as used on the stream
    # that called train, so the allocator does not give its memory to the lane while that stream reads it
    assert recorded and all(stream is main for _, stream in recorded)
    assert {id(t) for t in handed} <= {id(t) for t, _ in recorded} and (method != "scaffold" or handed)
    # a client's state lies in one marked buffer per dtype, not a mark per tensor
    marked = {t.untyped_storage().data_ptr() for t, _ in recorded}
    assert packed and all(t.untyped_storage().data_ptr() in marked for state, _ in packed for t in state)
    assert all(len(buffers) == len({t.dtype for t in state}) for state, buffers in packed)
    if method == "gbme":  # the joint round trains every parameter, a per-expert round a part of them
        assert len({len(trained) for lane in lanes for _, trained in lane.graphs}) > 1


def test_backend_choice_and_fallback(tmp_path):
    from fedlt.methods.feddecorr import FedDecorrClient
    from fedlt.methods.fedavg import FedAvgClient
    from fedlt.run_parts import choose_backend

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    # auto: the backend measured fastest for the device and model, where the method supports it
    assert prepare(config(tmp_path, "method=fedavgm", "run.backend=auto")).backend == "sequential"
    for model in ("cnn", "resnet8"):  # graphed on a GPU, for every model
        assert choose_backend(config(tmp_path, "run.backend=auto", f"model.name={model}"), FedAvgClient, gpu) == "graphed"
    assert choose_backend(config(tmp_path, "run.backend=auto"), FedDecorrClient, gpu) == "graphed"
    assert choose_backend(config(tmp_path, "run.backend=auto"), FedDecorrClient, cpu) == "sequential"
    assert prepare(config(tmp_path)).backend == "sequential"  # the default: measured faster on CPU
    for backend in ("vectorized", "graphed"):
        assert choose_backend(config(tmp_path, f"run.backend={backend}"), FedAvgClient, cpu) == backend
        assert choose_backend(config(tmp_path, f"run.backend={backend}"), FedAvgClient, gpu) == backend
        with pytest.raises(ConfigError, match=f"run.backend={backend} does not support method ditto"):
            prepare(config(tmp_path, "method=ditto", f"run.backend={backend}"))
    with pytest.raises(ConfigError, match="vectorized does not support method scaffold .its gradient is corrected"):
        prepare(config(tmp_path, "method=scaffold", "run.backend=vectorized"))  # a corrected gradient: graphed only
    # more than a loss of the logits (SFD, FedLoGe, GBME): graphed only; auto falls back where the
    # method has no local objective (Ditto)
    from fedlt.methods.ditto import DittoClient
    from fedlt.methods.sfd import SFDClient
    assert choose_backend(config(tmp_path, "run.backend=graphed"), SFDClient, gpu) == "graphed"
    assert choose_backend(config(tmp_path, "run.backend=auto"), SFDClient, gpu) == "graphed"
    assert choose_backend(config(tmp_path, "run.backend=auto"), DittoClient, gpu) == "sequential"
    for method, loss in (("fedloge", "ce"), ("gbme", "bsm"), ("fedyoyo", "ce")):
        with pytest.raises(ConfigError, match=f"vectorized does not support method {method} .*; use run.backend=graphed"):
            prepare(config(tmp_path, f"method={method}", f"loss.name={loss}", "run.backend=vectorized"))
    assert prepare(config(tmp_path, "method=sfd", "run.backend=graphed")).backend == "graphed"  # with SAFS calibration


#: every method that run.backend=vectorized refuses, and the reason its refusal gives
REFUSAL_REASONS = {
    "fedloge": "its loss reads the features and trains a personal head outside the model",
    "fedrod": "its loss reads the features and trains a personal head outside the model",
    "fedbabu": "only its body trains, under a frozen head",
    "fedrep": "its head and body train in turn: the head first, then only the body under it",
    "ditto": "it trains two models a round: its personal one, pulled towards the global, then the global",
    "gbme": "its clients train under a class prior it sends and, with the ensemble, only their own experts",
    "scaffold": "its gradient is corrected by control variates",
    "sfd": "its loss reads the features and their projections",
    "feddecorr": "its loss reads the features",
    "fedyoyo": "its loss reads the features and two views of each image",
}


def test_each_method_the_batched_backends_refuse_is_told_its_own_reason(tmp_path):
    """A refusal says what the method's step does that the backend cannot train (FedBABU and FedRep
    train only a part of the model), not one reason for all."""
    from fedlt.methods.registry import METHODS
    from fedlt.run_parts import choose_backend

    refused = {}
    for name, spec in METHODS.items():
        cfg = config(tmp_path, f"method={name}", f"loss.name={(spec.losses or ['ce'])[0]}", "run.backend=vectorized")
        try:
            choose_backend(cfg, spec.client, torch.device("cpu"))
        except ConfigError as err:
            refused[name] = str(err).split(" (", 1)[1].split("); use", 1)[0]
    assert refused == REFUSAL_REASONS


def test_many_clients_keep_no_per_client_state(tmp_path):
    """1,000 clients at 0.5% participation: a round touches only the 5 sampled clients."""
    sim = prepare(config(tmp_path, "data.num_clients=1000", "fl.participation=0.005", "data.imbalance_factor=1",
                         "data.partition=iid", "run.backend=vectorized", "eval.personalized=false"))
    touched = []
    original = sim._context
    sim._context = lambda cid, rnd: touched.append(cid) or original(cid, rnd)
    sim.setup()
    row = sim.fit_round(1)
    assert sorted(set(touched)) == sim.schedule[0] and len(sim.schedule[0]) == 5
    assert sim.client_states == {} and row["train_loss"] > 0


def test_reference_loop_of_the_speed_bench_trains_a_fedavg_round(tmp_path):
    from fedlt.bench.speed import reference_round, time_backend

    sim = prepare(config(tmp_path, "run.channels_last=false"))
    before = clone_state(sim.server_model)
    timing = time_backend(sim, "reference", rounds=1)
    sampled = sim.schedule[1]
    assert timing["images_per_round"] == sum(len(sim.train_data.partition.client_indices[c]) for c in sampled)
    assert timing["s_per_round"] > 0
    changed = [k for k, v in sim.server_model.state_dict().items() if not torch.equal(v, before[k])]
    assert sorted(changed) == sorted(k for k, _ in sim.server_model.named_parameters())
    reference_round(sim, 2)  # the global model keeps training
    assert not torch.equal(sim.server_model.head.weight, before["head.weight"])


def test_limit_of_the_speed_bench_trains_the_round_as_one_model(tmp_path):
    """The limit column: every image the sampled clients hold, once per local epoch, in batches of
    K x B through one model."""
    from fedlt.bench.speed import limit_round
    from fedlt.training.sequential import steps_per_epoch

    sim = prepare(config(tmp_path, "fl.local_epochs=2", "fl.batch_size=8"))
    sampled = sim.schedule[0]
    images = sum(len(sim.train_data.partition.client_indices[c]) for c in sampled)
    assert len(sampled) == 4 and images > 32
    before = clone_state(sim.worker)
    metrics = limit_round(sim, 1)
    assert metrics["steps"] == 2 * steps_per_epoch(images, 4 * 8)
    assert not torch.equal(sim.worker.head.weight, before["head.weight"])
    eager = clone_state(sim.worker)
    # the captured limit (GPU row) is the same step through the graphed trainer: on a CPU, uncaptured,
    # the same weights to the last bit
    from fedlt.bench.speed import captured_limit_round
    from fedlt.training.graphed import GraphedTrainer

    trainer = GraphedTrainer(sim.worker, lanes=1)
    assert captured_limit_round(sim, trainer, 1)["steps"] == metrics["steps"]
    lane = trainer.lanes[0].model.state_dict()
    assert all(torch.equal(lane[k], v) for k, v in eager.items())


def test_channels_last_applies_on_the_cpu_only(tmp_path):
    """cuDNN's backward under vmap refuses channels-last tensors, so CUDA runs keep NCHW."""
    from fedlt.engine.clients import channels_last

    cfg = config(tmp_path)
    assert cfg.run.channels_last and channels_last(cfg, torch.device("cpu"))
    assert not channels_last(cfg, torch.device("cuda")) and not channels_last(cfg, torch.device("cuda:1"))
    assert not channels_last(config(tmp_path, "run.channels_last=false"), torch.device("cpu"))
    sim = prepare(config(tmp_path, "run.device=cpu"))
    conv = next(m for m in sim.server_model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) and not conv.weight.is_contiguous()


def test_a_compile_cache_the_user_chose_is_kept(monkeypatch):
    from fedlt.environment import keyed_compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    keyed_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/mine"


def test_speed_bench_compares_eager_channels_last_and_compile(tmp_path, monkeypatch):
    """`fedlt bench speed` (no --backends): one row per variant, GFLOP/s = images/s x FLOPs per image;
    the compile row runs the model under torch.compile (run.compile=true)."""
    import os
    import re

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from fedlt.bench.speed import run_speed_bench

    # Inductor's graph cache is not keyed on the CPU's vector width: a graph cached under AVX512 and
    # run under AVX2 indexes out of bounds. A run that compiles keeps one cache per capability.
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # none chosen; restored afterwards
    capability = torch.backends.cpu.get_cpu_capability().lower()

    text = run_speed_bench(None, ["data.dataset=synthetic", "data.num_clients=4", "fl.participation=0.5",
                                  "fl.local_epochs=1", "run.threads=1", "run.checkpoint_every=0",
                                  f"run.out_dir={tmp_path}"], rounds=1)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(default_cache_dir(), f"cpu-{capability}")
    mflop = float(re.search(r"Training cost: ([\d.]+) MFLOP per image", text).group(1))
    peak = float(re.search(r"Matmul peak measured now: ([\d.]+) GFLOP/s", text).group(1))
    rows = [line.strip("|").split("|") for line in text.splitlines() if re.match(r"\| (eager|channels_last|compile) \|", line)]
    assert [r[0].strip() for r in rows] == ["eager", "channels_last", "compile"]
    for _, s_round, images, gflops, percent, eval_s in rows:
        assert float(s_round) > 0 and float(eval_s) > 0
        assert float(gflops) == pytest.approx(float(images) * mflop / 1e3, rel=0.01, abs=0.01)
        # the table prints GFLOP/s to 0.005, the peak to 0.05 and the percentage to 0.05: the
        # percentage recomputed from the printed figures is off by at most what those roundings allow
        g = float(gflops)
        bound = 100 * (0.005 / (peak - 0.05) + (g + 0.005) * 0.05 / (peak * (peak - 0.05))) + 0.05
        assert float(percent) == pytest.approx(100 * g / peak, abs=bound + 1e-9)
    assert re.search(r"Fastest here: (eager|channels_last|compile) \([\d.]+x eager\)", text)


def test_profile_bench_splits_a_step_into_its_parts(tmp_path, capfd):
    """`fedlt bench profile`: per backend, the marked parts of a step (batch, forward+loss, backward
    or vmap's forward+backward, optimizer) as host time, and no GPU columns on a CPU; FedAvg's epoch
    makes no host synchronisation, so what is counted is per client, not per batch."""
    import re

    from fedlt.bench.profile import run_profile_bench

    text = run_profile_bench(None, ["data.dataset=synthetic", "data.num_clients=4", "fl.local_epochs=2",
                                    "run.threads=1", "run.checkpoint_every=0", f"run.out_dir={tmp_path}"],
                             models=("cnn",), sampled_counts=(2,))
    header = next(line for line in text.splitlines() if line.startswith("| model"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = {r[2]: dict(zip(columns, r)) for r in (
        [c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if re.match(r"\| cnn \| 2 \|", line))}
    assert set(rows) == {"sequential", "vectorized"} and "kernel ms" not in columns  # no GPU columns on a CPU
    seq, vec = rows["sequential"], rows["vectorized"]
    assert all(float(seq[p]) > 0 for p in ("batch ms", "forward+loss ms", "backward ms", "optimizer ms"))
    assert seq["forward+backward ms"] == "" and vec["forward+loss ms"] == vec["backward ms"] == ""
    assert float(vec["forward+backward ms"]) > 0 and float(vec["optimizer ms"]) > 0
    # 2 clients x 2 epochs of synthetic data: the per-client synchronisations spread over many steps
    assert 0 < float(seq["host syncs / step"]) < 1
    assert "USDT:" not in capfd.readouterr().err  # the profiler's C++ start/stop lines


def test_the_profiled_round_drops_only_the_profilers_own_stderr_lines(capfd):
    import os
    import sys

    from fedlt.bench.profile import _without_profiler_lines

    with _without_profiler_lines():
        os.write(2, b"USDT:2026-11-30 SyncActivityProfilerHandler.cpp:52] profiler_start\nfrom C++\n")
        print("from Python", file=sys.stderr)
        os.write(2, b"STAGE:2026-11-30 Completed Stage: Warm Up\n")
    assert sorted(capfd.readouterr().err.splitlines()) == ["from C++", "from Python"]  # pytest's sys.stderr is not fd 2


def test_paper_rounds_time_the_rows_picked_by_name():
    from fedlt.bench.paper_rounds import chosen_rows, unknown_pick
    from fedlt.bench.suite import load_suite

    sfd, fedloge = load_suite("paper-sfd").spec, load_suite("paper-fedloge").spec
    picks = ["paper-sfd:SFD", "FedLoGe"]  # SUITE:ROW in one suite, ROW in every suite
    assert chosen_rows(sfd, None, picks) == ["FedLoGe", "SFD"] and chosen_rows(fedloge, None, picks) == ["FedLoGe"]
    assert chosen_rows(sfd, 2, []) == ["CReFF", "FedProx"]
    assert unknown_pick([sfd, fedloge], picks) is None
    assert unknown_pick([fedloge], ["paper-sfd:SFD"]).startswith("--row paper-sfd:SFD names no row")


def test_paper_rounds_project_a_protocol_from_two_timed_rounds(tmp_path):
    """`fedlt bench paper-rounds`: per row and backend, a round on synthetic data split into a fixed
    part and a part per image, projected to the protocol's images per round x rounds x seeds."""
    import re

    from fedlt.bench.paper_rounds import protocol_images, run_paper_rounds
    from fedlt.config import load_config

    extra = ["model.name=cnn", "data.image_size=16", "fl.local_epochs=1", "fl.participation=0.1", "run.threads=1"]
    text = run_paper_rounds(["paper-creff"], ("sequential", "vectorized"), extra=extra,
                            picks=["FedProx", "Fed-Focal Loss"])  # (CReFF's server step takes seconds here)
    assert ", 1 thread, " in text.split("\n\n")[1]  # the header names the threads the rounds ran with (run.threads)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if re.match(r"\| (FedProx|Fed-Focal Loss) \| cnn on ", line)]
    # each model is timed on each dataset size its settings use: CIFAR-10's and CIFAR-100's stand-ins
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (row, f"cnn on synthetic_cifar{size}", backend) for row in ("FedProx", "Fed-Focal Loss")
        for backend in ("sequential", "vectorized") for size in (10, 100)]
    # CIFAR-10-LT at IF = 100, 50, 10 and CIFAR-100-LT at the same: 10% of the clients, 1 local epoch
    settings = {d: [load_config(None, [f"data.dataset={d}", f"data.imbalance_factor={f}", *extra])
                    for f in (100, 50, 10)] for d in ("cifar10", "cifar100")}
    assert protocol_images(settings["cifar10"][0]) == pytest.approx(0.1 * 12406, abs=1)  # CIFAR-10-LT, IF = 100
    for ten, hundred in zip(rows[::2], rows[1::2]):
        expected, slack = 0.0, 0.05  # hours are printed to 0.1
        for row, d in ((ten, "cifar10"), (hundred, "cifar100")):
            fixed, per_1000 = float(row[4]), float(row[5])
            assert fixed >= 0 and per_1000 > 0
            expected += sum(fixed + per_1000 / 1e6 * protocol_images(cfg) for cfg in settings[d]) * 200 * 3 / 3600
            # fixed s are printed to 0.01 and ms per 1,000 images to 0.1: their rounding, over the settings
            slack += sum(0.005 + 0.05 / 1e6 * protocol_images(cfg) for cfg in settings[d]) * 200 * 3 / 3600
        assert ten[6] == hundred[6]  # the row's projection, over all its settings
        assert abs(float(ten[6]) - expected) <= slack + 1e-9
    assert re.search(r"paper-creff, the rows each backend ran: sequential [\d.]+ h; vectorized [\d.]+ h\.", text)

    # a backend the row's method does not support is named as refused, and the other still runs
    suite = tmp_path / "tiny-paper.yaml"
    suite.write_text(yaml.safe_dump({
        "name": "tiny-paper", "title": "Tiny", "description": "one CIFAR-10-LT setting",
        "overrides": ["model.name=cnn", "data.num_clients=4", "fl.participation=0.5", "fl.rounds=10"], "seeds": [0],
        "settings": [{"name": "CIFAR-10-LT, IF=100", "overrides": ["data.dataset=cifar10", "data.imbalance_factor=100"]}],
        "methods": [{"name": "SCAFFOLD", "overrides": ["method=scaffold"]}]}))
    four_clients = [e for e in extra if not e.startswith("fl.participation")]  # the tiny suite's own participation
    text = run_paper_rounds([str(suite)], ("sequential", "vectorized"), extra=four_clients)
    assert "| SCAFFOLD | | vectorized | refused: run.backend=vectorized does not support method scaffold" in text
    assert re.search(r"\| SCAFFOLD \| cnn on synthetic_cifar10 \| sequential \| [\d.]+ \|", text)


def test_paper_rounds_train_on_synthetic_data_of_the_settings_size_and_long_tail():
    """The stand-ins hold CIFAR-10's / CIFAR-100's classes and split sizes, so a setting's long tail
    and partition give the protocol's images and client sizes (CIFAR-100-LT at IF = 100: 10,847)."""
    from fedlt.bench.paper_rounds import protocol_images, stand_in
    from fedlt.config import load_config
    from fedlt.data.federated import build_federated_data

    for dataset, classes, images in (("cifar100", 100, 10847), ("cifar10", 10, 12406)):
        setting = ["data.imbalance_factor=100", "data.num_clients=20", "data.partition=dirichlet", "data.alpha=0.5"]
        cfg = load_config(None, [f"data.dataset={dataset}", *setting, "fl.participation=1.0", "fl.local_epochs=1"])
        data = build_federated_data(load_config(None, [*setting, *stand_in(dataset)]).data, seed=0)
        counts = data.train_counts
        assert data.num_classes == classes and data.train.image_size == 32 and counts.sum() == images
        assert counts.max() == counts[0] and counts[0] / counts.min() == pytest.approx(100, rel=0.02)
        assert protocol_images(cfg) == pytest.approx(images)
        assert sum(len(rows) for rows in data.partition.client_indices) == images
    assert stand_in("svhn")[0] == "data.dataset=synthetic_cifar10"  # CIFAR-shaped where no size of its own


@pytest.mark.parametrize("capturing_rounds,timed,left", [(0, 2, 0), (1, 3, 0), (9, 4, 1)])
def test_paper_rounds_warm_up_until_graphed_training_stops_capturing(monkeypatch, capturing_rounds, timed, left):
    """Warm-up rounds go on while graphed training still captures step graphs (at most three), so
    the timed round is the steady state; captures left in it are counted."""
    from fedlt.bench import paper_rounds
    from fedlt.engine.simulation import Simulation

    fit_round, rounds, trained = Simulation.fit_round, [], []

    def fit_and_capture(self, rnd):
        out = fit_round(self, rnd)
        rounds.append(rnd)
        trained.append(sum(len(self.train_data.partition.client_indices[c]) for c in self.schedule[rnd - 1]))
        if rnd <= capturing_rounds:
            self.graphed.captures += 1  # a lane met a batch shape for the second time
        return out

    monkeypatch.setattr(Simulation, "fit_round", fit_and_capture)
    line = paper_rounds.round_line(None, ["data.dataset=synthetic", "data.num_clients=10", "model.name=cnn",
                                          "fl.participation=0.3", "run.backend=graphed", "run.threads=1"])
    assert rounds == list(range(1, timed + 1)) and line.captures == left
    assert len(set(trained)) > 1 and line.images == trained[-1]  # the timed round's own clients, not another's
    assert line.seconds > line.fixed >= 0 and line.per_image > 0


def test_backend_bench_times_the_backends_it_is_asked_for_beside_the_reference_and_the_limit(tmp_path):
    """`fedlt bench speed --backends --compare sequential`: the reference loop, that backend and the
    limit, nothing else; vs reference and of limit are the rows' s/round ratios."""
    import re

    from fedlt.bench.speed import run_backend_bench

    text = run_backend_bench(None, ["data.dataset=synthetic", "data.num_clients=4", "fl.local_epochs=1",
                                    "run.threads=1", "run.checkpoint_every=0", f"run.out_dir={tmp_path}"],
                             rounds=1, models=("cnn",), sampled_counts=(2,), k_table=False, compare=("sequential",))
    rows = {r[3].strip(): r for r in (line.strip("|").split("|") for line in text.splitlines()
                                       if re.match(r"\| cnn \| synthetic \| 2 \|", line))}
    assert list(rows) == ["reference", "sequential", "limit"]
    seconds = {b: float(r[4]) for b, r in rows.items()}
    assert rows["limit"][7].strip() == "100%" and rows["reference"][6].strip() == "1.00x"
    # s/round is printed to 3 decimals (each true value within 0.0005) and the ratio to 2 (within 0.005)
    ratio = float(rows["sequential"][6].strip().rstrip("x"))
    ref, seq = seconds["reference"], seconds["sequential"]
    assert (ref - 5e-4) / (seq + 5e-4) - 0.005 <= ratio <= (ref + 5e-4) / max(seq - 5e-4, 1e-9) + 0.005
