"""The pipeline's side of dataset tasks: their env groups (seeded through :class:`RoundSeeds`, so a
round's seed names its prompt), their samplers' checkpoint state, and the evaluator."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rollart.data.config import DataTask, EvalConfig
from rollart.data.env import DatasetEnv, PromptSet
from rollart.data.evaluation import Evaluator
from rollart.data.sampler import EpochSampler, RoundSeeds
from rollart.data.tasks import eval_sets, load_prompts
from rollart.engines.base import SamplingParams

ManagerFn = Callable[..., Any]  # (env, sampling=...) -> EnvManager


class DataTasks:
    """Loads every ``data:`` task; :meth:`groups` builds their env groups, numbered from ``first_group``."""

    def __init__(self, tasks: list[DataTask], seeds: RoundSeeds, *, run_seed: int, max_new_tokens: int):
        self.tasks, self.seeds, self.max_new_tokens = tasks, seeds, max_new_tokens
        self.prompts: list[PromptSet] = [load_prompts(t, f"data[{i}]") for i, t in enumerate(tasks)]
        self.samplers = {p.tag: EpochSampler(len(p), run_seed) for p in self.prompts}

    def groups(self, manager_fn: ManagerFn, group_size: int, first_group: int) -> list[list[Any]]:
        out: list[list[Any]] = []
        for task, prompts in zip(self.tasks, self.prompts):
            sampler = self.samplers[prompts.tag]
            for k in range(task.groups):
                g = first_group + len(out)
                position_of = self._position_fn(g, k, task.groups)
                tokens = task.max_new_tokens or self.max_new_tokens
                out.append(
                    [
                        manager_fn(DatasetEnv(prompts, sampler, position_of=position_of, max_new_tokens=tokens))
                        for _ in range(group_size)
                    ]
                )
        return out

    def _position_fn(self, g: int, k: int, num_groups: int) -> Callable[[int], int]:
        """Round ``r`` of the task's ``k``-th group (env group ``g``) plays position ``r * num_groups + k``."""
        return lambda seed: self.seeds.round(g, seed) * num_groups + k

    def state_dict(self) -> dict[str, Any]:
        return {tag: s.state_dict() for tag, s in self.samplers.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for tag, sampler in self.samplers.items():
            if tag not in state:
                raise ValueError(
                    f"--resume: the checkpoint has no sampler of data task {tag!r} (it has {sorted(state)}); "
                    "resume with the data: tasks it was written with"
                )
            sampler.load_state_dict(state[tag], what=f"data task {tag!r}")

    def metrics(self) -> dict[str, float]:
        """Epochs started per task (fractional)."""
        return {tag: s.epoch for tag, s in self.samplers.items()}


def build_evaluator(
    cfg: EvalConfig | None, tasks: list[DataTask], manager_fn: ManagerFn, sampling: SamplingParams
) -> Evaluator | None:
    if cfg is None:
        return None
    sets = eval_sets(tasks, cfg, max_new_tokens=sampling.max_new_tokens)
    return Evaluator(cfg, sets, lambda env, s: manager_fn(env, sampling=s), sampling)
