"""Every method fedlt knows, by name."""

from __future__ import annotations

from pydantic import ValidationError

from fedlt.errors import ConfigError
from fedlt.methods.base import MethodArgs, MethodSpec
from fedlt.methods.calibrators import CALIBRATION_DESCRIPTIONS
from fedlt.methods.fedavg import FedAvgClient, FedAvgServer
from fedlt.methods.fedprox import FedProxArgs, FedProxClient

METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in [
        MethodSpec("fedavg", "FedAvg with the configured local loss (loss.name: ce, la, bsm, focal, ldam)",
                   FedAvgServer, FedAvgClient),
        MethodSpec("fedprox", "FedProx: FedAvg + proximal term (method_args.mu, default 0.01)",
                   FedAvgServer, FedProxClient, FedProxArgs),
        MethodSpec("centralized", "oracle: the same model and loss trained on the pooled data (not federated)",
                   FedAvgServer, FedAvgClient, pooled=True),
        *(MethodSpec(name, f"FedAvg + {desc}", FedAvgServer, FedAvgClient, calibration=(name,))
          for name, desc in CALIBRATION_DESCRIPTIONS.items() if name != "oracle"),
    ]
}


def get_method(name: str) -> MethodSpec:
    if name not in METHODS:
        raise ConfigError(f"unknown method '{name}'; use method=<one of {', '.join(METHODS)}> (see `fedlt methods`)")
    return METHODS[name]


def parse_method_args(spec: MethodSpec, raw: dict) -> MethodArgs:
    """Validate ``method_args`` against the method's own knobs, as one-line ConfigErrors."""
    try:
        return spec.args.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            valid = ", ".join(spec.args.model_fields) or "none"
            raise ConfigError(f"method {spec.name} has no knob method_args.{key}; its knobs: {valid}") from None
        raise ConfigError(f"invalid method_args.{key} for {spec.name}: {first['msg'].removeprefix('Value error, ')}") from None


def list_methods() -> list[tuple[str, str]]:
    return [(spec.name, spec.description) for spec in METHODS.values()]
