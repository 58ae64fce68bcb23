"""Config system: typed sections, strict YAML loading, dotted overrides."""

from .loader import (
    apply_overrides,
    config_from_dict,
    config_hash,
    flatten,
    load_config,
    load_raw,
    save_config,
    to_dict,
    to_yaml,
)
from .schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DepthGateConfig,
    EarlyExitConfig,
    HaltingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RoutingConfig,
    TokenizerConfig,
    TrackingConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DepthGateConfig", "EarlyExitConfig", "HaltingConfig",
    "ModelConfig", "OptimConfig",
    "ParallelConfig", "RoutingConfig", "TokenizerConfig", "TrackingConfig", "TrainConfig",
    "apply_overrides", "config_from_dict", "config_hash", "flatten", "load_config", "load_raw",
    "save_config", "to_dict", "to_yaml",
]
