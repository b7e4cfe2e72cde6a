from slime_rl.config.groups import (
    AlgoConfig,
    BatchConfig,
    CheckpointConfig,
    Config,
    CriticConfig,
    DataConfig,
    DebugConfig,
    EngineConfig,
    EvalConfig,
    FaultConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    WeightSyncConfig,
)
from slime_rl.config.load import ConfigError, build_config, parse_flags

__all__ = [
    "AlgoConfig", "BatchConfig", "CheckpointConfig", "Config", "ConfigError", "CriticConfig", "DataConfig",
    "DebugConfig", "EngineConfig", "EvalConfig", "FaultConfig", "LoggingConfig", "ModelConfig", "OptimizerConfig",
    "ParallelConfig", "RewardConfig", "RolloutConfig", "TrainerConfig", "WeightSyncConfig", "build_config",
    "parse_flags",
]
