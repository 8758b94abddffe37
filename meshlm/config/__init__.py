"""A run's settings: the sections (`meshlm.config.sections`, one dataclass per group of flags) and their
composition `TrainConfig` (`meshlm.config.run`), which every command parses its flags into.
The commands build their parsers from the sections (`meshlm.cli.flags`); Python users construct
`TrainConfig(...)` directly."""

from meshlm.config.run import ATTRIBUTES, TrainConfig, flag_fields
from meshlm.config.sections import (
                                    ATTENTION,
                                    DTYPES,
                                    LORA_TARGETS,
                                    PARAM_DTYPES,
                                    REMAT,
                                    SECTIONS,
                                    TRACKERS,
                                    BatchConfig,
                                    ChatDataConfig,
                                    CheckpointConfig,
                                    ClusterConfig,
                                    DataConfig,
                                    EvalConfig,
                                    LoggingConfig,
                                    LoraConfig,
                                    MeshConfig,
                                    ModelSection,
                                    OptimizerSection,
                                    PipelineConfig,
                                    PrecisionConfig,
                                    TrackingConfig,
                                    check_dtype,
                                    check_lora,
                                    check_positive,
                                    profile_range,
)

__all__ = ["ATTRIBUTES", "TrainConfig", "flag_fields", "ATTENTION", "DTYPES", "LORA_TARGETS", "PARAM_DTYPES", "REMAT",
           "SECTIONS", "TRACKERS", "BatchConfig", "ChatDataConfig", "CheckpointConfig", "ClusterConfig", "DataConfig",
           "EvalConfig", "LoggingConfig", "LoraConfig", "MeshConfig", "ModelSection", "OptimizerSection",
           "PipelineConfig", "PrecisionConfig", "TrackingConfig", "check_dtype", "check_lora", "check_positive",
           "profile_range"]
