"""Verifiers of dataset tasks: ``verifier(completion, answer, **row) -> float``.

A config names one as ``MODULE:FUNC`` (a module importable from the config file's folder or
``sys.path``), ``FILE.py:FUNC`` (a file, relative to the config file) or a built-in name:
``exact_match`` (the default), ``number``, ``contains``, or a built-in task's verifier (``reverse``,
``addition``, ``countdown``: their ``verify(response, ground_truth)``, imported by name like a user's). ``row`` holds the row's other columns (the answer column excepted);
a function without ``**kwargs`` gets only the columns it names.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollart.data.sources import DataError

Verifier = Callable[..., float]

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def exact_match(completion: str, answer: Any, **row: Any) -> float:
    """1 when the completion, stripped, is the answer, stripped."""
    return float(completion.strip() == str(answer).strip())


def number(completion: str, answer: Any, **row: Any) -> float:
    """1 when the last number in the completion equals the answer as a number."""
    found = _NUMBER.findall(completion)
    if not found:
        return 0.0
    try:
        return float(abs(float(found[-1]) - float(str(answer).strip())) < 1e-9)
    except ValueError:
        return 0.0


def contains(completion: str, answer: Any, **row: Any) -> float:
    """1 when the answer occurs in the completion."""
    return float(str(answer).strip() in completion)


BUILTIN: dict[str, Verifier] = {"exact_match": exact_match, "number": number, "contains": contains}
# the built-in tasks' own verifiers ``verify(response, ground_truth)``, loaded like a user's MODULE:FUNC
TASK_VERIFIERS: dict[str, str] = {
    "reverse": "rollart.envs.reverse:ReverseTask.verify",
    "addition": "rollart.envs.addition:AdditionTask.verify",
    "countdown": "rollart.envs.countdown:CountdownTask.verify",
}


def is_builtin(spec: str | None) -> bool:
    """Whether ``spec`` names one of rollart's own verifiers (all quick pure Python)."""
    return spec is None or spec in BUILTIN or spec in TASK_VERIFIERS


def add_import_dir(folder: str | Path) -> None:
    """Make modules in ``folder`` (a config file's folder) importable, first on ``sys.path``."""
    d = str(Path(folder).resolve())
    if d not in sys.path:
        sys.path.insert(0, d)


def resolve_verifier(spec: str | None, *, field: str, base_dir: str | Path | None = None) -> Verifier:
    """The function ``spec`` names; a :class:`DataError` naming ``field`` and the fix when it cannot be
    loaded or cannot be called as ``(completion, answer)``."""
    if spec is None:
        return exact_match
    if spec in BUILTIN:
        return BUILTIN[spec]
    spec = TASK_VERIFIERS.get(spec, spec)
    if ":" not in spec:
        raise DataError(
            f"{field}: {spec!r} is not a built-in verifier ({', '.join(sorted([*BUILTIN, *TASK_VERIFIERS]))}); "
            "name your own as MODULE:FUNC (e.g. my_rewards:score for a my_rewards.py next to the config)"
        )
    module_name, func_name = spec.rsplit(":", 1)
    if base_dir is not None:
        add_import_dir(base_dir)
    module = _import(module_name, field=field, base_dir=base_dir)
    fn: Any = module
    for part in func_name.split("."):  # FUNC or Class.method
        fn = getattr(fn, part, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise DataError(
            f"{field}: {module_name} ({getattr(module, '__file__', '?')}) has no function {func_name!r} "
            f"(it has {public}); fix the name after the colon"
        )
    if not callable(fn):
        raise DataError(f"{field}: {spec} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind_partial("completion", "answer")
    except TypeError:
        raise DataError(
            f"{field}: {spec} must accept (completion, answer, **row); its signature is {inspect.signature(fn)}"
        ) from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return fn


def _import(module_name: str, *, field: str, base_dir: str | Path | None) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.exists():
            raise DataError(f"{field}: verifier file {path} does not exist; give a path relative to the config file")
        mod_name = f"rollart_user_verifier_{zlib.crc32(str(path.resolve()).encode()):08x}"
        if mod_name in sys.modules:
            return sys.modules[mod_name]
        spec = importlib.util.spec_from_file_location(mod_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            sys.modules.pop(mod_name, None)
            raise DataError(f"{field}: importing {path} failed: {type(err).__name__}: {err}") from err
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and module_name.startswith(err.name):
            where = f"the config's folder {Path(base_dir).resolve()} or " if base_dir is not None else ""
            raise DataError(
                f"{field}: no module named {module_name!r} (looked in {where}sys.path); put {module_name}.py "
                "next to the config file, or fix the name before the colon"
            ) from None
        raise DataError(f"{field}: importing {module_name} failed: {err}") from err
    except Exception as err:
        raise DataError(f"{field}: importing {module_name} failed: {type(err).__name__}: {err}") from err


def required_columns(fn: Verifier) -> list[str]:
    """The parameters after ``(completion, answer)`` that ``fn`` needs and that must be columns."""
    try:
        params = list(inspect.signature(fn).parameters.values())[2:]
    except ValueError:
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]


def call_verifier(fn: Verifier, completion: str, answer: Any, row: dict[str, Any], answer_key: str) -> float:
    """``fn(completion, answer, **other columns)``: every other column when ``fn`` takes ``**kwargs``,
    else the ones it names."""
    extra = {k: v for k, v in row.items() if k not in (answer_key, "completion", "answer")}
    try:
        params = inspect.signature(fn).parameters
    except ValueError:
        params = None
    if params is not None and not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        extra = {k: v for k, v in extra.items() if k in params}
    value = fn(completion, answer, **extra)
    if value is None or isinstance(value, str):
        raise TypeError(f"verifier {getattr(fn, '__name__', fn)} returned {value!r}; it must return a number")
    return float(value)
