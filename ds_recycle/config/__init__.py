"""The `"recycle"` section of a DeepSpeed JSON config, parsed once into frozen, typed dataclasses."""
from ds_recycle.config.errors import ConfigError
from ds_recycle.config.schema import (
    DataConfig,
    FailSlowConfig,
    FaultConfig,
    GPTConfig,
    RecycleConfig,
    TrainConfig,
    load_config,
)

__all__ = ["ConfigError", "DataConfig", "FailSlowConfig", "FaultConfig", "GPTConfig", "RecycleConfig", "TrainConfig", "load_config"]
