"""The in-process engine: aggregation arithmetic, learning, determinism, resume, method hooks."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

import fedlt
from conftest import run_until_crash_in_round_3
from fedlt.api import prepare
from fedlt.config import build_config
from fedlt.engine.sampling import lr_at, sampling_schedule
from fedlt.errors import FedltError, TrainingDiverged
from fedlt.messages import Reply
from fedlt.methods.aggregation import weighted_average
from fedlt.methods.registry import list_methods
from fedlt.results import TIMING_KEYS, read_metrics, read_summary


def tiny(tmp_path, **over) -> dict:
    """A seconds-long synthetic federation."""
    cfg = {
        "seed": 3,
        "data": {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 6},
        "model": {"name": "cnn"},
        "fl": {"rounds": 4, "participation": 0.5, "local_epochs": 2, "batch_size": 32, "lr": 0.05},
        "eval": {"every": 2},
        "run": {"out_dir": str(tmp_path), "checkpoint_every": 2, "threads": 1},
    }
    for key, value in over.items():
        section, _, name = key.partition("__")
        if name:
            cfg.setdefault(section, {})[name] = value
        else:
            cfg[section] = value
    return cfg


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def test_weighted_average_arithmetic():
    a = Reply(weights={"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(4)}, num_samples=1)
    b = Reply(weights={"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(10)}, num_samples=3)
    empty = Reply(weights={"w": torch.tensor([100.0, 100.0])}, num_samples=0)
    out = weighted_average({0: a, 1: b, 2: empty})
    assert torch.allclose(out["w"], torch.tensor([(1 + 12) / 4, (2 + 24) / 4]))
    assert out["n"].dtype == torch.int64 and out["n"].item() == round((4 + 30) / 4)


def test_weighted_average_of_integer_buffers_converts_once_a_round_not_per_client():
    """Integer buffers are summed exactly in int64 and converted once, whatever the number of replies;
    an int32 buffer keeps its dtype and the mean rounds half to even, as the float64 sum did."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Conversions(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Conversions.count += func is torch.ops.aten._to_copy.default
            return func(*args, **(kwargs or {}))

    replies = {c: Reply(weights={"n": torch.tensor(2 * c + 1), "m": torch.tensor([c, 3], dtype=torch.int32)},
                        num_samples=1) for c in range(4)}
    with Conversions():
        out = weighted_average(replies)
    assert out["n"].dtype == torch.int64 and out["n"].item() == 4  # (1+3+5+7)/4
    assert out["m"].dtype == torch.int32 and out["m"].tolist() == [2, 3]  # 1.5 rounds to 2
    assert Conversions.count == 2 * 2 + 4  # each buffer to float64 and back once; m to int64 per reply


def test_weighted_average_rewriting_the_last_replys_products_equals_new_ones_bitwise(monkeypatch):
    """On a GPU a reply's weighted entries are written into the previous reply's tensors instead of new
    ones (tried here on the CPU): the same products and sums, bit for bit, for every dtype a state holds
    and for entries some replies lack; the round makes two tensors per entry, not one per entry and reply."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fedlt.methods import aggregation

    class Products(TorchDispatchMode):
        made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Products.made += len(out) if func is torch.ops.aten._foreach_mul.Scalar else 0
            return out

    g = torch.Generator().manual_seed(0)
    replies = {c: Reply(weights={"w": torch.randn(5, 3, generator=g), "d": torch.randn(4, generator=g).double(),
                                 "h": torch.randn(6, generator=g).half(), "n": torch.tensor(c * 7 + 1),
                                 "b": torch.randn(50, generator=g).bfloat16(),
                                 "m": torch.tensor([c, 2 * c], dtype=torch.int32),
                                 **({"head": torch.randn(2, generator=g)} if c % 2 else {})},
                        num_samples=12345 + 1001 * c) for c in range(6)}  # counts half precision cannot hold
    with Products():
        plain = weighted_average(replies)
    assert Products.made == 6 * 6 + 3  # a product per entry and reply
    monkeypatch.setattr(aggregation, "REWRITTEN_ON", frozenset({"cpu"}))
    Products.made = 0
    with Products():
        rewritten = weighted_average(replies)
    # the sum and one product per entry; half-precision entries (rounded otherwise in place) a product per reply
    assert Products.made == 7 + 5 + 2 * 5
    assert plain.keys() == rewritten.keys() == {"w", "d", "h", "b", "n", "m", "head"}
    for name in plain:
        assert plain[name].dtype == rewritten[name].dtype == replies[1].weights[name].dtype
        assert torch.equal(plain[name], rewritten[name]), name
    assert all(torch.equal(r.weights["m"], torch.tensor([c, 2 * c], dtype=torch.int32)) for c, r in replies.items())


def test_weighted_average_over_clients_that_sent_the_entry():
    a = Reply(weights={"body": torch.tensor([2.0]), "head": torch.tensor([1.0])}, num_samples=2)
    b = Reply(weights={"body": torch.tensor([4.0])}, num_samples=2)
    out = weighted_average({0: a, 1: b})
    assert out["body"].item() == 3.0 and out["head"].item() == 1.0


def test_a_servers_messages_share_one_copy_of_its_model_until_the_model_changes():
    """The model a server sends is copied once for all of a round's clients, not once per client; any
    change to the model (an aggregation, a step, a replaced tensor) makes a new copy, and a copy a
    receiver wrote to is refused instead of sent to the next client."""
    from fedlt.methods.base import broadcast_state

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    sent = [broadcast_state(model) for _ in range(3)]
    assert all(a[k] is sent[0][k] for a in sent for k in a) and sent[0] is not sent[1]  # one copy, a dict each
    assert all(torch.equal(sent[0][k], v) and sent[0][k] is not v for k, v in model.state_dict().items())
    model.load_state_dict({**model.state_dict(), "0.bias": torch.tensor([1.0, 2.0])})  # an aggregation
    after = broadcast_state(model)
    assert after["0.bias"].tolist() == [1.0, 2.0] and after["0.weight"] is not sent[0]["0.weight"]
    assert sent[0]["0.bias"].tolist() != [1.0, 2.0]  # what was sent before stays what was sent
    model[0].weight = torch.nn.Parameter(torch.ones(2, 3))  # a replaced tensor
    assert broadcast_state(model)["0.weight"].tolist() == [[1.0] * 3] * 2
    with torch.no_grad():
        model[0].weight.data = torch.full((2, 3), 2.0)  # replaced storage: no version is raised
    assert broadcast_state(model)["0.weight"].tolist() == [[2.0] * 3] * 2
    model.double()  # so does a conversion
    assert broadcast_state(model)["0.weight"].dtype == torch.float64
    broadcast_state(model)["1.running_mean"].add_(1)  # a receiver writing to what it was sent
    with pytest.raises(RuntimeError, match=r"a receiver wrote to the weights the server sent \(1.running_mean\)"):
        broadcast_state(model)
    with torch.inference_mode():  # no versions to check: a copy of its own
        assert broadcast_state(model)["0.weight"] is not broadcast_state(model)["0.weight"]
    for method, loss in (("fedavg", "ce"), ("sfd", "ce"), ("fedyoyo", "ce")):  # the servers' fit messages share it
        sim = prepare(build_config(tiny("unused", method=method, loss={"name": loss})))
        sim.setup()
        first, second = (sim.server.fit_message(1, cid).weights for cid in (0, 1))
        assert first.keys() == second.keys() and all(first[k] is second[k] for k in first), method


def test_sampling_schedule_is_seeded_and_valid():
    s1 = sampling_schedule(0, 20, 8, 30)
    assert s1 == sampling_schedule(0, 20, 8, 30) and s1 != sampling_schedule(1, 20, 8, 30)
    assert all(len(set(r)) == 8 and all(0 <= c < 20 for c in r) for r in s1)


def test_lr_schedules():
    cfg = fedlt.load_config(None, ["fl.rounds=10", "fl.lr=0.1", "fl.lr_schedule=cosine"])
    assert lr_at(cfg.fl, 1) == pytest.approx(0.1) and lr_at(cfg.fl, 6) == pytest.approx(0.05)
    cfg = fedlt.load_config(None, ["fl.rounds=10", "fl.lr=0.1", "fl.lr_schedule=step", "fl.lr_decay_at=[0.5]"])
    assert lr_at(cfg.fl, 5) == pytest.approx(0.1) and lr_at(cfg.fl, 6) == pytest.approx(0.01)


def test_fedavg_learns_synthetic(tmp_path):
    """FedAvg reaches >= 80% balanced test accuracy on synthetic-LT (IF=10) in 6 rounds."""
    res = fedlt.run(tiny(tmp_path, fl__rounds=6, fl__local_epochs=3, eval__every=3), quiet=True)
    final = res.summary["final"]
    assert final["round"] == 6 and final["acc"] >= 80.0
    first = res.metrics[0]["acc"]  # round 3
    assert first < final["acc"] or first >= 90.0
    assert len(final["per_class_acc"]) == 10
    assert final["server_metrics"] == {}  # FedAvg reports nothing of its own


def test_same_seed_same_metrics_and_resume_equals_uninterrupted(tmp_path, monkeypatch):
    full = fedlt.run(tiny(tmp_path / "a", run__name="full"), quiet=True)
    again = fedlt.run(tiny(tmp_path / "b", run__name="again"), quiet=True)
    assert without_timing(full.metrics) == without_timing(again.metrics)

    resumed = cut_in_round_3_and_resume(tiny(tmp_path / "c", run__name="cut"), monkeypatch)
    assert without_timing(resumed.metrics) == without_timing(full.metrics)
    assert resumed.summary["final"] == full.summary["final"]


def test_resume_refuses_metrics_that_lost_an_evaluated_round_and_remakes_a_damaged_partition(tmp_path, monkeypatch):
    """A resumed run does not evaluate the rounds before its checkpoint again: metrics that lost one
    (a damaged line, an emptied file) are refused, and a finished run's summary is not overwritten
    with empty results. The partition record is drawn from the seed, so a damaged one is made again."""
    full = fedlt.run(tiny(tmp_path / "a", run__name="full"), quiet=True)
    summary = (full.run_dir / "summary.json").read_text()
    metrics = full.run_dir / "metrics.jsonl"
    kept = metrics.read_bytes()
    for damaged, lost in ((b"", "2, 4"), (kept.splitlines()[0][:40] + b"\n" + kept.splitlines()[1] + b"\n", "2")):
        metrics.write_bytes(damaged)
        with pytest.raises(FedltError, match=re.escape(f"{metrics} lacks round(s) {lost} of the 2 evaluated up to the "
                                                       "checkpoint of round 4; restore the file, or start the run again")):
            fedlt.resume(full.run_dir, quiet=True)
        assert (full.run_dir / "summary.json").read_text() == summary
    metrics.write_bytes(kept)
    partition = full.run_dir / "partition.json"
    record = partition.read_bytes()
    partition.write_bytes(record[:40])
    fedlt.resume(full.run_dir, quiet=True)
    assert partition.read_bytes() == record
    checkpoint = full.run_dir / "checkpoint.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:100])
    with pytest.raises(FedltError, match=re.escape(f"{checkpoint} is not a complete torch checkpoint: cut off, damaged")):
        fedlt.resume(full.run_dir, quiet=True)


def test_a_hand_edited_config_is_refused_at_resume_but_how_the_run_executes_may_change(tmp_path, monkeypatch):
    import yaml

    from fedlt.errors import ConfigError

    run_dir = run_until_crash_in_round_3(tiny(tmp_path, fl__local_epochs=1, run__name="cut"), monkeypatch)
    saved = (run_dir / "config.yaml").read_text()
    for key, value, shown in [("data", "num_clients", "data.num_clients: 6 -> 5"), ("fl", "rounds", "fl.rounds: 4 -> 5"),
                              ("", "seed", "seed: 3 -> 5")]:
        tree = yaml.safe_load(saved)
        (tree[key] if key else tree)[value] = 5
        (run_dir / "config.yaml").write_text(yaml.safe_dump(tree))
        with pytest.raises(ConfigError, match=re.escape(f"{run_dir / 'config.yaml'} is not the config checkpoint.pt "
                                                        f"was saved with ({shown}); restore that value")):
            fedlt.resume(run_dir, quiet=True)
    tree = yaml.safe_load(saved)
    tree["run"].update(threads=2, checkpoint_every=1)  # execution only: the same run goes on
    (run_dir / "config.yaml").write_text(yaml.safe_dump(tree))
    assert fedlt.resume(run_dir, quiet=True).summary["final"]["round"] == 4


def test_a_resume_under_other_resolved_knobs_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A run interrupted under one fedlt and resumed under one whose default of a knob changed went on
    with the new value under the same config, its summary naming only that one. Each checkpoint keeps
    the knobs its rounds resolved to; a resume that resolves them otherwise is refused."""
    from fedlt.engine.checkpoint import load_checkpoint, save_checkpoint
    from fedlt.errors import ConfigError

    run_dir = run_until_crash_in_round_3(tiny(tmp_path, method="fedprox", fl__local_epochs=1, run__name="cut"),
                                         monkeypatch)
    ckpt = load_checkpoint(run_dir)
    assert ckpt["resolved_args"] == {"method_args": {"mu": 0.01}, "calibration_args": None}
    files = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    save_checkpoint(run_dir, {**ckpt, "resolved_args": {"method_args": {"mu": 0.5}, "calibration_args": None}})
    files["checkpoint.pt"] = (run_dir / "checkpoint.pt").read_bytes()
    with pytest.raises(ConfigError, match=re.escape(f"the first 2 rounds of {run_dir} ran method_args.mu=0.5, which "
                                                    "this fedlt resolves to 0.01 (a changed default or knob)")):
        fedlt.resume(run_dir, quiet=True)
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == files
    save_checkpoint(run_dir, {k: v for k, v in ckpt.items() if k != "resolved_args"})  # from before the record
    assert fedlt.resume(run_dir, quiet=True).summary["final"]["round"] == 4


def cut_in_round_3_and_resume(cfg: dict, monkeypatch):
    """Run ``cfg`` until a crash in round 3 (after round 2's checkpoint), then resume it to the end."""
    run_dir = run_until_crash_in_round_3(cfg, monkeypatch)
    assert [json.loads(l)["round"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()] == [2]
    return fedlt.resume(run_dir, quiet=True)


@pytest.mark.parametrize("method, over", [("fedyoyo", {"method_args": {"asd": False}}), ("gbme", {"loss__name": "bsm"})])
def test_a_method_with_server_state_resumes_as_if_uninterrupted(tmp_path, monkeypatch, method, over):
    """FedYoYo's global prior and GBME's GPI and client groups live on the server between rounds."""
    over = dict(method=method, fl__local_epochs=1, **over)
    full = fedlt.run(tiny(tmp_path / "a", run__name="full", **over), quiet=True)
    resumed = cut_in_round_3_and_resume(tiny(tmp_path / "b", run__name="cut", **over), monkeypatch)
    assert without_timing(resumed.metrics) == without_timing(full.metrics)
    assert resumed.summary["final"] == full.summary["final"]


def test_resume_refuses_a_folder_where_the_run_writes_a_file_before_training(tmp_path, monkeypatch):
    """A folder in a run file's place would have failed the resume after all its training."""
    from fedlt.engine.simulation import Simulation
    from fedlt.errors import ConfigError

    run_dir = fedlt.run(tiny(tmp_path, fl__rounds=2, run__name="folder"), quiet=True).run_dir
    metrics = (run_dir / "metrics.jsonl").read_text()
    (run_dir / "summary.json").unlink()
    (run_dir / "summary.json").mkdir()
    monkeypatch.setattr(Simulation, "fit_round", lambda *a: pytest.fail("trained before refusing"))
    with pytest.raises(ConfigError, match=re.escape(f"{run_dir / 'summary.json'} is not a file, where the run writes "
                                                    "its summary.json; move it out of the run directory, then resume")):
        fedlt.resume(run_dir, quiet=True)
    (run_dir / "summary.json").rmdir()
    (run_dir / "checkpoint.pt.tmp").mkdir()  # where the checkpoint is written before it replaces the last one
    with pytest.raises(ConfigError, match=re.escape(f"{run_dir / 'checkpoint.pt.tmp'} is not a file, where the run "
                                                    "writes its checkpoint.pt")):
        fedlt.resume(run_dir, quiet=True)
    assert (run_dir / "metrics.jsonl").read_text() == metrics


def test_resume_refuses_a_checkpoint_that_no_longer_fits_the_edited_config(tmp_path):
    from fedlt.errors import FedltError

    run_dir = fedlt.run(tiny(tmp_path, fl__rounds=2, run__name="edited"), quiet=True).run_dir
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace("name: cnn", "name: resnet8"))
    metrics = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(FedltError, match=r"config.yaml is not the config checkpoint.pt was saved with \(model.name: "
                                         r"'cnn' -> 'resnet8'\); restore that value"):
        fedlt.resume(run_dir, quiet=True)
    # a checkpoint saved before checkpoints kept their config: the state that no longer loads says so
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    del state["config"]
    torch.save(state, run_dir / "checkpoint.pt")
    with pytest.raises(FedltError, match=r"checkpoint.pt does not fit the run's config.yaml \(RuntimeError: Error\(s\) in loading "
                                         r"state_dict for FedModel\); restore the config.yaml it was saved with"):
        fedlt.resume(run_dir, quiet=True)
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # nothing rewritten


def test_a_checkpoint_holds_only_what_a_safe_load_reads(tmp_path):
    """State torch.load(weights_only=True) could not read back fails at the save, not at a resume."""
    import numpy as np

    from fedlt.engine.checkpoint import load_checkpoint, save_checkpoint

    state = {"round": 1, "clients": {0: {"counts": torch.arange(3)}}, "in_clear": ["evaluate"]}
    save_checkpoint(tmp_path, state)
    assert load_checkpoint(tmp_path)["clients"][0]["counts"].tolist() == [0, 1, 2]
    with pytest.raises(TypeError, match="numpy"):
        save_checkpoint(tmp_path, {**state, "clients": {0: {"counts": np.arange(3)}}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # the previous one, kept


def _writes_until_interrupted(after: int):
    """``open`` whose files raise KeyboardInterrupt at their ``after``-th write, as Ctrl-C landing while
    torch's writer is inside a record does."""
    import builtins

    class Cut:
        def __init__(self, handle):
            self.handle, self.writes = handle, 0

        def write(self, data):
            self.writes += 1
            if self.writes == after:
                raise KeyboardInterrupt
            return self.handle.write(data)

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    return lambda *args, **kwargs: Cut(builtins.open(*args, **kwargs))


def test_a_checkpoint_save_cut_short_by_ctrl_c_stops_as_an_interrupt_and_keeps_the_last_checkpoint(tmp_path,
                                                                                                   monkeypatch):
    """torch's writer, interrupted mid-record, fails closing the file (RuntimeError: unexpected pos) and
    that error replaced the interrupt: a run stopped while saving (one save a round, or a bench's
    worker stopped) failed where it should stop resumable."""
    from fedlt.engine.checkpoint import load_checkpoint, save_checkpoint

    state = {"round": 1, "server": {"w": torch.arange(1000.0)}, "clients": {0: {"c": torch.ones(10)}}}
    save_checkpoint(tmp_path, state)
    monkeypatch.setattr("fedlt.results.open", _writes_until_interrupted(3), raising=False)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, {**state, "round": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no half-written file beside it
    assert load_checkpoint(tmp_path)["round"] == 1


def test_a_data_cache_entry_cut_short_by_ctrl_c_stops_as_an_interrupt_and_leaves_no_file(tmp_path, monkeypatch):
    import tempfile

    from fedlt.data.sources import cache

    named = tempfile.NamedTemporaryFile
    cut = _writes_until_interrupted(3)
    monkeypatch.setattr(cache.tempfile, "NamedTemporaryFile",
                        lambda **kw: cut(named(**kw).name, "wb"))
    with pytest.raises(KeyboardInterrupt):
        cache.store(tmp_path / "fmnist-abc.pt", {"x": torch.arange(1000.0)})
    assert list(tmp_path.iterdir()) == []


def cut_text(self, text, *args, **kwargs):
    """``Path.write_text`` cut short by Ctrl-C after its first character."""
    with open(self, "w") as handle:
        handle.write(text[:1])
    raise KeyboardInterrupt


def test_a_file_cut_short_by_ctrl_c_leaves_no_temporary_file_beside_it(tmp_path, monkeypatch):
    """A run's files are written through a temporary file renamed into place; Ctrl-C while the plot was
    drawn into it, or while the saved checkpoint was checked, left ``tmp-curves.png`` or
    ``checkpoint.pt.tmp`` (a cut file) in the run's folder."""
    import matplotlib.figure

    from fedlt.engine.checkpoint import save_checkpoint
    from fedlt.results import plot_curves, write_atomic

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    save_checkpoint(tmp_path, {"round": 1, "server": {"w": torch.ones(3)}})
    write_atomic(tmp_path / "summary.json", "{}\n")
    kept = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def cut_plot(self, path, **kwargs):
        with open(path, "wb") as handle:
            handle.write(b"\x89PNG")  # a part of the image
        raise KeyboardInterrupt

    for patch, write in (
            ((torch.serialization, "get_unsafe_globals_in_checkpoint", interrupted),
             lambda: save_checkpoint(tmp_path, {"round": 2, "server": {"w": torch.zeros(3)}})),
            ((matplotlib.figure.Figure, "savefig", cut_plot),
             lambda: plot_curves(tmp_path / "curves.png", [{"round": 1, "acc": 50.0}], "a run")),
            ((type(tmp_path), "write_text", cut_text),
             lambda: write_atomic(tmp_path / "summary.json", "{\"a\": 1}\n"))):
        monkeypatch.setattr(*patch)
        with pytest.raises(KeyboardInterrupt):
            write()
        monkeypatch.undo()
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == kept, patch[1]


def test_a_run_stopped_while_its_folder_is_made_leaves_no_folder(tmp_path, monkeypatch):
    """Ctrl-C while the new run's config was written left a folder holding that config alone: no run,
    yet one more folder in a bench's or a user's listing."""
    from fedlt import results

    monkeypatch.setattr(type(tmp_path), "write_text", cut_text)
    with pytest.raises(KeyboardInterrupt):
        results.new_run_dir(build_config(tiny(tmp_path / "out")))
    assert list((tmp_path / "out").iterdir()) == []


def test_a_resumed_tensor_lands_where_the_uninterrupted_run_kept_it(tmp_path, monkeypatch):
    """Saved by a GPU run (its device tensors tagged ``cuda:0`` here), a checkpoint resumed on the
    run's device (``meta`` standing in) keeps the host-side state on the host; a CPU run's checkpoint
    resumed on a device puts everything there, and a GPU run's resumed on a CPU puts everything there."""
    from fedlt.engine.checkpoint import load_checkpoint, save_checkpoint

    weights, velocity, counts, control = torch.ones(4), torch.zeros(4), torch.arange(3), torch.ones(2)
    on_device = {t.untyped_storage().data_ptr() for t in (weights, velocity)}
    host_tag = torch.serialization.location_tag
    state = {"server": {"model": {"w": weights}, "velocity": {"w": velocity}, "global_counts": counts},
             "clients": {0: {"c_i": control}}}

    def places(device):
        got = load_checkpoint(tmp_path, device)
        return {"w": got["server"]["model"]["w"].device.type, "velocity": got["server"]["velocity"]["w"].device.type,
                "counts": got["server"]["global_counts"].device.type, "c_i": got["clients"][0]["c_i"].device.type}

    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag",
                      lambda storage: "cuda:0" if storage.data_ptr() in on_device else host_tag(storage))
        save_checkpoint(tmp_path, state)
    assert places("meta") == {"w": "meta", "velocity": "meta", "counts": "cpu", "c_i": "cpu"}
    assert places("cpu") == dict.fromkeys(("w", "velocity", "counts", "c_i"), "cpu")
    save_checkpoint(tmp_path, state)  # a CPU run's
    assert places("meta") == dict.fromkeys(("w", "velocity", "counts", "c_i"), "meta")
    assert load_checkpoint(tmp_path, "meta")["server"]["global_counts"].dtype == torch.int64


def test_different_seed_different_partition_and_metrics(tmp_path):
    a = fedlt.run(tiny(tmp_path, fl__rounds=2, run__name="s3"), quiet=True)
    b = fedlt.run(tiny(tmp_path, fl__rounds=2, seed=4, run__name="s4"), quiet=True)
    assert a.summary["data"] != b.summary["data"]
    assert a.metrics[-1]["loss"] != pytest.approx(b.metrics[-1]["loss"])


def test_clipping_sees_only_the_gradient_of_what_is_trained(tmp_path):
    """A gradient left on a parameter the loop does not train (an expert another client trained, a
    head outside ``params``) must not enter the clipping norm: training is then the same with or
    without it, whatever ran on the shared model before."""
    from fedlt.api import prepare
    from fedlt.methods.base import clone_state
    from fedlt.training.sequential import train_local

    sim = prepare(fedlt.load_config(None, ["data.dataset=synthetic", "fl.grad_clip=0.5", f"run.out_dir={tmp_path}"]))
    start = clone_state(sim.worker)
    trained = {}
    for stale in (None, 1e6):
        ctx = sim._context(0, 1)
        ctx.model.load_state_dict(start)
        ctx.model.head.weight.grad = None if stale is None else torch.full_like(ctx.model.head.weight, stale)
        train_local(ctx, lambda x, y: torch.nn.functional.cross_entropy(ctx.model(x), y),
                    params=ctx.model.encoder.parameters())
        trained[stale] = clone_state(ctx.model)
    assert all(torch.equal(trained[1e6][k], v) for k, v in trained[None].items())
    assert not torch.equal(trained[None]["encoder.0.weight"], start["encoder.0.weight"])  # it trained


def test_a_local_objective_fit_one_by_one_loads_the_clients_own_part_and_refuses_what_it_cannot_train(tmp_path):
    """``fit_objective``: the client's ``start`` over the received weights, the reply from ``finish``
    with what it added to the payload; an objective whose extras, prepared part or per-step rate need
    the method's own loop is refused, not trained without them."""
    from fedlt.api import prepare
    from fedlt.messages import Message
    from fedlt.methods.base import LocalObjective, clone_state
    from fedlt.training.sequential import fit_objective

    sim = prepare(fedlt.load_config(None, ["data.dataset=synthetic", f"run.out_dir={tmp_path}"]))
    ctx, received = sim._context(0, 1), clone_state(sim.worker)
    own = {"head.bias": torch.full_like(received["head.bias"], 7.0)}
    seen = {}

    def finish(state, extra):
        objective.payload["note"] = torch.ones(1)
        return {k: v for k, v in state.items() if k != "head.bias"}

    objective = LocalObjective(torch.nn.functional.cross_entropy, start=own, finish=finish)
    def first_bias(module, args):  # the head's bias when the first step's forward reaches it
        seen.setdefault("bias", module.bias.detach().clone())

    ctx.model.head.register_forward_pre_hook(first_bias)
    reply = fit_objective(ctx, Message(weights=received), objective)
    assert torch.equal(seen["bias"], own["head.bias"])  # the first step ran from the client's own bias
    assert "head.bias" not in reply.weights and "note" in reply.payload and reply.metrics["steps"] > 0
    untrained = fit_objective(ctx, Message(weights=received), None)  # a client without data
    assert untrained.num_samples == 0 and torch.equal(untrained.weights["head.weight"], received["head.weight"])
    for hooked in ({"prepare": lambda m: None}, {"lr_scale": lambda i: 1.0}, {"extra": {"p": torch.zeros(2)}}):
        with pytest.raises(ValueError, match="fit_objective trains neither extra tensors"):
            fit_objective(ctx, Message(weights=received), LocalObjective(torch.nn.functional.cross_entropy, **hooked))


def test_fedprox_with_zero_mu_equals_fedavg(tmp_path):
    avg = fedlt.run(tiny(tmp_path, fl__rounds=2, run__name="avg"), quiet=True)
    prox = fedlt.run(tiny(tmp_path, fl__rounds=2, method="fedprox", method_args={"mu": 0.0}, run__name="prox"),
                     quiet=True)
    strong = fedlt.run(tiny(tmp_path, fl__rounds=2, method="fedprox", method_args={"mu": 10.0}, run__name="p10"),
                       quiet=True)
    assert without_timing(prox.metrics) == without_timing(avg.metrics)  # mu=0 adds exact zeros: bit-identical
    assert strong.metrics[-1]["loss"] != pytest.approx(avg.metrics[-1]["loss"])


def test_global_prior_is_queried_once_and_costs_payload(tmp_path):
    res = fedlt.run(tiny(tmp_path, loss={"name": "bsm", "prior": "global"}), quiet=True)
    # every round the server sends the 10-class count vector (int64) to each of the 3 sampled
    # clients; a metrics line covers the 2 rounds since the previous one
    assert [r["comm"]["down_payload"] for r in res.metrics] == [2 * 3 * 10 * 8] * 2
    # the setup query's uploads (6 clients x (80-byte counts + 8-byte sample count)) land in the first line
    first, second = (r["comm"]["up_payload"] for r in res.metrics)
    assert first - second == 6 * (10 * 8 + 8)
    local = fedlt.run(tiny(tmp_path, loss={"name": "bsm", "prior": "local"}, run__name="l"), quiet=True)
    assert all(r["comm"]["down_payload"] == 0 for r in local.metrics)


def test_uniform_prior_makes_logit_adjustment_plain_cross_entropy(tmp_path, float64):
    """A uniform prior shifts every logit by the same log(1/C): softmax, hence training, is CE's
    up to rounding (compared in float64, see conftest.float64); the local prior of the same loss
    trains differently."""
    ce = fedlt.run(tiny(tmp_path, fl__rounds=2, run__name="ce"), quiet=True)
    uniform = fedlt.run(tiny(tmp_path, fl__rounds=2, loss={"name": "bsm", "prior": "uniform"}, run__name="u"), quiet=True)
    local = fedlt.run(tiny(tmp_path, fl__rounds=2, loss={"name": "bsm", "prior": "local"}, run__name="l"), quiet=True)
    assert len(ce.metrics) == len(uniform.metrics) == 1
    for a, b in zip(ce.metrics, uniform.metrics):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-10)
        assert b["acc"] == a["acc"] and b["per_class_acc"] == a["per_class_acc"]
        assert b["comm"]["down_payload"] == 0
    assert local.metrics[-1]["train_loss"] != pytest.approx(ce.metrics[-1]["train_loss"], abs=1e-3)


@pytest.mark.parametrize("loss", ["la", "focal", "ldam"])
def test_loss_variants_train(tmp_path, loss):
    """Every loss learns: far above the 10% chance level after 4 rounds."""
    res = fedlt.run(tiny(tmp_path, loss={"name": loss}), quiet=True)
    assert res.summary["final"]["acc"] > 40.0 and res.summary["loss"].startswith(loss)


def test_centralized_oracle_trains_one_pooled_client(tmp_path):
    res = fedlt.run(tiny(tmp_path, fl__rounds=2, method="centralized"), quiet=True)
    # one client holding every sample: the model goes down once and comes back once per round
    fed = fedlt.run(tiny(tmp_path, fl__rounds=2, run__name="fed"), quiet=True)
    assert res.metrics[0]["comm"]["down_model"] * 3 == fed.metrics[0]["comm"]["down_model"]
    assert res.summary["final"]["acc"] > fed.summary["final"]["acc"]
    assert res.summary["final"]["pm_acc"] is not None


def test_augmentation_is_seeded_and_applied_only_in_training(tmp_path, monkeypatch):
    from fedlt.engine.simulation import Simulation
    from fedlt.methods.base import ClientData

    batches, evaluating = [], [False]  # (inside an evaluation, augmented) per batch a client made
    evaluate, batch = Simulation.evaluate, ClientData.batch

    def marked_evaluate(self, rnd):
        evaluating[0] = True
        try:
            return evaluate(self, rnd)
        finally:
            evaluating[0] = False

    def recorded_batch(self, rows, generator=None):
        batches.append((evaluating[0], generator is not None and self.augment is not None))
        return batch(self, rows, generator)

    monkeypatch.setattr(Simulation, "evaluate", marked_evaluate)
    monkeypatch.setattr(ClientData, "batch", recorded_batch)
    w1 = fedlt.run(tiny(tmp_path, fl__rounds=2, data__augment="weak", run__name="w1"), quiet=True)
    assert (False, True) in batches and not any(inside and augmented for inside, augmented in batches)
    monkeypatch.undo()
    w2 = fedlt.run(tiny(tmp_path, fl__rounds=2, data__augment="weak", run__name="w2"), quiet=True)
    plain = fedlt.run(tiny(tmp_path, fl__rounds=2, run__name="plain"), quiet=True)
    assert without_timing(w1.metrics) == without_timing(w2.metrics)
    assert w1.metrics[-1]["loss"] != pytest.approx(plain.metrics[-1]["loss"])


def test_client_batches_augment_only_with_a_generator_and_respect_hflip():
    from fedlt.methods.base import ClientData

    seen = []

    def fake_augment(x, generator, hflip):
        seen.append(hflip)
        return 1.0 - x

    images = torch.randint(0, 256, (6, 1, 8, 8), dtype=torch.uint8)
    data = ClientData(images, torch.arange(6), torch.tensor([1, 3, 5]), 6, standardize=lambda x: x * 2,
                      augment=fake_augment, hflip=False)
    x, y = data.batch(torch.tensor([0, 2]))
    assert torch.equal(x, images[[1, 5]].float() / 255 * 2) and y.tolist() == [1, 5] and seen == []
    x, _ = data.batch(torch.tensor([0, 2]), torch.Generator().manual_seed(0))
    assert torch.allclose(x, (1 - images[[1, 5]].float() / 255) * 2) and seen == [False]


def test_a_run_diverged_by_its_loss_knob_names_the_knob_beside_the_learning_rate(tmp_path):
    """A logit adjustment scaled by tau=1e30 diverges at any learning rate: "lower fl.lr" alone misled."""
    with pytest.raises(TrainingDiverged) as err:
        fedlt.run(tiny(tmp_path, loss={"name": "la", "tau": 1e30}, fl__rounds=1), quiet=True)
    assert str(err.value).endswith("lower fl.lr (now 0.05) or set fl.grad_clip (e.g. 5), or bring loss.tau (now "
                                   "1e+30) toward its default 1.0"), err.value


def test_a_run_diverged_by_a_method_knob_names_the_knob_beside_the_learning_rate(tmp_path):
    """FedAvgM's server step scaled by server_lr=1e30 diverges at any learning rate: "lower fl.lr" alone
    misled. A knob set to its default (beta) is not named, nor a count (rounds of a schedule, experts)."""
    with pytest.raises(TrainingDiverged) as err:
        fedlt.run(tiny(tmp_path, method="fedavgm", method_args={"server_lr": 1e30, "beta": 0.9},
                       fl__rounds=2), quiet=True)
    assert str(err.value).endswith("lower fl.lr (now 0.05) or set fl.grad_clip (e.g. 5), or bring "
                                   "method_args.server_lr (now 1e+30) toward its default 1.0"), err.value
    with pytest.raises(TrainingDiverged) as err:
        fedlt.run(tiny(tmp_path, method="fedbabu", fl__lr=1e8, fl__rounds=2, method_args={"finetune_epochs": 2}),
                  quiet=True)
    assert str(err.value).endswith("lower fl.lr (now 100000000.0) or set fl.grad_clip (e.g. 5)"), err.value


def test_a_diverging_run_stops_with_the_round_and_the_fix(tmp_path):
    """A NaN model would otherwise report chance accuracy every round as if it were a result."""
    with pytest.raises(TrainingDiverged) as err:
        fedlt.run(tiny(tmp_path, fl__lr=1e8, fl__rounds=3), quiet=True)
    message = str(err.value)
    assert message.startswith("training diverged in round 1: the clients' mean training loss is ")
    assert message.endswith("lower fl.lr (now 100000000.0) or set fl.grad_clip (e.g. 5)")  # no loss knob is set
    assert isinstance(err.value, FedltError)  # the CLI prints it as one line, exit code 2
    kept = [d for d in tmp_path.iterdir() if d.is_dir()]  # the rounds before stay, for diagnosis
    assert len(kept) == 1 and (kept[0] / "config.yaml").is_file()
    summary = read_summary(kept[0])  # marked diverged, with the NaN model's (chance) accuracy as its result
    assert summary["status"] == "diverged" and summary["diverged_round"] == 1 and summary["rounds_done"] == 0
    assert summary["reason"] == message and summary["final"]["round"] == 1
    assert summary["final"]["acc"] == pytest.approx(10.0)  # NaN logits predict one class of 10 balanced ones
    assert summary["environment"]["torch"] and summary["method_args"] == {}
    rows = read_metrics(kept[0])
    assert rows[-1]["diverged"] is True and set(rows[-1]["comm"]) == {"down_model", "down_payload", "up_model",
                                                                       "up_payload"}


def test_a_global_model_made_non_finite_after_training_stops_the_run_when_evaluated(tmp_path, monkeypatch):
    """A server step (here a stand-in for a calibration or momentum gone wrong) can leave the global
    model NaN while the clients' training loss was finite: its test loss stops the run."""
    from fedlt.methods.base import Server

    def poison(server, rnd):
        if rnd == 2:
            with torch.no_grad():
                server.model.head.weight.fill_(float("nan"))

    monkeypatch.setattr(Server, "end_round", poison)
    with pytest.raises(TrainingDiverged, match=r"^training diverged in round 2: the global model's test loss is nan "
                                               r"though the clients' mean training loss was finite \(their last "
                                               r"steps, or a server step such as a calibration, made the model "
                                               r"non-finite\); lower fl.lr \(now 0.05\) or set fl.grad_clip"):
        fedlt.run(tiny(tmp_path, fl__rounds=3, eval__every=1), quiet=True)
    run_dir = next(d for d in tmp_path.iterdir() if d.is_dir())
    summary, rows = read_summary(run_dir), read_metrics(run_dir)
    assert summary["status"] == "diverged" and summary["diverged_round"] == 2 and summary["rounds_done"] == 1
    assert [r["round"] for r in rows] == [1, 2] and rows[-1]["diverged"] is True and math.isfinite(rows[-1]["train_loss"])
    assert sum(rows[-1]["comm"].values()) > 0


def test_metrics_lines_that_are_no_rows_are_passed_over_when_a_run_is_read_back(tmp_path):
    """A torn last line (a kill mid-write), bytes that are not UTF-8, or JSON that is not a round's
    row (a list, an object without its round): what resume and the reports read is the rows alone."""
    good = [{"round": 1, "acc": 50.0}, {"round": 2, "acc": 60.0}]
    lines = [json.dumps(good[0]).encode(), b"\xff\xfe garbage", b"[1, 2]", b'{"acc": 3}', json.dumps(good[1]).encode(),
             b'{"round": 3, "ac']
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assert read_metrics(tmp_path) == good and read_metrics(tmp_path, up_to_round=1) == good[:1]


@pytest.mark.parametrize(("method", "state"), [("fedavg", "global_counts"), ("fedloge", "gamma")])
def test_a_server_hands_queries_it_did_not_ask_up_and_stops(tmp_path, method, state):
    """In a server composed with another method's, a query the method did not ask reaches the other
    class, and the method's own handling of its query does not run on it."""
    from fedlt.api import prepare
    from fedlt.config import build_config
    from fedlt.messages import Query
    from fedlt.methods.base import Server

    class Tally(Server):
        def receive(self, query, replies):
            if query.name != "tally":
                return super().receive(query, replies)
            self.tally = sum(int(r.payload["count"]) for r in replies.values())

    cheap = {"method_args__sse_steps": 50} if method == "fedloge" else {}  # SSE-C's 10,000 steps: not the point here
    sim = prepare(build_config(tiny(tmp_path, method=method, **cheap)))
    composed = type("Composed", (type(sim.server), Tally), {})(sim.server.ctx)
    before = getattr(composed, state, None)
    composed.receive(Query("tally", {}), {0: Reply(payload={"count": 3}, num_samples=10),
                                          1: Reply(payload={"count": 4}, num_samples=20)})
    assert composed.tally == 7 and getattr(composed, state, None) == before


EMPTY_CLIENT_LOSS = {"gbme": "bsm"}  # the methods that train only with a loss built from class counts


@pytest.mark.parametrize("method", [name for name, _ in list_methods()])
def test_every_method_trains_and_evaluates_a_federation_with_a_client_left_without_samples(tmp_path, method):
    """A Dirichlet split at alpha = 0.05 leaves one of 12 clients empty: it is sampled, trains on
    nothing and is evaluated on its (empty) local test set, and the round ends with finite results."""
    cfg = fedlt.load_config(None, [
        "seed=0", "data.dataset=synthetic", "data.image_size=8", "data.imbalance_factor=10", "data.num_clients=12",
        "data.alpha=0.05", "fl.participation=1.0", "fl.rounds=1", "fl.local_epochs=1", "eval.every=1",
        f"run.out_dir={tmp_path}", "run.threads=1", f"method={method}", f"loss.name={EMPTY_CLIENT_LOSS.get(method, 'ce')}",
    ])
    sim = prepare(cfg)
    assert min(len(sim.eval_data.client_indices(c)) for c in range(12)) == 0
    (tmp_path / "run").mkdir()
    result = sim.run(tmp_path / "run", quiet=True)
    final = result.summary["final"]
    assert all(math.isfinite(v) for v in final.values() if isinstance(v, float)), final


def test_resume_refuses_a_folder_another_process_writes_and_checks_the_folder_before_the_data(tmp_path, monkeypatch):
    """Two processes on one run folder interleaved their metrics and checkpoints; a resume read the data
    (minutes on a large dataset) before it looked at the folder, and then blamed the data an edited
    config pointed to. A held folder, an edited dataset and a lost round are refused before ``prepare``."""
    import yaml

    import fedlt.api
    from fedlt.errors import ConfigError
    import fcntl
    import os

    run_dir = run_until_crash_in_round_3(tiny(tmp_path, fl__local_epochs=1, run__name="cut"), monkeypatch)
    monkeypatch.setattr(fedlt.api, "prepare", lambda cfg: pytest.fail("read the data before checking the folder"))
    held = os.open(run_dir, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # the lock another process writing the folder holds
    try:
        with pytest.raises(FedltError, match=re.escape(f"{run_dir} is being written by another fedlt process (the "
                                                       "run, or a resume of it, is still going); let it end or stop")):
            fedlt.resume(run_dir, quiet=True)
    finally:
        os.close(held)
    saved = (run_dir / "config.yaml").read_text()
    tree = yaml.safe_load(saved)
    tree["data"]["dataset"] = "cifar10"  # whose files are nowhere here
    (run_dir / "config.yaml").write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match=re.escape("(data.dataset: 'synthetic' -> 'cifar10'); restore that value")):
        fedlt.resume(run_dir, quiet=True)
    (run_dir / "config.yaml").write_text(saved)
    (run_dir / "metrics.jsonl").write_text("")
    with pytest.raises(FedltError, match=re.escape("metrics.jsonl lacks round(s) 2 of the 1 evaluated")):
        fedlt.resume(run_dir, quiet=True)


def test_a_resume_may_move_the_data_and_change_how_it_runs(tmp_path, monkeypatch):
    """The data moved, or a resume on another machine: ``data.root`` and ``run.*`` may be given with the
    resume (the CLI's --data-root and key=value); the run's config.yaml then says where the data are (the
    rest holds for that resume, recorded in the summary's segments); anything else is refused by name."""
    import yaml

    from fedlt.errors import ConfigError

    over = dict(fl__local_epochs=1, run__name="cut")
    full = fedlt.run(tiny(tmp_path / "a", **over), quiet=True)
    run_dir = run_until_crash_in_round_3(tiny(tmp_path / "b", **over), monkeypatch)
    monkeypatch.undo()
    for refused in ("fl.rounds=5", "data.alpha=1"):
        with pytest.raises(ConfigError, match=re.escape(f"{refused.split('=')[0]}: a resumed run goes on with its "
                                                        "saved config; only run.*, data.root and eval.batch_size")):
            fedlt.resume(run_dir, overrides=[refused], quiet=True)
    with pytest.raises(ConfigError, match=re.escape("how it runs); for another fl.rounds, start a new run with it")):
        fedlt.resume(run_dir, overrides=["fl.rounds=5"], quiet=True)
    with pytest.raises(ConfigError, match=re.escape(f"run.name: a resumed run stays in its folder {run_dir}")):
        fedlt.resume(run_dir, overrides=["run.name=other"], quiet=True)  # was accepted and ignored
    moved = tmp_path / "moved"
    resumed = fedlt.resume(run_dir, overrides=[f"data.root={moved}", "run.checkpoint_every=1"], quiet=True)
    assert without_timing(resumed.metrics) == without_timing(full.metrics)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["data"]["root"] == str(moved) and saved["run"]["checkpoint_every"] == 2  # this resume's alone


def test_a_checkpoint_the_disk_refuses_is_an_error_naming_the_file_and_leaves_nothing_half_written(tmp_path,
                                                                                                  monkeypatch):
    """torch's writer reported a full disk or a refused file as a RuntimeError naming nothing, which the
    command line showed as a traceback; the previous checkpoint is kept and the part written removed."""
    import errno

    from fedlt.engine.checkpoint import save_checkpoint

    save_checkpoint(tmp_path, {"round": 1})
    kept = (tmp_path / "checkpoint.pt").read_bytes()

    def disk_full(obj, handle):
        handle.write(b"PK partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError) as refused:
        save_checkpoint(tmp_path, {"round": 2})
    assert refused.value.errno == errno.ENOSPC and refused.value.filename == str(tmp_path / "checkpoint.pt.tmp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert (tmp_path / "checkpoint.pt").read_bytes() == kept


def test_an_interrupted_run_names_its_folder_and_whether_it_can_resume(tmp_path, monkeypatch):
    """The interrupt's line named a placeholder RUN_DIR, and offered --resume to a run that had saved
    no checkpoint yet. A run stopped while its summary is written is not taken for a finished one."""
    import fedlt.results
    from fedlt.engine.simulation import Simulation

    original = Simulation.fit_round

    def interrupted_in(round_: int, name: str, every: int = 2) -> KeyboardInterrupt:
        monkeypatch.setattr(Simulation, "fit_round", lambda self, rnd: (_ for _ in ()).throw(KeyboardInterrupt)
                            if rnd == round_ else original(self, rnd))
        with pytest.raises(KeyboardInterrupt) as stop:
            fedlt.run(tiny(tmp_path, fl__local_epochs=1, run__name=name, eval__every=every), quiet=True)
        monkeypatch.undo()
        return stop.value

    run_dir = tmp_path / "cut"
    assert interrupted_in(3, "cut").resume_hint == \
        f"`fedlt run --resume {run_dir}` goes on from its checkpoint of round 2"
    assert interrupted_in(2, "early", every=1).resume_hint == (  # round 1's result is kept
        f"{tmp_path / 'early'} stopped before its first checkpoint (run.checkpoint_every=2), so there is nothing to "
        "resume; start the run again")
    assert (tmp_path / "early" / "metrics.jsonl").is_file()
    assert interrupted_in(2, "unevaluated").resume_hint == (  # no result yet: no folder either
        f"the run stopped before its first result, so its folder {tmp_path / 'unevaluated'} is removed; start the "
        "run again")
    assert not (tmp_path / "unevaluated").exists()
    monkeypatch.setattr(fedlt.results, "plot_curves", lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt) as late:
        fedlt.resume(run_dir, quiet=True)
    assert not (run_dir / "summary.json").exists()  # not finished: resumed again, it writes all three
    # after the last round's checkpoint: the line names it, not a placeholder folder
    assert late.value.resume_hint == f"`fedlt run --resume {run_dir}` goes on from its checkpoint of round 4"
    monkeypatch.undo()
    assert fedlt.resume(run_dir, quiet=True).summary["final"]["round"] == 4
    assert {"summary.json", "report.md", "curves.png"} <= {p.name for p in run_dir.iterdir()}


def test_a_resume_interrupted_before_its_rounds_says_it_goes_on_from_the_checkpoint(tmp_path, monkeypatch):
    """Ctrl-C while a resume read its data (minutes for a large dataset) or its checkpoint set no line of
    its own, and the command said that there was nothing to resume, of a folder whose checkpoint was intact."""
    import fedlt.api
    from fedlt.engine import simulation

    run_dir = tmp_path / "r"
    fedlt.run(tiny(tmp_path, fl__rounds=2, fl__local_epochs=1, run__name="r", run__checkpoint_every=1), quiet=True)
    (run_dir / "summary.json").unlink()  # stopped after its last checkpoint: a resume writes the summary
    for module, step in ((fedlt.api, "prepare"), (simulation, "rewrite_metrics")):
        monkeypatch.setattr(module, step, lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt) as stop:
            fedlt.resume(run_dir, quiet=True)
        monkeypatch.undo()
        assert stop.value.resume_hint == f"`fedlt run --resume {run_dir}` goes on from its checkpoint", step
    assert fedlt.resume(run_dir, quiet=True).summary["final"]["round"] == 2


def test_an_interrupt_while_a_finished_run_closes_its_workers_names_its_last_checkpoint(tmp_path, monkeypatch):
    """After the last round the run waits for run.backend=parallel's workers to end: Ctrl-C then set no line
    of its own, and the command said that there was nothing to resume, beside the last round's checkpoint."""
    from fedlt.engine.simulation import Simulation

    monkeypatch.setattr(Simulation, "close", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt) as stop:
        fedlt.run(tiny(tmp_path, fl__local_epochs=1, run__name="r"), quiet=True)
    assert stop.value.resume_hint == f"`fedlt run --resume {tmp_path / 'r'}` goes on from its checkpoint of round 4"


def test_a_run_resumed_by_other_code_says_which_process_trained_which_rounds(tmp_path, monkeypatch):
    """The summary of a resumed run named only the resuming process's code and settings, and a finished
    run resumed with other settings was rewritten as if they had trained it. Each process that trained
    rounds is now a segment; a report names a run trained by two code versions by both."""
    import fedlt.engine.simulation as simulation
    from fedlt.reporting.collect import Run
    from fedlt.reporting.provenance import version

    run_dir = run_until_crash_in_round_3(tiny(tmp_path, fl__local_epochs=1, run__name="cut"), monkeypatch)
    real = simulation.collect_environment
    monkeypatch.setattr(simulation, "collect_environment", lambda *args: {**real(*args), "source_hash": "later"})
    summary = fedlt.resume(run_dir, quiet=True).summary
    first = summary["segments"][0]["environment"]["source_hash"]
    assert [s["from_round"] for s in summary["segments"]] == [1, 3] and first not in (None, "later")
    assert summary["segments"][1]["environment"]["source_hash"] == summary["environment"]["source_hash"] == "later"
    assert version(Run(run_dir, 3, summary)) == f"{first} then later"
    monkeypatch.undo()
    again = fedlt.resume(run_dir, overrides=["run.threads=2", "run.backend=vectorized"], quiet=True).summary
    assert again["segments"] == summary["segments"] and again["environment"] == summary["environment"]
    assert again["backend"] == "sequential" and again["environment"]["threads"] == 1  # nothing trained by this one
    plain = fedlt.run(tiny(tmp_path, fl__rounds=2, run__name="plain"), quiet=True).summary
    assert "segments" not in plain and version(Run(tmp_path / "plain", 3, plain)) == plain["environment"]["source_hash"]


def test_a_summary_with_no_evaluated_round_selects_its_best_round_by_nothing():
    """An aborted run that evaluated no round said its best round was selected by pm_acc."""
    from fedlt.results import summarize

    cfg = fedlt.load_config(None, ["data.dataset=synthetic"])
    assert summarize(cfg, [], {"status": "aborted"})["best_round"] == {"round": None, "selected_by": None} | {
        k: None for k in summarize(cfg, [], {})["best_round"] if k not in ("round", "selected_by")}
    comm = dict.fromkeys(("down_model", "down_payload", "up_model", "up_payload"), 0)
    no_global = [{"round": r, "acc": None, "pm_acc": 40.0 + r, "comm": comm} for r in (1, 2)]
    assert summarize(cfg, no_global, {})["best_round"]["selected_by"] == "pm_acc"


def test_a_run_without_a_global_model_chooses_its_best_round_on_local_validation_sets():
    """FedPer with data.val_per_class chose its best round on pm_acc (the local test sets) though
    val_pm_acc was there to choose on."""
    from fedlt.results import summarize

    cfg = fedlt.load_config(None, ["data.dataset=synthetic", "method=fedper", "data.val_per_class=20"])
    comm = dict.fromkeys(("down_model", "down_payload", "up_model", "up_payload"), 0)
    rows = [{"round": 1, "pm_acc": 50.0, "val_pm_acc": 70.0, "comm": comm},
            {"round": 2, "pm_acc": 60.0, "val_pm_acc": 65.0, "comm": comm}]
    best = summarize(cfg, rows, {})["best_round"]
    assert (best["round"], best["selected_by"]) == (1, "val_pm_acc")


def test_resuming_a_finished_run_makes_its_lost_artifacts_again(tmp_path):
    """A finished run's artifacts.pt (CReFF's federated features, for the report's plots), deleted since,
    stayed missing after a resume that said the run was complete; it is made again, equal, from the final
    state (CCVR's virtual features are drawn at the end and kept in no state: they cannot be)."""
    run_dir = fedlt.run(tiny(tmp_path, method="creff", fl__rounds=2, fl__local_epochs=1, run__name="done"),
                        quiet=True).run_dir
    saved = torch.load(run_dir / "artifacts.pt", weights_only=True)
    (run_dir / "artifacts.pt").unlink()
    fedlt.resume(run_dir, quiet=True)
    again = torch.load(run_dir / "artifacts.pt", weights_only=True)
    assert saved and again.keys() == saved.keys() and all(torch.equal(again[k], v) for k, v in saved.items())
    both = fedlt.run(tiny(tmp_path, calibration=["creff", "ccvr"], fl__rounds=2, fl__local_epochs=1, run__name="both"),
                     quiet=True).run_dir
    assert "ccvr/synthetic_features" in torch.load(both / "artifacts.pt", weights_only=True)
    (both / "artifacts.pt").unlink()
    fedlt.resume(both, quiet=True)
    assert not (both / "artifacts.pt").exists()  # CReFF's alone would pass for the whole file: none is made


def test_a_run_folder_this_process_holds_may_be_held_again_and_a_bench_never_deletes_one_held_elsewhere(tmp_path):
    """A resume holds its folder from its checks to its end and its run holds it again inside; a second
    bench on the same output folder deleted the first one's cell while that cell was training."""
    import fcntl
    import os

    from fedlt.bench.suite import run_cell
    from fedlt.results import check_not_written, writing

    with writing(tmp_path):
        with writing(tmp_path):
            check_not_written(tmp_path)
        check_not_written(tmp_path)
    cell = tmp_path / "cell"
    cell.mkdir()
    (cell / "config.yaml").write_text("seed: 0\n")  # a cell with no checkpoint yet, started by another bench
    held = os.open(cell, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        out = run_cell(None, ["data.dataset=synthetic"], str(cell), "new", 1)
    finally:
        os.close(held)
    assert out["status"] == "failed" and "is being written by another fedlt process" in out["error"]
    assert (cell / "config.yaml").read_text() == "seed: 0\n"  # left to the bench writing it
    fcntl.flock(released := os.open(tmp_path, os.O_RDONLY), fcntl.LOCK_EX | fcntl.LOCK_NB)  # nothing held here
    os.close(released)


def test_a_long_setup_stage_says_so_and_a_quick_one_prints_nothing(tmp_path, monkeypatch, capsys):
    """A method's setup stage can take a minute before round 1 (FedLoGe builds its SSE-C there) and
    printed nothing meanwhile; past a few seconds the progress now names it, once."""
    import time

    from fedlt.engine import simulation
    from fedlt.methods.fedavg import FedAvgServer

    cfg = lambda name: tiny(tmp_path, fl__rounds=1, loss={"name": "bsm", "prior": "global"},  # noqa: E731
                            run={"out_dir": str(tmp_path), "name": name, "threads": 1})
    fedlt.run(cfg("quick"))
    assert "setup stage" not in capsys.readouterr().err
    receive = FedAvgServer.receive
    monkeypatch.setattr(FedAvgServer, "receive", lambda self, q, r: (time.sleep(2), receive(self, q, r))[1])
    monkeypatch.setattr(simulation, "SETUP_NOTICE_AFTER", 0.05)  # the final stage keeps its 5 s
    fedlt.run(cfg("slow"))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[fedavg/bsm sequential] the method's setup stage, before round 1 ..." and len(lines) == 2, lines
    assert lines[1].startswith("[fedavg/bsm sequential] round 1/1 | acc ")
    per_round = float(lines[1].split(" | ")[-2].removesuffix(" s/round"))
    assert per_round < read_metrics(tmp_path / "slow")[0]["time_s"] + 1.5, lines  # the setup's 2 s are not a round's
    fedlt.run(cfg("slow-quiet"), quiet=True)
    assert capsys.readouterr().err == ""


def test_an_interrupt_in_the_setup_stage_says_there_is_nothing_to_resume(tmp_path, monkeypatch):
    """FedLoGe's SSE-C is built in the setup stage, after the run's folder exists: Ctrl-C there said how to
    resume a run that has no checkpoint to resume from, and left the folder of a run that never started."""
    from fedlt.methods.fedavg import FedAvgServer

    def interrupted(self, query, replies):
        raise KeyboardInterrupt

    monkeypatch.setattr(FedAvgServer, "receive", interrupted)
    cfg = tiny(tmp_path, fl__rounds=1, loss={"name": "bsm", "prior": "global"},
               run={"out_dir": str(tmp_path), "name": "setup", "threads": 1})
    with pytest.raises(KeyboardInterrupt) as stop:
        fedlt.run(cfg, quiet=True)
    assert stop.value.resume_hint == (f"the run stopped before its first result, so its folder {tmp_path / 'setup'} "
                                      "is removed; start the run again")
    assert not (tmp_path / "setup").exists()  # config.yaml and partition.json alone were a half-written run


def test_a_long_final_stage_says_so_before_the_last_rounds_line(tmp_path, monkeypatch, capsys):
    """A calibration's final step (SAFS: ~40 s on a CPU) ran silently inside the last round; past a few
    seconds the progress names it, and the last round's s/round still counts it (it is that round's work)."""
    import time

    from fedlt.engine import simulation
    from fedlt.methods.base import Server

    finish = Server.finish
    monkeypatch.setattr(Server, "finish", lambda self: (time.sleep(1), finish(self))[1])
    monkeypatch.setattr(simulation, "FINAL_NOTICE_AFTER", 0.05)  # the setup stage keeps its 5 s
    fedlt.run(tiny(tmp_path, fl__rounds=1, run={"out_dir": str(tmp_path), "name": "final", "threads": 1}))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[fedavg/ce sequential] the method's final stage, after the last round's training ..."
    assert len(lines) == 2 and float(lines[1].split(" | ")[-2].removesuffix(" s/round")) >= 1.0, lines


def test_a_checkpoint_that_does_not_fit_in_memory_is_not_called_unreadable(tmp_path, monkeypatch):
    """Running out of memory while loading says so; the file is sound, and 'delete it' would lose the run."""
    from fedlt.engine import checkpoint
    from fedlt.errors import FedltError

    checkpoint.save_checkpoint(tmp_path, {"round": 1})

    def load(*args, **kwargs):
        raise kind("out of memory")

    for kind in (MemoryError, torch.cuda.OutOfMemoryError):
        monkeypatch.setattr(checkpoint.torch, "load", load)
        with pytest.raises(kind):
            checkpoint.load_checkpoint(tmp_path)
    kind = RuntimeError  # a damaged file is still named as one
    with pytest.raises(FedltError, match="is not a readable fedlt checkpoint \\(RuntimeError\\); delete it"):
        checkpoint.load_checkpoint(tmp_path)


def test_a_long_stage_tells_how_far_it_is_in_a_log(monkeypatch, capsys):
    """SAFS at ImageNet-LT's 1,000 classes synthesizes for tens of minutes after the last round: a log
    showed one line when the stage began and nothing more. A stage's steps now give a line every
    STAGE_EVERY seconds after the stage's own notice, with its ETA; nothing outside a stage or when quiet."""
    from fedlt import progress as module

    clock = [100.0]
    monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(module, "STAGE_EVERY", 60.0)
    progress = module.Progress(3, 0, "sfd sequential", quiet=False)
    progress.stage_step(1, 4, "classes")  # no stage: nothing
    with progress.waiting("the final stage", after=10.0):  # its notice (a timer's line, 10 s in): not in this test
        clock[0] += 30.0
        progress.stage_step(1, 4, "classes")  # 30 s in: 20 s after the notice, nothing
        clock[0] += 1000.0
        progress.stage_step(2, 4, "classes")  # 1,030 s for 2: 1,030 s to go
        clock[0] += 30.0
        progress.stage_step(3, 4, "classes")  # 30 s after the last line: nothing
        clock[0] += 30.0
        progress.stage_step(4, 4, "classes")
    progress.stage_step(4, 4, "classes")
    assert capsys.readouterr().err.splitlines() == [
        "[sfd sequential] the final stage: 2/4 classes, ETA 17m10s",
        "[sfd sequential] the final stage: 4/4 classes, ETA 0m00s"]
    quiet = module.Progress(3, 0, "sfd sequential", quiet=True)
    with quiet.waiting("the final stage", after=0.0):
        clock[0] += 100.0
        quiet.stage_step(1, 4, "classes")
    assert capsys.readouterr().err == ""


def test_a_stage_that_counts_two_things_gives_each_its_own_eta(monkeypatch, capsys):
    """SFD's final stage counts the clients' answers, then SAFS's classes: the classes' ETA ran from the
    stage's start, so the minutes of the answers read as the first class's time (9 x 10 minutes to go)."""
    from fedlt import progress as module

    clock = [0.0]
    monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(module, "STAGE_EVERY", 0.0)
    progress = module.Progress(1, 0, "sfd sequential", quiet=False)
    with progress.waiting("the final stage", after=0.0):
        for k in (1, 2):
            clock[0] += 300.0
            progress.stage_step(k, 2, "clients answered")
        clock[0] += 10.0
        progress.stage_step(1, 10, "classes")  # 10 s a class, 9 to go
        clock[0] += 10.0
        progress.stage_step(1, 2, "clients answered")  # the same unit again counts from the last step too
    assert [line.split(": ", 1)[1] for line in capsys.readouterr().err.splitlines() if "ETA" in line] == [
        "1/2 clients answered, ETA 5m00s", "2/2 clients answered, ETA 0m00s", "1/10 classes, ETA 1m30s",
        "1/2 clients answered, ETA 0m10s"]


def test_sfds_synthesis_reports_its_classes_to_the_runs_progress(tmp_path, monkeypatch, capsys):
    from fedlt import progress
    from fedlt.engine import simulation

    monkeypatch.setattr(simulation, "FINAL_NOTICE_AFTER", 0.0)
    monkeypatch.setattr(progress, "STAGE_EVERY", 0.0)
    fedlt.run(tiny(tmp_path, method="sfd", fl__rounds=1, run={"out_dir": str(tmp_path), "threads": 1},
                   calibration_args={"safs_steps": 2, "safs_finetune_epochs": 1, "safs_max_per_class": 4,
                                     "safs_min_per_class": 2}))
    lines = [line for line in capsys.readouterr().err.splitlines() if "classes synthesized" in line]
    stage = "[sfd sequential] the method's final stage, after the last round's training: "
    assert [line.split(", ETA")[0] for line in lines] == [f"{stage}{k}/10 classes synthesized (SAFS)"
                                                          for k in range(1, 11)], lines


def test_a_setup_stage_that_asks_every_client_counts_their_answers(tmp_path, monkeypatch, capsys):
    """GBME's gradient pass before round 1 trains every client an epoch (minutes with many clients): the
    progress counts the clients that answered, and says nothing of the rounds' own exchanges."""
    from fedlt import progress
    from fedlt.engine import simulation

    monkeypatch.setattr(simulation, "SETUP_NOTICE_AFTER", 0.0)
    monkeypatch.setattr(progress, "STAGE_EVERY", 0.0)
    fedlt.run(tiny(tmp_path, method="gbme", loss={"name": "bsm"}, fl__rounds=1,
                   run={"out_dir": str(tmp_path), "threads": 1}))
    lines = [line.split(", ETA")[0] for line in capsys.readouterr().err.splitlines() if "answered" in line]
    clients = tiny(tmp_path)["data"]["num_clients"]
    assert lines == [f"[gbme/bsm sequential] the method's setup stage, before round 1: {k}/{clients} clients answered "
                     "query:gbme_lpi" for k in range(1, clients + 1)], lines


def test_a_progress_line_of_a_round_without_accuracy_has_no_empty_field(capsys):
    from fedlt.progress import Progress

    progress = Progress(3, 0, "fedavg/ce sequential", quiet=False)
    progress.update(1, {"train_loss": 1.0})  # a round the run did not evaluate, as a federation may report it
    progress.update(2, {"acc": 51.234})
    first, second = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"\[fedavg/ce sequential\] round 1/3 \| \d+\.\d\d s/round \| ETA \dm\d\ds", first), first
    assert re.fullmatch(r"\[fedavg/ce sequential\] round 2/3 \| acc 51\.23 \| \d+\.\d\d s/round \| ETA \dm\d\ds",
                        second), second


def test_a_model_at_chance_accuracy_is_named_beside_its_figures(tmp_path, monkeypatch):
    """A model that grew without becoming NaN (a loss scaled too far) finishes predicting one class, a
    finite model whose accuracy read as a figure looks like a weak method: the run's report names it."""
    import copy

    from fedlt.methods.base import Server
    from fedlt.results import model_notes

    def one_class(model):  # class 2 everywhere: exactly 1 in 10 of a balanced test set
        constant = copy.deepcopy(model)
        with torch.no_grad():
            constant.head.weight.zero_()
            constant.head.bias.copy_(10.0 * (torch.arange(constant.head.bias.numel()) == 2))
        return constant

    monkeypatch.setattr(Server, "extra_models", lambda self: {"constant": one_class(self.model)})
    result = fedlt.run(tiny(tmp_path, fl__rounds=2), quiet=True)
    constant = result.summary["final"]["variants"]["constant"]
    assert constant["acc"] == 10.0 and result.summary["final"]["acc"] > 11.0  # the headline learnt
    line = ("variant 'constant' scores chance accuracy (10.00% over 10 classes; predicting one class everywhere "
            "scores 10.00%); if its training loss fell, it has not yet learned past its largest classes: train "
            "longer (fl.rounds) or use a long-tail loss (loss.name=bsm); if it grew, or was already large in "
            "round 1 (the first steps too large), lower fl.lr, set fl.grad_clip, or bring a scaled loss "
            "(loss.ldam_scale, loss.tau) toward its default")
    assert model_notes(result.summary) == [line]
    assert f"**Chance:** {line}." in (result.run_dir / "report.md").read_text()
    monkeypatch.undo()
    clean = fedlt.run(tiny(tmp_path, fl__rounds=2), quiet=True)
    assert model_notes(clean.summary) == [] and "Chance" not in (clean.run_dir / "report.md").read_text()


def test_nan_models_beside_a_finite_headline_are_named_not_reported_as_results(tmp_path, monkeypatch):
    """A calibrated variant or clients' personalized models can go NaN while the headline model is finite:
    the run goes on (its headline is a result), but its summary, report and report rows name them, since a
    NaN model's accuracy (one class everywhere) read as a figure looks like a weak method."""
    import copy

    from fedlt.methods.base import Server
    from fedlt.methods.ditto import DittoClient
    from fedlt.reporting.collect import Run, _run_rows

    def nan_copy(model):
        broken = copy.deepcopy(model)
        with torch.no_grad():
            broken.head.weight.fill_(float("nan"))
        return broken

    personalize = DittoClient.personalize

    def personalize_some_nan(self, ctx, msg):
        personalize(self, ctx, msg)
        if ctx.cid % 2 == 0:  # clients 0, 2 and 4 of 6
            with torch.no_grad():
                ctx.model.head.weight.fill_(float("nan"))

    monkeypatch.setattr(DittoClient, "personalize", personalize_some_nan)
    monkeypatch.setattr(Server, "extra_models", lambda self: {"broken": nan_copy(self.model)})
    result = fedlt.run(tiny(tmp_path, method="ditto", fl__rounds=2), quiet=True)
    final = result.summary["final"]
    assert "status" not in result.summary and math.isfinite(final["loss"])
    assert final["pm_nonfinite"] == 3 and not math.isfinite(final["variants"]["broken"]["loss"])
    report = (result.run_dir / "report.md").read_text()
    assert ("**Non-finite:** variant 'broken' is a non-finite model (NaN test loss); its accuracy is a NaN "
            "model's. **Non-finite:** 3 client(s)' personalized models are non-finite; PM counts their accuracy, "
            "a NaN model's.") in report
    labels = [row.label for row in _run_rows("ditto", Run(result.run_dir, 0, result.summary))]
    assert labels == ["ditto (3 client(s)' personalized models are non-finite)", "ditto [broken] (non-finite model)"]
    monkeypatch.undo()  # the same run without the NaNs names nothing
    clean = fedlt.run(tiny(tmp_path, method="ditto", fl__rounds=2), quiet=True)
    assert "pm_nonfinite" not in clean.summary["final"] and "Non-finite" not in (clean.run_dir / "report.md").read_text()


def test_a_query_summed_in_the_clear_refuses_replies_it_cannot_sum_entry_by_entry():
    """A query its server declares summed reaches it as one sum, made as the replies arrive. A client's tensor of
    another shape would broadcast into a wrong sum ([3] + [1]) or stop in a traceback ([3] + [2]), where secure
    aggregation refuses both; and a value no sum takes is refused however few clients answer."""
    import numpy as np

    from fedlt.engine.secure_aggregation import add_reply

    def total(values):
        out = None
        for value in values:
            out = add_reply(out, Reply(payload={"x": value}, num_samples=1), "query:q")
        return out

    assert torch.equal(total([torch.ones(3), torch.ones(3), torch.ones(3)]).payload["x"], torch.full((3,), 3.0))
    assert total([True, True, False]).payload["x"] is True and total([False, False]).payload["x"] is False  # as
    assert torch.equal(total([torch.tensor([True, False])] * 2).payload["x"], torch.tensor([True, False]))  # a secure sum
    assert total([2, 3]).payload["x"] == 5 and total([0.5, 0.25]).payload["x"] == 0.75
    for values, shapes in (([torch.zeros(3), torch.ones(1)], "[3] vs [1]"),
                           ([torch.zeros(3), torch.ones(2)], "[3] vs [2]"), ([1.0, torch.ones(3)], "[] vs [3]")):
        with pytest.raises(FedltError, match=re.escape(f"query:q: the clients' replies differ in the shape of payload "
                                                       f"entry 'x' ({shapes})")):
            total(values)
    for values in ([np.ones(2)], [np.ones(2), np.ones(2)]):
        with pytest.raises(FedltError, match="query:q: reply payload entry 'x' is a ndarray, which cannot be summed"):
            total(values)
