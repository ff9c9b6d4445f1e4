"""Typed run configuration: the one place where every knob and its default lives.

- ``schema.py``: every section as a dataclass, each field with its default and a one-line
  description; ``slurm.py`` the ``slurm:`` section and the GPU layout it must give.
- ``load.py``: defaults <- a YAML file <- ``key=value`` overrides, then the checks.
- ``checks.py``: every value in range, settings that cannot be right together, the
  config against the files and model it names (``model_shape.py``).
- ``files.py``: where config files are found (a path, or ``configs/``).

The GPU memory check needs the number of trainer ranks and is ``memory.py``'s. This
package imports nothing of the rest of hpc_asyncppo but ``tools/base.py`` (the tool
config it validates); callers import from here.
"""

from hpc_asyncppo.config.checks import (
    _CHOICES,
    RESUME_FIXED,
    VLLM_HEAD_DIMS,
    check_resume_compatible,
    config_warnings,
    validate,
)
from hpc_asyncppo.config.files import CONFIG_DIR, resolve_config_path, tool_config_file
from hpc_asyncppo.config.load import load_config, load_resolved, to_yaml, valid_keys
from hpc_asyncppo.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    AsyncTrainingConfig,
    BufferConfig,
    CheckpointConfig,
    Config,
    ConfigError,
    CriticConfig,
    DataConfig,
    FilterGroupsConfig,
    GatewayConfig,
    ModelConfig,
    MultiTurnConfig,
    OverlongBufferConfig,
    PolicyLossConfig,
    RewardConfig,
    RolloutConfig,
    TimeoutConfig,
    TinyModelConfig,
    TrainerConfig,
    lora_targets,
)
from hpc_asyncppo.config.slurm import ComponentConfig, SlurmConfig

__all__ = [
    "_CHOICES",
    "CONFIG_DIR",
    "RESUME_FIXED",
    "VLLM_HEAD_DIMS",
    "ActorConfig",
    "AlgorithmConfig",
    "AsyncTrainingConfig",
    "BufferConfig",
    "CheckpointConfig",
    "ComponentConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "FilterGroupsConfig",
    "GatewayConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OverlongBufferConfig",
    "PolicyLossConfig",
    "RewardConfig",
    "RolloutConfig",
    "SlurmConfig",
    "TimeoutConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "check_resume_compatible",
    "config_warnings",
    "load_config",
    "load_resolved",
    "lora_targets",
    "resolve_config_path",
    "to_yaml",
    "tool_config_file",
    "valid_keys",
    "validate",
]
