"""Where a ``model:`` of a config comes from: a local Hugging Face folder, or a model the offline Hugging Face
cache holds. Checked with the rest of the config, so a wrong path is a config error naming the key, not a
traceback from an inference worker after the cluster started."""

from __future__ import annotations

from pathlib import Path

FIX = (
    "give the path of a Hugging Face model folder (e.g. the hf/ folder a run exported, or the output of "
    "`python -m rollart.models.pretrained`), or leave it out for the built-in tiny model"
)


def hf_cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def cached_model(name: str) -> str | None:
    """The cached ``config.json`` of the Hugging Face model ``name`` (``org/model``), or None when the offline
    cache does not hold it (or ``name`` cannot be a model name)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, "config.json", cache_dir=hf_cache_dir())
    except ValueError:  # not a valid repo id (a path, spaces, ...): HFValidationError is a ValueError
        return None
    return found if isinstance(found, str) else None


def model_problem(value: str) -> str | None:
    """None when ``value`` is a model ``from_pretrained`` can load offline: a folder with a ``config.json``,
    or a model name in the Hugging Face cache; else what is wrong and the fix."""
    path = Path(value)
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        return f"{value!r} is a folder without a config.json, not a Hugging Face model folder; {FIX}"
    if path.exists():
        return f"{value!r} is a file, not a Hugging Face model folder; {FIX}"
    if cached_model(value) is not None:
        return None
    return (
        f"{value!r} is neither a folder (none at {path.resolve()}) nor a model in the offline Hugging Face "
        f"cache ({hf_cache_dir()}); {FIX}"
    )


def check_model(value: str | None) -> str | None:
    """A pydantic field validator's body: ``value`` unchanged, or ValueError naming the problem."""
    if value is not None:
        problem = model_problem(value)
        if problem is not None:
            raise ValueError(problem)
    return value
