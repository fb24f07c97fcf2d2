"""Score code by running it against tests in the sandbox."""

from __future__ import annotations

import re
from typing import Any

from rollart.reward.sandbox import run_python

_FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


def code_tests(trajectory: dict[str, Any]) -> dict[str, Any]:
    """``ground_truth = {"tests": [{"input": str, "output": str}, ...], "timeout_s": 5, "memory_mb": 256}``;
    the response is Python (a fenced block is taken if present). Score: the fraction of tests whose
    stdout matches (trimmed)."""
    gt = trajectory["ground_truth"] or {}
    tests = gt.get("tests") or []
    if not tests:
        raise ValueError("code_tests needs ground_truth.tests")
    m = _FENCE.search(trajectory["response"])
    code = m.group(1) if m else trajectory["response"]
    passed, reasons = 0, []
    for t in tests:
        r = run_python(
            code, t.get("input", ""), timeout_s=float(gt.get("timeout_s", 5)), memory_mb=int(gt.get("memory_mb", 256))
        )
        ok = r.ok and r.stdout.strip() == str(t["output"]).strip()
        passed += ok
        reasons.append(
            "ok" if ok else "timeout" if r.timed_out else f"exit {r.returncode}" if r.returncode else "wrong"
        )
    return {"score": passed / len(tests), "tests": reasons}
