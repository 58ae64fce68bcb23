"""megaroute: scale-out pretraining for routed transformers."""

__version__ = "0.1.0"
