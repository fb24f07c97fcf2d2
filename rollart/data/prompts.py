"""Prompt sets (a loaded dataset with its columns, system prompt and verifier) from the ``data:`` /
``eval:`` config sections, and the config-load check that reports a missing file, column, module or
function before any actor starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollart.data.config import DataTask, EvalConfig
from rollart.data.sources import DataError, check_columns, load_rows
from rollart.data.verifiers import (
    Verifier,
    add_import_dir,
    call_verifier,
    is_builtin,
    required_columns,
    resolve_verifier,
)

VAL_SPLITS = ("validation", "test", "val")


class PromptSet:
    """A loaded dataset with its prompt/answer columns, system prompt and verifier (shared, read-only)."""

    def __init__(
        self,
        rows: Any,
        *,
        tag: str,
        verifier: Verifier,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        system_prompt: str | None = None,
        source: str = "",
        inline_verifier: bool = False,
    ):
        self.rows, self.tag, self.verifier = rows, tag, verifier
        self.prompt_key, self.answer_key, self.system_prompt = prompt_key, answer_key, system_prompt
        self.source = source
        self.inline_verifier = inline_verifier  # quick: scored on the rollout's event loop (DataTask.inline_verifier)

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> dict[str, Any]:
        return dict(self.rows[index])

    def prompt(self, row: dict[str, Any]) -> str:
        text = str(row[self.prompt_key])
        return f"{self.system_prompt}\n{text}" if self.system_prompt else text

    def score(self, completion: str, row: dict[str, Any]) -> float:
        return call_verifier(self.verifier, completion, row[self.answer_key], row, self.answer_key)


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
        inline_verifier=task.inline_verifier if task.inline_verifier is not None else is_builtin(task.verifier),
    )


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


def eval_prompts(data: list[DataTask], cfg: EvalConfig) -> tuple[PromptSet, DataTask] | None:
    """The prompts of ``eval.data``, read with the keys and verifier of the only data task (defaults
    without one), and that task; None without ``eval.data``."""
    if cfg.data is None:
        return None
    task = data[0] if data else DataTask(train=cfg.data)
    return load_prompts(task, "data[0]" if data else "eval", split="eval.data", path=cfg.data), task


def check_config(data: list[DataTask], eval_cfg: EvalConfig | None) -> None:
    """Load every dataset and verifier once: a :class:`DataError` naming the field on the first problem.
    (``eval.env`` is an env name, checked where the envs are built.)"""
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
    eval_prompts(data, eval_cfg)
