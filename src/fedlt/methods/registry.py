"""Every method fedlt knows, by name: the built-ins below and the ``fedlt.methods`` entry points
of installed packages (:mod:`fedlt.plugins`)."""

from __future__ import annotations

from fedlt.calibration.calibrators import CALIBRATION_DESCRIPTIONS
from fedlt.errors import ConfigError
from fedlt.methods.base import MethodArgs, MethodSpec, Server, parse_args
from fedlt.methods.ditto import DittoArgs, DittoClient
from fedlt.methods.fedavg import FedAvgClient, FedAvgServer
from fedlt.methods.fedavgm import FedAvgMArgs, FedAvgMServer
from fedlt.methods.fedbabu import FEDBABU_HEAD, FedBABUArgs, FedBABUClient
from fedlt.methods.fedbn import FedBNArgs, FedBNClient, FedBNServer, keeps_batchnorm
from fedlt.methods.feddecorr import FedDecorrArgs, FedDecorrClient
from fedlt.methods.fedetf import FEDETF_HEAD, FedETFArgs, FedETFClient, FedETFServer, fedetf_model
from fedlt.methods.fedlc import FedLCArgs, FedLCClient
from fedlt.methods.fedloge import FEDLOGE_HEAD, FedLoGeArgs, FedLoGeClient, FedLoGeServer, fedloge_model
from fedlt.methods.fedper import FEDPER_HEAD, FedPerClient, FedPerServer
from fedlt.methods.fedprox import FedProxArgs, FedProxClient
from fedlt.methods.fedrep import FedRepArgs, FedRepClient, FedRepServer, fedrep_head
from fedlt.methods.fedrod import FedRoDClient
from fedlt.methods.fedyoyo import FedYoYoArgs, FedYoYoClient, FedYoYoServer
from fedlt.methods.gbme import GBME_LOSSES, GBMEArgs, GBMEClient, GBMEServer, gbme_head, make_gbme_model
from fedlt.methods.scaffold import ScaffoldClient, ScaffoldServer
from fedlt.methods.sfd import SFDArgs, SFDClient, SFDServer, make_sfd_model
from fedlt.models import FedModel
from fedlt.plugins import PluginRegistry


def method_from_plugin(name: str, loaded: object) -> MethodSpec:
    """What a ``fedlt.methods`` entry point loads: a MethodSpec, or a callable returning one."""
    if isinstance(loaded, MethodSpec):
        spec = loaded
    elif callable(loaded):
        try:
            spec = loaded()
        except Exception as err:
            reason = (str(err).strip().splitlines() or [""])[0]
            raise ValueError(f"raised {type(err).__name__} when called ({reason}); make it return a MethodSpec "
                             "without arguments, or point the entry point at the MethodSpec itself") from None
    else:
        raise TypeError(f"loads an object of type {type(loaded).__name__}, not a MethodSpec or a callable returning one; "
                        "point the entry point at the method's MethodSpec")
    if not isinstance(spec, MethodSpec):
        raise TypeError(f"returned an object of type {type(spec).__name__}, not a MethodSpec; make it return the method's MethodSpec")
    if spec.name != name:
        raise ValueError(f"loads the method named '{spec.name}'; name the entry point '{spec.name}'")
    return spec


def always(args: MethodArgs, model: FedModel) -> bool:
    """``MethodSpec.keeps_state`` of a method whose clients keep state between rounds whatever its knobs."""
    return True


METHODS: PluginRegistry[MethodSpec] = PluginRegistry("fedlt.methods", "method", {
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
                   make_model=fedloge_model, uses_loss_config=False, head=lambda args: FEDLOGE_HEAD,
                   keeps_state=always),
        MethodSpec("fedrod", "FedRoD: generic head with balanced softmax + personal head on its logits",
                   Server, FedRoDClient, uses_loss_config=False, keeps_state=always),
        MethodSpec("fedbabu", "FedBABU: body trained under a frozen random head; personalized by fine-tuning "
                   "(method_args.finetune_epochs)", Server, FedBABUClient, FedBABUArgs, uses_loss_config=False,
                   head=lambda args: FEDBABU_HEAD),
        MethodSpec("fedetf", "FedETF: projection + fixed simplex-ETF classifier with learnable temperature, "
                   "balanced softmax; local ETF/projection adaptation", FedETFServer, FedETFClient, FedETFArgs,
                   make_model=fedetf_model, uses_loss_config=False, head=lambda args: FEDETF_HEAD),
        MethodSpec("fedrep", "FedRep: shared body, personal heads fitted first each round (method_args.head_epochs)",
                   FedRepServer, FedRepClient, FedRepArgs, uses_loss_config=False, head=fedrep_head,
                   keeps_state=always),
        MethodSpec("fedper", "FedPer: shared body, personal heads; no global model",
                   FedPerServer, FedPerClient, uses_loss_config=False, head=lambda args: FEDPER_HEAD,
                   keeps_state=always),
        MethodSpec("ditto", "Ditto: FedAvg + personal models pulled towards it (method_args.mu)",
                   Server, DittoClient, DittoArgs, uses_loss_config=False, keeps_state=always),
        MethodSpec("fedbn", "FedBN: FedAvg with BatchNorm kept local (method_args.global_bn)",
                   FedBNServer, FedBNClient, FedBNArgs, uses_loss_config=False, keeps_state=keeps_batchnorm),
        MethodSpec("gbme", "GBME: gradient-proxy (GPI) prior + multi-expert ensemble; GBME-p with "
                   "method_args.dp_epsilon (loss.name: bsm, la, ldam)",
                   GBMEServer, GBMEClient, GBMEArgs, make_model=make_gbme_model, losses=GBME_LOSSES,
                   losses_why="the losses that take its GPI as the class prior", head=gbme_head,
                   prior_knob="prior"),
        MethodSpec("scaffold", "SCAFFOLD: local steps corrected by client/server control variates",
                   ScaffoldServer, ScaffoldClient, keeps_state=always),
        MethodSpec("fedavgm", "FedAvgM: FedAvg + server momentum (method_args.beta, default 0.9)",
                   FedAvgMServer, FedAvgClient, FedAvgMArgs),
        *(MethodSpec(name, f"FedAvg + {desc}", FedAvgServer, FedAvgClient, calibration=(name,))
          for name, desc in CALIBRATION_DESCRIPTIONS.items() if name != "oracle"),
        MethodSpec("sfd", "SFD: ABBL local training (A-CE + annealed A-SCL on a projector) + SAFS calibration",
                   SFDServer, SFDClient, SFDArgs, make_model=make_sfd_model, uses_loss_config=False,
                   calibration=("safs",)),
        MethodSpec("fedlc", "FedLC: CE on logits - tau * n_{k,y}^(-1/4) of the client's counts (method_args.tau, default 1)",
                   FedAvgServer, FedLCClient, FedLCArgs, uses_loss_config=False),
        MethodSpec("feddecorr", "FedDecorr: configured loss + beta x the batch features' decorrelation term (beta 0.1, on "
                   "the released code's scale)",
                   FedAvgServer, FedDecorrClient, FedDecorrArgs),
        MethodSpec("fedyoyo", "FedYoYo: weak/strong views, self-distillation (ASD) + estimated-prior logit adjustment (DLA)",
                   FedYoYoServer, FedYoYoClient, FedYoYoArgs, uses_loss_config=False,
                   keeps_state=lambda args, model: args.dla and args.prior_source == "estimated"),
    ]
}, method_from_plugin)


def get_method(name: str) -> MethodSpec:
    if name not in METHODS:
        raise ConfigError(f"unknown method '{name}'; use method=<one of {', '.join(METHODS)}> (see `fedlt methods`)")
    return METHODS[name]


def parse_method_args(spec: MethodSpec, raw: dict) -> MethodArgs:
    """Validate ``method_args`` against the method's own knobs."""
    return parse_args(spec.args, raw, "method_args", f"method {spec.name}")


def list_methods() -> list[tuple[str, str]]:
    """(name, description) of every method; a plug-in's description names its distribution."""
    return [(name, spec.description + (f" [plug-in: {origin}]" if (origin := METHODS.origin(name)) else ""))
            for name, spec in METHODS.items()]
