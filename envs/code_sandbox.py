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
fails its tests; it never takes the env server down. The test report is a line carrying a secret of the
run and the names of the tests of ``test_solution.py``: a solution that prints a report of its own
gets no reward for it.

Rewards: a step that runs the tests earns the fraction of tests that pass (1.0 when all do, which ends
the episode, *terminated*); a step that only writes earns 0; an action with neither tag, or a write to
another file, costs ``-format_penalty`` and the observation says "invalid action". The observation
after a run is the test report (names of failing tests and their first error line).
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
import secrets
from dataclasses import dataclass
from typing import Any, ClassVar

from rollart.envs.base import StepResult, TextEnv, check_positive, register_env
from rollart.reward.sandbox import check, limits, run_python

EDITABLE = "solution.py"
TESTS = "test_solution.py"


@dataclass(frozen=True)
class CodeTask:
    """A buggy ``solution.py``, its fixed version (for tests and demos) and ``test_solution.py``."""

    name: str
    buggy: str
    fixed: str
    tests: str


TASKS: tuple[CodeTask, ...] = (
    CodeTask(
        "clamp",
        "def clamp(x, lo, hi):\n    return max(lo, min(x, lo))\n",
        "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
        "from solution import clamp\n\n"
        "def test_inside():\n    assert clamp(5, 0, 10) == 5\n\n"
        "def test_above():\n    assert clamp(15, 0, 10) == 10\n\n"
        "def test_below():\n    assert clamp(-3, 0, 10) == 0\n",
    ),
    CodeTask(
        "mean",
        "def mean(xs):\n    return sum(xs) / (len(xs) + 1)\n",
        "def mean(xs):\n    return sum(xs) / len(xs)\n",
        "from solution import mean\n\n"
        "def test_one():\n    assert mean([4]) == 4\n\n"
        "def test_many():\n    assert mean([1, 2, 3, 4]) == 2.5\n\n"
        "def test_negative():\n    assert mean([-2, 2]) == 0\n",
    ),
    CodeTask(
        "count_vowels",
        "def count_vowels(s):\n    return sum(1 for c in s if c in 'aeiou')\n",
        "def count_vowels(s):\n    return sum(1 for c in s.lower() if c in 'aeiou')\n",
        "from solution import count_vowels\n\n"
        "def test_lower():\n    assert count_vowels('banana') == 3\n\n"
        "def test_upper():\n    assert count_vowels('AEIOU') == 5\n\n"
        "def test_none():\n    assert count_vowels('xyz') == 0\n",
    ),
)

# Runs in the sandbox: reads the run's secret from stdin (first, before anything of the workspace runs),
# writes the workspace into its working directory, imports the tests, calls every ``test_*`` function and
# prints one line ``RESULTS <secret> <json>``. A solution that prints a results line of its own does not
# know the secret; the env also checks that the results name exactly the tests of ``test_solution.py``.
_RUNNER = r"""
import json, sys
nonce = sys.stdin.readline().strip()
files = json.loads(%(files)r)
for name, text in files.items():
    with open(name, "w") as f:
        f.write(text)
sys.path.insert(0, ".")
results = {}
try:
    import test_solution as t
except BaseException as e:
    print("RESULTS " + nonce + " " + json.dumps({"error": "cannot import the tests: " + repr(e)[:300]}))
    raise SystemExit(0)
for name in sorted(n for n in dir(t) if n.startswith("test_") and callable(getattr(t, n))):
    try:
        getattr(t, name)()
        results[name] = None
    except BaseException as e:
        results[name] = (type(e).__name__ + ": " + str(e))[:200]
print("RESULTS " + nonce + " " + json.dumps({"results": results}))
"""


def expected_tests(tests: str) -> set[str]:
    """The ``test_*`` functions ``tests`` defines at module level (what the runner must report on)."""
    return {
        node.name
        for node in ast.parse(tests).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
    }


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
        """Run the workspace's tests in the sandbox: ``(passed, total, report)``."""
        code = _RUNNER % {"files": json.dumps(self.files)}
        nonce = secrets.token_hex(16)
        res = run_python(
            code, nonce + "\n", timeout_s=self.timeout_s, memory_mb=self.memory_mb, max_output_bytes=100_000
        )
        mark = f"RESULTS {nonce} "
        line = next((ln for ln in reversed(res.stdout.splitlines()) if ln.startswith(mark)), None)
        if res.timed_out or line is None:
            why = "timed out" if res.timed_out else f"exited with {res.returncode} ({res.killed_by or 'no result'})"
            return 0, 1, f"tests {why}\n{res.stderr[-500:]}"
        try:
            data = json.loads(line[len(mark) :])
        except ValueError:
            return 0, 1, "tests: unreadable results"
        if not isinstance(data, dict) or "error" in data:
            return 0, 1, str(data.get("error") if isinstance(data, dict) else data)
        results = data.get("results")
        expected = expected_tests(self.files[TESTS])
        if not isinstance(results, dict) or set(results) != expected:
            return 0, max(1, len(expected)), f"tests: the results do not name the tests of {TESTS}"
        passed = sum(err is None for err in results.values())
        lines = [f"{name}: {'ok' if err is None else 'FAIL ' + str(err)}" for name, err in results.items()]
        return passed, max(1, len(results)), f"{passed}/{len(results)} tests passed\n" + "\n".join(lines)

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
