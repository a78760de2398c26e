"""Configuration: YAML + dotted overrides, validation errors as one-line ConfigErrors, dump round-trip."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from fedlt.config import Config, apply_overrides, build_config, load_config
from fedlt.errors import ConfigError

TOP_LEVEL_KEYS = ["seed", "engine", "method", "method_args", "calibration", "calibration_args", "data", "model", "fl", "loss", "eval", "run", "flower", "secagg", "privacy"]


def config_error(path: str | Path | None = None, overrides: list[str] | None = None) -> str:
    """The message of the ConfigError that loading raises; it must be one line."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- YAML + overrides ---------------------------------------------------------------------

def test_yaml_plus_overrides_parse_values_as_yaml_scalars(tmp_path: Path) -> None:
    path = write(tmp_path, "data:\n  dataset: synthetic\n  alpha: 0.5\n  num_clients: 10\nfl:\n  rounds: 10\n  lr: 0.01\n")
    cfg = load_config(path, [
        "data.alpha=0.1", "fl.rounds=50", "method=fedprox", "method_args.mu=0.1",
        "run.compile=true", "fl.lr_schedule=step", "fl.lr_decay_at=[0.3, 0.6]", "fl.grad_clip=null",
        "data.imbalance_factor=10",
    ])
    # overrides win over the file
    assert cfg.data.alpha == 0.1 and type(cfg.data.alpha) is float
    assert cfg.fl.rounds == 50 and type(cfg.fl.rounds) is int
    assert cfg.method == "fedprox"
    # method_args is a free dict: only the YAML scalar parsing makes this a float, not the string "0.1"
    assert cfg.method_args == {"mu": 0.1} and type(cfg.method_args["mu"]) is float
    assert cfg.run.compile is True
    assert cfg.fl.lr_decay_at == [0.3, 0.6]
    assert cfg.fl.grad_clip is None
    # an integer literal into a float field becomes a float
    assert cfg.data.imbalance_factor == 10.0 and type(cfg.data.imbalance_factor) is float
    # values only in the file are kept, everything else is the default
    assert cfg.data.dataset == "synthetic" and cfg.data.num_clients == 10 and cfg.fl.lr == 0.01
    assert cfg.fl.participation == Config().fl.participation
    assert cfg.seed == 0


def test_free_method_args_keep_yaml_types() -> None:
    cfg = load_config(None, ["method_args.flag=false", "method_args.n=3", "method_args.name=abc",
                             "method_args.xs=[1, 2]", "method_args.nested.k=2.5"])
    assert cfg.method_args == {"flag": False, "n": 3, "name": "abc", "xs": [1, 2], "nested": {"k": 2.5}}
    assert type(cfg.method_args["flag"]) is bool and type(cfg.method_args["n"]) is int


def test_override_value_may_contain_equals_sign() -> None:
    assert load_config(None, ["run.name=a=b"]).run.name == "a=b"


def test_no_file_and_no_overrides_is_the_default_config(tmp_path: Path) -> None:
    assert load_config() == Config()
    assert build_config(None) == Config()


def test_apply_overrides_sets_nested_keys_in_place() -> None:
    tree = {"fl": {"rounds": 3}}
    out = apply_overrides(tree, ["fl.lr=0.2", "data.alpha=1e-1", "seed=7"])
    assert out is tree
    # PyYAML reads 1e-1 (no dot) as a string; pydantic then parses it into the float field
    assert tree == {"fl": {"rounds": 3, "lr": 0.2}, "data": {"alpha": "1e-1"}, "seed": 7}
    assert build_config(tree).data.alpha == pytest.approx(0.1)


# ---- unknown keys -------------------------------------------------------------------------

def test_unknown_top_level_key_names_it_and_lists_valid_keys() -> None:
    msg = config_error(overrides=["methd=fedprox"])
    assert "'methd'" in msg and "unknown config key" in msg
    for key in TOP_LEVEL_KEYS:
        assert key in msg


def test_unknown_nested_key_names_it_and_lists_the_sections_keys() -> None:
    msg = config_error(overrides=["data.alphaa=1"])
    assert "'data.alphaa'" in msg
    assert "valid keys in data" in msg
    for key in ("dataset", "imbalance_factor", "alpha", "num_clients", "min_client_size"):
        assert key in msg
    # keys of other sections are not offered
    assert "rounds" not in msg


def test_unknown_key_in_yaml_file(tmp_path: Path) -> None:
    msg = config_error(write(tmp_path, "fl:\n  rounds: 2\n  lrr: 0.1\n"))
    assert "'fl.lrr'" in msg
    for key in ("rounds", "lr", "participation", "local_epochs"):
        assert key in msg


# ---- invalid values -----------------------------------------------------------------------

@pytest.mark.parametrize("overrides, key", [
    (["data.imbalance_factor=0.5"], "data.imbalance_factor"),
    (["data.imbalance_factor=0"], "data.imbalance_factor"),
    (["data.alpha=0"], "data.alpha"),
    (["data.alpha=-0.5"], "data.alpha"),
    (["fl.participation=0"], "fl.participation"),
    (["fl.participation=1.5"], "fl.participation"),
    (["data.num_clients=0"], "data.num_clients"),
    (["fl.rounds=0"], "fl.rounds"),
    (["fl.rounds=2.5"], "fl.rounds"),
    (["fl.rounds=abc"], "fl.rounds"),
    (["fl.lr=0"], "fl.lr"),
    (["data.min_client_size=-1"], "data.min_client_size"),
    (["data.partition=random"], "data.partition"),
    (["eval.shot_rule=median"], "eval.shot_rule"),
    (["eval.every=0"], "eval.every"),
    (["run.streams=17"], "run.streams"),  # lanes past 16 would share CUDA's streams
    (["data.partition=grouped_dirichlet", "data.equal_size=true"], "data.equal_size"),  # it re-cuts by itself
    (["data.partition=iid", "data.equal_size=true"], "data.equal_size"),
    (["fl.lr=inf"], "fl.lr"),  # nan and inf are typos, never settings: refused before the run folder exists
    (["data.imbalance_factor=nan"], "data.imbalance_factor"),
    (["fl.lr_decay=-1"], "fl.lr_decay"),  # a negative factor makes the lr negative at the first step
    (["fl.lr_decay_at=[0.5, 5.0]"], "fl.lr_decay_at"),
    (["eval.many_threshold=-5"], "eval.many_threshold"),
])
def test_invalid_value_is_a_one_line_error_naming_the_key(overrides: list[str], key: str) -> None:
    msg = config_error(overrides=overrides)
    assert key in msg
    assert msg.startswith("invalid config value")


def test_nan_inf_and_out_of_range_knobs_and_devices_are_refused_before_training() -> None:
    from fedlt.run_parts import check_config, resolve_device

    assert "Input should be a finite number" in config_error(overrides=["fl.lr=inf"])
    assert "data.image_size: Input should be greater than or equal to 1" in config_error(overrides=["data.image_size=0"])
    assert "data.image_size: Input should be less than or equal to 1024" in config_error(
        overrides=["data.image_size=100000"])  # 1.2 TB of images: refused, not a MemoryError traceback
    for overrides, fragment in [(["method=fedprox", "method_args.mu=nan"], "method_args.mu for method fedprox: Input "
                                 "should be a finite number"),
                                (["method=safs", "calibration_args.safs_eps=0"], "calibration_args.safs_eps for "
                                 "calibration: Input should be greater than 0")]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            check_config(load_config(None, overrides))
    for name, fragment in [("meta", "run.device=meta: fedlt trains on cpu, cuda (cuda:N) or mps; use run.device=auto"),
                           ("nosuch", "run.device='nosuch' is not a device")]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            resolve_device(name)
    if not torch.backends.mps.is_available():
        with pytest.raises(ConfigError, match="run.device=mps but this torch has no usable MPS"):
            resolve_device("mps")


def test_numbers_past_float32_and_threads_past_torchs_int_are_refused_before_training() -> None:
    """Training computes in float32: a knob past its range (fl.lr=1e39, a step schedule that grows fl.lr past
    it) stopped SGD with a RuntimeError traceback in round 1, after the run folder was made; run.threads past
    a C int stopped torch.set_num_threads the same way."""
    from fedlt.run_parts import check_config

    beyond = "is beyond the 32-bit floats that training computes in (at most 3.403e+38 in size); give a smaller number"
    for overrides, key in [(["fl.lr=1e39"], "fl.lr"), (["fl.weight_decay=1e300"], "fl.weight_decay"),
                           (["loss.name=la", "loss.tau=-1e39"], "loss.tau"), (["flower.timeout_s=1e39"], "flower.timeout_s")]:
        msg = config_error(overrides=overrides)
        assert msg.startswith(f"invalid config value {key}: ") and msg.endswith(beyond), msg
    for overrides, fragment in [(["method=fedetf", "method_args.temperature_init=1e39"],
                                 "method_args.temperature_init for method fedetf: 1e+39 " + beyond),
                                (["method=ccvr", "calibration_args.retrain_lr=1e39"],
                                 "calibration_args.retrain_lr for calibration: 1e+39 " + beyond),
                                (["method=fedloge", "method_args.gamma=1e39"], "method_args.gamma for method fedloge"),
                                (["method=fedloge", "fl.lr=3e38", "method_args.head_lr_scale=100"],  # each in range
                                 "the heads' lr fl.lr x method_args.head_lr_scale = 3e+40 is past the 32-bit floats")]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            check_config(load_config(None, overrides))
    assert "takes fl.lr=0.05 past the 32-bit floats" in config_error(
        overrides=["fl.lr_schedule=step", "fl.lr_decay=1e38"])  # 0.05 x 1e38 x 1e38 at the last round
    assert "run.threads: Input should be less than or equal to 1024" in config_error(overrides=["run.threads=2147483648"])
    load_config(None, ["fl.lr=3e38", "fl.lr_schedule=step", "fl.lr_decay=0.1", "run.threads=1024"])  # within range
    check_config(load_config(None, ["method=fedloge", "fl.lr=3e38", "method_args.head_optimizer=released",
                                    "method_args.head_lr_scale=100"]))  # the released optimiser's lr is 0.03 x 100


def test_numbers_that_round_to_zero_in_float32_are_refused_before_training() -> None:
    """fl.lr=1e-50 is 0 in the float32 that SGD steps in: the run trained nothing and said nothing. A number
    that float32 holds, however small (its smallest subnormal), and 0 itself where a knob takes it, stay valid."""
    from fedlt.run_parts import check_config

    zero = "is zero in the 32-bit floats that training computes in (the smallest is 1.4e-45); give a larger number"
    for overrides, key in [(["fl.lr=1e-50"], "fl.lr"), (["loss.name=la", "loss.tau=-1e-46"], "loss.tau"),
                           (["fl.lr=7.006e-46"], "fl.lr")]:  # just under half the smallest subnormal
        msg = config_error(overrides=overrides)
        assert msg.startswith(f"invalid config value {key}: ") and msg.endswith(zero), msg
    with pytest.raises(ConfigError, match=re.escape("calibration_args.retrain_lr for calibration: 1e-60 " + zero)):
        check_config(load_config(None, ["method=ccvr", "calibration_args.retrain_lr=1e-60"]))
    config = load_config(None, ["fl.lr=1.4e-45", "fl.weight_decay=0"])
    assert float(torch.tensor(config.fl.lr, dtype=torch.float32)) > 0 and config.fl.weight_decay == 0


def test_a_creff_feature_step_past_float32_is_refused_before_training(tmp_path) -> None:
    """CReFF steps its features with creff_feature_lr x C (the released code's row sum): a knob in range
    whose product was not stopped SGD with a RuntimeError traceback; it is one line, exit 2, no folder."""
    from typer.testing import CliRunner

    from fedlt.cli import app

    out = tmp_path / "runs"
    base = ["run", "data.dataset=synthetic", "data.num_clients=4", "fl.rounds=1", "method=creff",
            f"run.out_dir={out}", "--quiet"]
    result = CliRunner().invoke(app, [*base, "calibration_args.creff_feature_lr=1e38"])
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [
        "fedlt: error: CReFF's feature step calibration_args.creff_feature_lr x 10 classes = 1e+39 is past the 32-bit "
        "floats training computes in (at most 3.403e+38); lower creff_feature_lr"], result.stderr
    assert not out.exists()
    trained = CliRunner().invoke(app, [*base, "calibration_args.creff_feature_lr=3e37"])  # x 10 is in range: it trains
    assert "training diverged in round 1" in trained.stderr, trained.stderr


def test_products_of_knobs_past_float32_are_refused_before_training() -> None:
    """Each knob passed its own float32 check, what training makes of them did not: SSE-C's first Adam step
    (sse_lr / (1 - beta1)) stopped FedLoGe's setup with a RuntimeError traceback; GBME-p's noise sigma
    (~ dp_clip / dp_epsilon) made a NaN prior that every client's loss refused with a ValueError traceback,
    and under the analytic calibration a sigma past the doubles hung its bisection."""
    from fedlt.run_parts import check_config

    for overrides, fragment in [
        (["method=fedloge", "method_args.sse_lr=3.41e37"],
         "SSE-C's first Adam step method_args.sse_lr / (1 - 0.9) = 3.41e+38 is past the 32-bit floats"),
        (["method=gbme", "loss.name=bsm", "method_args.dp_epsilon=1e-45"],
         "GBME-p's noise sigma = 2.731e+45 (from method_args.dp_clip=1, dp_epsilon=1e-45, dp_delta=0.03) is past"),
        (["method=gbme", "loss.name=bsm", "method_args.dp_epsilon=1e-44", "method_args.dp_clip=3e38",
          "method_args.dp_calibration=analytic"], "GBME-p's noise sigma = 3.988e+39")]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            check_config(load_config(None, overrides))
    for overrides in (["method=fedloge", "method_args.sse_lr=3.4e37"],  # x 10 is in range
                      ["method=fedloge", "method_args.sse_lr=3e38", "method_args.sse_steps=0"],  # no Adam step
                      ["method=fedloge", "method_args.sse_lr=3e38", "method_args.classifier=etf"],
                      ["method=gbme", "loss.name=bsm", "method_args.dp_epsilon=1", "method_args.dp_clip=1e37"]):
        check_config(load_config(None, overrides))


def test_a_class_order_index_past_64_bits_is_refused_in_one_line(tmp_path) -> None:
    """numpy holds no index past 64 bits: data.class_order with one stopped the data build with an
    OverflowError traceback; it is the same refusal as any list that is not a permutation of the classes."""
    from typer.testing import CliRunner

    from fedlt.cli import app

    out = tmp_path / "runs"
    result = CliRunner().invoke(app, ["run", "data.dataset=synthetic", "data.num_clients=4", "fl.rounds=1",
                                      "data.class_order=[0,1,2,3,4,5,6,7,8,18446744073709551616]",
                                      f"run.out_dir={out}", "--quiet"])
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [
        "fedlt: error: data.class_order=[0, 1, 2, 3, 4, 5, 6, 7, 8, 18446744073709551616] is not a permutation of "
        "the 10 classes 0..9; list every class once, head first, or use natural or shuffled"], result.stderr
    assert not out.exists()


def test_a_class_prior_is_refused_where_no_loss_reads_it() -> None:
    """loss.prior acts on la, bsm and ldam only; elsewhere a prior the user asked for would be ignored
    (or, for a global one, ask the server for counts it never fetches)."""
    from fedlt.run_parts import check_config

    for overrides, fragment in [(["loss.prior=global"], "and loss.name=ce has none; drop loss.prior or use "
                                 "loss.name=<one of la, bsm, ldam>"),
                                (["loss.name=focal", "loss.prior=uniform"], "loss.prior=uniform acts only on the losses "
                                 "built from class counts (la, bsm, ldam), and loss.name=focal has none"),
                                (["method=fedetf", "loss.prior=global"], "method fedetf (its own objective) has none; "
                                 "drop loss.prior")]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            check_config(load_config(None, overrides))
    for loss in ("la", "bsm", "ldam"):
        check_config(load_config(None, [f"loss.name={loss}", "loss.prior=global"]))


def test_true_or_false_is_refused_where_a_setting_takes_a_number_or_a_list() -> None:
    """pydantic would read true as 1 (fl.lr=true a learning rate of 1, data.num_clients=true one client)."""
    from fedlt.run_parts import check_config

    for override, fix in [("fl.lr=true", "give a number, e.g. fl.lr=0.05"),
                          ("data.num_clients=true", "give a whole number, e.g. data.num_clients=20"),
                          ("data.alpha=false", "give a number, e.g. data.alpha=0.5"),
                          ("fl.grad_clip=true", "give a number, e.g. fl.grad_clip=0.5"),
                          ("data.seed=true", "give a whole number, e.g. data.seed=10"),
                          ("data.class_order=true", "give natural, shuffled or a list of whole numbers, e.g. "
                                                    "data.class_order=natural")]:
        assert config_error(overrides=[override]).endswith(": true/false is not a value of this setting "
                                                           f"(got {override.split('=')[1]}); {fix}"), override
    # a setting whose type has no short name points to the configuration reference (fedlt run --help lists no keys)
    assert config_error(overrides=["method_args=true"]).endswith("give a value of its type (the configuration "
                                                                 "reference lists them: python -m fedlt.docs_config)")
    with pytest.raises(ConfigError, match=re.escape("invalid method_args.mu for method fedprox: true/false is not a "
                                                    "value of this setting (got true); give a number, e.g. "
                                                    "method_args.mu=0.01")):
        check_config(load_config(None, ["method=fedprox", "method_args.mu=true"]))
    cfg = load_config(None, ["data.hflip=false", "eval.personalized=false", "method=fedyoyo", "method_args.dla=false"])
    assert cfg.data.hflip is False and cfg.eval.personalized is False and check_config(cfg)


def test_a_value_of_the_wrong_type_names_the_type_and_an_example_of_the_fix() -> None:
    """pydantic's message, then the fix: the type the key takes and an example (its default where it has one)."""
    from fedlt.run_parts import check_config

    for override, fix in [
        ("fl.rounds=abc", "fl.rounds: Input should be a valid integer, unable to parse string as an integer; give a "
                          "whole number, e.g. fl.rounds=50"),
        ("fl.rounds=2.5", "got a number with a fractional part; give a whole number, e.g. fl.rounds=50"),
        ("fl.lr=abc", "fl.lr: Input should be a valid number, unable to parse string as a number; give a number, "
                      "e.g. fl.lr=0.05"),
        ("data.image_size=abc", "give a whole number, e.g. data.image_size=10"),  # no default: an example value
        ("eval.personalized=maybe", "give true or false, e.g. eval.personalized=true"),
        ("data.partition=random", "give dirichlet, grouped_dirichlet, pathological or iid, e.g. "
                                  "data.partition=dirichlet"),
        ("engine=x", "give inprocess or flower, e.g. engine=inprocess"),
        ("run.name=123", "run.name: Input should be a valid string; give a string, e.g. \"run.name='123'\""),
        ("fl.lr_decay_at=abc", "give a list of numbers, e.g. fl.lr_decay_at=[0.5, 0.75]"),
        # a union's member tag is not part of the key
        ("data.class_order=5", "invalid config value data.class_order: Input should be 'natural' or 'shuffled'; give "
                               "natural, shuffled or a list of whole numbers, e.g. data.class_order=natural"),
    ]:
        message = config_error(overrides=[override])
        assert message.startswith("invalid config value") and message.endswith(fix), (override, message)
    for overrides, fix in [(["method=fedprox", "method_args.mu=abc"], "method_args.mu for method fedprox: Input "
                            "should be a valid number, unable to parse string as a number; give a number, e.g. "
                            "method_args.mu=0.01"),
                           (["method=ccvr", "calibration_args.retrain_steps=x"], "give a whole number, e.g. "
                            "calibration_args.retrain_steps=300")]:
        with pytest.raises(ConfigError, match=re.escape(fix)):
            check_config(load_config(None, overrides))


def test_an_invalid_value_read_from_a_config_file_names_the_file(tmp_path: Path) -> None:
    """A run folder's config.yaml cut short, or a hand-written file: the message says which file to fix; a
    value an override gives is the override's, not the file's."""
    import fedlt

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("data:\n  dataset: synthetic\nloss:\n  name")
    with pytest.raises(ConfigError) as info:
        fedlt.resume(run)
    assert str(info.value).startswith(f"{run / 'config.yaml'}: invalid config value loss: 'name' where a section "
                                      "of keys is expected")
    path = write(tmp_path, "fl:\n  rounds: abc\n")
    assert config_error(path).startswith(f"{path}: invalid config value fl.rounds: Input should be a valid integer")
    assert config_error(path, ["data.alpha=0.1"]).startswith(f"{path}: invalid config value fl.rounds")
    assert config_error(path, ["fl.rounds=x"]).startswith("invalid config value fl.rounds")  # the override's
    assert config_error(write(tmp_path, "fl:\n  rounds: 2\n  lrr: 0.1\n")).startswith(f"{tmp_path / 'exp.yaml'}: "
                                                                                       "unknown config key 'fl.lrr'")


def test_image_size_describes_every_dataset_it_sizes() -> None:
    from fedlt.config import DataConfig
    from fedlt.data.registry import DATASETS

    """Names are matched as words: "imagefolder" inside "imagefolder_lt" must not stand for it; the fixed-size
    datasets are named nowhere, and there are resizable ones, so the check is not vacuous."""
    import re

    words = set(re.findall(r"[a-z][a-z0-9_]*", DataConfig.model_fields["image_size"].description))
    resizable = {name for name, info in DATASETS.items() if info.resizable}
    assert {"synthetic", "imagefolder", "imagenet_lt"} <= resizable
    assert resizable <= words, resizable - words
    assert not words & (set(DATASETS) - resizable), words & (set(DATASETS) - resizable)


def test_a_run_name_is_one_folder_inside_out_dir_and_momentum_stays_below_one() -> None:
    for name in ("../../escape", "a/b", "..", "a\\b"):
        assert f"invalid config value run.name: '{name}' is no folder name" in config_error(overrides=[f"run.name={name}"])
    assert load_config(None, ["run.name=my-run.2"]).run.name == "my-run.2"
    assert config_error(overrides=["fl.momentum=1"]) == ("invalid config value fl.momentum: 1.0 is not below 1, where "
                                                         "SGD's steps grow without bound; use e.g. 0.9")


def test_an_empty_or_blank_path_is_refused_not_read_as_the_working_directory() -> None:
    for key in ("run.out_dir", "data.root", "eval.test_data", "eval.val_data"):
        for value in ("''", "'   '"):
            message = config_error(overrides=[f"{key}={value}"])
            assert message.startswith(f"invalid config value {key}: ") and "give a folder's path" in message, message
    assert load_config(None, ["run.out_dir=.", "data.root="]).run.out_dir == "."  # `data.root=` is null: the default


def test_min_client_size_is_refused_on_a_split_that_is_even_by_construction() -> None:
    for partition, how in (("iid", "gives every client an equal share"), ("grouped_dirichlet", "re-cuts its clients")):
        message = config_error(overrides=[f"data.partition={partition}", "data.min_client_size=5"])
        assert message.startswith("invalid config value data: data.min_client_size redraws a dirichlet or "
                                  f"pathological split, but data.partition={partition} {how}"), message
    assert load_config(None, ["data.partition=pathological", "data.min_client_size=5"]).data.min_client_size == 5


def test_invalid_value_messages_state_the_valid_range() -> None:
    assert "must be >= 1" in config_error(overrides=["data.imbalance_factor=0.5"])
    assert "must be > 0" in config_error(overrides=["data.alpha=0"])
    assert "(0, 1]" in config_error(overrides=["fl.participation=1.5"])
    assert "(0, 1]" in config_error(overrides=["fl.participation=0"])


@pytest.mark.parametrize("overrides", [
    ["data.imbalance_factor=1"],  # balanced is allowed
    ["fl.participation=1"],
    ["data.num_clients=1", "fl.participation=1"],
    ["data.alpha=0.001"],
])
def test_boundary_values_are_valid(overrides: list[str]) -> None:
    load_config(None, overrides)


def test_participation_that_samples_no_client_is_rejected() -> None:
    msg = config_error(overrides=["data.num_clients=10", "fl.participation=0.01"])
    assert msg.startswith("invalid config: fl.participation=0.01 samples no client out of data.num_clients=10")
    # the suggested value must itself be accepted and sample exactly one client
    assert "at least 0.1" in msg
    cfg = load_config(None, ["data.num_clients=10", "fl.participation=0.1"])
    assert cfg.clients_per_round() == 1


@pytest.mark.parametrize("num_clients, participation, expected", [(20, 0.4, 8), (20, 1.0, 20), (20, 0.05, 1),
                                                                  (7, 0.5, 3), (100, 0.1, 10)])
def test_clients_per_round(num_clients: int, participation: float, expected: int) -> None:
    cfg = load_config(None, [f"data.num_clients={num_clients}", f"fl.participation={participation}"])
    assert cfg.clients_per_round() == expected


# ---- files and override syntax ------------------------------------------------------------

def test_missing_yaml_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    msg = config_error(missing)
    assert str(missing) in msg and "does not exist" in msg


def test_directory_instead_of_yaml_file(tmp_path: Path) -> None:
    assert str(tmp_path) in config_error(tmp_path)


@pytest.mark.parametrize("text", ["", "# fl: {rounds: 50}\n", "{}\n"])
def test_a_config_file_without_keys_is_refused_rather_than_run_as_the_defaults(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    assert config_error(path, ["fl.rounds=1"]) == (f"config file {path} holds no keys; pass a config that sets some "
                                                   "(e.g. configs/fmnist_lt.yaml), or no file, to run the defaults "
                                                   "with key=value overrides")


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just some text\n", "42\n"])
def test_yaml_that_is_not_a_mapping(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    msg = config_error(path)
    assert str(path) in msg and "mapping" in msg


@pytest.mark.parametrize("text, line", [("data: [1, 2\n", 2), ("fl:\n  rounds: 1\n   lr: 2\n", 3), ("a: b: c\n", 1)])
def test_invalid_yaml_syntax_names_file_and_line(tmp_path: Path, text: str, line: int) -> None:
    path = write(tmp_path, text)
    msg = config_error(path)
    assert str(path) in msg and "not valid YAML" in msg and f"line {line}" in msg


@pytest.mark.parametrize(("text", "key", "line"), [
    ("fl: {rounds: 1}\ndata: {alpha: 0.1}\nfl: {lr: 0.01}\n", "fl", 3),  # a whole section would be dropped
    ("fl:\n  rounds: 1\n  lr: 0.1\n  rounds: 2\n", "rounds", 4),
])
def test_a_key_given_twice_is_refused_not_half_dropped(tmp_path: Path, text: str, key: str, line: int) -> None:
    path = write(tmp_path, text)
    assert config_error(path) == (f"config file {path} gives the key '{key}' twice (the second time at line {line}); "
                                  "write it once")


def test_a_merge_key_may_still_be_overridden(tmp_path: Path) -> None:
    from fedlt.config import load_yaml

    assert load_yaml("base: &b {rounds: 1, lr: 0.1}\nfl:\n  <<: *b\n  rounds: 2\n")["fl"] == {"rounds": 2, "lr": 0.1}
    text = "a: &a {x: 1}\nc: {<<: &b {<<: *a, x: 2}, y: 3}\nd: *b\n"  # a merging mapping used again by its alias
    assert load_yaml(text) == yaml.safe_load(text)


def test_binary_file_as_config_is_a_config_error(tmp_path: Path) -> None:
    # not UTF-8: used to escape as a UnicodeDecodeError traceback
    path = tmp_path / "model.pt"
    path.write_bytes(bytes([0x80, 0xA4, 0xFF, 0x00, 0x12]) * 20)
    assert str(path) in config_error(path)


@pytest.mark.parametrize("item", ["fl.rounds", "rounds50", ""])
def test_override_without_equals_sign(item: str) -> None:
    msg = config_error(overrides=[item])
    assert f"'{item}'" in msg and "key=value" in msg


def test_overrides_given_as_one_string_are_refused_with_the_fix() -> None:
    """``overrides="fl.rounds=2"`` was read one character at a time ("override 'f' is not key=value")."""
    with pytest.raises(ConfigError, match=r"list of key=value strings.*overrides=\['fl.rounds=2'\]"):
        load_config(None, "fl.rounds=2")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="list of key=value strings"):
        apply_overrides({}, "fl.rounds=2")  # type: ignore[arg-type]


def test_overrides_and_configs_of_the_wrong_type_are_one_error_naming_the_types(tmp_path: Path) -> None:
    """The API's arguments of another type failed deep in pathlib (``expected str ... not int``)."""
    import fedlt

    with pytest.raises(ConfigError, match=r"^overrides must be key=value strings; 1 is of type int"):
        load_config(None, ["fl.rounds=2", 1])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"^overrides must be a list of key=value strings, not an object of type int"):
        load_config(None, 5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^config must be a fedlt Config, a dict or a YAML file's path, not an "
                                          r"object of type list; key=value strings go in overrides"):
        fedlt.run(["data.dataset=synthetic"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^run_dir must be a run directory's path \(str or Path\), not an object "
                                          r"of type NoneType"):
        fedlt.resume(None)  # type: ignore[arg-type]


def test_a_mapping_given_for_a_section_merges_into_it() -> None:
    """``data={alpha: 0.1}`` replaced the whole section, silently dropping an earlier ``data.num_clients=4``."""
    cfg = load_config(None, ["data.num_clients=4", "data={alpha: 0.1}", "fl={rounds: 3}"])
    assert (cfg.data.num_clients, cfg.data.alpha, cfg.fl.rounds) == (4, 0.1, 3)
    tree = apply_overrides({"method_args": {"mu": 0.5}}, ["method_args={beta: 1}", "seed={a: 1}"])
    assert tree == {"method_args": {"mu": 0.5, "beta": 1}, "seed": {"a": 1}}  # a plain value is replaced


def test_config_file_after_an_override_says_to_give_it_first() -> None:
    with pytest.raises(ConfigError, match=r"'configs/x.yaml' is a config file among the key=value overrides; give it"):
        apply_overrides({}, ["fl.rounds=2", "configs/x.yaml"])


@pytest.mark.parametrize("item", ["data..alpha=1", ".alpha=1", "=3"])
def test_override_with_empty_key_part(item: str) -> None:
    assert "empty" in config_error(overrides=[item])


def test_override_below_a_scalar_value(tmp_path: Path) -> None:
    msg = config_error(write(tmp_path, "seed: 3\n"), ["seed.x=1"])
    assert "override 'seed.x': seed is a value, not a section of keys; write seed=VALUE" in msg


def test_an_empty_yaml_section_takes_overrides(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "method: fedprox\nmethod_args:\n"), ["method_args.mu=0.1"])
    assert cfg.method_args == {"mu": 0.1}


def test_a_section_given_a_plain_value_names_the_section_and_the_fix(tmp_path: Path) -> None:
    path = write(tmp_path, "fl: 5\n")
    assert config_error(path, ["fl.rounds=1"]) == (
        "override 'fl.rounds': fl is set to 5 (in the config file or an earlier override), but fl is a section of "
        "keys; put its keys under it")
    assert "method_args is set to 3" in config_error(None, ["method_args=3", "method_args.mu=0.1"])
    msg = config_error(path)
    assert msg.startswith(f"{path}: invalid config value fl: 5 where a section of keys is expected (rounds, "
                          "participation")
    assert msg.endswith("in YAML put its keys under `fl:`, as an override write fl.rounds=VALUE")


# ---- dump round-trip ----------------------------------------------------------------------

def _non_default_config() -> Config:
    return load_config(None, [
        "seed=3", "method=fedprox", "method_args.mu=0.05", "data.dataset=synthetic", "data.alpha=0.1",
        "data.imbalance_factor=50", "data.num_clients=7", "data.root=/some/where", "fl.rounds=4",
        "fl.participation=0.5", "fl.lr_schedule=step", "fl.lr_decay_at=[0.25, 0.9]", "fl.grad_clip=5",
        "loss.name=la", "loss.prior=global", "eval.many_threshold=30",
        "run.name=exp1", "run.compile=true", "secagg.enabled=true", "secagg.neighbours=5",
    ])


def test_dump_then_build_gives_an_equal_config() -> None:
    cfg = _non_default_config()
    assert cfg != Config()
    dumped = cfg.dump()
    assert build_config(dumped) == cfg
    assert build_config(Config().dump()) == Config()


def test_dump_round_trips_through_a_yaml_file(tmp_path: Path) -> None:
    cfg = _non_default_config()
    path = write(tmp_path, yaml.safe_dump(cfg.dump(), sort_keys=False))
    assert load_config(path) == cfg
    # the dump is plain data: every top-level key present, and nothing that safe_dump cannot write
    assert list(cfg.dump()) == TOP_LEVEL_KEYS


def test_knobs_that_would_be_ignored_are_refused_naming_what_they_need() -> None:
    """A step decay without the step schedule, a tau without logit adjustment, and the server's own
    test or validation set outside a federation whose nodes hold their data all did nothing."""
    from fedlt.run_parts import check_config

    assert config_error(overrides=["fl.lr_decay_at=[0.1]"]) == (
        "invalid config value fl: fl.lr_decay_at sets the step schedule's decay, but fl.lr_schedule=constant; "
        "add fl.lr_schedule=step or drop fl.lr_decay_at")
    assert "fl.lr_decay sets the step schedule's decay, but fl.lr_schedule=cosine" in config_error(
        overrides=["fl.lr_schedule=cosine", "fl.lr_decay=0.5"])
    assert load_config(None, ["fl.lr_schedule=step", "fl.lr_decay_at=[0.5]"]).fl.lr_decay_at == [0.5]
    assert config_error(overrides=["eval.shot_rule=cumulative", "eval.few_threshold=10"]) == (
        "invalid config value eval: eval.few_threshold sets the count rule's shot groups, but eval.shot_rule="
        "cumulative groups by cumulative shares; drop eval.few_threshold or use eval.shot_rule=count")
    assert load_config(None, ["eval.many_threshold=100"]).eval.many_threshold == 100
    for overrides, fragment in [
        (["loss.name=focal", "loss.tau=3"], "loss.tau=3.0 scales logit adjustment's log-prior (loss.name=la), and "
                                            "loss.name=focal has no tau; drop loss.tau or use loss.name=la"),
        (["method=fedetf", "loss.tau=2"], "and method fedetf (its own objective) has no tau; drop loss.tau"),
        (["loss.focal_gamma=5"], "loss.focal_gamma=5.0 acts only on loss.name=focal, and loss.name=ce has no "
                                 "focal_gamma; drop loss.focal_gamma or use loss.name=focal"),
        (["loss.name=la", "loss.ldam_scale=30"], "loss.ldam_scale=30.0 acts only on loss.name=ldam, and loss.name=la"),
        (["loss.name=bsm", "loss.ldam_max_margin=0.9"], "loss.ldam_max_margin=0.9 acts only on loss.name=ldam"),
        (["method=fedrod", "loss.focal_gamma=0.5"], "and method fedrod (its own objective) has no focal_gamma; drop "
                                                    "loss.focal_gamma"),
        (["eval.test_data=/data/test"], "eval.test_data is the server's own set in a federation whose nodes hold "
                                        "their data (flower.node_data=true); this run reads fmnist's splits"),
        (["eval.val_data=/data/val"], "drop eval.val_data"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            check_config(load_config(None, overrides))
    check_config(load_config(None, ["loss.name=la", "loss.tau=2"]))
    check_config(load_config(None, ["loss.name=focal", "loss.focal_gamma=5"]))
    check_config(load_config(None, ["loss.name=ldam", "loss.ldam_scale=30", "loss.ldam_max_margin=0.9"]))


def test_a_key_a_saved_config_lacks_ran_its_default():
    """A key added to fedlt after a run was saved is absent from its config: the run did what the key's
    default does, so asking for the default matches it and asking for another value does not (a resumed
    checkpoint, a kept bench cell), and between two saved runs (``common``)."""
    from fedlt.config import config_difference
    from fedlt.engine.simulation import check_resumed_config

    saved = Config().dump()
    del saved["data"]["hflip"]
    assert config_difference(saved, Config().dump()) is None
    wanted = build_config({"data": {"hflip": False}})
    shown = "data.hflip: not recorded (the run predates it, so it ran the default 'auto') -> False"
    assert config_difference(saved, wanted.dump()) == shown
    assert config_difference(saved, wanted.dump(), ("data.hflip",)) is None
    assert config_difference(saved, wanted.dump(), common=True) == shown  # two saved runs: the same reading
    check_resumed_config(Config(), Path("run"), {"config": json.dumps(saved)})
    with pytest.raises(ConfigError, match=re.escape(f"is not the config checkpoint.pt was saved with ({shown})")):
        check_resumed_config(wanted, Path("run"), {"config": json.dumps(saved)})


def test_two_saved_runs_differ_where_one_lacks_a_key_the_other_sets_off_its_default():
    """Two kept runs of one row (a report's seeds): a key one predates ran its default there, so a run that set
    another value is another config, and one at the default is the same, whichever side is the older."""
    from fedlt.config import config_difference

    old, same, other = (build_config({"data": {"augment": "weak", **extra}}).dump()
                        for extra in ({}, {}, {"interpolation": "released"}))
    del old["data"]["interpolation"]
    assert config_difference(old, same, common=True) is None and config_difference(same, old, common=True) is None
    assert config_difference(other, old, common=True) == (
        "data.interpolation: 'released' -> not recorded (that run predates it, so it ran the default 'bilinear')")
    assert config_difference(old, other, common=True) == (
        "data.interpolation: not recorded (the run predates it, so it ran the default 'bilinear') -> 'released'")


def test_knobs_that_other_knobs_leave_unread_are_named_by_a_new_run(capsys) -> None:
    """Knobs the config sets whose switch is off: a suite's rows keep such pins, so a run says so instead
    of refusing them; knobs left at their defaults, or read, are not named."""
    from fedlt.api import _note_unread
    from fedlt.run_parts import unread_settings

    cases = [
        (["method=fedyoyo", "method_args.asd=false", "method_args.lam=2", "method_args.asd_average=batch",
          "method_args.gamma=0.2"],
         ["method_args.lam is not read with asd=false (they shape ASD's term)",
          "method_args.asd_average is not read with asd=false (they shape ASD's term)"]),
        (["method=fedyoyo", "method_args.lam=2"], []),
        (["method=gbme", "method_args.dp_delta=0.01", "method_args.dp_clip=2"],
         ["method_args.dp_delta is not read without dp_epsilon (GBME-p's privacy budget; GBME adds no noise)",
          "method_args.dp_clip is not read without dp_epsilon (GBME-p's privacy budget; GBME adds no noise)"]),
        (["method=gbme", "method_args.dp_epsilon=0.5", "method_args.dp_delta=0.01"], []),
        (["method=fedloge", "method_args.finetune_lr=0.01"],
         ["method_args.finetune_lr is not read with finetune_epochs=0 (no fine-tuning)"]),
        (["method=fedloge", "method_args.finetune_lr=0.01", "method_args.finetune_epochs=1"], []),
        (["method=sfd", "method_args.scl_weight=0", "method_args.scl_temperature=0.1"],
         ["method_args.scl_temperature is not read with scl_weight=0 (no contrastive branch)"]),
        (["method=sfd", "method_args.scl_temperature=0.1"], []),
        (["data.val_from=test"], ["data.val_from is not read with data.val_per_class=0 (no validation split)"]),
        (["data.val_from=test", "data.val_per_class=50"], []),
        (["method=fedyoyo", "method_args.asd=false"], []),
        (["method=gbme", "method_args.ensemble=false", "method_args.num_experts=2", "method_args.expert_head=linear",
          "method_args.gpi_floor=0", "method_args.gpi_counts=proxy"],
         ["method_args.num_experts is not read with ensemble=false (the plain model has no experts)",
          "method_args.expert_head is not read with ensemble=false (the plain model has no experts)"]),
        (["method=gbme", "method_args.gpi_floor=0"],  # the default GPI, the count estimate, has no zero
         ["method_args.gpi_floor is not read with gpi_counts=released (every class keeps at least 5 counts, so no "
          "GPI entry is 0 to floor)"]),
        (["method=gbme", "method_args.prior=local", "method_args.lpi_steps=2", "method_args.gpi_floor=0"],
         ["method_args.gpi_floor is not read with prior=local (it floors the GPI prior)"]),  # GPI grouping: an LPI
        (["method=gbme", "method_args.prior=local", "method_args.ensemble=false", "method_args.gpi_counts=released",
          "method_args.dp_epsilon=1", "method_args.dp_clip=2"],
         ["method_args.gpi_counts is not read with prior=local and no GPI grouping (no client computes an LPI)",
          "method_args.dp_epsilon is not read with prior=local and no GPI grouping (no client computes an LPI)",
          "method_args.dp_clip is not read with prior=local and no GPI grouping (no client computes an LPI)"]),
        (["method=sfd", "method_args.ce_gamma=0", "method_args.beta_pi=0.5"],
         ["method_args.beta_pi is not read with ce_gamma=0 (A-CE adds no prior to the logits)"]),
        (["method=sfd", "method_args.beta_pi=0.5"], []),
        (["method=ditto", "method_args.mu=0.5", "eval.personalized=false"],
         ["method_args.mu shapes only the personalized models, which eval.personalized=false does not evaluate"]),
        (["method=ditto", "method_args.mu=0.5"], []),
        # the validator fills personal_head and la_fr_psi in, which the config never gave
        (["method=fedloge", "method_args.finetune_lr=0.01", "method_args.la_fr=false", "eval.personalized=false"],
         ["method_args.finetune_lr is not read with finetune_epochs=0 (no fine-tuning)",
          "method_args.la_fr shapes only the personalized models, which eval.personalized=false does not evaluate"]),
        (["data.partition=iid", "data.alpha=0.1", "data.classes_per_client=3", "data.max_retries=5"],
         ["data.alpha is not read with data.partition=iid (it is the Dirichlet concentration)",
          "data.classes_per_client is not read with data.partition=iid (it shapes the pathological partition)",
          "data.max_retries is not read with data.partition=iid (one draw)"]),
        (["data.partition=pathological", "data.alpha=0.1", "data.classes_per_client=3"],
         ["data.alpha is not read with data.partition=pathological (it is the Dirichlet concentration)"]),
        (["data.partition=grouped_dirichlet", "data.alpha=0.1", "data.max_retries=3"], []),
        (["run.backend=sequential", "run.workers=2", "run.streams=2"],
         ["run.workers is not read with run.backend=sequential (it sizes run.backend=parallel's pool)",
          "run.streams is not read with run.backend=sequential (it sizes run.backend=graphed's streams)"]),
        (["run.backend=parallel", "run.workers=2"], []),
        (["secagg.threshold=0.6", "flower.timeout_s=5", "privacy.allow_leaks=true"],
         ["secagg.threshold is not read with secagg.enabled=false",
          "flower.timeout_s is not read by engine=inprocess (Flower's settings)",
          "privacy.allow_leaks is not read unless nodes hold their own data (flower.node_data=true)"]),
        (["engine=flower", "flower.timeout_s=5", "flower.min_nodes=3", "flower.connect_timeout_s=9"],
         ["flower.min_nodes is not read in a simulation (flower.node_data=false)"]),  # it connects its nodes
        (["secagg.enabled=false", "flower.node_data=false"], []),  # the switches are read, whatever their value
        (["method=gbme", "method_args.prior=local", "method_args.diagnose_gpi=true", "method_args.gpi_floor=0",
          "method_args.gpi_counts=proxy"], []),
        # a dataset long-tailed as distributed makes no long-tail draw: an IF given for it was dropped silently
        (["data.dataset=imagefolder_lt", "data.imbalance_factor=10"],
         ["data.imbalance_factor is not read with data.dataset=imagefolder_lt (its training split is long-tailed as "
          "distributed; no long-tail draw is made)"]),
        (["data.dataset=inat", "data.imbalance_factor=10"],
         ["data.imbalance_factor is not read with data.dataset=inat (its training split is long-tailed as "
          "distributed; no long-tail draw is made)"]),
        (["data.dataset=imagefolder", "data.imbalance_factor=10"], []),
    ]
    for overrides, expected in cases:
        assert unread_settings(load_config(None, overrides)) == expected, overrides
    cfg = load_config(None, ["method=fedloge", "method_args.finetune_lr=0.01"])
    _note_unread(cfg, quiet=True)
    assert capsys.readouterr().err == ""
    _note_unread(cfg, quiet=False)
    assert capsys.readouterr().err == "note: method_args.finetune_lr is not read with finetune_epochs=0 (no fine-tuning)\n"


def test_a_method_with_its_own_objective_names_no_configured_loss() -> None:
    """SFD, FedRoD and the like read no loss.* setting: their summary, report and progress lines said 'ce'."""
    from fedlt.results import loss_label, progress_label

    assert progress_label(load_config(None, ["method=sfd"]), "sequential") == "sfd sequential"
    assert loss_label(load_config(None, ["method=fedrod"])) == "the method's own"
    assert progress_label(load_config(None, ["loss.name=bsm"]), "graphed") == "fedavg/bsm graphed"
    assert loss_label(load_config(None, ["loss.name=bsm"])) == "bsm (prior local)"
    assert loss_label(load_config(None, ["method=creff", "loss.name=focal"])) == "focal"
    # GBME's prior is its own knob's, never loss.prior's (the label said "prior local" under its GPI)
    assert loss_label(load_config(None, ["method=gbme", "loss.name=bsm"])) == "bsm (prior gpi, method_args.prior)"
    assert loss_label(load_config(None, ["method=gbme", "loss.name=la", "method_args.prior=local"])) == \
        "la (prior local, method_args.prior)"
