"""Experiment configuration: one validated tree, loaded from YAML plus ``key=value`` overrides.

Every run writes its resolved config, so a result can always be traced to the exact settings
that produced it. Unknown keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator,
)
from pydantic_core import PydanticCustomError, PydanticUndefined

from fedlt.errors import ConfigError


def _unit_fraction(v: float) -> float:
    """Participation, reply, threshold and data fractions: a share of something, so in (0, 1]."""
    if not 0 < v <= 1:
        raise ValueError(f"must be in (0, 1], got {v}")
    return v


UnitFraction = Annotated[float, AfterValidator(_unit_fraction)]


def _a_path(v: str) -> str:
    """A folder's path: an empty or blank one would silently mean the working directory (or a folder named by
    spaces), as the command line's path options refuse it too."""
    if not v.strip():
        raise ValueError(f"{v!r} is no path (an empty one would mean the working directory); give a folder's path, "
                         "or . for the working directory")
    return v


PathText = Annotated[str, AfterValidator(_a_path)]


def admits_bool(annotation: Any) -> bool:
    """Whether a field of this type takes true / false as a value: not where it takes only numbers (or
    strings, lists ...), although pydantic would read true as 1."""
    if annotation is bool or annotation is Any or isinstance(annotation, bool):
        return True
    origin = get_origin(annotation)
    if origin is Literal:
        return any(isinstance(option, bool) for option in get_args(annotation))
    if origin is Annotated:
        return admits_bool(get_args(annotation)[0])
    if origin is Union or origin is UnionType:
        return any(admits_bool(option) for option in get_args(annotation))
    return origin is None and not (isinstance(annotation, type) and issubclass(annotation, (int, float, str, type(None))))


#: where every key's type is listed, for an error that cannot name the type itself
TYPE_REFERENCE = "give a value of its type (the configuration reference lists them: python -m fedlt.docs_config)"


#: the largest magnitude of a float32, the numbers training computes in
FLOAT32_MAX = 3.4028234663852886e38
#: magnitudes at most this round to zero in float32 (half its smallest subnormal, 2**-149, rounds to even: 0)
FLOAT32_ZERO = 2.0 ** -150


def _beyond_float32(value: Any) -> float | None:
    """The first number in ``value`` (a number, or a list of them) that no float32 holds, or None: one past its
    range, or one not zero that rounds to zero in it (``fl.lr=1e-50`` would train nothing without a word)."""
    if isinstance(value, (list, tuple)):
        return next((big for item in value if (big := _beyond_float32(item)) is not None), None)
    return value if isinstance(value, float) and (abs(value) > FLOAT32_MAX or 0 < abs(value) <= FLOAT32_ZERO) \
        else None


class NoBoolForNumbers(BaseModel):
    """Knobs whose type takes no true / false refuse them: ``fl.lr=true`` is a typo, not a learning rate of 1.
    Nor do they take a number past float32's range, which training computes in: ``fl.lr=1e39`` is refused
    here, not by a RuntimeError traceback in the first SGD step of a half-written run; nor one float32
    rounds to zero (``fl.lr=1e-50``: a run that trains nothing)."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and not admits_bool(cls.model_fields[info.field_name].annotation):
            raise PydanticCustomError(BOOL_REFUSED, "true/false is not a value of this setting (got {got}); {fix}",
                                      {"got": str(value).lower(), "fix": TYPE_REFERENCE})
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _within_float32(cls, value: Any) -> Any:
        out = _beyond_float32(value)
        if out is not None and abs(out) > FLOAT32_MAX:
            raise ValueError(f"{out:g} is beyond the 32-bit floats that training computes in (at most "
                             f"{FLOAT32_MAX:.4g} in size); give a smaller number")
        if out is not None:
            raise ValueError(f"{out:g} is zero in the 32-bit floats that training computes in (the smallest is "
                             f"{2.0 ** -149:.2g}); give a larger number")
        return value


BOOL_REFUSED = "bool_not_a_value"
#: pydantic's errors for a value of the wrong type, which :func:`type_hint` completes with the type and an example
_TYPE_ERRORS = {"int_parsing", "int_from_float", "int_type", "float_parsing", "float_type", "bool_parsing",
                "bool_type", "literal_error", "enum", "string_type", "list_type", BOOL_REFUSED}


def _alternatives(annotation: Any) -> list[tuple[str, Any]]:
    """What a field of this type takes, as (phrase, example) pairs: ``int | None`` -> [("a whole number", 10)]."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _alternatives(get_args(annotation)[0])
    if origin is Union or origin is UnionType:
        return [alt for option in get_args(annotation) if option is not type(None) for alt in _alternatives(option)]
    if origin is Literal:
        return [(_yaml_scalar(option), option) for option in get_args(annotation)]
    if origin is list:
        item = (_alternatives(get_args(annotation)[0]) or [("", None)])[0][0]
        plural = {"a whole number": "whole numbers", "a number": "numbers", "a string": "strings"}.get(item)
        return [(f"a list of {plural}" if plural else "a list", None)]
    simple = {bool: ("true or false", True), int: ("a whole number", 10), float: ("a number", 0.5),
              str: ("a string", None)}
    return [simple[annotation]] if annotation in simple else []


def _yaml_scalar(value: Any) -> str:
    """``value`` as written after ``key=`` (and in YAML): true, 0.5, [0.5, 0.75], '123' for the string "123"."""
    return yaml.safe_dump(value, default_flow_style=True, width=1000).removesuffix("\n").removesuffix("\n...")


def type_hint(model: type[BaseModel], loc: tuple, error_type: str, given: Any, prefix: str = "") -> str | None:
    """For an error of a value's type at ``loc`` in ``model``, the fix in words: the type the field
    takes and an example with its default, e.g. "give a whole number, e.g. fl.rounds=50"; None for
    other errors, or where the field is unknown. ``prefix`` is put before the key (``method_args.``)."""
    if error_type not in _TYPE_ERRORS:
        return None
    kind: Any = model
    field = None
    parts: list[str] = []
    for part in loc:  # a union's member tags (``literal['natural','shuffled']``) follow the field's name
        if not (is_model(kind) and part in kind.model_fields):
            break
        field = kind.model_fields[part]
        kind = field.annotation
        parts.append(str(part))
    alternatives = _alternatives(kind) if field is not None else []
    if not alternatives:
        return None
    phrases = list(dict.fromkeys(phrase for phrase, _ in alternatives))
    wanted = phrases[0] if len(phrases) == 1 else f"{', '.join(phrases[:-1])} or {phrases[-1]}"
    example = None if field.default in (None, [], PydanticUndefined) else field.default
    if example is None and alternatives[0][0] == "a string" and isinstance(given, (int, float)):
        example = str(given)  # a name that YAML reads as a number: quoted, it is the string
    example = example if example is not None else alternatives[0][1]
    key = prefix + ".".join(parts)
    shown = f"{key}={_yaml_scalar(example)}"
    shown = f'"{shown}"' if "'" in shown else shown  # quoted for a shell, which would strip the inner quotes
    return f"give {wanted}" + (f", e.g. {shown}" if example is not None else "")


class _Section(NoBoolForNumbers):
    # nan or inf in a number is a typo, never a setting: refused like any value out of range
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


#: the ``data.augment`` values whose geometric ops resample the image, as ``data.interpolation`` says
RESAMPLING_AUGMENTATIONS = ("weak", "strong")


class DataConfig(_Section):
    """Source dataset, long-tail subsampling and the split over clients."""

    dataset: str = Field("fmnist", description="dataset name (see `fedlt datasets`): fmnist, cifar10, cifar100, svhn, "
                         "cinic10, imagenet_lt, inat, imagefolder and imagefolder_lt (your own class folders), synthetic; "
                         "synthetic_cifar10 and synthetic_cifar100 (CIFAR's size, for timing)")
    root: PathText | None = Field(None, description="folder with the dataset files (default: per dataset, or $FEDLT_DATA)")
    image_size: int | None = Field(None, ge=1, le=1024, description="image side of the datasets whose size is "
                                   "chosen: imagenet_lt and inat are resized to it (default 64), the images of "
                                   "imagefolder and imagefolder_lt have it (default 32), the synthetic datasets are "
                                   "generated at it "
                                   "(synthetic: default 16; synthetic_cifar10, synthetic_cifar100: 32); fixed-size "
                                   "datasets refuse another; at most 1024")
    imbalance_factor: float = Field(100.0, description="IF = n_max / n_min of the long-tailed training set (not "
                                    "applied to ImageNet-LT, iNaturalist and imagefolder_lt, long-tailed as "
                                    "distributed)")
    seed: int | None = Field(None, ge=0, description="seed of the federation: long-tail draw, class order, partition, "
                             "local test sets and client sampling (default: the run's seed); fix it and vary the run's "
                             "seed to measure the training noise of one federation")
    class_order: Literal["natural", "shuffled"] | list[int] = Field(
        "natural", description="which classes are head and tail: natural (class 0 the head), shuffled (a permutation "
        "drawn per seed from its own stream) or an explicit list of every class, head first")
    train_fraction: UnitFraction = Field(1.0, description="keep this fraction of every class of the long-tailed training set "
                                  "(at least one sample each): quick runs and scaling studies")
    partition: Literal["dirichlet", "grouped_dirichlet", "pathological", "iid"] = Field(
        "dirichlet", description="how the training set is split over clients: per-class Dirichlet proportions "
        "(data.alpha); CReFF's and FedYoYo's released split (Dirichlet in groups of 10 clients, a client at the "
        "mean size takes no more, re-cut to equal sizes); a fixed number of classes per client "
        "(data.classes_per_client); or uniformly at random")
    alpha: float = Field(0.5, description="Dirichlet concentration (smaller = more heterogeneous)")
    classes_per_client: int = Field(2, ge=1, description="pathological partition: classes held by each client")
    num_clients: int = Field(20, ge=1, description="clients in the federation (K)")
    min_client_size: int = Field(0, ge=0, description="Dirichlet, pathological: redraw until every client holds "
                                 "at least this many")
    max_retries: int = Field(1000, ge=1, description="Dirichlet, grouped Dirichlet, pathological: draws tried before "
                             "giving up with an error")
    equal_size: bool = Field(False, description="Dirichlet: re-cut the one draw into equal-size clients "
                             "(data.partition=grouped_dirichlet is the CReFF/FedYoYo code's whole split)")
    rounding: Literal["floor", "largest_remainder"] = Field(
        "floor", description="Dirichlet: how a class's shares n x p_k become whole counts: floor = cut at floor(n x "
        "cumsum(p)), as most released splits do (each class's rounding remainder goes to the last client, which so "
        "holds every class); largest_remainder = floor(n x p_k) and one more to the largest fractional parts (SFD's "
        "released split)")
    val_per_class: int = Field(0, ge=0, description="a balanced validation set of this many images per class, "
                               "disjoint from the training federation and the test set, evaluated beside the test set "
                               "(val_acc): make choices on it, read the test set once; 0 = none")
    val_from: Literal["auto", "dataset", "train", "test"] = Field(
        "auto", description="where the validation set comes from: the dataset's own validation list (dataset; "
        "ImageNet-LT, CINIC-10's valid/), held out of the training source before the long-tail draw (train: every "
        "class's count shrinks by (n_max - N) / n_max), or split off the balanced test set (test: the federation is "
        "unchanged); auto = dataset where one exists, test for an already long-tailed source (iNaturalist), else "
        "train")
    augment: Literal["none", "crop_flip", "crop_flip_cutout", "resized_crop_flip", "weak", "strong"] = Field(
        "none", description="training augmentation on the device: crop_flip = crop+flip (the usual CIFAR one), "
        "crop_flip_cutout = + Cutout, resized_crop_flip = a square crop of 64-100% of the area resized back + flip, "
        "weak = crop+flip+rotate, strong = crop+flip+RandAugment+Cutout")
    interpolation: Literal["bilinear", "nearest", "bicubic", "released"] = Field(
        "bilinear", description="how data.augment=weak and strong resample their rotations, shears and translations: "
        "one mode for all, or released = nearest with bicubic shears (torchvision's and PIL's defaults, as FedYoYo's "
        "released code resamples its views)")
    hflip: Literal["auto"] | bool = Field(
        "auto", description="random horizontal flips in training augmentations and methods' views: auto = per dataset "
        "(off for digits), true, or false for data whose objects face one way (Fashion-MNIST's footwear)")
    classes: list[str] | None = Field(
        None, description="class names in label order, one per class of the dataset: the per-class results' names; "
        "a node's image folders map to labels through them (default: the dataset's own names)")

    @model_validator(mode="after")
    def _interpolation_is_a_resampling_augmentation(self) -> "DataConfig":
        if self.interpolation != "bilinear" and self.augment not in RESAMPLING_AUGMENTATIONS:
            raise ValueError(f"data.interpolation={self.interpolation} resamples only data.augment="
                             f"{' or '.join(RESAMPLING_AUGMENTATIONS)} (data.augment={self.augment} has no rotation, "
                             "shear or translation); remove it, or use one of those (FedYoYo's own views resample as "
                             "method_args.view_interpolation says)")
        return self

    @model_validator(mode="after")
    def _min_size_is_redrawn_splits(self) -> "DataConfig":
        if self.min_client_size and self.partition in ("iid", "grouped_dirichlet"):
            how = "gives every client an equal share" if self.partition == "iid" else "re-cuts its clients to equal sizes"
            raise ValueError(f"data.min_client_size redraws a dirichlet or pathological split, but data.partition="
                             f"{self.partition} {how}; remove data.min_client_size")
        return self

    @model_validator(mode="after")
    def _rounding_is_dirichlets(self) -> "DataConfig":
        if self.rounding != "floor" and self.partition != "dirichlet":
            raise ValueError(f"data.rounding={self.rounding} rounds a Dirichlet split's shares, not data.partition="
                             f"{self.partition}'s; remove data.rounding")
        return self

    @model_validator(mode="after")
    def _equal_size_is_dirichlets(self) -> "DataConfig":
        if self.equal_size and self.partition != "dirichlet":
            raise ValueError(f"data.equal_size re-cuts a Dirichlet split, not data.partition={self.partition}"
                             + (" (which re-cuts by itself)" if self.partition == "grouped_dirichlet" else "")
                             + "; remove data.equal_size=true")
        return self

    @field_validator("imbalance_factor")
    @classmethod
    def _if_at_least_one(cls, v: float) -> float:
        if v < 1:
            raise ValueError(f"must be >= 1 (1 = balanced), got {v}")
        return v

    @field_validator("class_order", mode="before")
    @classmethod
    def _order_is_a_name_or_a_list(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in ("natural", "shuffled"):
            raise ValueError(f"'{v}' is not a class order; use natural, shuffled or a list of every class, head first")
        if isinstance(v, list) and not all(isinstance(c, int) and not isinstance(c, bool) for c in v):
            odd = next(c for c in v if not isinstance(c, int) or isinstance(c, bool))
            raise ValueError(f"{odd!r} is no class index; list every class by its whole-number index, head first")
        return v

    @field_validator("class_order")
    @classmethod
    def _order_lists_classes_once(cls, v: str | list[int]) -> str | list[int]:
        if isinstance(v, list) and (len(set(v)) != len(v) or min(v, default=0) < 0):
            raise ValueError(f"{v} must list every class once (non-negative class indices, head first)")
        return v

    @field_validator("hflip", mode="before")
    @classmethod
    def _hflip_is_auto_or_a_bool(cls, v: Any) -> Any:
        if v != "auto" and not isinstance(v, bool):
            raise ValueError(f"{v!r} is not a flip setting; use auto, true or false")
        return v

    def flips(self, dataset_flips: bool) -> bool:
        """Whether training flips images: ``hflip``, or the dataset's own setting under ``auto``."""
        return dataset_flips if self.hflip == "auto" else self.hflip

    @field_validator("alpha")
    @classmethod
    def _alpha_positive(cls, v: float) -> float:
        if v <= 0:
            raise ValueError(f"must be > 0 (e.g. 0.5; smaller is more heterogeneous), got {v}")
        return v



#: the partitions that draw Dirichlet proportions, so data.alpha describes them
DIRICHLET_PARTITIONS = ("dirichlet", "grouped_dirichlet")


def partition_label(partition: str, alpha: float, classes_per_client: int | None = None) -> str:
    """How reports name a partition: with its alpha where one applies."""
    if partition == "dirichlet":
        return f"Dirichlet alpha={alpha:g}"
    if partition == "grouped_dirichlet":
        return f"grouped Dirichlet alpha={alpha:g}"
    if partition == "pathological" and classes_per_client is not None:
        return f"pathological, {classes_per_client} classes per client"
    return "IID" if partition == "iid" else partition


def federation_seed(cfg: DataConfig, run_seed: int) -> int:
    """``data.seed`` when set, else the run's seed: the seed of everything that defines the federation."""
    return run_seed if cfg.seed is None else cfg.seed


class ModelConfig(_Section):
    """The network every client trains (methods with special heads or experts build on it)."""

    name: str = Field("cnn", description="model name (see `fedlt models`): cnn, resnet8, resnet18, resnet32, "
                      "resnet34, resnet50")


class FLConfig(_Section):
    """Federation and local optimisation."""

    rounds: int = Field(50, ge=1, le=1_000_000, description="communication rounds (R)")
    participation: UnitFraction = Field(0.4, description="fraction of clients sampled each round, in (0, 1]")
    local_epochs: int = Field(2, ge=1, description="passes over the local data per round")
    batch_size: int = Field(32, ge=1, description="local mini-batch size")
    lr: float = Field(0.05, gt=0, description="local SGD learning rate (at round 1, before the schedule)")
    momentum: float = Field(0.9, ge=0, description="local SGD momentum (below 1: at 1 or more the steps grow without bound)")
    weight_decay: float = Field(5e-4, ge=0, description="local SGD weight decay")
    lr_schedule: Literal["constant", "cosine", "step"] = Field(
        "constant", description="learning rate over the rounds: constant, cosine decay, or step (fl.lr_decay_at, "
        "fl.lr_decay)")
    lr_decay_at: list[UnitFraction] = Field([0.5, 0.75], description="step schedule: fractions of the rounds where lr "
                                            "*= lr_decay, each in (0, 1]")
    lr_decay: float = Field(0.1, gt=0, description="step schedule: factor applied at each fl.lr_decay_at")
    grad_clip: float | None = Field(None, gt=0, description="clip the norm of the gradient of what local training updates "
                                   "(a frozen part, such as an expert the client does not train, is not counted)")

    @field_validator("momentum")
    @classmethod
    def _momentum_below_one(cls, v: float) -> float:
        if v >= 1:
            raise ValueError(f"{v} is not below 1, where SGD's steps grow without bound; use e.g. 0.9")
        return v

    @model_validator(mode="after")
    def _decay_is_the_step_schedules(self) -> "FLConfig":
        defaults = type(self).model_fields
        changed = [k for k in ("lr_decay_at", "lr_decay") if getattr(self, k) != defaults[k].default]
        if changed and self.lr_schedule != "step":
            raise ValueError(f"fl.{changed[0]} sets the step schedule's decay, but fl.lr_schedule={self.lr_schedule}; "
                             f"add fl.lr_schedule=step or drop fl.{changed[0]}")
        steps = sum(1 for frac in self.lr_decay_at if frac < 1)  # the last round has passed every one below 1
        if self.lr_schedule == "step" and self.lr_decay > 1 and \
                math.log(self.lr) + steps * math.log(self.lr_decay) > math.log(FLOAT32_MAX):
            raise ValueError(f"fl.lr_decay={self.lr_decay:g} at {steps} steps of fl.lr_decay_at takes fl.lr={self.lr:g} "
                             f"past the 32-bit floats that training computes in (at most {FLOAT32_MAX:.4g}); use "
                             "fl.lr_decay <= 1 (a decay) or a smaller fl.lr")
        return self


class LossConfig(_Section):
    """The local classification loss of methods that let the user choose it (FedAvg family)."""

    name: str = Field("ce", description="ce (cross-entropy), la (logit adjustment), bsm (balanced softmax), focal, "
                      "ldam")
    prior: Literal["local", "global", "uniform"] = Field(
        "local", description="class prior for la/bsm/ldam: client's own counts, the server's aggregate of all counts, "
        "or uniform (no prior)"
    )
    tau: float = Field(1.0, description="logit adjustment: temperature of the log-prior added to the logits")
    focal_gamma: float = Field(2.0, ge=0, description="focal loss: focusing parameter gamma")
    ldam_max_margin: float = Field(0.5, gt=0, description="LDAM: margin of the rarest class (margins ~ n^(-1/4))")
    ldam_scale: float = Field(1.0, gt=0, description="logit scale s; the LDAM paper uses 30 with a cosine head, 1 suits a linear head")


class EvalConfig(_Section):
    """When and how the models are evaluated."""

    every: int = Field(5, ge=1, description="evaluate every N rounds (and always after the last)")
    shot_rule: Literal["count", "cumulative", "cumulative_local"] = Field(
        "count", description="count: thresholds on training samples per class; cumulative: FedLoGe's 75%/95% of samples "
        "(its paper's text); cumulative_local: the same shares of the clients' local test sets' class totals, each "
        "client's floor(n_kc / N x test size), as FedLoGe's released code groups its Table 1's columns"
    )
    many_threshold: int | None = Field(None, ge=0, description="many-shot: > this many training samples (default by #classes)")
    few_threshold: int | None = Field(None, ge=0, description="few-shot: < this many training samples (default by #classes)")
    accuracy: Literal["class_mean", "top1"] = Field(
        "class_mean", description="acc on a test set whose classes differ in size (SVHN's own, the nodes' own test "
        "splits): class_mean = the mean of the per-class accuracies, as a balanced set would weigh them; top1 = the "
        "share of all test images classified right (FedYoYo's released code on SVHN-LT); equal on a balanced set")
    personalized: bool = Field(True, description="also evaluate on each client's local test set")
    batch_size: int = Field(1000, ge=1, description="evaluation batch size (memory; results change at most by float rounding)")

    @model_validator(mode="after")
    def _thresholds_are_the_count_rules(self) -> "EvalConfig":
        given = [k for k in ("many_threshold", "few_threshold") if getattr(self, k) is not None]
        if given and self.shot_rule != "count":
            raise ValueError(f"eval.{given[0]} sets the count rule's shot groups, but eval.shot_rule={self.shot_rule} "
                             f"groups by cumulative shares; drop eval.{given[0]} or use eval.shot_rule=count")
        return self
    test_data: PathText | None = Field(
        None, description="flower.node_data: the server's balanced test set, an image-folder tree (test/<class>/...); "
        "without it the nodes evaluate on their own test splits (federated evaluation)")
    val_data: PathText | None = Field(
        None, description="flower.node_data: the server's balanced validation set, an image-folder tree "
        "(val/<class>/...; fedlt data export writes one with data.val_per_class)")


class RunConfig(_Section):
    """Where a run writes, and how it uses the machine."""

    out_dir: PathText = Field("runs", description="folder that holds the run directories")
    name: str | None = Field(None, description="run directory name (default: method-dataset-time)")
    checkpoint_every: int = Field(10, ge=0, description="save a resumable checkpoint every N rounds (0 = only at the end)")
    device: str = Field("auto", description="auto (CUDA when present), cpu, cuda, cuda:N")
    threads: int | None = Field(None, ge=1, le=1024, description="torch CPU threads (default: torch's choice; under "
                                "run.backend=parallel: per worker, cores / run.workers); at most 1024")
    compile: bool = Field(False, description="torch.compile the model")
    channels_last: bool = Field(True, description="channels-last memory format on the CPU (measured faster for convs there; "
                                "not used on CUDA)")
    backend: Literal["auto", "sequential", "parallel", "vectorized", "graphed"] = Field(
        "sequential", description="local training: sampled clients one after another; at the same time in "
        "run.workers CPU processes (parallel, any method); all at once as one batched computation (vectorized; "
        "FedAvg, FedProx, FedAvgM, FedLC, FedETF, FedPer, FedBN, centralized and the calibration methods); each client's step captured as a "
        "CUDA graph, run.streams clients at once (graphed; every method but Ditto; on a CPU the same step without "
        "capture); "
        "auto = the backend measured fastest for the device and model (docs/speed.md)"
    )
    streams: int = Field(8, ge=1, le=16, description="run.backend=graphed on a GPU: clients trained at once, each on "
                         "its own CUDA stream with its own copy of the model (at most 16: CUDA hands out 32 streams "
                         "per device in turn, and each client takes two)")
    workers: int | None = Field(None, ge=1, description="run.backend=parallel: worker processes (default: one per "
                                "CPU core, at most the clients sampled per round)")
    deterministic: bool = Field(True, description="GPU runs: cuDNN deterministic mode without autotuning, and torch's deterministic CUDA kernels (warns where one has none)")
    tensorboard: bool = Field(False, description="also write TensorBoard event files to RUN_DIR/tensorboard (needs fedlt[tracking])")

    @field_validator("name")
    @classmethod
    def _one_folder_in_out_dir(cls, name: str | None) -> str | None:
        if name is not None and (not name.strip() or "/" in name or "\\" in name or name in (".", "..")):
            raise ValueError(f"'{name}' is no folder name: the run directory is one folder inside run.out_dir "
                             "(no '/', '\\', '.' or '..'); put the path in run.out_dir")
        return name


class FlowerConfig(_Section):
    """The Flower engine (``engine: flower``): timeouts and how many missing replies a phase survives."""

    timeout_s: float = Field(600.0, gt=0, description="longest wait for the replies of one phase (every send has it)")
    min_reply_fraction: UnitFraction = Field(
        0.5, description="a phase goes on with the replies that arrived if at least this fraction of its clients answered"
    )
    connect_timeout_s: float = Field(120.0, gt=0, description="longest wait for every partition's SuperNode to connect")
    cpus_per_client: float = Field(1.0, gt=0, description="simulation: CPU cores Ray reserves per running ClientApp")
    gpus_per_client: float = Field(
        0.0, ge=0, description="simulation: GPUs Ray reserves per running ClientApp (a fraction shares one: 0.25 runs "
        "four clients per GPU); 0 = the simulated clients train on CPU")
    node_data: bool = Field(
        False, description="a real federation: each SuperNode is one client and trains on its own folder "
        "(--node-config 'data=\"PATH\" name=\"SITE\"'); the server reads no training data")
    min_nodes: int = Field(2, ge=1, description="flower.node_data: SuperNodes to wait for (up to connect_timeout_s) "
                           "before the first round; the clients are the nodes found, ordered by name")


class PrivacyConfig(_Section):
    """What a real federation (``flower.node_data``) lets leave a node."""

    allow_leaks: bool = Field(False, description="allow options that send a node's label histogram or real features "
                              "in the clear under flower.node_data (refused otherwise); without secagg.enabled the "
                              "engine's class counts and evaluation sums, and the method's summed queries, then "
                              "travel in the clear too, not as secure sums")


class SecAggConfig(_Section):
    """Secure aggregation (SecAgg+) of the phases a method declares as sums or weighted means."""

    enabled: bool = Field(False, description="the server sees only sums of the secure phases' replies (needs fedlt[flower])")
    neighbours: int = Field(0, ge=0, description="SecAgg+: clients each one masks with, itself included (odd, >= 3); "
                            "0: every client of the phase (SecAgg)")
    threshold: UnitFraction = Field(0.5, description="fraction of a client's neighbours whose shares rebuild its secrets: "
                             "t = max(2, ceil(threshold x neighbours)); more dropouts than neighbours - t abort the phase")
    fraction_bits: int = Field(24, ge=8, le=40, description="fixed-point precision of the masked integers (2^-bits)")

    @field_validator("neighbours")
    @classmethod
    def _odd(cls, v: int) -> int:
        if v and (v < 3 or v % 2 == 0):
            raise ValueError(f"must be 0 (every client) or an odd number >= 3, got {v}")
        return v


class Config(_Section):
    """The whole experiment."""

    seed: int = Field(0, ge=0, description="seed of every random stream of the run (data split, client sampling, "
                      "model init, training, server); data.seed overrides the federation's")
    engine: Literal["inprocess", "flower"] = Field(
        "inprocess", description="inprocess: one deterministic process; flower: Flower's simulation engine (fedlt[flower])"
    )
    method: str = Field("fedavg", description="the federated method (see `fedlt methods`)")
    method_args: dict[str, Any] = Field(default_factory=dict,
                                        description="method-specific knobs (see `fedlt methods NAME`)")
    calibration: list[str] = Field(
        default_factory=list,
        description="server-side classifier calibrations applied to the method's model (creff, ccvr, fedncm, fed3r, "
        "taunorm, safs, oracle); the first is the headline, every one is evaluated",
    )
    calibration_args: dict[str, Any] = Field(default_factory=dict, description="calibration knobs (see `fedlt calibrations`)")

    @field_validator("calibration", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        if v is None or v == "none":
            return []
        return [v] if isinstance(v, str) else v
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    fl: FLConfig = FLConfig()
    loss: LossConfig = LossConfig()
    eval: EvalConfig = EvalConfig()
    run: RunConfig = RunConfig()
    flower: FlowerConfig = FlowerConfig()
    secagg: SecAggConfig = SecAggConfig()
    privacy: PrivacyConfig = PrivacyConfig()

    @model_validator(mode="after")
    def _clients_vs_participation(self) -> "Config":
        if self.clients_per_round() < 1:
            raise ValueError(
                f"fl.participation={self.fl.participation} samples no client out of data.num_clients="
                f"{self.data.num_clients}; raise fl.participation to at least {1 / self.data.num_clients:.3g}"
            )
        return self

    def clients_per_round(self) -> int:
        """floor(participation x clients): 40% of 20 clients is 8; a fraction sampling none is an error."""
        return int(self.fl.participation * self.data.num_clients + 1e-9)

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def parse_scalar(text: str) -> Any:
    """``key=value`` values are YAML scalars: ``0.1`` -> float, ``true`` -> bool, ``[1,2]`` -> list; text YAML
    cannot read stays text (it equals no value, and the config check names it)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def override_list(overrides: list[str] | None) -> list[str]:
    """``overrides`` as a list; a lone string (``overrides="fl.rounds=2"``, which would otherwise be read
    one character at a time) is refused with the fix."""
    if overrides is None:
        return []
    if isinstance(overrides, (str, bytes)):
        raise ConfigError(f"overrides must be a list of key=value strings, not the string {overrides!r}; "
                          f"write overrides=[{overrides!r}]")
    try:
        items = list(overrides)
    except TypeError:
        raise ConfigError(f"overrides must be a list of key=value strings, not an object of type {type(overrides).__name__}; "
                          "write e.g. overrides=['fl.rounds=2']") from None
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"overrides must be key=value strings; {item!r} is of type {type(item).__name__}: write it "
                              "as a string, e.g. 'fl.rounds=2'")
    return items


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys (``data.alpha=0.1``) in a nested dict; returns the same dict."""
    for item in override_list(overrides):
        if "=" not in item:
            if Path(item).suffix in (".yaml", ".yml"):  # the config file given after an override
                raise ConfigError(f"'{item}' is a config file among the key=value overrides; give it first, "
                                  f"before them: {item} key=value ...")
            raise ConfigError(f"override '{item}' is not key=value; write it like data.alpha=0.1")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override key '{key}' is empty or has an empty part; write it like fl.rounds=50")
        node = tree
        for depth, part in enumerate(parts[:-1], start=1):
            if node.get(part) is None:  # absent, or an empty YAML section (`method_args:`)
                node[part] = {}
            child = node[part]
            if not isinstance(child, dict):
                prefix = ".".join(parts[:depth])
                if _is_section(prefix):  # the config file (or an earlier override) gave a section a plain value
                    raise ConfigError(f"override '{key}': {prefix} is set to {child!r} (in the config file or an "
                                      f"earlier override), but {prefix} is a section of keys; put its keys under it")
                raise ConfigError(f"override '{key}': {prefix} is a value, not a section of keys; write {prefix}=VALUE")
            node = child
        _set_merged(node, parts[-1], parse_scalar(value))
    return tree


def _set_merged(node: dict[str, Any], key: str, value: Any) -> None:
    """``node[key] = value``, except that a mapping given for a section merges into it, as its dotted keys
    would: ``data={alpha: 0.1}`` after ``data.num_clients=4`` keeps the 4."""
    if isinstance(value, dict) and isinstance(node.get(key), dict):
        for k, v in value.items():
            _set_merged(node[key], k, v)
    else:
        node[key] = value


def _key_of(loc: tuple) -> str:
    """The dotted key of an error's location, without the union member tags pydantic adds after a
    field (``data.class_order.literal['natural','shuffled']`` is data.class_order); list indexes stay."""
    kind: Any = Config
    parts = []
    for part in loc:
        if is_model(kind):
            field = kind.model_fields.get(part)
            kind = field.annotation if field else None
        elif not isinstance(part, int):
            continue
        parts.append(str(part))
    return ".".join(parts)


def _describe(err: ValidationError) -> str:
    first = err.errors()[0]
    where = _key_of(first["loc"]) or "config"
    if first["type"] == "extra_forbidden":
        section = ".".join(str(p) for p in first["loc"][:-1])
        valid = _valid_keys(section)
        return f"unknown config key '{where}'; valid keys{' in ' + section if section else ''}: {', '.join(valid)}"
    if first["type"] == "model_type":  # a section given a plain value, e.g. `fl: 5`
        keys = _valid_keys(where)
        return (f"invalid config value {where}: {first.get('input')!r} where a section of keys is expected "
                f"({', '.join(keys[:4])}, ...); in YAML put its keys under `{where}:`, as an override write "
                f"{where}.{keys[0]}=VALUE")
    if not _key_of(first["loc"]):  # a check across sections names its keys itself
        return f"invalid config: {with_type_hint(first, Config)}"
    return f"invalid config value {where}: {with_type_hint(first, Config)}"


def with_type_hint(error: Any, model: type[BaseModel], prefix: str = "") -> str:
    """pydantic's message of ``error`` (one of ValidationError.errors()), ending in the fix where the
    value had the wrong type: "Input should be a valid integer, ...; give a whole number, e.g. fl.rounds=50"."""
    msg = error["msg"].removeprefix("Value error, ")
    hint = type_hint(model, error["loc"], error["type"], error.get("input"), prefix)
    return f"{msg.removesuffix('; ' + TYPE_REFERENCE)}; {hint}" if hint else msg


def _annotation(key: str) -> Any:
    """The declared type of dotted ``key`` in the schema ("" is the whole Config), or None."""
    kind: Any = Config
    for part in filter(None, key.split(".")):
        field = is_model(kind) and kind.model_fields.get(part)
        if not field:
            return None
        kind = field.annotation
    return kind


def is_model(kind: Any) -> bool:
    """Whether a field's type is a section of settings (a pydantic model), not a value."""
    return isinstance(kind, type) and issubclass(kind, BaseModel)


def _is_section(key: str) -> bool:
    """Whether dotted ``key`` holds keys: a nested section, or a free-form mapping like method_args."""
    kind = _annotation(key)
    return is_model(kind) or get_origin(kind) is dict


def _valid_keys(section: str) -> list[str]:
    kind = _annotation(section)
    return list(kind.model_fields) if is_model(kind) else []


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:  # method_args too: a knob a finished run did not set is compared by name
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_difference(saved: dict[str, Any], wanted: dict[str, Any], ignored: tuple[str, ...] = (),
                      common: bool = False) -> str | None:
    """The first dotted key whose value differs between two config trees, as ``key: a -> b``; keys
    that start with one of ``ignored`` do not count. A key of :class:`Config` that a saved config lacks
    was added to fedlt after that run, which therefore ran what the key's default does (so a key's
    default never changes once runs are kept): the other config differs only where it asks for another
    value. ``common``: ``wanted`` is a saved run too, and a key it lacks is read the same way. Knobs of
    ``method_args`` and ``calibration_args`` a config does not set are their method's defaults, which
    this module cannot know: callers compare those resolved (the bench, a checkpoint's records)."""
    a, b, defaults = _flatten(saved), _flatten(wanted), _defaults()
    for key in sorted(a):
        if key.startswith(ignored) or (common and key not in b and key not in defaults):
            continue
        if common and key not in b:
            if a[key] != defaults[key]:
                return (f"{key}: {a[key]!r} -> not recorded (that run predates it, so it ran the default "
                        f"{defaults[key]!r})")
        elif a[key] != b.get(key):
            return f"{key}: {a[key]!r} -> {b.get(key)!r}"
    for key in sorted(set(b) - set(a)):
        if not key.startswith(ignored) and key in defaults and b[key] != defaults[key]:
            return f"{key}: not recorded (the run predates it, so it ran the default {defaults[key]!r}) -> {b[key]!r}"
    return None


@functools.cache
def _defaults() -> dict[str, Any]:
    """Every :class:`Config` key's default, dotted (read, never changed, by :func:`config_difference`)."""
    return _flatten(Config().dump())


def build_config(tree: dict[str, Any] | None = None) -> Config:
    """Validate a nested dict into a :class:`Config`, turning errors into one-line ConfigErrors."""
    try:
        return Config.model_validate(tree or {})
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """YAML file (optional) + dotted ``key=value`` overrides -> validated config."""
    tree: dict[str, Any] = {}
    overrides = override_list(overrides)
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {p} is a folder; pass a YAML file, e.g. {p / 'config.yaml'}")
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass an existing YAML file or only key=value overrides")
        tree = read_yaml_mapping(p)
        if not tree:  # a file given and empty is a mistake (the wrong file, one not yet saved): not all defaults
            raise ConfigError(f"config file {p} holds no keys; pass a config that sets some (e.g. configs/"
                              "fmnist_lt.yaml), or no file, to run the defaults with key=value overrides")
        if "methods" in tree and "name" in tree:  # a suite's keys, which no run config has
            raise ConfigError(f"{p} is a benchmark suite, not a run config; run it with fedlt bench {p}")
    if path is None:
        return build_config(apply_overrides(tree, overrides or []))
    return file_config(p, tree, overrides)


def file_config(p: Path, tree: dict[str, Any], overrides: list[str] | None = None) -> Config:
    """The mapping ``tree`` read from config file ``p``, plus ``overrides``, validated: an invalid value is one
    ConfigError naming the file, unless an override gave it (for a caller that has read the file already)."""
    try:
        return Config.model_validate(apply_overrides(tree, overrides or []))
    except ValidationError as err:
        key = _key_of(err.errors()[0]["loc"])
        given = [item.split("=", 1)[0].strip() for item in overrides or []]
        # the value an override gives is the override's; a check across sections (key "") the file's alone
        overridden = any(k == key or k.startswith(key + ".") or key.startswith(k + ".") for k in given) if key \
            else bool(given)
        raise ConfigError(_describe(err) if overridden else f"{p}: {_describe(err)}") from None


class DuplicateKey(yaml.YAMLError):
    """A mapping that gives one key twice: PyYAML would keep the last value and drop the first."""

    def __init__(self, key: Any, line: int):
        super().__init__(f"key '{key}' given twice (again at line {line})")
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, refusing a key written twice in one mapping (merge keys, ``<<``, may still be
    overridden)."""

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """Check a mapping's own keys once, before PyYAML merges others into it in place (an anchored
        mapping used again through its alias is already merged then)."""
        checked = self.__dict__.setdefault("_checked", set())
        if id(node) not in checked:
            checked.add(id(node))
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                if isinstance(key, (str, int, float, bool)) or key is None:
                    if key in seen:
                        raise DuplicateKey(key, key_node.start_mark.line + 1)
                    seen.add(key)
        super().flatten_mapping(node)


def load_yaml(data: bytes | str) -> Any:
    """What a YAML document holds, as yaml.safe_load reads it, except that a key given twice in one
    mapping is a DuplicateKey (a YAMLError) instead of silently dropping its first value."""
    return yaml.load(data, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


def yaml_problem(err: yaml.YAMLError, what: str) -> str:
    """One line on why ``what`` (a file, named) is not the YAML it should be, and the fix."""
    if isinstance(err, DuplicateKey):
        return f"{what} gives the key '{err.key}' twice (the second time at line {err.line}); write it once"
    mark = getattr(err, "problem_mark", None)
    return f"{what} is not valid YAML{f' at line {mark.line + 1}' if mark else ''}; fix the syntax"


def read_yaml_mapping(p: Path, what: str = "config file") -> dict[str, Any]:
    """The mapping a YAML file holds ({} when empty); an unreadable file, invalid YAML, a key given twice
    or another type is one ConfigError naming ``what`` and the file."""
    try:
        # bytes: PyYAML detects the encoding itself, and undecodable bytes become a YAMLError
        loaded = load_yaml(p.read_bytes())
    except OSError as err:
        raise ConfigError(f"cannot read {what} {p} ({err.strerror or err}); check its permissions") from None
    except yaml.YAMLError as err:
        raise ConfigError(yaml_problem(err, f"{what} {p}")) from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{what} {p} must hold a mapping of keys (e.g. 'fl: {{rounds: 50}}')")
    return loaded or {}
