"""megaroute: scale-out pretraining for routed transformers."""

# Registers the routing methods (megaroute.model.routing) in the registry config validation reads
# (megaroute.config.schema.ROUTING_METHODS), whichever megaroute module a program imports first:
# the config package cannot import them itself, as the model imports it.
from .model import routing as _routing  # noqa: F401

__version__ = "0.1.0"
