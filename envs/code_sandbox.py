"""Fix a bug in a small workspace: an agentic coding task whose tests run in the code sandbox.

Each episode (chosen by the reset seed) is a workspace of two files: ``solution.py`` holding a small
function with a bug, and ``test_solution.py`` holding the tests it must pass. The agent acts with

* ``<write file="solution.py">...full new content...</write>`` -- replace the content of
  ``solution.py`` (the tests are read-only: writing any other file is refused);
* ``<run/>`` -- run the tests; a step may write and then run (``<write ...>...</write><run/>``).

The tests run in :func:`rollart.reward.sandbox.run_python`: bubblewrap namespaces (no network but its
own loopback, no view of the server's files or processes), a uid of its own, CPU, memory, disk and
process limits and a wall-clock timeout. ``timeout_s`` and ``memory_mb`` may only lower the server's
sandbox limits. Without an isolation layer the env refuses to start unless the operator opted in
(``--unsafe-no-sandbox``). A solution that loops forever, allocates without end or opens a socket
fails its tests; it never takes the env server down.

Verdicts are computed here, where the solution cannot reach: each test of ``test_solution.py`` is a
call of the task's function and the value it must return (:class:`CodeCase`). The sandbox only
imports ``solution.py``, makes the calls and sends back what they returned, as JSON (and, for a call
that raised, the error); it never holds an expected value, and no secret. The env compares the values
with the expected ones. Whatever the solution does in the sandbox -- print a report of its own, walk up
to the runner's frames, patch ``json`` or builtins, return objects that claim to equal anything, exit
early -- it can at most make its calls appear to return some values, which is what a solution does
anyway; a report that does not name exactly the task's tests counts as no report.

Rewards: a step that runs the tests earns the fraction of tests that pass (1.0 when all do, which ends
the episode, *terminated*); a step that only writes earns 0; an action with neither tag, or a write to
another file, costs ``-format_penalty`` and the observation says "invalid action". The observation
after a run is the test report (names of failing tests and why). When the machine kept the tests
waiting for a CPU until their wall clock ran out, the step raises
:class:`~rollart.reward.sandbox.SandboxContended` (a failed step, not a reward of 0).
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from rollart.envs.base import StepResult, TextEnv, check_positive, register_env
from rollart.reward.sandbox import check, limits, run_python

EDITABLE = "solution.py"
TESTS = "test_solution.py"


@dataclass(frozen=True)
class CodeCase:
    """One test: ``function(*args)`` must return ``expected`` (JSON values)."""

    name: str
    args: tuple[Any, ...]
    expected: Any


@dataclass(frozen=True)
class CodeTask:
    """A buggy ``solution.py`` defining ``function``, its fixed version (for tests and demos) and the
    tests (:class:`CodeCase`); :attr:`tests` is ``test_solution.py`` as the agent sees it."""

    name: str
    function: str
    buggy: str
    fixed: str
    cases: tuple[CodeCase, ...]

    @property
    def tests(self) -> str:
        calls = "\n\n".join(
            f"def {c.name}():\n    assert {self.function}({', '.join(map(repr, c.args))}) == {c.expected!r}"
            for c in self.cases
        )
        return f"from solution import {self.function}\n\n{calls}\n"


TASKS: tuple[CodeTask, ...] = (
    CodeTask(
        "clamp",
        "clamp",
        "def clamp(x, lo, hi):\n    return max(lo, min(x, lo))\n",
        "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
        (
            CodeCase("test_inside", (5, 0, 10), 5),
            CodeCase("test_above", (15, 0, 10), 10),
            CodeCase("test_below", (-3, 0, 10), 0),
        ),
    ),
    CodeTask(
        "mean",
        "mean",
        "def mean(xs):\n    return sum(xs) / (len(xs) + 1)\n",
        "def mean(xs):\n    return sum(xs) / len(xs)\n",
        (
            CodeCase("test_one", ([4],), 4),
            CodeCase("test_many", ([1, 2, 3, 4],), 2.5),
            CodeCase("test_negative", ([-2, 2],), 0),
        ),
    ),
    CodeTask(
        "count_vowels",
        "count_vowels",
        "def count_vowels(s):\n    return sum(1 for c in s if c in 'aeiou')\n",
        "def count_vowels(s):\n    return sum(1 for c in s.lower() if c in 'aeiou')\n",
        (
            CodeCase("test_lower", ("banana",), 3),
            CodeCase("test_upper", ("AEIOU",), 5),
            CodeCase("test_none", ("xyz",), 0),
        ),
    ),
)

# Runs in the sandbox: keeps the original stdout as the report's channel and sends the solution's own
# output to stderr, writes solution.py into its working directory, imports it and makes the calls, then
# writes one JSON report: {"results": {test: {"value": ...} | {"error": "..."}}} or {"error": "..."}.
# It holds no expected value and no secret: the env judges the values.
_RUNNER = r"""
import json, os, sys
report = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
with open("solution.py", "w") as f:
    f.write(%(solution)r)
calls = json.loads(%(calls)r)
sys.path.insert(0, ".")
try:
    import solution
    fn = getattr(solution, %(function)r)
except BaseException as e:
    report.write(json.dumps({"error": "cannot import the solution: " + repr(e)[:300]}))
    report.flush()
    raise SystemExit(0)
results = {}
for name, args in calls:
    try:
        value = fn(*args)
        json.dumps(value)
        results[name] = {"value": value}
    except BaseException as e:
        results[name] = {"error": (type(e).__name__ + ": " + str(e))[:200]}
report.write(json.dumps({"results": results}))
report.flush()
"""


def expected_tests(tests: str) -> set[str]:
    """The ``test_*`` functions ``tests`` defines at module level (what the runner must report on)."""
    return {
        node.name
        for node in ast.parse(tests).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
    }


def _json_value(value: Any) -> Any:
    """``value`` as the JSON the sandbox's report carries it (tuples are lists)."""
    return json.loads(json.dumps(value))


def judge(task: CodeTask, report: str) -> tuple[int, int, list[str]]:
    """Compare the sandbox's ``report`` with the task's expected values: ``(passed, total, lines)``.
    A report that is not one JSON object naming exactly the task's tests passes nothing."""
    total = len(task.cases)
    try:
        data = json.loads(report)
    except (ValueError, RecursionError):
        return 0, total, ["tests: no readable report (the solution ended the run or wrote over the report)"]
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        error = data.get("error") if isinstance(data, dict) else None
        return 0, total, [str(error)[:300] if isinstance(error, str) else "tests: no report"]
    results = data["results"]
    if set(results) != {c.name for c in task.cases}:
        return 0, total, [f"tests: the report does not name the tests of {TESTS}"]
    passed, lines = 0, []
    for case in task.cases:
        got = results[case.name]
        call = f"{task.function}({', '.join(map(repr, case.args))})"
        if not isinstance(got, dict) or set(got) not in ({"value"}, {"error"}):
            lines.append(f"{case.name}: FAIL no result")
        elif "error" in got:
            lines.append(f"{case.name}: FAIL {call} raised {str(got['error'])[:200]}")
        elif type(got["value"]) is type(_json_value(case.expected)) and got["value"] == _json_value(case.expected):
            passed += 1
            lines.append(f"{case.name}: ok")
        elif (
            isinstance(got["value"], (int, float))
            and not isinstance(got["value"], bool)
            and got["value"] == case.expected
        ):
            passed += 1  # 4.0 for 4: equal numbers, as the test's == says
            lines.append(f"{case.name}: ok")
        else:
            lines.append(
                f"{case.name}: FAIL {call} returned {json.dumps(got['value'])[:100]}, expected {case.expected!r}"
            )
    return passed, total, lines


_WRITE = re.compile(r"<write\s+file=\"([^\"]+)\"\s*>\n?(.*?)</write>", re.S)
_RUN = re.compile(r"<run\s*/>")


@register_env("code_sandbox")
class CodeSandboxEnv(TextEnv):
    """Fix ``solution.py`` so that ``test_solution.py`` passes (see the module docstring)."""

    tag: ClassVar[str] = "code_sandbox"
    needs_sandbox: ClassVar[bool] = True  # env servers check the isolation layer at start-up
    instructions: ClassVar[str] = (
        'Fix the bug in solution.py. Replace its content with <write file="solution.py">...</write> and run the '
        "tests with <run/> (both may be in one action). Reward: the fraction of tests passing."
    )

    def __init__(
        self,
        max_steps: int = 4,
        timeout_s: float = 5.0,
        memory_mb: int = 256,
        format_penalty: float = 0.1,
        max_new_tokens: int = 256,
    ) -> None:
        check_positive("code_sandbox", max_steps=max_steps, memory_mb=memory_mb, max_new_tokens=max_new_tokens)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s):
            raise ValueError(f"code_sandbox: timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        if timeout_s <= 0:
            raise ValueError(f"code_sandbox: timeout_s must be > 0, got {timeout_s!r}")
        check()  # no isolation layer (and no --unsafe-no-sandbox): refuse now, before any code runs
        # the server's sandbox limits bound these (a session's kwargs may only lower them)
        lim = limits().lowered("code_sandbox.", timeout_s=timeout_s, memory_mb=memory_mb)
        timeout_s, memory_mb = lim.timeout_s, lim.memory_mb
        self.max_steps = max_steps
        self.max_new_tokens = max_new_tokens
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.format_penalty = format_penalty
        self.task: CodeTask | None = None
        self.files: dict[str, str] = {}
        self.steps = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.task = random.Random(seed).choice(TASKS)
        self.files = {EDITABLE: self.task.buggy, TESTS: self.task.tests}
        self.steps = 0
        return self._render("Workspace:"), {"task": self.task.name, "fixed": self.task.fixed}

    def _render(self, head: str) -> str:
        body = "\n".join(f"--- {name} ---\n{text}" for name, text in sorted(self.files.items()))
        return f"{head}\n{body}"

    def run_tests(self) -> tuple[int, int, str]:
        """Run the workspace's tests in the sandbox and judge them here: ``(passed, total, report)``.
        Raises :class:`~rollart.reward.sandbox.SandboxContended` when the machine kept them waiting for a
        CPU until their wall clock ran out (no verdict)."""
        assert self.task is not None
        calls = json.dumps([[c.name, list(c.args)] for c in self.task.cases])
        code = _RUNNER % {"solution": self.files[EDITABLE], "calls": calls, "function": self.task.function}
        res = run_python(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb, max_output_bytes=100_000)
        total = len(self.task.cases)
        if res.out_of_time:
            return 0, total, f"tests timed out (their CPU time or wall clock ran out)\n{res.stderr[-500:]}"
        passed, _, lines = judge(self.task, res.stdout)
        if not res.stdout.strip() and (res.returncode or res.killed_by):
            lines = [f"tests exited with {res.returncode} ({res.killed_by or 'no report'})"]
        text = f"{passed}/{total} tests passed\n" + "\n".join(lines)
        return passed, total, text + (f"\n{res.stderr[-500:]}" if passed < total and res.stderr.strip() else "")

    def step(self, action: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("code_sandbox: call reset() before step()")
        self.steps += 1
        truncated = self.steps >= self.max_steps
        writes = _WRITE.findall(action)
        run = _RUN.search(action) is not None
        bad = [name for name, _ in writes if name != EDITABLE]
        if bad or (not writes and not run):
            why = f"only {EDITABLE} may be written, not {bad[0]!r}" if bad else "no <write> or <run/>"
            return f"invalid action: {why}", -self.format_penalty, False, truncated, {"invalid": True}
        for _, text in writes:
            self.files[EDITABLE] = text
        if not run:
            return f"wrote {EDITABLE}", 0.0, False, truncated, {}
        passed, total, report = self.run_tests()
        done = passed == total
        info = {"passed": passed, "total": total}
        return report, passed / total, done, truncated and not done, info
