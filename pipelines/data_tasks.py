"""The pipeline's side of dataset tasks (``data:``) and evaluation (``eval:``): their env groups, seeded
through :class:`~rollart.data.sampler.RoundSeeds` so a round's seed names its prompt, their samplers'
checkpoint state, and the eval sets."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rollart.data.config import DataTask, EvalConfig
from rollart.data.evaluation import EvalSet
from rollart.data.prompts import PromptSet, eval_prompts, load_prompts
from rollart.data.sampler import EpochSampler, RoundSeeds
from rollart.envs import EnvSpec, make_env
from rollart.envs.dataset import DatasetEnv

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
            tokens = task.max_new_tokens or self.max_new_tokens
            for k in range(task.groups):
                position_of = self._position_fn(first_group + len(out), k, task.groups)
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


def eval_sets(data: list[DataTask], cfg: EvalConfig, *, max_new_tokens: int) -> list[EvalSet]:
    """The sets ``cfg`` evaluates (see :class:`~rollart.data.config.EvalConfig`), at most ``max_prompts``
    prompts each. An unknown ``eval.env`` name raises ``ValueError`` naming the field."""
    out: list[EvalSet] = []
    from_file = eval_prompts(data, cfg)
    if from_file is not None:
        out.append(_dataset_set(*from_file, cfg, max_new_tokens))
    if cfg.env is not None:
        e = cfg.env
        spec = EnvSpec(name=e.name, tag=e.tag, kwargs=e.kwargs, max_steps=e.max_steps, max_new_tokens=e.max_new_tokens)
        try:
            probe = make_env(spec)
        except (ValueError, TypeError) as err:
            raise ValueError(f"eval.env: {str(err).removeprefix('env: ')}") from None
        out.append(EvalSet(str(probe.tag), lambda: make_env(spec), [e.seed + i for i in range(cfg.max_prompts or 64)]))
        probe.close()
    if cfg.data is None and cfg.env is None:
        for i, task in enumerate(data):
            if task.val is not None:
                out.append(_dataset_set(load_prompts(task, f"data[{i}]", split="val"), task, cfg, max_new_tokens))
    return out


def _dataset_set(prompts: PromptSet, task: DataTask, cfg: EvalConfig, max_new_tokens: int) -> EvalSet:
    n = len(prompts) if cfg.max_prompts is None else min(cfg.max_prompts, len(prompts))
    sampler = EpochSampler(len(prompts), shuffle=False)  # eval prompt i is row i
    tokens = task.max_new_tokens or max_new_tokens
    return EvalSet(prompts.tag, lambda: DatasetEnv(prompts, sampler, max_new_tokens=tokens), list(range(n)))
