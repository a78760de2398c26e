"""Every method fedlt knows, by name."""

from __future__ import annotations

from fedlt.errors import ConfigError
from fedlt.methods.base import MethodArgs, MethodSpec, parse_args
from fedlt.methods.calibrators import CALIBRATION_DESCRIPTIONS
from fedlt.methods.fedavg import FedAvgClient, FedAvgServer
from fedlt.methods.fedloge import FedLoGeArgs, FedLoGeClient, FedLoGeServer, fedloge_model
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
        MethodSpec("fedloge", "FedLoGe: backbone through a frozen sparse ETF (SSE-C), global head with GA-FR, "
                   "personal heads with LA-FR", FedLoGeServer, FedLoGeClient, FedLoGeArgs,
                   make_model=fedloge_model, uses_loss_config=False),
        *(MethodSpec(name, f"FedAvg + {desc}", FedAvgServer, FedAvgClient, calibration=(name,))
          for name, desc in CALIBRATION_DESCRIPTIONS.items() if name != "oracle"),
    ]
}


def get_method(name: str) -> MethodSpec:
    if name not in METHODS:
        raise ConfigError(f"unknown method '{name}'; use method=<one of {', '.join(METHODS)}> (see `fedlt methods`)")
    return METHODS[name]


def parse_method_args(spec: MethodSpec, raw: dict) -> MethodArgs:
    """Validate ``method_args`` against the method's own knobs."""
    return parse_args(spec.args, raw, "method_args", f"method {spec.name}")


def list_methods() -> list[tuple[str, str]]:
    return [(spec.name, spec.description) for spec in METHODS.values()]
