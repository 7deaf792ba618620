"""The typed, validated run configuration: `schema` (one dataclass per section, a docstring per
field), `coercion` (raw values to typed fields) and `loading` (YAML, --set, `hvdtrain config`).
Imports nothing of hvdtrain but `errors`; everything else may import it.
"""

from hvdtrain.config.loading import (FIT_SETTINGS, default_part, describe, load_config, parse_assignment,
                                     saved_run_overrides, settings_config)
from hvdtrain.config.schema import (Config, DataConfig, ModelConfig, OptimConfig, RunConfig, TaskConfig,
                                    TrainConfig)

__all__ = ["Config", "DataConfig", "ModelConfig", "OptimConfig", "RunConfig", "TaskConfig", "TrainConfig",
           "FIT_SETTINGS", "default_part", "describe", "load_config", "parse_assignment", "saved_run_overrides",
           "settings_config"]
