"""From the ``data:`` / ``eval:`` config sections to loaded prompt sets, verifiers and eval sets; and the
config-load check that reports a missing file, column, module or function before any actor starts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollart.data.config import DataTask, EvalConfig
from rollart.data.env import DatasetEnv, PromptSet
from rollart.data.sampler import EpochSampler
from rollart.data.sources import DataError, check_columns, load_rows
from rollart.data.verifiers import add_import_dir, required_columns, resolve_verifier
from rollart.envs.base import TextEnv

VAL_SPLITS = ("validation", "test", "val")


def load_prompts(task: DataTask, field: str, split: str = "train", path: str | None = None) -> PromptSet:
    """The ``train`` or ``val`` prompts of ``task``, ``field`` being ``data[i]``; or, with ``path``, the
    file of the config field ``split`` (``eval.data``) read with ``task``'s keys and verifier."""
    where = path if path is not None else (task.train if split == "train" else task.val)
    assert where is not None
    path_field = split if path is not None else f"{field}.{split}"
    rows = load_rows(where, field=path_field, splits=("train",) if split == "train" else VAL_SPLITS)
    check_columns(rows, field, where, prompt_key=task.prompt_key, answer_key=task.answer_key)
    verifier = resolve_verifier(task.verifier, field=f"{field}.verifier")
    missing = [c for c in required_columns(verifier) if c not in rows.column_names or c == task.answer_key]
    if missing:
        raise DataError(
            f"{field}.verifier: {task.verifier} needs the arguments {missing}, which are not columns of {where} "
            f"(columns: {rows.column_names}); give them defaults or take **row"
        )
    return PromptSet(
        rows,
        tag=task.name,
        verifier=verifier,
        prompt_key=task.prompt_key,
        answer_key=task.answer_key,
        system_prompt=task.system_prompt,
        source=str(where),
    )


@dataclass
class EvalSet:
    """One held-out set: a fresh env per episode, the reset seeds of its prompts."""

    tag: str
    make_env: Callable[[], TextEnv]
    seeds: list[int]


def eval_sets(data: list[DataTask], cfg: EvalConfig, *, max_new_tokens: int) -> list[EvalSet]:
    """The sets ``cfg`` evaluates (see :class:`EvalConfig`), prompts limited to ``max_prompts``."""
    out: list[EvalSet] = []
    if cfg.data is not None:
        task = data[0] if data else DataTask(train=cfg.data)
        prompts = load_prompts(task, "data[0]" if data else "eval", split="eval.data", path=cfg.data)
        out.append(_dataset_set(prompts, task, cfg, max_new_tokens))
    if cfg.env is not None:
        from rollart.envs import EnvSpec, make_env

        e = cfg.env
        spec = EnvSpec(name=e.name, tag=e.tag, kwargs=e.kwargs, max_steps=e.max_steps, max_new_tokens=e.max_new_tokens)
        probe = make_env(spec)
        n = cfg.max_prompts or 64
        out.append(EvalSet(str(probe.tag), lambda: make_env(spec), [e.seed + i for i in range(n)]))
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


def resolve_paths(data: list[DataTask], eval_cfg: EvalConfig | None, base_dir: Path) -> tuple[list[DataTask], Any]:
    """Relative data paths (and ``FILE.py:FUNC`` verifiers) resolved against the config file's folder,
    which also becomes importable (``MODULE:FUNC`` verifiers next to the config)."""
    add_import_dir(base_dir)

    def absolute(p: str | None) -> str | None:
        return None if p is None or Path(p).is_absolute() else str((base_dir / p).resolve())

    tasks = []
    for t in data:
        update: dict[str, Any] = {"train": absolute(t.train) or t.train, "tag": t.name}
        if t.val is not None:
            update["val"] = absolute(t.val) or t.val
        if t.verifier and ":" in t.verifier and t.verifier.rsplit(":", 1)[0].endswith(".py"):
            file, func = t.verifier.rsplit(":", 1)
            update["verifier"] = f"{absolute(file) or file}:{func}"
        tasks.append(t.model_copy(update=update))
    if eval_cfg is not None and eval_cfg.data is not None:
        eval_cfg = eval_cfg.model_copy(update={"data": absolute(eval_cfg.data) or eval_cfg.data})
    return tasks, eval_cfg


def check_config(data: list[DataTask], eval_cfg: EvalConfig | None, *, max_new_tokens: int = 32) -> None:
    """Load every dataset and verifier once: a :class:`DataError` naming the field on the first problem."""
    seen: dict[str, int] = {}
    for i, task in enumerate(data):
        if task.name in seen:
            raise DataError(
                f"data[{i}].tag: {task.name!r} is the tag of data[{seen[task.name]}] too; give each task its own tag"
            )
        seen[task.name] = i
        load_prompts(task, f"data[{i}]")
        if task.val is not None:
            load_prompts(task, f"data[{i}]", split="val")
    if eval_cfg is None:
        return
    if eval_cfg.data is not None and len(data) > 1:
        raise DataError(
            "eval.data: with several data tasks, whose keys and verifier apply is ambiguous; "
            "give each task a val: file instead"
        )
    if eval_cfg.data is None and eval_cfg.env is None and not any(t.val for t in data):
        raise DataError("eval: nothing to evaluate; set eval.data: PATH, eval.env: {name: ...} or val: on a data task")
    if eval_cfg.data is not None:
        eval_sets(data, eval_cfg.model_copy(update={"env": None}), max_new_tokens=max_new_tokens)
    if eval_cfg.env is not None:
        try:
            eval_sets([], eval_cfg.model_copy(update={"data": None, "max_prompts": 1}), max_new_tokens=max_new_tokens)
        except DataError:
            raise
        except (ValueError, TypeError) as err:
            raise DataError(f"eval.env: {err}") from None
