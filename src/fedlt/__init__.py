"""fedlt: federated learning on long-tailed data."""

from fedlt._version import __version__
from fedlt.api import resume, run
from fedlt.config import Config, load_config

__all__ = ["Config", "load_config", "resume", "run", "__version__"]
