"""A real federation on Flower (``flower.node_data``): each SuperNode is one client with its own
data folder (``--node-config 'data="PATH" name="SITE"'``) and the server reads no training data.

The server waits for ``flower.min_nodes`` SuperNodes, orders them by name (client ``k`` is the
k-th name, whatever Flower's node ids are), keeps the digest of each one's training data that its
hello carries (a resume refuses a site whose data changed; a reply, which carries it too, from other data
is not used), learns the federation's class counts from one summed
``counts`` exchange, and evaluates the global model on its own test set (``eval.test_data``) or,
without one, on the nodes' test splits: each node replies per-class sums for every evaluated model
(``evaluate_counts``, also summed), and a personalized method's nodes reply their personalized
models' accuracies as summable entries (``evaluate``). These three, and the queries the method
declares it only sums (``Server.secure_phases``), are secure phases with two nodes or
more (unless ``privacy.allow_leaks=true`` without ``secagg.enabled``), so the server sees only their
sums; a round whose secure evaluation lost too many nodes to be summed is left unevaluated. Everything
else, the round loop, the client runtime and the messages, is the Flower engine's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from fedlt.config import Config, build_config
from fedlt.data.dataset import ImageDataset
from fedlt.data.declaration import declared_dataset
from fedlt.data.registry import DATASETS
from fedlt.data.sources.imagefolder import load_image_folder, load_node_data
from fedlt.engine.clients import COUNTS, EVALUATE, EVALUATE_COUNTS, ClientRuntime
from fedlt.engine.flower_app import HELLO, FlowerSimulation, client_failure, log
from fedlt.engine.flower_codec import decode_meta
from fedlt.engine.node_federation import NodeFederation, node_federation, server_federation
from fedlt.engine.portable_model import encode_model
from fedlt.engine.secure_aggregation import KEYS, SecureAggregation, TooFewForSecureSum
from fedlt.errors import ConfigError, DataError, FedltError
from fedlt.evaluation import HEADLINE_METRICS, count_metrics, mean_of_summed_accuracies, shot_groups, validation_metrics
from fedlt.messages import Message
from fedlt.run_parts import check_config, setup_runtime

GLOBAL = "global"
#: why a reply is not used: it came from other training data than its site's (a SuperNode started again on
#: another folder under its old id, as one with a registered key is)
OTHER_DATA = "their SuperNode's training data are not those the site began the run with (started again?)"


def node_config(context_node_config: dict[str, Any]) -> tuple[Path, str] | None:
    """(folder, name) of a SuperNode that holds its own data, None for a partition node."""
    if "data" not in context_node_config:
        return None
    folder = Path(str(context_node_config["data"])).expanduser()
    return folder, str(context_node_config.get("name") or folder.name)


def declared_shape(cfg: Config) -> ImageDataset:
    """An empty dataset of the declared image shape, classes and standardisation."""
    d = declared_dataset(cfg.data)
    images = torch.zeros((0, d.channels, d.image_size, d.image_size), dtype=torch.uint8)
    return ImageDataset(images, torch.zeros(0, dtype=torch.int64), list(d.classes), d.mean, d.std)


def server_set(cfg: Config, key: str, device: torch.device | str) -> ImageDataset | None:
    """The server's own balanced test or validation set (``key``: ``test_data`` or ``val_data`` of
    ``cfg.eval``): an image-folder split at that path, or None where none is given."""
    path = getattr(cfg.eval, key)
    if not path:
        return None
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise DataError(f"eval.{key}={path} is not a folder; give the server's set as an image-folder tree (one "
                        "subfolder per class)")
    return load_image_folder(folder.parent, folder.name, declared_dataset(cfg.data), f"eval.{key}").to(device)


# ---- node side ------------------------------------------------------------------------------
_node_runtime: dict[tuple[str, Path], ClientRuntime] = {}


def require_test_folder(cfg: Config, folder: Path | str, has_test: bool) -> None:
    """A site evaluates on its own test/ folder wherever the run measures personalized accuracy, or
    has no server test set to evaluate the global model on."""
    if not has_test and (cfg.eval.personalized or not cfg.eval.test_data):
        raise DataError(f"{folder} has no test/ folder, which the run evaluates on (personalized accuracy, or "
                         "federated evaluation without eval.test_data); add test/<class>/... or set "
                         "eval.personalized=false and eval.test_data=PATH")


def node_runtime(config_json: str, folder: Path) -> ClientRuntime:
    """The client runtime of a node that holds ``folder``, for the run's config (rebuilt when it changes)."""
    key = (config_json, folder)
    if key not in _node_runtime:
        _node_runtime.clear()
        cfg = build_config(json.loads(config_json))
        if not cfg.flower.node_data:
            raise FedltError(f"this SuperNode holds its own data ({folder}), but the run's config has "
                             "flower.node_data=false; deploy with fedlt deploy --node-data, or start the SuperNode "
                             'with --node-config "partition-id=I num-partitions=N"')
        spec, device = setup_runtime(cfg)
        node = load_node_data(folder, declared_dataset(cfg.data))
        require_test_folder(cfg, folder, node.test is not None)
        flips = cfg.data.flips(DATASETS[cfg.data.dataset].hflip if cfg.data.dataset in DATASETS else True)
        data = node_federation(node.train.to(device), node.test.to(device) if node.test is not None else None, flips,
                               node.train.digest())  # hashed on the host, where the images were read
        _node_runtime[key] = ClientRuntime(cfg, spec, data, device)
    return _node_runtime[key]


def hello_reply(name: str, data: NodeFederation) -> dict[str, Any]:
    """What a node says of itself: its site's name and the digest of its training data (no image, label or count)."""
    return {"name": name, "node_data": True, "digest": data.digest}


# ---- server side ----------------------------------------------------------------------------
class NodeDataSimulation(FlowerSimulation):
    """The Flower engine's round loop over SuperNodes that each hold one client's data."""

    def __init__(self, cfg: Config, spec, device: torch.device, grid, prompt: bool = False):
        self.grid, self.prompt, self.cfg = grid, prompt, cfg
        self.nodes, self.node_names, self.exited, self.gone = {}, {}, set(), {}  # for the hello exchange
        self._config_json = json.dumps(cfg.dump())
        #: node id -> the digest of its training data, as its hello said
        self.node_digests: dict[int, str] = {}
        found = self._wait_for_nodes()
        names = sorted(found, key=found.get)
        cfg = build_config({**cfg.dump(), "data": {**cfg.dump()["data"], "num_clients": len(names)}})
        check_config(cfg)  # against the clients that came (a method may need more: GBME's experts)
        test, val = (server_set(cfg, key, device) for key in ("test_data", "val_data"))
        data = server_federation(declared_shape(cfg).to(device), len(names), test, val)
        super().__init__(cfg, spec, data, device, grid, prompt)
        self.nodes = dict(enumerate(names))
        self.node_names = dict(found)
        self._told_late: set[int] = set()
        #: a late node's hello message id -> that node, until its name comes back
        self._asked_late: dict[str, int] = {}
        #: late node -> (the run's site it serves, its data's digest), until that site's old node is gone
        self._standby: dict[int, tuple[str, str]] = {}
        self._told_late_standby: set[int] = set()
        #: clients whose last reply came from other training data than their site's (told once)
        self._other_data: set[int] = set()
        #: client id -> its node's name (the node's ``name`` node config)
        self.client_names = [found[n] for n in names]
        #: client id -> the digest of its site's training data: a resume refuses a site whose data changed
        self.client_digests = [self.node_digests.get(n, "") for n in names]
        engine_sums = {COUNTS: "sum", EVALUATE_COUNTS: "sum", EVALUATE: "sum"}
        if self.secure is not None:
            self.secure.phases.update(engine_sums)
        elif len(names) > 1 and not cfg.privacy.allow_leaks:
            # the server needs only the sums of the nodes' class counts and evaluation figures, never one
            # node's, nor of the method's queries it declares it only sums (a global prior's class counts,
            # a calibration's per-class statistics): those exchanges are secure even where fit is not
            queries = {k: mode for k, mode in spec.server.secure_phases(cfg).items() if k.startswith("query:")}
            self.secure = SecureAggregation(cfg.secagg, {**engine_sums, **queries}, cfg.seed, device)

    def _wait_for_nodes(self) -> dict[int, str]:
        """Node id -> name of the SuperNodes that answered, once ``flower.min_nodes`` have, within
        ``flower.connect_timeout_s``. Two nodes of one name stop the run: which holds the site's data is
        unknown (replies come in any order), and keeping either would train on the wrong one."""
        fl = self.cfg.flower
        deadline = time.monotonic() + fl.connect_timeout_s
        found: dict[int, str] = {}
        asked: set[int] = set()
        log(f"fedlt: waiting for flower.min_nodes={fl.min_nodes} SuperNodes (up to flower.connect_timeout_s="
            f"{fl.connect_timeout_s:g})")
        while True:
            new = [n for n in self.grid.get_node_ids() if n not in asked]
            asked.update(new)
            if new:
                for r in self._send(HELLO, [(n, -1, Message(), 0) for n in new])[0]:
                    meta = decode_meta(r.content)
                    node = r.metadata.src_node_id
                    if not meta.get("node_data"):
                        raise FedltError(f"SuperNode {node} was started with partition-id/num-partitions, but this run "
                                         'has flower.node_data=true; start every SuperNode with --node-config '
                                         '\'data="PATH" name="SITE"\'')
                    if meta["name"] in found.values():
                        other = next(n for n, name in found.items() if name == meta["name"])
                        raise FedltError(f"two SuperNodes are named {meta['name']!r} (nodes {other} and {node}), so "
                                         "which one holds that site's data is unknown; give each node its own name "
                                         "(--node-config 'data=\"PATH\" name=\"SITE\"'), stop the extra one, and "
                                         "start the run again")
                    found[node] = meta["name"]
                    self.node_digests[node] = meta.get("digest", "")
                log(f"fedlt: {len(found)}/{fl.min_nodes} SuperNodes connected ({', '.join(sorted(found.values()))})")
            if len(found) >= fl.min_nodes:
                return found
            if time.monotonic() > deadline:
                have = ", ".join(sorted(found.values())) or "none"
                raise FedltError(f"{len(found)} of flower.min_nodes={fl.min_nodes} SuperNodes connected within "
                                 f"flower.connect_timeout_s={fl.connect_timeout_s:g} (connected: {have}); start the "
                                 "missing ones or lower flower.min_nodes")
            time.sleep(0.5)

    def connect(self) -> None:
        """Done when the run was built: the clients are the nodes that answered then."""

    def _deliver(self, kind, rnd, messages):
        self._name_late_nodes(kind)
        yield from super()._deliver(kind, rnd, messages)

    def _name_late_nodes(self, kind: str = "") -> None:
        """Tell of nodes that joined mid-run and ask each for its site's name without waiting (the answer
        comes in a later phase): an operator knows sites, not Flower's ids. A late node is most often a
        site's SuperNode started again after it failed; it rejoins in the site's place when the old node is
        gone and the site's client kept no state there (a personalized model, control variates), which the
        new node would lack. Any other late node takes no part in the run. Inside a secure phase (``kind``) a
        node takes a site's place only at its key exchange: its later stages need the keys the old node made."""
        # node_names: every node that served a site, a replaced one too (listed until Flower's heartbeat drops it)
        late = sorted(set(self.grid.get_node_ids()) - set(self.node_names) - self._told_late)
        for node in late:
            log(f"fedlt: SuperNode {node} joined after the federation was formed; asking which site it serves")
        self._told_late.update(late)
        if late:
            hello = [self.outgoing(HELLO, node, -1, Message(), 0) for node in late]
            self._asked_late.update(zip(self.grid.push_messages(hello), late))
        for reply in self.grid.pull_messages(list(self._asked_late)) if self._asked_late else []:
            node = self._asked_late.pop(reply.metadata.reply_to_message_id, None)
            if node is not None and reply.has_error():
                log(f"fedlt: the late SuperNode {node} could not say which site it serves "
                    f"({client_failure(reply.error.reason)}); it takes no part")
                continue
            meta = {} if node is None else decode_meta(reply.content)
            if meta.get("name") is not None:
                self._standby[node] = (meta["name"], meta.get("digest", ""))
        if self.secure is not None and self.secure.phase is not None and kind != KEYS:
            return  # re-checked at the next exchange
        for node, (name, digest) in list(self._standby.items()):
            if self._rejoin(node, name, digest):
                del self._standby[node]

    def _rejoin(self, node: int, name: str, digest: str) -> bool:
        """Whether the late ``node`` of site ``name``, whose training data hash to ``digest``, is settled:
        rejoined, or out of the run for good. While the site's old node is still listed (Flower's heartbeat
        keeps a killed SuperNode up to 60 s), it waits. A node whose data are not those the site began the
        run with stays out: its updates would train on other data than the run's records describe."""
        if name not in self.client_names:
            log(f"fedlt: the late SuperNode {node} serves site {name!r}, not one of this run's; it takes no part")
            return True
        if node not in self.grid.get_node_ids():  # it stood by, then left (or failed) itself
            log(f"fedlt: the late SuperNode {node} of site {name!r} left before it could take the site's place")
            return True
        cid = self.client_names.index(name)
        old = self.nodes[cid]
        if digest != self.client_digests[cid]:
            log(_other_data_line(f"the late SuperNode {node}", name))
            return True
        if old not in self._gone_nodes():
            if node not in self._told_late_standby:
                self._told_late_standby.add(node)
                log(f"fedlt: the late SuperNode {node} serves site {name!r}, which SuperNode {old} still serves; it "
                    "stands by until that node is gone")
            return False
        if self.may_keep_state(cid):
            log(f"fedlt: site {name!r} is back as SuperNode {node}, but its client's state between rounds (kept "
                f"by {self.cfg.method}) was on SuperNode {old}, which is gone; the site stays out of this run")
            return True
        # the site's lines in the lost-nodes file that are its earlier nodes' (written before or after this)
        self.lost_before[node] = sum(1 for n, site in self.node_names.items() if site == name)
        self.nodes[cid] = node
        self.node_names[node] = name
        log(f"fedlt: site {name!r} rejoined as SuperNode {node} (it was SuperNode {old}); its client takes part "
            "again from this exchange")
        return True

    def other_data(self, meta: dict[str, Any]) -> str | None:
        """Why a reply is not used: its digest is not its site's. A SuperNode with a registered key started again
        keeps its id, so no hello checks its data; each reply carries their digest instead. Started again on the
        site's own folder, its client takes part again unless it kept state there (then found lost)."""
        cid = meta["cid"]
        node, name = self.nodes[cid], self.client_names[cid]
        if meta.get("digest", self.client_digests[cid]) == self.client_digests[cid]:
            if cid in self._other_data:
                self._other_data.discard(cid)
                log(f"fedlt: SuperNode {node} serves site {name!r} with the site's own training data again")
            return None
        if cid not in self._other_data:
            self._other_data.add(cid)
            log(_other_data_line(f"SuperNode {node}", name))
        return OTHER_DATA

    def setup(self) -> None:
        """The federation's class counts (summed over the nodes), then the method's setup stage."""
        self._sum_class_counts(lambda sites, fix: FedltError(
            f"{sites} did not answer the federation's class-count exchange before round 1: the class counts and the "
            f"many/medium/few groups need every site's; {fix}, then start the run again"))
        super().setup()

    def _sum_class_counts(self, unanswered: Callable[[str, str], FedltError]) -> None:
        """The sites' summed class counts, from every site: a sum short of one would misplace classes in the
        shot groups for the whole run (and a resume, summing all, would take the run's data for other data).
        ``unanswered(sites, fix)`` is the error naming the sites that did not answer and how to bring them."""
        log(f"fedlt: summing the class counts of {len(self.all_clients)} nodes"
            + (" (secure aggregation)" if self.secure is not None and len(self.all_clients) > 1 else ""))
        dropped = len(self.dropped)
        try:
            total = _summed(self._exchange(COUNTS, 0, [(cid, Message()) for cid in self.all_clients]).values(),
                            "counts")
        except FedltError:  # too few answered to sum: which sites did not is the news
            if len(self.dropped) == dropped:
                raise
        silent = sorted({cid for d in self.dropped[dropped:] for cid in d["clients"]})
        if silent:
            one = len(silent) == 1
            sites = ("site " if one else "sites ") + ", ".join(self.site_of(self.nodes[cid]) for cid in silent)
            raise unanswered(sites, f"start {'its SuperNode' if one else 'their SuperNodes'} (or see why "
                                    f"{'it' if one else 'they'} stopped)")
        self.eval_data.counts = np.rint(total.cpu().numpy()).astype(np.int64)
        self.groups = shot_groups(self.eval_data.counts, self.cfg.eval)

    def federation_record(self) -> dict[str, Any]:
        """The sites, in client order, their data's digests and their summed class counts: a resume refuses
        other sites or data."""
        return {"sites": list(self.client_names), "digests": list(self.client_digests),
                "class_counts": [int(c) for c in self.eval_data.counts]}

    def resume_stage(self, saved: dict[str, Any]) -> None:
        """The class counts again (the method's setup stage is in the checkpoint), from the same sites with
        the same data."""
        super().resume_stage(saved)
        before = saved.get("federation", {})
        if before.get("sites") != self.client_names:
            raise ConfigError(f"the run's sites were {', '.join(before.get('sites') or [])}, the connected SuperNodes "
                              f"are {', '.join(self.client_names)}; start the run's own sites to resume it")
        changed = [site for site, was, now in zip(self.client_names, before.get("digests") or [], self.client_digests)
                   if was != now]
        if changed:
            raise ConfigError(f"the data of {'site' if len(changed) == 1 else 'sites'} {', '.join(changed)} are not "
                              "those the run began with (the digest of the training images and labels differs); "
                              "resume with each site's own folder, or start a new run")
        traffic = dict(self._traffic)
        self._sum_class_counts(lambda sites, fix: ConfigError(
            f"{sites} did not answer the resumed run's check of the sites' class counts; {fix}, then run the same "
            "resume again"))
        self._traffic = traffic  # counted once, in round 1: comm as in the uninterrupted run
        if [int(c) for c in self.eval_data.counts] != before.get("class_counts"):
            raise ConfigError("the sites' data are not those the run began with (their summed class counts differ); "
                              "resume with each site's own folder, or start a new run")

    def _write_partition(self, run_dir: Path) -> None:
        """None: the server does not know which node holds what."""

    def evaluate(self, rnd: int) -> dict[str, Any]:
        on_server = len(self.eval_data.test) > 0
        out: dict[str, Any] = self._server_metrics()[0] if on_server else {}
        model = self.server.global_model()
        val = self.eval_data.val
        if not on_server and val is not None and model is not None:
            out.update(validation_metrics(model, val, self.groups, self.cfg.eval.batch_size))
        personalized = self.cfg.eval.personalized
        models = {} if model is None else {GLOBAL: model}
        if not on_server:
            models.update(self.server.extra_models())
        if models and (not on_server or (personalized and not self.spec.client.personalized)):
            if on_server:
                models = {GLOBAL: model}
            out.update(self._federated_metrics(rnd, models, on_server))
        if personalized and self.spec.client.personalized:
            try:
                out.update(self._personalized_metrics(rnd, None, None))
            except TooFewForSecureSum as err:
                log(f"fedlt: round {rnd}'s personalized accuracy is not evaluated: {err}")
        return out

    def _federated_metrics(self, rnd: int, models: dict[str, Any], pm_only: bool) -> dict[str, Any]:
        """Each node evaluates ``models`` on its own test split; the sums give the metrics."""
        own = type(self.server_model.head)
        msg = Message(payload={"models": {name: encode_model(m, own) for name, m in models.items()}})
        try:
            replies = list(self._exchange(EVALUATE_COUNTS, rnd, [(cid, msg) for cid in self.all_clients]).values())
        except TooFewForSecureSum as err:  # too few nodes answered to sum without revealing one: no figures this round
            log(f"fedlt: round {rnd} is not evaluated: {err}")
            return {}
        out: dict[str, Any] = {}
        if self.cfg.eval.personalized and not self.spec.client.personalized and GLOBAL in models:
            out["pm_acc"] = mean_of_summed_accuracies(replies, "pm")
        if pm_only:
            return out
        totals = _summed(replies, "totals")
        variants = {}
        for name in models:
            metrics = count_metrics(_summed(replies, f"hits/{name}"), totals, _summed(replies, f"loss/{name}"),
                                    self.groups, self.cfg.eval.accuracy)
            if name == GLOBAL:
                out.update(metrics)
            else:
                variants[name] = {k: metrics[k] for k in HEADLINE_METRICS}
        if variants:
            out["variants"] = variants
        return out

    def _summary_extra(self, elapsed: float) -> dict[str, Any]:
        extra = super()._summary_extra(elapsed)
        return {**extra, "nodes": self.client_names,
                "evaluation": "server test set" if len(self.eval_data.test) else
                "federated: per-class sums over the nodes' own test splits, accuracy = "
                + ("share of test images classified right" if self.cfg.eval.accuracy == "top1" else
                   "mean of per-class accuracies")}


def _other_data_line(node: str, site: str) -> str:
    return (f"fedlt: {node} serves site {site!r}, but its training data are not those the site began the run with "
            "(the digest of its images and labels differs); it takes no part (start it on the site's own folder to "
            "rejoin)")


def _summed(replies, key: str) -> torch.Tensor:
    """The sum of one payload entry over the replies (one aggregate reply under secure aggregation)."""
    values = [r.payload[key] for r in replies]
    if not values:
        raise FedltError(f"no node answered the federated '{key}' sums; check that the SuperNodes are running")
    return sum(torch.as_tensor(v, dtype=torch.float64) for v in values)
