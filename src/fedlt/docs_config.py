"""The configuration reference, generated from the pydantic schema (``fedlt.config``) and the
methods' and calibrations' knob classes, so the documentation cannot drift from the code.

``docs/hooks.py`` serves its output as the site's ``configuration.md`` at every ``mkdocs build``;
``python -m fedlt.docs_config [FILE]`` prints (or writes) the same page.
"""

from __future__ import annotations

import json
import sys
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from fedlt.config import Config, is_model

INTRO = """\
# Configuration reference

One validated tree (`src/fedlt/config.py`), read from a YAML file plus dotted `key=value`
overrides applied in order (values are parsed as YAML scalars: `0.1` is a float, `true` a bool,
`[ccvr,fed3r]` a list). Unknown keys are errors that name the valid keys of their section.

```bash
fedlt run configs/fmnist_lt.yaml data.alpha=0.1 fl.rounds=50 method=fedprox method_args.mu=0.01
```

```yaml
# the same as a file
method: fedprox
method_args: {mu: 0.01}
data: {alpha: 0.1}
fl: {rounds: 50}
```

A setting that other settings leave unread is kept as given, and a new run names it in a line
on stderr (not with `--quiet`), e.g. `note: data.alpha is not read with data.partition=iid (it is the Dirichlet
concentration)` or `note: method_args.mu shapes only the personalized models, which
eval.personalized=false does not evaluate`. A suite's rows may pin such keys; a value that
contradicts another (`fl.lr_decay` without `fl.lr_schedule=step`) is refused instead.

*This page is generated from the schema at every documentation build
(`python -m fedlt.docs_config` prints it).*
"""


def _constraint(meta: list[Any]) -> str:
    """``>= 1``, ``in (0, 1]`` ... from a field's metadata (Field(ge=...) and AfterValidators)."""
    parts = []
    for m in meta:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                parts.append(f"{sym} {getattr(m, attr)}")
        func = getattr(m, "func", None)
        if func is not None and func.__name__ == "_unit_fraction":
            parts.append("in (0, 1]")
    return ", ".join(parts)


def type_name(kind: Any) -> str:
    """A readable type: ``int``, ``float | null``, ``"a" | "b"``, ``list[float]``."""
    origin = get_origin(kind)
    if kind is type(None):
        return "null"
    if origin is Annotated:
        base, *meta = get_args(kind)
        extra = _constraint(meta)
        return type_name(base) + (f" {extra}" if extra else "")
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in get_args(kind))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(kind))
    if origin in (list, tuple):
        return f"list[{', '.join(type_name(a) for a in get_args(kind) if a is not Ellipsis)}]"
    if origin is dict:
        return "mapping"
    if kind is Any:
        return "any"
    return getattr(kind, "__name__", str(kind))


def field_type(field: FieldInfo) -> str:
    name = type_name(field.annotation)
    extra = _constraint(field.metadata)
    if not extra:
        return name
    return f"{name} {extra}" if extra.startswith("in ") else f"{name} ({extra})"


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if is_model(field.annotation):
            continue
        rows.append(f"| `{prefix}{name}` | `{_cell(field_type(field))}` | `{_cell(default_text(field))}` | "
                    f"{_cell(field.description or '')} |")
    return rows


def config_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, FieldInfo]]:
    """Every leaf key of the schema as (dotted key, field)."""
    keys = []
    for name, field in model.model_fields.items():
        if is_model(field.annotation):
            keys += config_keys(field.annotation, f"{prefix}{name}.")
        else:
            keys.append((prefix + name, field))
    return keys


def missing_descriptions() -> list[str]:
    """Config keys, method knobs and calibration knobs without a ``description``."""
    missing = [key for key, field in config_keys() if not field.description]
    for label, model in knob_classes():
        missing += [f"{label}.{k}" for k, f in model.model_fields.items() if not f.description]
    return missing


def knob_classes() -> list[tuple[str, type[BaseModel]]]:
    """(label, knob class) of every method with knobs and of the calibrations."""
    from fedlt.calibration.calibrators import CalibrationArgs
    from fedlt.methods.registry import METHODS

    seen: set[type] = set()
    out = []
    for spec in METHODS.values():
        if spec.args.model_fields and spec.args not in seen:
            seen.add(spec.args)
            out.append((f"method={spec.name}", spec.args))
    out.append(("calibration_args", CalibrationArgs))
    return out


def compatibility_matrix() -> list[str]:
    """Method x calibration, method x loss and model x dataset, each cell from the components' declarations
    (:func:`fedlt.run_parts.calibration_refusal`, :func:`fedlt.run_parts.loss_refusal`) at the
    methods' default knobs: what ``check_config`` accepts (runs) or refuses, with its reason."""
    from fedlt.calibration.calibrators import CALIBRATORS
    from fedlt.losses import LOSSES
    from fedlt.methods.registry import METHODS, parse_method_args
    from fedlt.run_parts import calibration_refusal, loss_refusal

    def cell(refusal: str | None) -> str:
        return "runs" if refusal is None else "refused: " + _cell(refusal.split(": ", 1)[1].split("; ")[0])

    lines = ["## Compatibility", "",
             "Which `calibration=NAME` and `loss.name=NAME` each `method=NAME` takes, from what every method "
             "declares about its model's head and losses and every calibration about the head it works on "
             "(at the methods' default `method_args`). A refused pair fails before any data are read, with one "
             "line that says what would work. See [Calibration](calibration.md) and each method's page for "
             "the reasons.", "",
             "### Method x calibration", "", "| method | " + " | ".join(CALIBRATORS) + " |",
             "|---|" + "---|" * len(CALIBRATORS)]
    for spec in METHODS.values():
        args = parse_method_args(spec, {})
        lines.append(f"| `{spec.name}` | " + " | ".join(cell(calibration_refusal(spec, args, name))
                                                      for name in CALIBRATORS) + " |")
    lines += ["", "### Method x loss", "", "| method | " + " | ".join(LOSSES) + " |", "|---|" + "---|" * len(LOSSES)]
    for spec in METHODS.values():
        own = "" if spec.uses_loss_config else " (its own objective)"
        lines.append(f"| `{spec.name}` | " + " | ".join(cell(loss_refusal(spec, loss)) + (own if loss == "ce" else "")
                                                      for loss in LOSSES) + " |")
    return [*lines, "", *model_dataset_matrix(), ""]


def model_dataset_matrix() -> list[str]:
    """Model x dataset from each model's declared input (:class:`fedlt.models.registry.ModelInput`)
    and each dataset's registry entry: at the dataset's own image size, and the smallest
    ``data.image_size`` where the dataset is resized."""
    from fedlt.data.registry import DATASETS
    from fedlt.models.registry import MODELS, input_refusal, model_input

    def cell(model: str, dataset: str) -> str:
        info, smallest = DATASETS[dataset], model_input(model).min_image_size
        refusal = input_refusal(model, dataset, info, smallest if info.resizable else None)
        if refusal is not None:
            return "refused: " + _cell(refusal.split(": ", 1)[1].split("; ")[0])
        return f"runs (data.image_size >= {smallest})" if info.resizable else "runs"

    lines = ["### Model x dataset", "",
             "Which `model.name` takes which `data.dataset`'s images, from what every model declares (the channel "
             "counts and smallest image side it works on) and every dataset's registry entry (channels, image side), "
             "so a pair is refused before any data are read. Datasets marked with a `data.image_size` bound are "
             "resized; a smaller size is refused for that model.", "",
             "| model | " + " | ".join(DATASETS) + " |", "|---|" + "---|" * len(DATASETS)]
    for model in MODELS:
        lines.append(f"| `{model}` | " + " | ".join(cell(model, dataset) for dataset in DATASETS) + " |")
    return lines


def render() -> str:
    from fedlt.calibration.calibrators import CalibrationArgs
    from fedlt.methods.registry import METHODS

    lines = [INTRO, "## Top level", "", *_table(Config, ""), ""]
    for name, field in Config.model_fields.items():
        if not is_model(field.annotation):
            continue
        section = field.annotation
        lines += [f"## `{name}`", ""]
        doc = (section.__doc__ or "").strip()
        if doc:
            lines += [doc.replace("``", "`"), ""]
        lines += [*_table(section, f"{name}."), ""]

    lines += ["## `method_args`: each method's knobs", "",
              "`method_args.KEY=VALUE`; a knob the chosen method does not have is an error that lists its knobs "
              "(`fedlt methods NAME` prints them too). Methods not listed here have no knobs.", ""]
    for spec in METHODS.values():
        if not spec.args.model_fields:
            continue
        lines += [f"### `{spec.name}`", "", _cell(spec.description), "", *_table(spec.args, "method_args."), ""]
    lines += ["## `calibration_args`", "",
              "Knobs of the classifier calibrations (`calibration=NAME`, and the methods that apply one: "
              "`creff`, `ccvr`, `fedncm`, `fed3r`, `taunorm`, `safs`, `sfd`); see [Calibration](calibration.md).",
              "", *_table(CalibrationArgs, "calibration_args."), ""]
    lines += compatibility_matrix()
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if argv:
        with open(argv[0], "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
