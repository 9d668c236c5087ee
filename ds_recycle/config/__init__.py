"""The `"recycle"` section of a DeepSpeed JSON config, parsed once into frozen, typed dataclasses."""
from ds_recycle.config.errors import ConfigError
from ds_recycle.config.schema import DataConfig, FaultConfig, GPTConfig, RecycleConfig, TrainConfig, load_config

__all__ = ["ConfigError", "DataConfig", "FaultConfig", "GPTConfig", "RecycleConfig", "TrainConfig", "load_config"]
