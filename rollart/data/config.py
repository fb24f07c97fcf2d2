"""The ``data:`` and ``eval:`` sections of a pipeline config (validated shapes only; files, columns and
verifiers are checked by :func:`rollart.data.tasks.check_config` when the config is loaded).

``data:`` is one task or a list of tasks; each task is a prompt dataset with its own tag, verifier and
number of env groups::

    data:
      - {train: arith.jsonl, val: arith_val.jsonl, tag: arith, verifier: my_rewards:score, groups: 4}
      - {train: words.parquet, tag: words, prompt_key: question, answer_key: solution, groups: 4}
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from rollart.config_model import ConfigModel


class DataTask(ConfigModel):
    """One task trained from a prompt dataset: a JSONL file, a Parquet file or a folder written by
    ``datasets.Dataset.save_to_disk`` (a ``DatasetDict`` folder: its ``train`` split for ``train`` and
    its ``validation`` or ``test`` split for ``val``). Relative paths are relative to the config file."""

    train: str = Field(min_length=1)
    """The training prompts: a JSONL or Parquet file or a `save_to_disk` folder, relative to the config file."""
    val: str | None = None
    """Held-out prompts, the default eval set of this task."""
    prompt_key: str = "prompt"
    """The column holding the prompt."""
    answer_key: str = "answer"
    """The column holding the answer (passed to the verifier)."""
    system_prompt: str | None = None
    """Text put before every prompt, followed by a newline."""
    tag: str | None = None
    """Routing tag and metrics key; default: the train file's name without its suffix."""
    verifier: str | None = None
    """Scores a completion: `MODULE:FUNC`, `FILE.py:FUNC` or a built-in name (`exact_match`, `number`,
    `contains`, `reverse`, `addition`, `countdown`); default `exact_match`.
    """
    inline_verifier: bool | None = None
    """Score answers on the rollout's event loop instead of in a worker thread: no thread hop per answer,
    for a quick pure-Python verifier. One that blocks, sleeps or may hang stalls the whole rollout (no
    timeout can stop it): leave those false. Default: true for the built-in verifiers, false for yours.
    """
    groups: int = Field(default=1, ge=1)
    """Env groups playing this task (they count toward `rollout.num_env_groups`)."""
    max_new_tokens: int | None = Field(default=None, ge=1)
    """Tokens per answer at most; default: `sampling.max_new_tokens`."""

    @property
    def name(self) -> str:
        """The task's tag: ``tag`` or the train file's stem."""
        if self.tag:
            return self.tag
        stem = self.train.rstrip("/").rsplit("/", 1)[-1]
        for suffix in (".jsonl", ".json", ".parquet"):
            stem = stem.removesuffix(suffix)
        return stem


class EvalEnv(ConfigModel):
    """A procedural env to evaluate on (``envs`` registry name), on held-out reset seeds."""

    name: str = Field(min_length=1)
    """The env to evaluate on (a registry name or `MODULE:CLASS`)."""
    tag: str | None = None
    """Metrics key of this eval set; default: the env's tag."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Arguments of the env's constructor."""
    max_steps: int | None = Field(default=None, ge=1)
    """Turns per episode; default: the env's own."""
    max_new_tokens: int | None = Field(default=None, ge=1)
    """Tokens per turn at most; default: the env's own, else `sampling.max_new_tokens`."""
    seed: int = 1_000_000_007
    """First reset seed of the eval episodes (far from the training seeds)."""


class EvalConfig(ConfigModel):
    """Held-out evaluation with the current policy, through the same inference workers, every ``every``
    steps and after the last step. The eval sets: ``data`` (a file read with the keys and verifier of
    the only data task), ``env`` (a procedural env), else the ``val`` split of every data task."""

    every: int = Field(default=10, ge=1)
    """Evaluate every this many steps (and after the last step)."""
    data: str | None = None
    """An eval file read with the keys and verifier of the only data task; default: the `val` of every data task."""
    env: EvalEnv | None = None
    """Evaluate on a procedural env on held-out seeds instead."""
    samples_per_prompt: int = Field(default=4, ge=1)
    """Samples drawn per eval prompt."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature of the eval."""
    max_prompts: int | None = Field(default=64, ge=1)
    """Prompts per eval set at most; null: all of it."""
    pass_k: list[int] | None = None
    """The k of every pass@k reported; default `[1, samples_per_prompt]`."""
    success_threshold: float = 1.0
    """A sample with a reward at least this counts as correct (for `accuracy` and pass@k)."""
    concurrency: int = Field(default=64, ge=1)
    """Eval episodes in flight at once."""

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        for k in self.ks:
            if not 1 <= k <= self.samples_per_prompt:
                raise ValueError(
                    f"eval.pass_k: {k} needs 1 <= k <= samples_per_prompt={self.samples_per_prompt}; "
                    "raise samples_per_prompt or drop it"
                )
        return self

    @property
    def ks(self) -> list[int]:
        """The k of every pass@k reported."""
        return sorted(set(self.pass_k if self.pass_k is not None else [1, self.samples_per_prompt]))
