"""Every method fedlt knows, by name."""

from __future__ import annotations

from fedlt.errors import ConfigError
from fedlt.methods.base import MethodArgs, MethodSpec, parse_args
from fedlt.methods.calibrators import CALIBRATION_DESCRIPTIONS
from fedlt.methods.fedavg import FedAvgClient, FedAvgServer
from fedlt.methods.fedavgm import FedAvgMArgs, FedAvgMServer
from fedlt.methods.fedprox import FedProxArgs, FedProxClient
from fedlt.methods.gbme import GBMEArgs, GBMEClient, GBMEServer, make_gbme_model
from fedlt.methods.scaffold import ScaffoldClient, ScaffoldServer

METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in [
        MethodSpec("fedavg", "FedAvg with the configured local loss (loss.name: ce, la, bsm, focal, ldam)",
                   FedAvgServer, FedAvgClient),
        MethodSpec("fedprox", "FedProx: FedAvg + proximal term (method_args.mu, default 0.01)",
                   FedAvgServer, FedProxClient, FedProxArgs),
        MethodSpec("centralized", "oracle: the same model and loss trained on the pooled data (not federated)",
                   FedAvgServer, FedAvgClient, pooled=True),
        MethodSpec("gbme", "GBME: gradient-proxy (GPI) prior + multi-expert ensemble; GBME-p with "
                   "method_args.dp_epsilon (loss.name: bsm, la, ldam)",
                   GBMEServer, GBMEClient, GBMEArgs, make_model=make_gbme_model),
        MethodSpec("scaffold", "SCAFFOLD: local steps corrected by client/server control variates",
                   ScaffoldServer, ScaffoldClient),
        MethodSpec("fedavgm", "FedAvgM: FedAvg + server momentum (method_args.beta, default 0.9)",
                   FedAvgMServer, FedAvgClient, FedAvgMArgs),
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
