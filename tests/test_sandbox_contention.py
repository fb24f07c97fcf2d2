"""What a sandbox timeout means: the code's own verdict when it used its CPU time or sat blocked, and a
failure the caller sees (:class:`SandboxContended`: retried, or counted as failed) when the machine kept
it waiting for a CPU -- never a reward of 0 because a neighbour was busy."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
from security_fixtures import wait_until

from rollart.reward import sandbox
from rollart.reward.builtin import code_tests

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        shutil.which("bwrap") is None,
        reason="the sandbox's isolation layer needs bubblewrap (apt-get install bubblewrap)",
    ),
]

# half a second of CPU, whatever the machine's speed, then the right answer
VICTIM = "import time\nwhile time.process_time() < 0.5:\n    pass\nprint('done')\n"
SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def test_a_victim_on_a_busy_machine_is_scored_right_or_fails_never_0() -> None:
    noisy = 3 * (os.cpu_count() or 2)  # another tenant's sandboxes: three per core, spinning
    threads = [
        threading.Thread(target=sandbox.run_python, args=(SPIN.format(seconds=4),), kwargs={"timeout_s": 5})
        for _ in range(noisy)
    ]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: sandbox.running() >= noisy, 60, "the other tenant's sandboxes running")
        truth = {"tests": [{"input": "", "output": "done"}], "timeout_s": 1.0}
        try:
            outcome: object = code_tests({"response": VICTIM, "ground_truth": truth})["score"]
        except sandbox.SandboxContended as err:  # a failed reward: the caller retries or counts it
            outcome = "failed"
            assert "CPU" in str(err)
    finally:
        for t in threads:
            t.join(120)
    assert outcome in (1.0, "failed"), outcome


def test_code_that_uses_its_cpu_time_or_sleeps_gets_its_own_verdict() -> None:
    # its own doing, not the machine's: a score (the test fails), not a failure
    for code in ("while True:\n    pass\n", "import time\ntime.sleep(60)\n"):
        out = code_tests({"response": code, "ground_truth": {"tests": [{"output": "x"}], "timeout_s": 0.5}})
        assert out["score"] == 0.0 and out["tests"] == ["timeout"], out


def test_code_that_keeps_itself_waiting_gets_its_own_verdict() -> None:
    # many processes spinning in one sandbox: the contention is its own, so is the verdict
    forks = "import os\nfor _ in range(8):\n    if os.fork() == 0:\n        break\nwhile True:\n    pass\n"
    out = code_tests({"response": forks, "ground_truth": {"tests": [{"output": "x"}], "timeout_s": 0.5}})
    assert out["score"] == 0.0 and out["tests"] == ["timeout"], out
