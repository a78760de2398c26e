"""A minimal plain-Flower FedAvg app on fedlt's model, data and SuperNodes: the baseline of
``fedlt bench engines --engines plain-flower``, so the table shows what fedlt adds to Flower itself.

It is the app a Flower user writes from Flower's quickstart: a ServerApp that hands Flower's own
``FedAvg`` (``flwr.serverapp.strategy``, the Message API) the initial model and a server-side
``evaluate_fn``, and a ClientApp whose ``train`` handler loads the global model, runs a plain torch
SGD loop with cross-entropy over its node's folder and replies with the weights. fedlt supplies only
what must be identical for the comparison to mean anything: the config's hyperparameters
(:func:`fedlt.config.load_config`), the image-folder loader and dataset declaration, and the model
builder. None of fedlt's round loop, methods, message codec or reply polling runs.

Run config (``flwr run --run-config``): ``config``, the ``federation.yaml`` that ``fedlt data export``
wrote; ``server-test``, the server's test folder; ``result``, a JSON file the ServerApp writes at the
end (seconds of each round, final accuracy, bytes uploaded per round). Each SuperNode's
``--node-config data=...`` names its exported folder, as for ``fedlt deploy --node-data``.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedlt.config import Config, load_config
from fedlt.data.dataset import ImageDataset
from fedlt.data.declaration import declared_dataset
from fedlt.data.sources.imagefolder import TRAIN, load_image_folder
from fedlt.errors import ConfigError, FedltError
from fedlt.models import FedModel, create_model

if TYPE_CHECKING:
    from fedlt.deploy import Federation

#: the Flower app's pyproject.toml (written by :func:`write_app`): its code is this module
PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "plain-fedavg"
version = "1.0.0"
description = "Plain Flower FedAvg (cross-entropy, torch SGD) on fedlt's exported node folders"
dependencies = ["flwr==1.41.*", "torch"]

[tool.flwr.app]
publisher = "fedlt-bench"

[tool.flwr.app.components]
serverapp = "fedlt.bench.plain_flower:serverapp"
clientapp = "fedlt.bench.plain_flower:clientapp"

[tool.flwr.app.config]
config = ""
server-test = ""
result = ""
"""


def write_app(folder: Path) -> Path:
    """The Flower app folder ``flwr run`` builds the FAB from (only pyproject.toml: like fedlt's own
    app, the code is imported from the installed package, not shipped in the FAB)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(PYPROJECT)
    return folder


def check_plain(cfg: Config) -> None:
    """Refuse a config the plain app would not compute the same way: it trains FedAvg with plain
    cross-entropy at a constant lr, without augmentation or clipping."""
    differs = {"method": (cfg.method, "fedavg"), "loss.name": (cfg.loss.name, "ce"),
               "fl.lr_schedule": (cfg.fl.lr_schedule, "constant"), "data.augment": (cfg.data.augment, "none"),
               "fl.grad_clip": (cfg.fl.grad_clip, None)}
    for key, (have, want) in differs.items():
        if have != want:
            raise ConfigError(f"the plain-flower engine trains FedAvg with cross-entropy, so {key}={have} has no "
                              f"counterpart there; compare with {key}={'null' if want is None else want}")


@lru_cache(maxsize=2)
def settings(path: str) -> Config:
    """The exported ``federation.yaml``, read once per process."""
    return load_config(path, [])


def build_model(cfg: Config) -> FedModel:
    """The config's model for the declared classes, channels and image size."""
    d = declared_dataset(cfg.data)
    return create_model(cfg.model.name, len(d.classes), in_channels=d.channels, image_size=d.image_size)


def _threads(cfg: Config) -> None:
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)


def train_model(model: torch.nn.Module, data: ImageDataset, *, epochs: int, batch_size: int, lr: float,
                momentum: float, weight_decay: float, generator: torch.Generator) -> float:
    """Plain SGD on cross-entropy over shuffled batches; returns the mean batch loss. A trailing
    batch of one row is dropped (BatchNorm cannot train on one sample)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    model.train()
    total, steps = 0.0, 0
    for _ in range(epochs):
        batches = torch.randperm(len(data), generator=generator).split(batch_size)
        for rows in batches if len(batches) == 1 or len(batches[-1]) > 1 else batches[:-1]:
            loss = F.cross_entropy(model(data.normalize(data.images[rows])), data.labels[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
            steps += 1
    return total / max(steps, 1)


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: ImageDataset, batch_size: int = 1000) -> float:
    """Top-1 accuracy in percent."""
    model.eval()
    correct = 0
    for start in range(0, len(data), batch_size):
        logits = model(data.normalize(data.images[start:start + batch_size]))
        correct += int((logits.argmax(1) == data.labels[start:start + batch_size]).sum())
    return 100.0 * correct / len(data)


# ---- client side ----------------------------------------------------------------------------
@lru_cache(maxsize=2)
def node_train_set(folder: str, config: str) -> ImageDataset:
    """The node's training rows, read once per process (as a quickstart caches its partition)."""
    return load_image_folder(Path(folder), TRAIN, declared_dataset(settings(config).data))


clientapp = ClientApp()


@clientapp.train()
def train(msg: Message, context: Context) -> Message:
    """Load the global model, train it on this node's folder, reply with weights and sample count."""
    config = str(context.run_config["config"])
    cfg = settings(config)
    _threads(cfg)
    folder = str(context.node_config["data"])
    data = node_train_set(folder, config)
    model = build_model(cfg)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    server_round = int(msg.content["config"]["server-round"])
    # seeded by the site's name, not its path: a run repeats wherever the folders are
    generator = torch.Generator().manual_seed(zlib.crc32(f"{cfg.seed}/{Path(folder).name}/{server_round}".encode()))
    loss = train_model(model, data, epochs=cfg.fl.local_epochs, batch_size=cfg.fl.batch_size, lr=cfg.fl.lr,
                       momentum=cfg.fl.momentum, weight_decay=cfg.fl.weight_decay, generator=generator)
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(data)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


# ---- server side ----------------------------------------------------------------------------
def make_strategy(cfg: Config, uploads: list[int]) -> FedAvg:
    """Flower's FedAvg over all ``data.num_clients`` nodes at ``fl.participation``, no federated
    evaluation; ``uploads`` gets the bytes of each round's replied arrays as Flower serialises them
    (``.npy``: the tensor's bytes and a header of about 128 bytes per tensor)."""

    def train_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
        uploads.append(sum(len(array.data) for record in records for arrays in record.array_records.values()
                           for array in arrays.values()))
        return aggregate_metricrecords(records, weight_key)

    return FedAvg(fraction_train=cfg.fl.participation, fraction_evaluate=0.0, min_train_nodes=cfg.clients_per_round(),
                  min_available_nodes=cfg.data.num_clients, train_metrics_aggr_fn=train_metrics)


serverapp = ServerApp()


@serverapp.main()
def main(grid: Grid, context: Context) -> None:
    """FedAvg for ``fl.rounds`` rounds, the global model evaluated on the server's test folder on
    fedlt's schedule (every ``eval.every`` rounds and after the last), the result to ``result``."""
    cfg = settings(str(context.run_config["config"]))
    _threads(cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    folder = Path(str(context.run_config["server-test"]))
    test = load_image_folder(folder.parent, folder.name, declared_dataset(cfg.data))
    ends, accs, uploads = [], {}, []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round and (server_round % cfg.eval.every == 0 or server_round == cfg.fl.rounds):
            model.load_state_dict(arrays.to_torch_state_dict())
            accs[server_round] = accuracy(model, test)
        ends.append(time.perf_counter())  # round 0 is called before the first round
        return MetricRecord({"acc": accs[server_round]}) if server_round in accs else None

    make_strategy(cfg, uploads).start(grid, ArrayRecord(model.state_dict()), num_rounds=cfg.fl.rounds,
                                      evaluate_fn=evaluate)
    result = {"round_s": [b - a for a, b in zip(ends, ends[1:])], "acc": accs[cfg.fl.rounds], "up_bytes": uploads}
    Path(str(context.run_config["result"])).write_text(json.dumps(result))


# ---- running it on a federation ---------------------------------------------------------------
def run_on(fed: Federation, config: Path, server_test: Path, result: Path, timeout: float) -> dict:
    """``flwr run`` this app on ``fed`` (whose SuperNodes hold the exported folders) and wait; the
    ServerApp's ``result`` JSON, or a FedltError naming the log when it wrote none."""
    app = write_app(fed.workdir / "plain-flower-app")
    result.unlink(missing_ok=True)
    run_config = f'config="{config.resolve()}" server-test="{server_test.resolve()}" result="{result.resolve()}"'
    flwr = fed.start("flwr-run-plain.log", str(Path(sys.executable).with_name("flwr")), "run", str(app), "deploy",
                     "--stream", "--run-config", run_config)
    deadline = time.monotonic() + timeout
    try:
        while flwr.poll() is None and fed.superlink.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        finished = flwr.poll() is not None
    finally:
        fed.stop(flwr)
    if not result.is_file():
        if fed.superlink.poll() is not None:
            raise FedltError(f"the SuperLink exited (code {fed.superlink.returncode}) during the plain-flower run; "
                             f"logs in {fed.workdir}")
        if not finished:
            raise FedltError(f"the plain-flower run did not finish within {timeout:g} s; logs in {fed.workdir}")
        raise FedltError(f"the plain-flower ServerApp wrote no result (flwr run exit code {flwr.returncode}); "
                         f"see {fed.workdir / 'flwr-run-plain.log'}")
    return json.loads(result.read_text())

