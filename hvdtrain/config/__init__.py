"""The typed, validated run configuration: `schema` and `components` (one dataclass per section, a
docstring per field), `coercion` (raw values to typed fields), `loading` (YAML, --set, `hvdtrain
config`) and `fit_settings` (fit's settings, each declared once: flag and keyword, key, help).
Imports nothing of hvdtrain but `errors`; everything else may import it.
"""

from hvdtrain.config.components import DataConfig, ModelConfig, OptimConfig, TaskConfig
from hvdtrain.config.fit_settings import FIT, FIT_SETTINGS, FitSetting, not_a_choice, settings_config
from hvdtrain.config.loading import default_part, describe, load_config, parse_assignment, saved_run_overrides
from hvdtrain.config.schema import Config, RunConfig, TrainConfig

__all__ = ["Config", "DataConfig", "ModelConfig", "OptimConfig", "RunConfig", "TaskConfig", "TrainConfig",
           "FIT", "FIT_SETTINGS", "FitSetting", "default_part", "describe", "load_config", "not_a_choice", "parse_assignment",
           "saved_run_overrides", "settings_config"]
