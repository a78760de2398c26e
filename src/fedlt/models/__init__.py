"""Models: every one is a :class:`FedModel` (encoder + head), built by name via :func:`create_model`."""

from fedlt.models.base import FedModel
from fedlt.models.registry import MODELS, create_model, list_models

__all__ = ["MODELS", "FedModel", "create_model", "list_models"]
