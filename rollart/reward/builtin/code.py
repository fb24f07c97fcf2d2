"""Score code by running it against tests in the sandbox."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollart.reward.errors import RewardInputError
from rollart.reward.sandbox import SandboxLimitError, limits, run_python

_FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


class CodeTest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str = ""
    output: str | int | float


class CodeTestsTruth(BaseModel):
    """``ground_truth`` of :func:`code_tests`; ``timeout_s`` / ``memory_mb`` may only lower the server's
    sandbox limits (``rollart serve rewards --sandbox-timeout-s / --sandbox-memory-mb``)."""

    model_config = ConfigDict(extra="forbid")

    tests: list[CodeTest] = Field(min_length=1, max_length=1000)
    timeout_s: Any = None
    memory_mb: Any = None


def code_tests(trajectory: dict[str, Any]) -> dict[str, Any]:
    """``ground_truth = {"tests": [{"input": str, "output": str}, ...], "timeout_s": 5, "memory_mb": 256}``;
    the response is Python (a fenced block is taken if present). Score: the fraction of tests whose
    stdout matches (trimmed), compared here, outside the sandbox (the code never sees the expected
    output). A malformed ``ground_truth`` raises :class:`RewardInputError` (422).

    A test whose code used its CPU time (``timeout_s``: CPU seconds) or sat blocked past the wall clock
    fails (``"timeout"``). A test the machine kept waiting for a CPU until the wall clock ran out has no
    verdict: :class:`~rollart.reward.sandbox.SandboxContended` is raised, and the reward fails (the
    service answers 5xx, the client retries, then reports the trajectory as failed) -- never a 0."""
    try:
        gt = CodeTestsTruth.model_validate(trajectory.get("ground_truth"))
    except ValidationError as err:
        where = "; ".join(f"ground_truth.{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in err.errors())
        raise RewardInputError(
            f"code_tests: {where}; expected {{'tests': [{{'input': str, 'output': str}}, ...]}}"
        ) from None
    try:
        lim = limits().lowered("ground_truth.", timeout_s=gt.timeout_s, memory_mb=gt.memory_mb)
    except SandboxLimitError as err:
        raise RewardInputError(f"code_tests: {err}") from None
    response = trajectory.get("response")
    if not isinstance(response, str):
        raise RewardInputError("code_tests: response must be a string of Python")
    m = _FENCE.search(response)
    code = m.group(1) if m else response
    passed, reasons = 0, []
    for t in gt.tests:
        r = run_python(code, t.input, timeout_s=lim.timeout_s, memory_mb=lim.memory_mb)
        ok = r.ok and r.stdout.strip() == str(t.output).strip()
        passed += ok
        reasons.append(
            "ok"
            if ok
            else "timeout"
            if r.out_of_time
            else f"exit {r.returncode}"
            if r.returncode
            else "output limit"
            if r.output_truncated
            else "wrong"
        )
    return {"score": passed / len(gt.tests), "tests": reasons}


code_tests.needs_sandbox = True  # type: ignore[attr-defined]  # servers check the isolation layer at start-up
