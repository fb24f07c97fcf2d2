"""Bring your own data: prompt datasets as single-turn tasks (``data:``), verifiers from your own module
or built in, an epoch-aware prompt sampler that resumes where it stopped, and held-out evaluation
(``eval:``: accuracy, mean reward, unbiased pass@k). The env is :class:`rollart.envs.dataset.DatasetEnv`;
the pipeline side is :mod:`rollart.pipelines.data_tasks`."""

from rollart.data.config import DataTask, EvalConfig, EvalEnv
from rollart.data.evaluation import EvalSet, Evaluator, pass_at_k, summarise
from rollart.data.prompts import PromptSet, load_prompts
from rollart.data.sampler import EpochSampler, RoundSeeds
from rollart.data.sources import DataError, load_rows
from rollart.data.verifiers import BUILTIN, resolve_verifier

__all__ = [
    "BUILTIN",
    "DataError",
    "DataTask",
    "EpochSampler",
    "EvalConfig",
    "EvalEnv",
    "EvalSet",
    "Evaluator",
    "PromptSet",
    "RoundSeeds",
    "load_prompts",
    "load_rows",
    "pass_at_k",
    "resolve_verifier",
    "summarise",
]
