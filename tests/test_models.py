"""Model zoo: shapes, the encoder/head split, parameter counts, registry errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedlt.errors import ConfigError
from fedlt.models import MODELS, FedModel, create_model, list_models

NUM_CLASSES = 10
FEATURE_DIMS = {"cnn": 128, "resnet8": 256, "resnet18": 512, "resnet32": 64, "resnet34": 512, "resnet50": 2048}
INPUTS = [(1, 28), (3, 32)]


def _batch_size(name: str) -> int:
    return 2 if name == "resnet50" else 4


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_registry_lists_every_model() -> None:
    assert [name for name, _ in list_models()] == list(FEATURE_DIMS)
    assert list(MODELS) == list(FEATURE_DIMS)
    for name, description in list_models():
        assert f"{FEATURE_DIMS[name]}-d feature" in description


@pytest.mark.parametrize("in_channels,size", INPUTS)
@pytest.mark.parametrize("name", list(FEATURE_DIMS))
def test_shapes_and_split(name: str, in_channels: int, size: int) -> None:
    torch.manual_seed(0)
    model = create_model(name, NUM_CLASSES, in_channels=in_channels, image_size=size).eval()
    assert isinstance(model, FedModel)
    assert (model.feature_dim, model.num_classes) == (FEATURE_DIMS[name], NUM_CLASSES)
    x = torch.randn(_batch_size(name), in_channels, size, size)
    with torch.no_grad():
        features = model.forward_features(x)
        logits = model(x)
        assert features.shape == (x.shape[0], FEATURE_DIMS[name])
        assert logits.shape == (x.shape[0], NUM_CLASSES)
        torch.testing.assert_close(logits, model.forward_head(features))


@pytest.mark.parametrize("name", list(FEATURE_DIMS))
def test_head_and_encoder_keys_partition_state_dict(name: str) -> None:
    model = create_model(name, NUM_CLASSES)
    head, encoder = model.head_parameter_names(), model.encoder_parameter_names()
    assert head and encoder
    assert all(key.startswith("head.") for key in head)
    assert all(key.startswith("encoder.") for key in encoder)
    assert len(head) + len(encoder) == len(model.state_dict())
    assert set(head) | set(encoder) == set(model.state_dict())


def test_replace_head_changes_output_and_keeps_keys() -> None:
    torch.manual_seed(0)
    model = create_model("resnet8", NUM_CLASSES).eval()
    keys = list(model.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(x)
        old = model.replace_head(nn.Linear(model.feature_dim, NUM_CLASSES))
        after = model(x)
    assert isinstance(old, nn.Linear) and old is not model.head
    assert not torch.allclose(before, after)
    assert list(model.state_dict()) == keys
    assert model.head_parameter_names() == ["head.weight", "head.bias"]


def test_replace_head_rejects_wrong_linear_shape() -> None:
    model = create_model("cnn", NUM_CLASSES)
    with pytest.raises(ValueError, match="128 features to 10 classes"):
        model.replace_head(nn.Linear(64, NUM_CLASSES))


def _conv(c_in: int, c_out: int, k: int) -> int:
    return c_in * c_out * k * k


def _bn(c: int) -> int:
    return 2 * c


def _basic_block(c_in: int, c_out: int) -> int:
    """Two 3x3 convs + BNs, plus a 1x1 conv + BN projection when the width changes."""
    projection = _conv(c_in, c_out, 1) + _bn(c_out) if c_in != c_out else 0
    return _conv(c_in, c_out, 3) + _bn(c_out) + _conv(c_out, c_out, 3) + _bn(c_out) + projection


def test_resnet8_parameter_count() -> None:
    stem = _conv(3, 64, 3) + _bn(64)
    stages = _basic_block(64, 64) + _basic_block(64, 128) + _basic_block(128, 256)
    head = 256 * NUM_CLASSES + NUM_CLASSES
    expected = stem + stages + head
    assert expected == 1_227_594
    assert _n_params(create_model("resnet8", NUM_CLASSES)) == expected


def test_resnet18_parameter_count() -> None:
    # The widely quoted CIFAR ResNet-18 size (3x3 stem, projection shortcuts, 10 classes).
    assert _n_params(create_model("resnet18", NUM_CLASSES)) == 11_173_962


def test_resnet32_parameter_count() -> None:
    # LDAM's ResNet-32 has 464,154 parameters with zero-padding shortcuts; the two 1x1 conv + BN
    # projections (16->32, 32->64) add 16*32 + 2*32 + 32*64 + 2*64 = 2,752.
    assert _n_params(create_model("resnet32", NUM_CLASSES)) == 464_154 + 2_752


def test_cnn_stays_small() -> None:
    assert 100_000 <= _n_params(create_model("cnn", NUM_CLASSES)) <= 200_000


def test_resnet50_stem_depends_on_image_size() -> None:
    small = create_model("resnet50", NUM_CLASSES, image_size=32)
    large = create_model("resnet50", NUM_CLASSES, image_size=64)
    assert small.encoder.stem[0].kernel_size == (3, 3)
    assert large.encoder.stem[0].kernel_size == (7, 7)
    assert isinstance(large.encoder.stem[-1], nn.MaxPool2d)
    with torch.no_grad():
        assert large.eval()(torch.randn(1, 3, 64, 64)).shape == (1, NUM_CLASSES)


@pytest.mark.parametrize("name", ["cnn", "resnet8", "resnet32"])
def test_smallest_image_size(name: str) -> None:
    model = create_model(name, NUM_CLASSES, in_channels=1, image_size=8).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 8, 8)).shape == (2, NUM_CLASSES)


@pytest.mark.parametrize("name", list(FEATURE_DIMS))
def test_deterministic_under_seed(name: str) -> None:
    def build() -> FedModel:
        torch.manual_seed(123)
        return create_model(name, NUM_CLASSES)

    first, second = build().state_dict(), build().state_dict()
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


def test_unknown_model_name() -> None:
    with pytest.raises(ConfigError) as info:
        create_model("vgg16", NUM_CLASSES)
    message = str(info.value)
    assert "\n" not in message
    assert "'vgg16'" in message
    assert "use model.name=<one of cnn, resnet8, resnet18, resnet32, resnet34, resnet50>" in message


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_classes": 0}, "num_classes must be >= 1"),
        ({"in_channels": 0}, "in_channels must be >= 1"),
        ({"image_size": 4}, "image_size must be >= 8"),
        ({"dropout": 0.5}, "does not take option"),
    ],
)
def test_invalid_arguments_raise_config_error(kwargs: dict, match: str) -> None:
    args = {"num_classes": NUM_CLASSES, **kwargs}
    with pytest.raises(ConfigError, match=match):
        create_model("cnn", **args)
