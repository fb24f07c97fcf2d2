"""Pipeline configuration: the YAML a user writes, validated before anything starts.

Errors name the field and the fix, e.g. ``rollout.batch_groups: ...``. Resource pools are the same
dicts ``ResourceManager`` takes.

The package composes: :class:`PipelineConfig` (``pipeline.py``) is made of sections, most of them owned by
the package they configure (``rollout.config``, ``training.config``, ``serving.config``, ...; the rest in
``sections.py``); the checks that relate several sections live in ``checks.py`` and ``colocation.py``;
reading a file, ``--set`` overrides and the one error listing every problem in ``loading.py``.
"""

from __future__ import annotations

from rollart.config.checks import (
    cross_field_problems,
    elastic_problems,
    model_problems,
    packing_problems,
    sharding_problems,
)
from rollart.config.colocation import colocated_pools, colocation_problems
from rollart.config.errors import ConfigError
from rollart.config.loading import (
    _problem,
    load_config,
    parse_sets,
    read_yaml,
    resolve_config_path,
    set_dotted,
    shipped_configs,
    validate_config,
    yaml_error_line,
)
from rollart.config.pipeline import PipelineConfig, task_problems, task_tags
from rollart.config.sections import (
    ClusterConfig,
    EnvEntry,
    ExportConfig,
    RewardConfig,
    StopAtConfig,
    TaskConfig,
    TaskSampling,
    TracesConfig,
    TrackerName,
    WeightsConfig,
)

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "EnvEntry",
    "ExportConfig",
    "PipelineConfig",
    "RewardConfig",
    "StopAtConfig",
    "TaskConfig",
    "TaskSampling",
    "TracesConfig",
    "TrackerName",
    "WeightsConfig",
    "_problem",
    "colocated_pools",
    "colocation_problems",
    "cross_field_problems",
    "elastic_problems",
    "load_config",
    "model_problems",
    "packing_problems",
    "parse_sets",
    "read_yaml",
    "resolve_config_path",
    "set_dotted",
    "sharding_problems",
    "shipped_configs",
    "task_problems",
    "task_tags",
    "validate_config",
    "yaml_error_line",
]
