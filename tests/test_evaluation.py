"""Evaluation protocol and traffic accounting, on hand-made numbers."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import fedlt
from fedlt.config import EvalConfig
from fedlt.data.dataset import ImageDataset
from fedlt.errors import ConfigError
from fedlt.evaluation import (
    SharedEncoderFeatures, ShotGroups, count_metrics, encode, global_metrics, local_accuracy, mean_local_accuracy,
    mean_of_summed_accuracies, personalized_figures, predict, shot_groups,
)
from fedlt.messages import Message, Reply, payload_nbytes


# ---- shot groups: count rule --------------------------------------------------------------

def test_count_rule_defaults_for_ten_classes() -> None:
    counts = np.array([5000, 1001, 1000, 999, 500, 200, 199, 50, 2, 1])
    groups = shot_groups(counts, EvalConfig())
    # many > 1000, medium 200..1000 (both ends inclusive), few < 200
    assert groups.classes == {"many": [0, 1], "medium": [2, 3, 4, 5], "few": [6, 7, 8, 9]}
    assert "1000" in groups.rule and "200" in groups.rule and groups.rule.startswith("count")


def test_count_rule_defaults_for_hundred_classes() -> None:
    counts = np.full(100, 50)
    counts[[3, 10]] = [500, 101]  # many: > 100
    counts[[20, 30]] = [100, 20]  # medium: boundaries
    counts[[40, 99]] = [19, 1]  # few: < 20
    groups = shot_groups(counts, EvalConfig())
    assert groups.classes["many"] == [3, 10]
    assert groups.classes["few"] == [40, 99]
    assert groups.classes["medium"] == [k for k in range(100) if k not in (3, 10, 40, 99)]
    assert "100" in groups.rule and "20" in groups.rule


def test_count_rule_default_switches_at_one_hundred_classes() -> None:
    counts = np.full(99, 150)  # 99 classes: still the 1000/200 defaults, so 150 is few-shot
    assert shot_groups(counts, EvalConfig()).classes["few"] == list(range(99))
    counts = np.full(100, 150)  # 100 classes: 100/20, so 150 is many-shot
    assert shot_groups(counts, EvalConfig()).classes["many"] == list(range(100))


def test_count_rule_explicit_thresholds_override_defaults() -> None:
    counts = np.array([11, 10, 5, 3, 2, 0, 5000, 1500, 150, 100])
    groups = shot_groups(counts, EvalConfig(many_threshold=10, few_threshold=3))
    assert groups.classes == {"many": [0, 6, 7, 8, 9], "medium": [1, 2, 3], "few": [4, 5]}
    # only one threshold given: the other keeps its default (many > 1000 for 10 classes)
    groups = shot_groups(counts, EvalConfig(few_threshold=3))
    assert groups.classes == {"many": [6, 7], "medium": [0, 1, 2, 3, 8, 9], "few": [4, 5]}


@pytest.mark.parametrize("kwargs", [{"many_threshold": 10}, {"many_threshold": 10, "few_threshold": 50}])
def test_count_rule_rejects_few_threshold_above_many_threshold(kwargs: dict) -> None:
    # many > 10 and few < 200 (the default for 10 classes) would put a class of 150 samples in both groups
    with pytest.raises(ConfigError) as info:
        shot_groups(np.array([11, 10, 5, 3, 2, 0, 5000, 1500, 150, 100]), EvalConfig(**kwargs))
    message = str(info.value)
    assert "eval.few_threshold" in message and "eval.many_threshold" in message and "\n" not in message


def test_count_rule_equal_thresholds_leave_medium_empty() -> None:
    groups = shot_groups(np.array([11, 10, 9]), EvalConfig(many_threshold=10, few_threshold=10))
    assert groups.classes == {"many": [0], "medium": [1], "few": [2]}


def test_count_rule_every_class_in_exactly_one_group() -> None:
    counts = np.random.default_rng(0).integers(0, 3000, size=100)
    groups = shot_groups(counts, EvalConfig(many_threshold=1500, few_threshold=400))
    assert sorted(sum(groups.classes.values(), [])) == list(range(100))


# ---- shot groups: cumulative rule (FedLoGe) -----------------------------------------------

def test_cumulative_rule_on_hand_made_counts() -> None:
    # 100 samples; sorted by count: 50 (class 2), 25 (4) -> 75 % reached; 12 (1), 8 (5) -> 95 % reached;
    # 3 (0), 2 (3) are the rest
    counts = np.array([3, 12, 50, 2, 25, 8])
    groups = shot_groups(counts, EvalConfig(shot_rule="cumulative"))
    assert groups.classes == {"many": [2, 4], "medium": [1, 5], "few": [0, 3]}
    assert groups.rule.startswith("cumulative") and "75%" in groups.rule and "95%" in groups.rule


def test_cumulative_rule_dominant_head_is_many_shot() -> None:
    # the head alone holds 80 % of the samples: whatever the rule, it is many-shot, and it is the only one
    # (the 10 % of the next class starts at 80 %, past 75 %); 10 and 5 take the total to 95 %; the last 5 % is few
    counts = np.array([5, 10, 80, 5])
    groups = shot_groups(counts, EvalConfig(shot_rule="cumulative"))
    assert groups.classes["many"] == [2]
    assert groups.classes["few"] in ([0], [3])  # equal counts: which one is last depends only on tie order
    assert sorted(groups.classes["medium"] + groups.classes["few"]) == [0, 1, 3]
    assert 1 in groups.classes["medium"]


def test_cumulative_rule_is_monotone_in_counts() -> None:
    counts = np.floor(500 * 100.0 ** (-np.arange(100) / 99)).astype(int)
    counts = np.random.default_rng(1).permutation(counts)
    g = shot_groups(counts, EvalConfig(shot_rule="cumulative")).classes
    assert sorted(g["many"] + g["medium"] + g["few"]) == list(range(100))
    assert all(g[name] for name in g)
    assert counts[g["many"]].min() >= counts[g["medium"]].max()
    assert counts[g["medium"]].min() >= counts[g["few"]].max()
    # the many-shot classes hold at least 75 % of the samples, without their smallest class less than 75 %
    many = np.sort(counts[g["many"]])
    assert many.sum() >= 0.75 * counts.sum() > many[1:].sum()


def test_cumulative_local_rule_groups_by_the_floored_local_test_sizes() -> None:
    """FedLoGe's released code: class 1's 30 samples spread over five clients give each a local test
    share of floor(6/100 x 10) = 0 images, so class 1 is few-shot there, many-shot by training counts."""
    client_counts = np.array([[50, 0, 0], [0, 6, 0], [0, 6, 0], [0, 6, 0], [0, 6, 0], [0, 6, 20]])
    totals = client_counts.sum(axis=0)  # 50, 30, 20
    text = shot_groups(totals, EvalConfig(shot_rule="cumulative"), client_counts, 10)
    assert text.classes == {"many": [0, 1], "medium": [2], "few": []}
    code = shot_groups(totals, EvalConfig(shot_rule="cumulative_local"), client_counts, 10)
    assert code.classes == {"many": [0, 2], "medium": [], "few": [1]}  # local test totals 5, 0, 2
    assert code.rule.startswith("cumulative_local: classes sorted by its clients' local test sets (floor(n_kc / N x 10)")
    with pytest.raises(ConfigError, match="cumulative_local needs every client's class counts"):
        shot_groups(totals, EvalConfig(shot_rule="cumulative_local"))
    with pytest.raises(ConfigError, match=r"a test set of 1 images floors to 0 images of every class"):
        shot_groups(totals, EvalConfig(shot_rule="cumulative_local"), client_counts, 1)


# ---- global metrics -----------------------------------------------------------------------

def test_global_metrics_on_a_hand_made_correct_vector() -> None:
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3])
    correct = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.bool)
    losses = torch.arange(14, dtype=torch.float32)
    groups = ShotGroups({"many": [0, 1], "medium": [2], "few": [3]}, "hand-made")
    m = global_metrics(correct, losses, labels, groups, num_classes=4)
    # classes of 4, 2, 5 and 3 samples: acc weighs each class alike, as a balanced test set would (not 7/14)
    assert m["acc"] == pytest.approx((75 + 50 + 0 + 100) / 4)
    assert m["per_class_acc"] == pytest.approx([75.0, 50.0, 0.0, 100.0])
    # group accuracy is the mean of its classes' accuracies, not of its samples (that would be 4/6)
    assert m["many_acc"] == pytest.approx(62.5)
    assert m["medium_acc"] == pytest.approx(0.0)
    assert m["few_acc"] == pytest.approx(100.0)
    assert m["loss"] == pytest.approx(6.5)



def test_top1_accuracy_counts_images_and_the_summed_form_agrees() -> None:
    """eval.accuracy=top1 (FedYoYo's code on SVHN-LT): 7 of 14 images right is 50%, not the class mean
    56.25; the shot groups stay class means; the per-class sums of federated evaluation give the same."""
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3])
    correct = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.bool)
    losses = torch.arange(14, dtype=torch.float32)
    groups = ShotGroups({"many": [0, 1], "medium": [2], "few": [3]}, "hand-made")
    top1 = global_metrics(correct, losses, labels, groups, num_classes=4, accuracy="top1")
    assert top1["acc"] == pytest.approx(50.0) and top1["many_acc"] == pytest.approx(62.5)
    hits = torch.bincount(labels, weights=correct.double(), minlength=4)
    totals = torch.bincount(labels, minlength=4).double()
    for accuracy, want in (("top1", 50.0), ("class_mean", 56.25)):
        summed = count_metrics(hits, totals, losses.double().sum(), groups, accuracy)
        assert summed["acc"] == pytest.approx(want) and summed["few_acc"] == pytest.approx(100.0)

def test_global_metrics_acc_on_a_balanced_set_is_the_plain_accuracy_to_the_last_bit() -> None:
    """On a balanced set acc stays the plain mean, bit for bit (the committed results' figure): here the
    mean of the per-class accuracies would differ from it in the last bit (44.44444444444445)."""
    labels = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    correct = torch.tensor([1, 1, 0, 1, 0, 0, 1, 0, 0], dtype=torch.bool)
    groups = ShotGroups({"many": [0], "medium": [1], "few": [2]}, "hand-made")
    acc = global_metrics(correct, torch.zeros(9), labels, groups, num_classes=4)["acc"]  # class 3: no samples
    assert acc == 100 * correct.double().mean().item() == 44.44444444444444


def test_global_metrics_empty_group_is_none() -> None:
    labels = torch.tensor([0, 1, 1])
    correct = torch.tensor([True, False, True])
    groups = ShotGroups({"many": [], "medium": [0, 1], "few": []}, "x")
    m = global_metrics(correct, torch.zeros(3), labels, groups, num_classes=2)
    assert m["many_acc"] is None and m["few_acc"] is None
    assert m["medium_acc"] == pytest.approx(75.0)
    assert len(m["per_class_acc"]) == 2


# ---- personalized accuracy ----------------------------------------------------------------

def test_mean_local_accuracy_is_unweighted_and_skips_empty_clients() -> None:
    per_client = [
        torch.tensor([True, True, False, False]),  # 50 %
        torch.tensor([True]),  # 100 %
        torch.zeros(0, dtype=torch.bool),  # no local test set: ignored, not 0 %
        torch.tensor([False, False, False]),  # 0 %
    ]
    # unweighted mean of 50, 100, 0 (a sample-weighted mean would be 3/8 = 37.5 %)
    assert mean_local_accuracy(per_client) == pytest.approx(50.0)


def test_mean_local_accuracy_without_any_local_test_is_none() -> None:
    assert mean_local_accuracy([]) is None
    assert mean_local_accuracy([torch.zeros(0, dtype=torch.bool)] * 3) is None


def summable(correct: torch.Tensor, prefix: str = "pm", suffix: str = "") -> dict:
    """A client's evaluation entries for one local set, as the client runtime builds them."""
    return {f"{prefix}_sum{suffix}": local_accuracy(correct) or 0.0, f"{prefix}_n{suffix}": int(correct.numel() > 0)}


def test_summed_accuracies_give_the_mean_over_clients_to_the_last_digit() -> None:
    """From one reply per client the summable entries give mean_local_accuracy exactly (same sum, same
    division), empty clients left out; from one secure sum of them, sum / count."""
    gen = torch.Generator().manual_seed(0)
    per_client = [torch.rand(n, generator=gen) < 0.6 for n in (7, 0, 13, 1, 29, 3, 11, 17, 5, 0, 19)]
    replies = [Reply(payload=summable(c)) for c in per_client]
    assert mean_of_summed_accuracies(replies, "pm") == mean_local_accuracy(per_client)
    summed = {k: sum(r.payload[k] for r in replies) for k in replies[0].payload}
    assert summed["pm_n"] == 9
    assert mean_of_summed_accuracies([Reply(payload=summed)], "pm") == pytest.approx(mean_local_accuracy(per_client),
                                                                                     rel=1e-15)
    assert mean_of_summed_accuracies([Reply(payload=summable(per_client[1]))], "pm") is None
    assert mean_of_summed_accuracies([Reply(payload={})], "val_pm") is None


def test_personalized_figures_read_each_reading_and_the_validation_sets() -> None:
    right, wrong = torch.tensor([True, True, False, True]), torch.tensor([False, True, False, False])
    replies = [Reply(payload={**summable(right), **summable(wrong, "val_pm"), **summable(wrong, suffix="/other"),
                              **summable(right, "val_pm", "/other")}),
               Reply(payload={**summable(wrong), **summable(wrong, "val_pm"), **summable(wrong, suffix="/other"),
                              **summable(torch.zeros(0, dtype=torch.bool), "val_pm", "/other")})]
    figures = personalized_figures(replies, with_val=True)
    assert figures == {"pm_acc": 50.0, "val_pm_acc": 25.0,
                       "pm_variants": {"other": {"pm_acc": 25.0, "val_pm_acc": 75.0}}}
    assert personalized_figures(replies, with_val=False)["pm_variants"] == {"other": {"pm_acc": 25.0}}


# ---- predict ------------------------------------------------------------------------------

class PixelClassifier(nn.Module):
    """Logit 5 for the class written in the image's single pixel, 0 for the others."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        assert not self.training
        cls = x.reshape(x.shape[0], -1)[:, 0].round().long()
        return 5.0 * nn.functional.one_hot(cls, self.num_classes).float()


def _pixel_dataset(pixels: list[int], labels: list[int]) -> ImageDataset:
    images = torch.tensor(pixels, dtype=torch.uint8).view(-1, 1, 1, 1)
    # mean 0, std 1/255: normalize() turns the uint8 pixel p back into the float p
    return ImageDataset(images, torch.tensor(labels), ["a", "b", "c"], (0.0,), (1 / 255,))


def test_predict_gives_correct_vector_and_per_sample_cross_entropy() -> None:
    data = _pixel_dataset([0, 1, 2, 2, 0], [0, 1, 1, 2, 2])
    model = PixelClassifier(3)
    correct, losses = predict(model, data, batch_size=2)
    assert correct.tolist() == [True, True, False, True, False]
    assert model.calls == 3  # batches of 2, 2, 1
    lse = math.log(math.exp(5) + 2)  # log-sum-exp of the logits (5, 0, 0)
    right, wrong = lse - 5, lse
    assert losses.tolist() == pytest.approx([right, right, wrong, right, wrong], abs=1e-5)


def test_predict_on_a_subset_keeps_the_order_of_indices() -> None:
    data = _pixel_dataset([0, 1, 2, 2, 0], [0, 1, 1, 2, 2])
    correct, losses = predict(PixelClassifier(3), data, batch_size=10, indices=torch.tensor([4, 1, 3]))
    assert correct.tolist() == [False, True, True]
    lse = math.log(math.exp(5) + 2)
    assert losses.tolist() == pytest.approx([lse, lse - 5, lse - 5], abs=1e-5)


def test_predict_on_an_empty_subset() -> None:
    data = _pixel_dataset([0, 1], [0, 1])
    correct, losses = predict(PixelClassifier(3), data, batch_size=4, indices=torch.zeros(0, dtype=torch.int64))
    assert correct.shape == (0,) and correct.dtype == torch.bool
    assert losses.shape == (0,)


def test_models_with_one_encoder_share_its_features_and_predict_as_whole_models_to_rounding() -> None:
    """The features are made once per encoder, in the batches a whole-set prediction uses; a head
    applied to them gives the whole model's figures (bit for bit over the whole set, to rounding on
    a subset); a changed encoder makes new ones; only head-of-features models qualify."""
    from fedlt.evaluation import equal, head_of_features
    from fedlt.models import create_model

    torch.manual_seed(0)
    data = ImageDataset(torch.randint(0, 256, (37, 3, 8, 8), dtype=torch.uint8), torch.randint(0, 4, (37,)),
                        list("abcd"), (0.5, 0.4, 0.3), (0.2, 0.3, 0.25))
    model = create_model("resnet8", 4, in_channels=3, image_size=8)
    shared = SharedEncoderFeatures()
    features = shared.of(model, data, batch_size=5)
    assert features.shape == (37, model.feature_dim) and shared.of(model, data, batch_size=5) is features
    with torch.no_grad():
        model.head.weight.mul_(-2)  # another model's head on the same encoder
    whole, by_head = predict(model, data, 5), predict(model, data, 5, features=features)
    assert torch.equal(by_head[0], whole[0]) and torch.equal(by_head[1], whole[1])  # the same batches
    rows = torch.tensor([30, 2, 7, 7, 19, 0, 36])
    whole, by_head = predict(model, data, 3, indices=rows), predict(model, data, 3, indices=rows, features=features)
    with torch.no_grad():  # rounding moves a logit by ~1e-6 of its size: far from every top-two gap here
        top2 = model(data.normalize(data.images[rows])).topk(2, dim=1).values
    assert ((top2[:, 0] - top2[:, 1]) > 1e-4 * top2.abs().max()).all()
    assert torch.equal(by_head[0], whole[0])
    assert torch.allclose(by_head[1], whole[1], rtol=1e-5, atol=1e-6)  # features of other batches: rounding
    with torch.no_grad():
        next(model.encoder.parameters()).add_(1e-3)  # another encoder: new features
    assert not torch.equal(shared.of(model, data, 5), features)
    assert torch.equal(shared.of(model, data, 5), encode(model, data, 5))

    assert head_of_features(model)

    class OwnForward(type(model)):
        def forward(self, x):
            return super().forward(x) * 2

    model.__class__ = OwnForward
    assert not head_of_features(model)
    model.__class__ = OwnForward.__mro__[1]
    model.encoder.add_module("batch_stats", nn.BatchNorm1d(4, track_running_stats=False))
    assert not head_of_features(model)  # eval-mode outputs that depend on the batch
    del model.encoder.batch_stats
    model.compile()
    assert not head_of_features(model)

    a = [torch.zeros(3), torch.ones(2, 2)]
    assert equal(a, [t.clone() for t in a]) and not equal(a, [torch.zeros(3), torch.eye(2)])
    assert not equal([torch.tensor([float("nan")])], [torch.tensor([float("nan")])])
    assert not equal(a, a[:1]) and not equal(a, [torch.zeros(3), torch.ones(4)]) and equal([], [])


# ---- traffic ------------------------------------------------------------------------------

def test_payload_nbytes_counts_tensor_bytes_and_scalars() -> None:
    assert payload_nbytes({}) == 0
    assert payload_nbytes({"w": torch.zeros(10, 10, dtype=torch.float32)}) == 400
    assert payload_nbytes({"c": torch.zeros(3, dtype=torch.int64)}) == 24
    assert payload_nbytes({"h": torch.zeros(4, dtype=torch.float16)}) == 8
    assert payload_nbytes({"b": torch.zeros(5, dtype=torch.uint8)}) == 5
    # only the viewed elements travel, not the whole storage behind a slice
    assert payload_nbytes({"v": torch.zeros(100)[:10]}) == 40
    assert payload_nbytes({"i": 3, "f": 0.5, "t": True}) == 24
    assert payload_nbytes({"s": "abc", "u": "é"}) == 3 + 2  # UTF-8 bytes
    assert payload_nbytes({"n": None}) == 0
    nested = {"d": {"a": torch.zeros(2, dtype=torch.float64), "k": 1}, "l": [torch.zeros(3), 2.0]}
    assert payload_nbytes(nested) == (16 + 8) + (12 + 8)
    assert payload_nbytes({"a": np.zeros(3, dtype=np.float32)}) == 12


def test_payload_refuses_what_cannot_cross_a_network() -> None:
    with pytest.raises(TypeError, match="cannot carry a Linear"):
        payload_nbytes({"head": torch.nn.Linear(2, 2)})
    with pytest.raises(TypeError, match="cannot carry a function"):
        Message(payload={"f": lambda x: x}).nbytes()


def test_message_and_reply_nbytes() -> None:
    msg = Message(weights={"a": torch.zeros(10, 10), "b": torch.zeros(10)}, payload={"c": torch.zeros(3, dtype=torch.int64)})
    assert msg.nbytes() == (440, 24)
    assert Message().nbytes() == (0, 0)
    reply = Reply(weights={"a": torch.zeros(10, 10)}, num_samples=17, payload={"c": torch.zeros(3, dtype=torch.int64)},
                  metrics={"train_loss": 1.0, "steps": 3.0})
    # payload side: the payload, the metrics (8 each) and num_samples (8)
    assert reply.nbytes() == (400, 24 + 16 + 8)
    assert Reply().nbytes() == (0, 8)


def test_fedavg_traffic_is_clients_times_model_bytes(tmp_path: Path) -> None:
    config = {
        "data": {"dataset": "synthetic", "num_clients": 10, "image_size": 8},
        "fl": {"rounds": 2, "participation": 0.3, "local_epochs": 1},
        "eval": {"personalized": False},
        "loss": {"name": "ce"},
        "run": {"out_dir": str(tmp_path), "device": "cpu", "checkpoint_every": 0},
    }
    result = fedlt.run(config, quiet=True)
    assert result.run_dir.parent == tmp_path
    # the CNN on 3-channel images with 10 classes, float32 (its size does not depend on the image side):
    # conv 3->32 (3x3) + conv 32->64 (3x3) + FC 64*4*4 -> 128 + head 128 -> 10, weights and biases
    params = (3 * 32 * 9 + 32) + (32 * 64 * 9 + 64) + (64 * 16 * 128 + 128) + (128 * 10 + 10)
    model_bytes = 4 * params
    per_round = 3  # round(0.3 * 10) clients
    # eval.every is 5: only the last round is evaluated, and its line counts the traffic of both rounds
    assert [r["round"] for r in result.metrics] == [2]
    row = result.metrics[0]
    assert "acc" in row and "pm_acc" not in row  # eval.personalized=false
    assert row["comm"]["down_model"] == 2 * per_round * model_bytes
    assert row["comm"]["up_model"] == 2 * per_round * model_bytes
    assert row["comm"]["down_payload"] == 0  # FedAvg with CE sends the model only
    assert row["comm"]["up_payload"] > 0  # num_samples and training metrics travel back
    assert result.summary["communication_bytes"]["down_model"] == 2 * per_round * model_bytes
    assert result.summary["communication_bytes"]["up_model"] == 2 * per_round * model_bytes
