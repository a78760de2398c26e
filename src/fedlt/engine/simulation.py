"""The in-process engine: a whole federation simulated in one process, deterministically.

It owns rounds, client sampling, the calls into a method's hooks, traffic accounting,
evaluation, checkpoints and progress — and nothing about any particular method. One worker
model instance is reloaded for every client; per-client memory holds only the state a method
chooses to keep in ``ctx.state``. Clients are reached through one method, :meth:`_deliver`;
the Flower engine (``engine/flower_app.py``) reuses this loop and replaces only that.
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
import time
from collections.abc import Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from fedlt.config import Config, LossConfig, config_difference, federation_seed
from fedlt.data.federated import FederatedData
from fedlt.calibration.wrapper import parse_calibration_args
from fedlt.engine.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint, unsafe_entry
from fedlt.engine.clients import EVALUATE, EVALUATE_COUNTS, ClientRuntime, new_model
from fedlt.engine.process_pool import ClientPool, default_workers
from fedlt.engine.sampling import lr_at, sampling_schedule
from fedlt.engine.secure_aggregation import AGGREGATE, SecureAggregation, add_reply, summed_entries
from fedlt.engine.vectorized import fit_together
from fedlt.environment import collect as collect_environment
from fedlt.errors import MEMORY_KNOBS, ConfigError, FedltError, OutOfMemory, PluginError, TrainingDiverged, out_of_memory
from fedlt.evaluation import (
    HEADLINE_METRICS, SharedEncoderFeatures, ShotGroups, global_metrics, head_of_features, mean_local_accuracy,
    personalized_figures, predict, shot_groups, validation_figures, validation_metrics,
)
from fedlt.messages import Message, Reply, describe_message
from fedlt.methods.base import MethodSpec, ServerContext, check_message
from fedlt.methods.registry import parse_method_args
from fedlt.models import FedModel
from fedlt.progress import Progress
from fedlt.results import (
    ARTIFACTS_FILE, CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, append_metrics, partition_record, progress_label,
    read_metrics, rewrite_metrics, save_artifacts, write_partition, write_stopped_summary, write_summary, writing,
)
from fedlt.run_parts import LOSS_KNOBS, choose_backend, no_global_model_refusal, outside_code
from fedlt.training.graphed import GraphedTrainer
from fedlt.tracking import Tracker
from fedlt.seeding import seed_for

TRAFFIC_KINDS = ("down_model", "down_payload", "up_model", "up_payload")
STAGES = ("setup", "before_fit", "after_fit", "final")
#: seconds of a setup or final stage before the progress names it (FedLoGe's SSE-C, SAFS: up to a minute);
#: one each, so that shortening one leaves the other stage's quick work unnamed
SETUP_NOTICE_AFTER = FINAL_NOTICE_AFTER = 5.0
#: what a resumed run's config.yaml may differ in from the checkpoint's: where its files go, how it
#: is executed (device, backend, threads ...), where its data are read from
RESUME_MAY_CHANGE = ("run.", "data.root", "eval.batch_size")


def server_metrics(server: Any) -> dict[str, Any]:
    """``Server.metrics()`` as its metrics line writes it: a one-element tensor or numpy number becomes a
    float (a client's tensor loss is read the same way); anything JSON cannot write is refused naming it."""
    out = {}
    for key, value in server.metrics().items():
        if isinstance(value, torch.Tensor) and value.numel() == 1 or \
                isinstance(value, (np.ndarray, np.generic)) and value.size == 1:
            value = value.item()
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError):
            raise PluginError(f"{type(server).__name__}.metrics() gave {key!r} as a {type(value).__name__}, which "
                              "a metrics line cannot hold: return numbers (float(...)), strings or lists of them"
                              ) from None
        out[key] = value
    return out


def check_resumable(cfg: Config, run_dir: Path) -> None:
    """What a resume needs from ``run_dir`` besides the data: a checkpoint saved with this config and the
    metrics up to it. Checked before the data are read (minutes for a large dataset), so that a folder
    that cannot resume is refused for what it lacks, not for data its edited config would read."""
    ckpt = load_checkpoint(run_dir, "cpu", mmap=True)  # its tensors mapped, not read
    check_resumed_config(cfg, run_dir, ckpt)
    start = ckpt.get("round")
    if isinstance(start, int):
        check_resumed_metrics(cfg, run_dir, read_metrics(run_dir, up_to_round=start), start)


def check_resumed_metrics(cfg: Config, run_dir: Path, rows: list[dict[str, Any]], start: int) -> None:
    """The metrics a resumed run keeps must hold every round evaluated up to its checkpoint: the run
    does not evaluate them again, and its summary would read them as missing."""
    every, last = cfg.eval.every, cfg.fl.rounds
    wanted = [r for r in range(1, start + 1) if r == last or r % every == 0]
    have = [r["round"] for r in rows]
    if have != wanted:
        lost = sorted(set(wanted) - set(have))
        what = (f"lacks round(s) {', '.join(map(str, lost[:5]))}" if lost else
                f"holds rounds {', '.join(map(str, have[:8]))}")
        raise FedltError(f"{run_dir / METRICS_FILE} {what} of the {len(wanted)} evaluated up to the checkpoint of "
                         f"round {start}; restore the file, or start the run again")


def check_resumed_config(cfg: Config, run_dir: Path, ckpt: dict[str, Any]) -> None:
    """A hand-edited ``config.yaml`` would go on with another federation or training from the saved
    state: refused, except where the run's files go and how it is executed (``run.*``)."""
    if "config" not in ckpt:  # saved before checkpoints kept their config
        return
    diff = config_difference(json.loads(ckpt["config"]), cfg.dump(), RESUME_MAY_CHANGE)
    if diff is not None:
        raise ConfigError(f"{run_dir / CONFIG_FILE} is not the config {CHECKPOINT_FILE} was saved with ({diff}); "
                          f"restore that value (or, if {CHECKPOINT_FILE} was copied from another run, this run's "
                          "own checkpoint), or start a new run with the new config")


@dataclass
class RunResult:
    """A finished run: its folder, ``summary.json`` and ``metrics.jsonl`` as read back (docs/api.md,
    "The run directory", names their keys)."""

    run_dir: Path
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]


class Simulation:
    """Runs one experiment of ``spec`` on ``data`` under ``cfg`` and writes it to ``run_dir``."""

    #: the engine's name, and whether its clients can fail to answer (then metrics lines and the
    #: summary list who did not)
    engine = "inprocess"
    reports_dropouts = False

    def __init__(self, cfg: Config, spec: MethodSpec, data: FederatedData, device: torch.device):
        self.cfg, self.spec, self.device = cfg, spec, device
        self.eval_data = data
        self.train_data = data.pooled() if spec.pooled else data
        self.groups: ShotGroups = shot_groups(data.train_counts, cfg.eval, data.partition.counts, len(data.test))
        args = parse_method_args(spec, cfg.method_args)
        #: every knob the method ran with, defaults included: what a suite matches its cells on
        self.resolved_method_args = args.model_dump(mode="json")
        #: and every calibration knob, where the run calibrates (a changed default changes such a run too)
        self.resolved_calibration_args = (parse_calibration_args(cfg.calibration_args).model_dump(mode="json")
                                          if spec.calibration else None)

        try:  # a size knob (method_args.expert_width, a projector's width, CReFF's features) sizes these
            self.server_model = self._new_model()
            self.clients = self._client_runtime()
            self.server_context = ServerContext(
                model=self.server_model, config=cfg, num_classes=data.num_classes,
                num_clients=self.train_data.num_clients, device=device, args=args, make_model=self._new_model,
            )
            self.server = spec.server(self.server_context)
        except (MemoryError, RuntimeError, OverflowError, ValueError, TypeError) as err:
            if (what := out_of_memory(err)) is None:
                raise
            raise OutOfMemory(f"out of memory building the model and the method's state, before any file is "
                              f"written: {what}; lower what sizes them (the model, a method's width such as "
                              "method_args.expert_width or projector_hidden, a calibration's *_per_class)") from None
        self._check_something_is_measured()
        #: how sampled clients train: "sequential", "parallel", "vectorized" or "graphed" (run.backend, resolved
        #: for the method); clients on Flower SuperNodes train one message at a time
        self.backend = choose_backend(cfg, spec.client, device) if self.clients is not None else "sequential"
        self._pool: ClientPool | None = None  # run.backend=parallel's worker processes, started on first use
        self.graphed: GraphedTrainer | None = None  # run.backend=graphed's lanes and graphs, made on first use
        self.client_states: dict[int, dict[str, Any]] = {}
        #: secure aggregation of the method's linear phases (secagg.enabled), else None
        self.secure = (SecureAggregation(cfg.secagg, spec.server.secure_phases(cfg), cfg.seed, device)
                       if cfg.secagg.enabled else None)
        #: the queries the server declared it only sums or averages: in the clear, "sum" ones are summed as
        #: their replies arrive
        self.summed_queries = {k: mode for k, mode in spec.server.secure_phases(cfg).items() if k.startswith("query:")}
        self.all_clients = list(range(self.train_data.num_clients))
        self._local_test: list[torch.Tensor] | None = None
        self._local_val: list[torch.Tensor] | None = None
        per_round = 1 if spec.pooled else cfg.clients_per_round()
        self.schedule = sampling_schedule(federation_seed(cfg.data, cfg.seed), len(self.all_clients), per_round, cfg.fl.rounds)
        self._traffic = dict.fromkeys(TRAFFIC_KINDS, 0)
        #: clients that were sent a message but did not answer: {"round", "kind", "clients"}
        self.dropped: list[dict[str, Any]] = []
        #: per exchange kind, the keys, shapes and bytes of the first message each way
        self.message_record: dict[str, dict] = {}
        #: the processes that trained the run: the first round each trained, and its environment
        self.segments: list[dict[str, Any]] = []
        #: the names of the tensors the method saved in artifacts.pt after its last round
        self.artifact_names: list[str] = []

    def _check_something_is_measured(self) -> None:
        """Without a global model only personalized evaluation measures anything: eval.personalized=false
        is refused here, before any file is written, where the server's declaration did not refuse it
        already (check_config; FedBN's depends on the model's BatchNorm)."""
        if not self.server.has_final_global_model() and not self.cfg.eval.personalized:
            raise ConfigError(no_global_model_refusal(self.cfg.method))

    def _new_model(self) -> FedModel:
        return new_model(self.cfg, self.spec, self.eval_data, self.device)

    def _client_runtime(self) -> ClientRuntime | None:
        """Where clients run: here, in this process (the Flower engine returns None: on SuperNodes)."""
        return ClientRuntime(self.cfg, self.spec, self.eval_data, self.device)

    @property
    def worker(self) -> FedModel:
        return self.clients.worker

    @property
    def client(self):
        return self.clients.client

    def _context(self, cid: int, rnd: int):
        """Client ``cid``'s context with its in-process state (for tests and tools)."""
        return self.clients.context(cid, rnd, self.client_states.setdefault(cid, {}))

    # ---- talking to clients -------------------------------------------------------------
    def _deliver(self, kind: str, rnd: int, messages: Iterable[tuple[int, Message]]
                 ) -> Iterator[tuple[int, Message, Reply]]:
        """The transport: send each (client, message) and yield the replies, in message order.
        Here each client answers before the next message is built (under run.backend=parallel
        the phase goes to the worker processes at once); the Flower engine sends a whole phase at
        once and yields only the replies that arrived."""
        if self.backend == "parallel":
            yield from self._deliver_parallel(kind, rnd, messages)
            return
        for cid, msg in messages:
            reply = self.clients.handle(kind, cid, rnd, msg, self.client_states.setdefault(cid, {}))
            self._forget_empty_state(cid)
            yield cid, msg, reply

    def _deliver_parallel(self, kind: str, rnd: int, messages: Iterable[tuple[int, Message]]
                          ) -> Iterator[tuple[int, Message, Reply]]:
        if self._pool is None or not self._pool.open:  # first use, or after a failure closed it
            self._pool = ClientPool(self.cfg, 1 if self.spec.pooled else default_workers(self.cfg))
        sent: list[tuple[int, Message] | None] = []  # in order; replies come back in the same order

        def jobs():
            for cid, msg in messages:
                sent.append((cid, msg))
                yield cid, msg, self.client_states.get(cid, {})

        size = lambda cid: len(self.train_data.partition.client_indices[cid])  # noqa: E731
        for i, (reply, state) in enumerate(self._pool.answer(kind, rnd, jobs(), size)):
            cid, msg = sent[i]
            sent[i] = None  # the message is not needed any more
            self.client_states[cid] = state
            self._forget_empty_state(cid)
            yield cid, msg, reply

    def close(self) -> None:
        """Stop run.backend=parallel's worker processes (a later exchange starts new ones)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _exchange(self, kind: str, rnd: int, messages: Iterable[tuple[int, Message]]) -> dict[int, Reply]:
        """One phase of messages; under ``secagg.enabled`` a phase the method declared linear goes
        through secure aggregation and yields one aggregate reply."""
        if self.secure is not None:
            if kind in self.secure.phases:
                return self.secure.exchange(self._exchange_plain, kind, rnd, list(messages))
            if not kind.startswith("secagg:"):
                self.secure.in_clear.add(kind)
        if self.summed_queries.get(kind) == "sum":
            return self._exchange_summed(kind, rnd, messages)
        return self._exchange_plain(kind, rnd, messages)

    def _exchange_summed(self, kind: str, rnd: int, messages: Iterable[tuple[int, Message]]) -> dict[int, Reply]:
        """A query the server declared it only sums, summed as the replies arrive: the server gets the one
        aggregate reply that secure aggregation would hand it, and the engine never holds every client's
        reply (a calibration's per-class second moments are classes x d x d each)."""
        total: Reply | None = None
        for answered, (cid, msg, reply) in enumerate(self._deliver(kind, rnd, messages), 1):
            self._account(kind, msg, reply)
            total = add_reply(total, reply, kind)
            self._answered(kind, answered, messages)
        return {} if total is None else {AGGREGATE: total}

    def _exchange_plain(self, kind: str, rnd: int, messages: Iterable[tuple[int, Message]]) -> dict[int, Reply]:
        """One phase of messages, with traffic accounting (evaluation is not traffic)."""
        replies = {}
        for cid, msg, reply in self._deliver(kind, rnd, messages):
            replies[cid] = reply
            self._account(kind, msg, reply)
            self._answered(kind, len(replies), messages)
        return replies

    def _answered(self, kind: str, answered: int, messages: Iterable[tuple[int, Message]]) -> None:
        """Tell a long stage's progress how many clients have answered (GBME's gradient pass over every
        client before round 1): shown only inside such a stage, for a phase whose size is known."""
        if isinstance(messages, Sized):
            self.server_context.stage_progress(answered, len(messages), f"clients answered {kind}")

    def _account(self, kind: str, msg: Message, reply: Reply) -> None:
        """The ledger records the first message each way of every exchange; traffic counts all but
        evaluation's."""
        if kind not in self.message_record:
            self.message_record[kind] = {"to_client": describe_message(msg), "from_client": describe_message(reply)}
            if (summed := summed_entries(reply)) is not None:  # a secure phase's upload: what it masks
                self.message_record[kind]["from_client"]["secure_sum_of"] = summed
        evaluation = (EVALUATE, EVALUATE_COUNTS)
        if kind in evaluation or (self.secure is not None and self.secure.phase in evaluation):
            return  # an evaluation, or a secure evaluation's key, share and unmask exchanges
        for name, n in zip(TRAFFIC_KINDS, (*msg.nbytes(), *reply.nbytes())):
            self._traffic[name] += n

    def _forget_empty_state(self, cid: int) -> None:
        if not self.client_states.get(cid):
            self.client_states.pop(cid, None)

    def _seed_global(self, rnd: int, stage: int) -> None:
        """Seed the global RNGs before each stage, for method code that draws without a generator:
        a resumed run then draws exactly what an uninterrupted one did."""
        torch.manual_seed(seed_for(self.cfg.seed, "server", rnd, 1000 + stage))
        np.random.seed(seed_for(self.cfg.seed, "server", rnd, 2000 + stage) % 2**32)

    def _run_queries(self, stage: str, rnd: int, clients: list[int]) -> None:
        self._seed_global(rnd, STAGES.index(stage))
        while (query := self.server.next_query(stage, rnd, clients)) is not None:
            replies = self._exchange(f"query:{query.name}", rnd, sorted(query.messages.items()))
            self.server.receive(query, replies)

    def fit_round(self, rnd: int) -> dict[str, Any]:
        """One round: queries, local training of the sampled clients (those the server sends a
        message to), aggregation, more queries, server steps."""
        sampled = self.server.select_clients(rnd, self.schedule[rnd - 1])
        if len(set(sampled)) != len(sampled) or not all(0 <= c < len(self.all_clients) for c in sampled):
            raise PluginError(f"{type(self.server).__name__}.select_clients returned {sampled}: "
                               f"need distinct ids in 0..{len(self.all_clients) - 1}")
        self._run_queries("before_fit", rnd, sampled)
        self._seed_global(rnd, len(STAGES))
        if self.backend in ("vectorized", "graphed"):
            replies = fit_together(self, rnd, sampled)
        else:
            replies = self._exchange("fit", rnd, self._fit_messages(rnd, sampled))
        if (returned := self.server.aggregate(rnd, replies)) is not None:
            raise PluginError(f"{type(self.server).__name__}.aggregate returned {type(returned).__name__}, which the "
                              "engine ignores: aggregate loads the average into self.model and returns None")
        self._run_queries("after_fit", rnd, sampled)
        self.server.end_round(rnd)
        losses = [(r.metrics["train_loss"], r.num_samples) for r in replies.values()
                  if r.num_samples > 0 and r.metrics.get("train_loss") is not None]
        total = sum(n for _, n in losses)
        return {"train_loss": sum(l * n for l, n in losses) / total if total else None,
                **server_metrics(self.server)}

    def _fit_messages(self, rnd: int, sampled: list[int]) -> Iterator[tuple[int, Message]]:
        """The round's fit messages, checked; a client the server sends None sits the round out."""
        for cid in sampled:
            msg = self.server.fit_message(rnd, cid)
            check_message(msg, self.server)
            if msg is not None:
                yield cid, msg

    # ---- evaluation ---------------------------------------------------------------------
    def evaluate(self, rnd: int) -> dict[str, Any]:
        out, correct, val_correct = self._server_metrics()
        if self.cfg.eval.personalized:
            out.update(self._personalized_metrics(rnd, correct, val_correct))
        return out

    def _server_metrics(self) -> tuple[dict[str, Any], torch.Tensor | None, torch.Tensor | None]:
        """The global model and its variants on the balanced test (and validation) set; with the
        global model's per-sample correctness on each, which local test (validation) sets index into."""
        test, val, bs = self.eval_data.test, self.eval_data.val, self.cfg.eval.batch_size
        out: dict[str, Any] = {}
        model = self.server.global_model()
        correct = val_correct = None
        extra = self.server.extra_models()
        # calibrated variants differ from the global model in their heads: one pass through the encoder
        on_test, on_val = (SharedEncoderFeatures(), SharedEncoderFeatures()) if extra else (None, None)

        def features(m: torch.nn.Module, data, shared: SharedEncoderFeatures | None) -> torch.Tensor | None:
            return shared.of(m, data, bs) if shared is not None and head_of_features(m) else None

        if model is not None:
            correct, losses = predict(model, test, bs, features=features(model, test, on_test))
            out.update(global_metrics(correct, losses, test.labels, self.groups, test.num_classes, self.cfg.eval.accuracy))
            if val is not None:
                val_correct, val_losses = predict(model, val, bs, features=features(model, val, on_val))
                out.update(validation_figures(val_correct, val_losses, val, self.groups))
        variants = {}
        for name, variant in extra.items():
            on_features = features(variant, test, on_test)
            metrics = global_metrics(*predict(variant, test, bs, features=on_features), test.labels, self.groups,
                                     test.num_classes, self.cfg.eval.accuracy)
            variants[name] = {k: metrics[k] for k in HEADLINE_METRICS}
            if val is not None:
                variants[name].update(validation_metrics(variant, val, self.groups, bs, features(variant, val, on_val)))
        if variants:
            out["variants"] = variants
        return out, correct, val_correct

    def _personalized_metrics(self, rnd: int, correct: torch.Tensor | None, val_correct: torch.Tensor | None
                              ) -> dict[str, Any]:
        """``pm_acc``: the mean accuracy over clients on their local test sets, of each client's
        personalized model (asked of the clients), else of the global model (``correct``);
        ``val_pm_acc`` the same on local validation sets, where the run has them; ``pm_variants``:
        both for each of the method's other personal readings."""
        local_val = self.eval_data.local_val
        if self.spec.client.personalized:
            messages = ((cid, self.server.eval_message(cid)) for cid in self.all_clients)
            replies = list(self._exchange(EVALUATE, rnd, messages).values())
            if self.clients is not None:
                self.clients.forget_test_features()
            return personalized_figures(replies, local_val is not None)
        out: dict[str, Any] = {"pm_acc": None}
        if correct is None:
            return out
        if self._local_test is None:  # once per run, not per evaluation: K can be large
            device = correct.device
            self._local_test = [torch.as_tensor(ix, dtype=torch.int64, device=device) for ix in self.eval_data.local_test]
            if local_val is not None:
                self._local_val = [torch.as_tensor(ix, dtype=torch.int64, device=device) for ix in local_val]
        out["pm_acc"] = mean_local_accuracy([correct[idx] for idx in self._local_test])
        if val_correct is not None and self._local_val is not None:
            out["val_pm_acc"] = mean_local_accuracy([val_correct[idx] for idx in self._local_val])
        return out

    # ---- the run ------------------------------------------------------------------------
    def setup(self) -> None:
        """The setup stage: queries the method runs once before the first round."""
        self._run_queries("setup", 0, self.all_clients)

    def _write_partition(self, run_dir: Path) -> None:
        """``partition.json``: which client holds how many samples of each class."""
        write_partition(run_dir, partition_record(self.cfg, self.eval_data.partition.counts,
                                                  self.eval_data.train.classes))

    def _save_artifacts(self, run_dir: Path, saved: list[str] | None = None) -> None:
        """Save the method's named tensors (``Server.artifacts``) once, after training. Beside
        synthetic features go real test-set features of the global model, up to 100 per class,
        so the report can project both into one plane. Made again for a finished run (``saved``: the
        names its file held), only if the final state still yields every one of them."""
        tensors = {k: v.detach().cpu() for k, v in self.server.artifacts().items()}
        self.artifact_names = sorted(tensors)
        if not tensors or (saved is not None and self.artifact_names != saved):
            return
        model = self.server.global_model()
        if model is not None and len(self.eval_data.test) and any(k.endswith("synthetic_features") for k in tensors):
            test = self.eval_data.test
            labels = test.labels.cpu()
            rows = torch.cat([(labels == c).nonzero().flatten()[:100] for c in range(test.num_classes)])
            rows = rows.to(test.labels.device)
            model.eval()
            with torch.no_grad():
                feats = [model.forward_features(test.normalize(test.images[rows[i:i + 500]])).float().cpu()
                         for i in range(0, rows.numel(), 500)]
            tensors["test_features"], tensors["test_labels"] = torch.cat(feats), test.labels[rows].cpu()
        save_artifacts(run_dir, tensors)

    def _divergence(self, row: dict[str, Any]) -> str | None:
        """Why a run must stop at once, or None: its model is NaN (the clients' training loss, or the
        global model's test loss once evaluated, is not finite) and every later round would report
        chance accuracy as if it were a result."""
        fl = self.cfg.fl
        fix = (f"lower fl.lr (now {fl.lr}) or "
               + (f"lower fl.grad_clip (now {fl.grad_clip})" if fl.grad_clip is not None else "set fl.grad_clip (e.g. 5)"))
        knobs = [f"loss.{knob} (now {getattr(self.cfg.loss, knob)}) toward its default "
                 f"{LossConfig.model_fields[knob].default}" for knob in ("tau", *LOSS_KNOBS)
                 if getattr(self.cfg.loss, knob) != LossConfig.model_fields[knob].default]  # set: the loss's own
        knobs += self._numeric_method_knobs_set()
        if knobs:  # a loss or a method's step scaled far enough diverges at any learning rate
            fix += f", or bring {' and '.join(knobs)}"
        trained, tested = row.get("train_loss"), row.get("loss")
        if trained is not None and not math.isfinite(trained):
            return f"training diverged in round {row['round']}: the clients' mean training loss is {trained}; {fix}"
        if tested is not None and not math.isfinite(tested):
            return (f"training diverged in round {row['round']}: the global model's test loss is {tested} though "
                    f"the clients' mean training loss was finite (their last steps, or a server step such as a "
                    f"calibration, made the model non-finite); {fix}, or check the calibration's knobs")
        return None

    def _numeric_method_knobs_set(self) -> list[str]:
        """``method_args.K (now V) toward its default D`` for each real-valued knob the config sets away from
        its default (FedLoGe's gamma, SFD's scl_weight, a server lr): such a knob can scale a step past any lr
        (a count, such as GBME's num_experts, scales none)."""
        fields, out = self.spec.args.model_fields, []
        for key in sorted(self.cfg.method_args):
            value, field = self.resolved_method_args.get(key), fields.get(key)
            if field is None or not isinstance(value, float) or value == field.default:
                continue
            default = f" {field.default}" if isinstance(field.default, (int, float)) else ""
            out.append(f"method_args.{key} (now {value}) toward its default{default}")
        return out

    def _checkpoint_state(self, rnd: int, elapsed: float, pending: dict[str, Any]) -> dict[str, Any]:
        return {"round": rnd, "server": self.server.state_dict(), "clients": self.client_states, "elapsed": elapsed,
                "pending": pending, "messages": self.message_record,
                "in_clear": sorted(self.secure.in_clear) if self.secure else [], "config": json.dumps(self.cfg.dump()),
                "segments": self.segments, "artifacts": self.artifact_names, "resolved_args": self._resolved_args()}

    def _resolved_args(self) -> dict[str, Any]:
        """Every knob the run trains with, defaults included: a resume under a fedlt whose defaults changed
        would go on with other knobs than its first rounds had, under the same config."""
        return {"method_args": self.resolved_method_args, "calibration_args": self.resolved_calibration_args}

    def _check_resumed_knobs(self, run_dir: Path, ckpt: dict[str, Any]) -> None:
        saved = ckpt.get("resolved_args")  # None: saved before checkpoints kept them
        if not isinstance(saved, dict):
            return
        for group, now in self._resolved_args().items():
            before = saved.get(group) or {}
            changed = [k for k in sorted({*before, *(now or {})}) if before.get(k) != (now or {}).get(k)]
            if changed:
                k = changed[0]
                raise ConfigError(f"the first {ckpt['round']} rounds of {run_dir} ran {group}.{k}={before.get(k)!r}, "
                                  f"which this fedlt resolves to {(now or {}).get(k)!r} (a changed default or knob); "
                                  "resume it with the fedlt version that started it, or start a new run")

    def run(self, run_dir: Path, resume: bool = False, quiet: bool = False) -> RunResult:
        """Train all rounds and write ``run_dir``, which no other process may write meanwhile.
        ``metrics.jsonl`` gets one line per evaluated round; its ``comm`` counts every byte since the
        previous line (the setup stage's included). Interrupted (Ctrl-C, SIGTERM), the exception
        carries ``resume_hint``: how to go on from the folder's last checkpoint, if it has one."""
        with writing(run_dir):
            try:
                return self._run(run_dir, resume, quiet)
            except BaseException:
                if self._discards(run_dir, resume):  # a new in-process run that wrote no result leaves no folder
                    shutil.rmtree(run_dir, ignore_errors=True)
                raise

    def _discards(self, run_dir: Path, resume: bool) -> bool:
        """Whether a run stopped now leaves nothing worth its folder: a new in-process run (Flower's
        write a stopped summary) with no evaluated round, checkpoint or summary yet."""
        return not resume and self.engine == "inprocess" and not any(
            (run_dir / name).exists() for name in (METRICS_FILE, CHECKPOINT_FILE, SUMMARY_FILE))

    def _run(self, run_dir: Path, resume: bool, quiet: bool) -> RunResult:
        cfg = self.cfg
        checkpointed = 0  # the round of the folder's last checkpoint
        start, elapsed = 0, 0.0
        pending: dict[str, Any] = {"comm": dict.fromkeys(TRAFFIC_KINDS, 0), "time_s": 0.0}
        if resume:
            ckpt = load_checkpoint(run_dir, self.device)
            check_resumed_config(cfg, run_dir, ckpt)
            self._check_resumed_knobs(run_dir, ckpt)
            try:
                start, elapsed, pending = ckpt["round"], ckpt["elapsed"], ckpt["pending"]
                self.message_record = ckpt["messages"]
                if self.secure is not None:
                    self.secure.in_clear.update(ckpt.get("in_clear", []))
                self.server.load_state_dict(ckpt["server"])
                self.client_states = ckpt["clients"]
            except (KeyError, RuntimeError, ValueError, TypeError) as err:  # the config no longer builds this state
                if isinstance(err, torch.cuda.OutOfMemoryError):
                    raise
                text = str(err).strip().splitlines()[0][:160].rstrip(":") if str(err).strip() else ""
                reason = f"{type(err).__name__}: {text}" if text else type(err).__name__
                raise FedltError(f"{run_dir / CHECKPOINT_FILE} does not fit the run's {CONFIG_FILE} ({reason}); "
                                 f"restore the {CONFIG_FILE} it was saved with, or start a new run") from None
            checkpointed = start
            self.segments = [dict(s) for s in ckpt.get("segments", [{"from_round": 1, "environment": None}])]
            rows = read_metrics(run_dir, up_to_round=start)
            check_resumed_metrics(cfg, run_dir, rows, start)
            rewrite_metrics(run_dir, rows)
            self._write_partition(run_dir)  # drawn from the seed: a damaged one is made again
            if start == cfg.fl.rounds and ckpt.get("artifacts") and not (run_dir / ARTIFACTS_FILE).is_file():
                self._save_artifacts(run_dir, ckpt["artifacts"])  # a finished run's, lost since
        progress = Progress(cfg.fl.rounds, start, progress_label(cfg, self.backend), quiet)
        self.server_context.stage_progress = progress.stage_step
        if not resume:
            rows = []
            try:
                self._write_partition(run_dir)
                with progress.waiting("the method's setup stage, before round 1", after=SETUP_NOTICE_AFTER):
                    self.setup()
            except BaseException as stop:
                progress.close()
                if isinstance(stop, KeyboardInterrupt):
                    stop.resume_hint = self._resume_hint(run_dir, 0)  # in the setup stage: nothing written yet
                if (what := out_of_memory(stop)) is not None:
                    raise OutOfMemory(f"out of memory in the method's setup stage: {what}; lower what sizes it "
                                      f"({MEMORY_KNOBS}); " + self._resume_hint(run_dir, 0)) from None
                raise
        if start < cfg.fl.rounds:  # this process trains rounds: a segment of its own
            self.segments.append({"from_round": start + 1, "device": str(self.device), "backend": self.backend,
                                  "environment": self._environment()})
        tracker = Tracker(cfg, run_dir)
        try:
            for rnd in range(start + 1, cfg.fl.rounds + 1):
                t0 = time.perf_counter()
                row: dict[str, Any] = {"round": rnd, "lr": lr_at(cfg.fl, rnd), **self.fit_round(rnd)}
                if rnd == start + 1:  # a state no checkpoint can keep fails here, not rounds later at the first one
                    self._check_server_state()
                diverged = self._divergence(row)
                last = rnd == cfg.fl.rounds
                evaluated = last or rnd % cfg.eval.every == 0
                if diverged is None:
                    if last:
                        with progress.waiting("the method's final stage, after the last round's training",
                                              after=FINAL_NOTICE_AFTER, restart_clock=False):
                            self._run_queries("final", rnd, self.all_clients)
                            self.server.finish()
                    for kind in TRAFFIC_KINDS:
                        pending["comm"][kind] += self._traffic[kind]
                    self._traffic = dict.fromkeys(TRAFFIC_KINDS, 0)
                    if evaluated:
                        row.update(self.evaluate(rnd))
                        diverged = self._divergence(row)
                seconds = time.perf_counter() - t0
                if diverged is not None:
                    row["comm"] = {k: pending["comm"][k] + self._traffic[k] for k in TRAFFIC_KINDS}
                    row["time_s"] = round(pending["time_s"] + seconds, 4)
                    self._write_diverged(run_dir, rows, row, diverged, elapsed + seconds)
                    raise TrainingDiverged(diverged)
                pending["time_s"] += seconds
                elapsed += seconds
                if evaluated:
                    if self.reports_dropouts:
                        since = rows[-1]["round"] if rows else 0
                        row["dropped"] = [d for d in self.dropped if d["round"] > since]
                    row["comm"] = pending["comm"]
                    row["time_s"] = round(pending["time_s"], 4)
                    pending = {"comm": dict.fromkeys(TRAFFIC_KINDS, 0), "time_s": 0.0}
                    rows.append(row)
                    append_metrics(run_dir, row)
                    tracker.log(row)
                if last:  # before the final checkpoint: a run resumed from it trains nothing and has none to save
                    self._save_artifacts(run_dir)
                every = cfg.run.checkpoint_every
                if last or (every and rnd % every == 0):
                    save_checkpoint(run_dir, self._checkpoint_state(rnd, elapsed, pending))
                    checkpointed = rnd
                progress.update(rnd, row if evaluated else None)
        except KeyboardInterrupt as stop:
            stop.resume_hint = self._resume_hint(run_dir, checkpointed)
            raise
        # torch's argument parsing names a size past 64 bits (a size knob of 2**64) in a ValueError or TypeError
        except (MemoryError, RuntimeError, OverflowError, ValueError, TypeError) as err:
            if (what := out_of_memory(err)) is None:
                raise
            raise OutOfMemory(f"out of memory in round {rnd}: {what}; lower what sizes the step ({MEMORY_KNOBS}); "
                              + self._resume_hint(run_dir, checkpointed)
                              + (" with lower run.* or eval.batch_size, or start it again" if checkpointed else "")
                              ) from None
        finally:
            try:
                progress.close()
                tracker.close()
                self.close()
            except KeyboardInterrupt as stop:  # while run.backend=parallel's workers end, after the last round too
                stop.resume_hint = self._resume_hint(run_dir, checkpointed)
                raise
        try:  # the summary, report and plot, after the last checkpoint
            summary = write_summary(run_dir, cfg, rows, self._summary_extra(elapsed))
        except KeyboardInterrupt as stop:
            stop.resume_hint = self._resume_hint(run_dir, checkpointed)
            raise
        return RunResult(run_dir, summary, rows)

    def _resume_hint(self, run_dir: Path, checkpointed: int) -> str:
        """How a run interrupted after its checkpoint of round ``checkpointed`` (0: none yet) goes on."""
        every, folder = self.cfg.run.checkpoint_every, shlex.quote(str(run_dir))
        if checkpointed:
            return f"`fedlt run --resume {folder}` goes on from its checkpoint of round {checkpointed}"
        if self._discards(run_dir, resume=False):
            return f"the run stopped before its first result, so its folder {run_dir} is removed; start the run again"
        return (f"{run_dir} stopped before its first checkpoint (run.checkpoint_every={every}), so there is nothing "
                "to resume; start the run again")

    def _check_server_state(self) -> None:
        if (bad := unsafe_entry(self.server.state_dict(), "state_dict()")) is not None:
            raise PluginError(f"{type(self.server).__name__}.state_dict() holds {bad}, which a checkpoint cannot "
                              "keep: keep tensors, numbers, strings and lists, tuples, sets or dicts of them")

    def _write_diverged(self, run_dir: Path, rows: list[dict[str, Any]], row: dict[str, Any], reason: str,
                        elapsed: float) -> None:
        """A diverged run's summary: the NaN model evaluated as it is (chance accuracy: what the
        method delivered), ``"status": "diverged"`` with the round, so a report shows the cell as
        diverged instead of dropping it or reading an earlier round's accuracy as its result."""
        try:
            if "loss" not in row:  # not evaluated yet
                row.update(self.evaluate(row["round"]))
        except Exception as err:  # noqa: BLE001 - a method's own evaluation of a NaN model may fail: the reason says how
            reason += f"; its evaluation failed too ({type(err).__name__}: {str(err).strip()[:160]})"
        row["diverged"] = True
        rows.append(row)
        append_metrics(run_dir, row)
        write_stopped_summary(run_dir, self.cfg, rows, "diverged", reason, row["round"] - 1,
                              {"diverged_round": row["round"], **self._summary_extra(elapsed)})

    def _environment(self) -> dict[str, Any]:
        return collect_environment(self.device, self.backend if self.engine == "inprocess" else self.engine,
                                   outside_code(self.cfg))

    def _summary_extra(self, elapsed: float) -> dict[str, Any]:
        """What a summary says beyond the metrics: the data, shot groups, machine, messages, knobs. The
        device, backend and environment are those of the process that trained the last rounds; a resumed
        run lists each process that trained some (``segments``: the first round each trained, and those)."""
        last = self.segments[-1] if self.segments and self.segments[-1].get("environment") else {}
        return {
            "elapsed_s": round(elapsed, 2),
            "data": self.eval_data.describe(),
            "shot_rule": self.groups.rule,
            "shot_groups": self.groups.classes,
            "train_class_counts": [int(c) for c in self.eval_data.train_counts],
            **({"test_samples": len(self.eval_data.test)} if len(self.eval_data.test) else {}),
            "class_names": self.eval_data.train.classes,
            "device": last.get("device", str(self.device)),
            "backend": last.get("backend", self.backend),
            "environment": last.get("environment") or self._environment(),
            **({"segments": self.segments} if len(self.segments) > 1 else {}),
            "messages": self.message_record,
            "calibration": list(self.spec.calibration),
            "method_args": self.resolved_method_args,
            **({"calibration_args": self.resolved_calibration_args} if self.spec.calibration else {}),
            **({"engine": self.engine, "dropped": self.dropped} if self.reports_dropouts else {}),
            **({"secure_aggregation": self.secure.describe()} if self.secure is not None else {}),
        }
