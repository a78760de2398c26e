"""fedlt: federated learning on long-tailed data."""

from fedlt.api import resume, run
from fedlt.config import Config, load_config

__version__ = "0.1.0"
__all__ = ["Config", "load_config", "resume", "run", "__version__"]
