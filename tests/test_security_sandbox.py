"""Hostile code against the code sandbox (rollart.reward.sandbox) and the code_sandbox env: escapes,
resource exhaustion, limits a caller cannot raise, deadlines that kill a sandbox's whole process tree,
forged test reports, and no code at all without an isolation layer unless the operator opted in."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from security_fixtures import alive, no_bwrap, processes_of_uid, run_python_as

from rollart.envs.code_sandbox import CodeSandboxEnv, expected_tests
from rollart.reward import isolation, sandbox
from rollart.reward.builtin import code_tests
from rollart.reward.sandbox import SandboxCancelled, SandboxLimitError, SandboxUnavailable, deadline, run_python

pytestmark = pytest.mark.timeout(300)
needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="the sandbox's isolation layer needs bubblewrap (apt-get install bubblewrap)"
)


def test_without_bubblewrap_code_is_refused_unless_the_operator_opts_in(tmp_path: Path) -> None:
    shadow = "print(open('/etc/shadow').read()[:8])"
    with no_bwrap(tmp_path, opt_in=False):
        with pytest.raises(SandboxUnavailable, match=r"bubblewrap.*--unsafe-no-sandbox"):
            run_python(shadow)
        with pytest.raises(SandboxUnavailable):
            code_tests({"response": shadow, "ground_truth": {"tests": [{"input": "", "output": "x"}]}})
        with pytest.raises(SandboxUnavailable):
            CodeSandboxEnv()
    # the operator asked for it by name: runs (with a Python the code's own uid can run), and says so
    out = run_python_as("root", "print('ran')", unsafe=True)
    assert out["returncode"] == 0 and out["stdout"].strip() == "ran" and out["isolation"] == "unsafe-no-sandbox"
    assert "UNSAFE" in out["describe"]


@needs_bwrap
def test_code_cannot_read_host_files_write_outside_nor_read_the_servers_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "hostile-suite-" + uuid.uuid4().hex
    monkeypatch.setenv("ROLLART_TEST_SECRET", secret)  # in this (the server's) environment
    target = tmp_path / "pwned"
    code = f"""
import glob, os
seen = [p for p in ('/etc/shadow', '/etc/passwd', {str(tmp_path)!r}, '/root/.bashrc', '/work', '/home')
        if os.path.exists(p)]
leak = ''
for p in glob.glob('/proc/*/environ') + ['/proc/%d/environ' % os.getppid()]:
    try:
        leak += open(p).read()
    except OSError:
        pass
print('LEAK' if {secret!r} in leak else 'clean')
try:
    open({str(target)!r}, 'w').write('pwned')
    print('wrote')
except OSError:
    print('refused')
print('seen', seen)
print('procs', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
"""
    out = run_python(code)
    assert out.ok, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "clean" and lines[1] == "refused" and not target.exists()
    assert lines[2] == "seen []"  # no host file, no home, no /etc at all
    assert len(eval(lines[3][len("procs ") :])) <= 3  # its own processes only (init, itself)


@needs_bwrap
def test_code_runs_as_an_unprivileged_uid_of_its_own_and_cannot_regain_root() -> None:
    code = (
        "import os\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print(os.getuid(), os.geteuid(), status['CapEff'].strip(), status['CapPrm'].strip(), status['NoNewPrivs'].strip())\n"
        "try:\n    os.setuid(0)\n    print('root again')\nexcept PermissionError:\n    print('stays')\n"
    )
    out = run_python(code)
    uid, euid, cap_eff, cap_prm, nnp = out.stdout.split("\n")[0].split()
    assert uid == euid and int(uid) not in (0, os.getuid()), out.stdout
    assert int(cap_eff, 16) == 0 and int(cap_prm, 16) == 0 and nnp == "1"
    assert out.stdout.split("\n")[1] == "stays"


FORKS = """
import os, time
n = 0
for _ in range(150):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    n += 1
print(n, os.getuid(), flush=True)
"""


@needs_bwrap
def test_the_process_limit_binds_even_when_the_server_is_root() -> None:
    out = run_python(FORKS, max_processes=16)
    forked, uid = map(int, out.stdout.split())
    assert forked < 16, out.stdout  # 150 asked; the limit counts the sandbox's own processes
    assert processes_of_uid(uid) == []  # and none outlives the sandbox


@needs_bwrap
def test_the_total_disk_a_sandbox_writes_is_limited() -> None:
    code = (
        "written = 0\n"
        "try:\n"
        "    for i in range(30):\n"
        "        with open(f'f{i}', 'wb') as f:\n"
        "            f.write(b'x' * (4 << 20))\n"
        "        written += 4\n"
        "except OSError as e:\n"
        "    print(type(e).__name__, e.errno)\n"
        "print(written)\n"
    )
    out = run_python(code, disk_mb=32)
    assert out.stdout.split()[:2] == ["OSError", "28"]  # ENOSPC: no space left (per file, each was allowed)
    assert int(out.stdout.split()[-1]) <= 32


@needs_bwrap
def test_a_caller_can_only_lower_the_servers_limits() -> None:
    for bad in (float("nan"), float("inf"), -1.0, 0, "5", True):
        with pytest.raises(SandboxLimitError, match="timeout_s"):
            run_python("pass", timeout_s=bad)  # type: ignore[arg-type]
    with pytest.raises(SandboxLimitError, match="memory_mb"):
        run_python("pass", memory_mb=-1)
    hog = "x = bytearray(1500 * 2**20)\nprint('allocated')"
    big = run_python(hog, memory_mb=10**6)  # asks for a terabyte: gets the server's limit
    assert "allocated" not in big.stdout and "MemoryError" in big.stderr
    assert sandbox.limits().lowered(timeout_s=1e9).timeout_s == sandbox.limits().timeout_s


SANDBOX_UIDS = range(isolation.uid_base(), isolation.uid_base() + 64)


@needs_bwrap
def test_a_cancelled_deadline_kills_the_sandbox_and_every_process_it_started() -> None:
    tree = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        while True:\n"
        "            time.sleep(0.05)\n"
        "    os._exit(0)\n"
        "while True:\n"
        "    pass\n"
    )
    outcome: list[BaseException | object] = []
    started = threading.Event()

    def request() -> None:
        with deadline(60) as scope:
            holder.append(scope)
            started.set()
            try:
                outcome.append(run_python(tree))
            except BaseException as err:  # the outcome is asserted in the test's thread
                outcome.append(err)

    holder: list[sandbox.Deadline] = []
    worker = threading.Thread(target=request)
    worker.start()
    started.wait(30)
    end = __import__("time").monotonic() + 30
    while sandbox.running() == 0 and worker.is_alive():  # the sandbox is up
        assert __import__("time").monotonic() < end
        worker.join(0.02)
    holder[0].cancel()  # the request timed out or went away
    worker.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], SandboxCancelled), outcome  # killed, not timed out
    assert sandbox.running() == 0
    assert [u for u in SANDBOX_UIDS if processes_of_uid(u)] == []  # the setsid grandchild too
    with pytest.raises(SandboxCancelled), deadline(60) as scope:  # nothing starts in a cancelled scope
        scope.cancel()
        run_python("print(1)")


def test_without_bubblewrap_a_double_forked_setsid_child_dies_with_its_sandbox() -> None:
    code = (
        "import os, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.write(w, str(os.getpid()).encode())\n"
        "        while True:\n"
        "            time.sleep(0.05)\n"
        "    os._exit(0)\n"
        "os.close(w)\n"
        "print(os.read(r, 64).decode(), flush=True)\n"
        "time.sleep(60)\n"
    )
    out = run_python_as("nobody", code, unsafe=True, timeout_s=0.5)  # as the server's own uid
    grandchild = int(out["stdout"].split()[0])
    assert out["timed_out"] and out["isolation"] == "unsafe-no-sandbox"
    assert not alive(grandchild)  # out of the session and orphaned, still killed


@needs_bwrap
def test_bubblewrap_is_run_from_where_it_was_found(tmp_path: Path) -> None:
    wrapper = tmp_path / "bin" / "bwrap"
    wrapper.parent.mkdir()
    log = tmp_path / "bwrap.log"
    wrapper.write_text(f'#!/bin/sh\necho started >> {log}\nexec {shutil.which("bwrap")} "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "PATH": f"{wrapper.parent}:/usr/bin:/bin"}
    env.pop(isolation.SANDBOX_ENV, None)
    code = "from rollart.reward.sandbox import run_python\nr = run_python('print(6 * 7)')\nprint(r.stdout.strip())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "42", done.stderr[-2000:]
    assert log.read_text().split() == ["started", "started"]  # the probe, then the run: the same bubblewrap


# Each is appended to the task's buggy solution.py: whatever it does, the reward may not exceed the bug's.
FORGERIES = {
    # the report line of the runner, printed by the solution itself, then an exit before the tests run
    "runner-line": 'import json, os\nprint("RESULTS " + json.dumps({"results": dict.fromkeys(NAMES)}), flush=True)\n'
    "os._exit(0)\n",
    # a guess at a secret
    "guessed-secret": 'import json, os\nprint("RESULTS " + "ab" * 16 + " " + json.dumps({"results": '
    "dict.fromkeys(NAMES)}), flush=True)\nos._exit(0)\n",
    # read the run's secret from stdin before the tests run
    "stdin": 'import json, os, sys\nprint("RESULTS " + sys.stdin.read().strip() + " " + json.dumps({"results": '
    "dict.fromkeys(NAMES)}), flush=True)\nos._exit(0)\n",
    # walk up to the frames of whatever imports the solution, take every secret and every writable
    # channel found there, report a full pass on each, and leave before anything else runs
    "frame-walk": """
import json, os, sys
seen, f = {}, sys._getframe()
while f is not None:
    seen.update(f.f_globals)
    seen.update(f.f_locals)
    f = f.f_back
passed = {"results": dict.fromkeys(NAMES)}
for key in ("nonce", "secret", "token"):
    if isinstance(seen.get(key), str):
        print("RESULTS " + seen[key] + " " + json.dumps(passed), flush=True)
for value in list(seen.values()):
    if hasattr(value, "write") and hasattr(value, "flush") and value is not sys.stderr:
        try:
            value.write(json.dumps(passed) + "\\n")
            value.flush()
        except Exception:
            pass
os._exit(0)
""",
    # the runner reports through json.dumps: make every report a full pass
    "patched-json": """
import json
_dumps = json.dumps
json.dumps = lambda obj, *a, **k: _dumps({"results": dict.fromkeys(NAMES)} if isinstance(obj, dict) else obj)
""",
    # a function whose results compare equal to anything (by class, or as a subclass of int)
    "always-equal": """
class _Any:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__
class _Int(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
def _wrap(fn):
    return lambda *a, **k: _Int(0) if isinstance(fn(*a, **k), int) else _Any()
for _name in [n for n in dir() if not n.startswith("_")]:
    if callable(globals()[_name]):
        globals()[_name] = _wrap(globals()[_name])
""",
    # exits with success from odd places: at import, from a finally of the tests' caller, at exit
    "exit-zero": """
import atexit, os, sys
atexit.register(lambda: os._exit(0))
sys.excepthook = lambda *a: os._exit(0)
raise SystemExit(0)
""",
}


@needs_bwrap
@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_solution_cannot_forge_its_test_report(forgery: str) -> None:
    env = CodeSandboxEnv()
    _, info = env.reset(0)
    buggy = env.files["solution.py"]
    _, unfixed, _, _, _ = env.step("<run/>")  # the bug's own reward
    names = sorted(expected_tests(env.files["test_solution.py"]))
    forged = buggy + FORGERIES[forgery].replace("NAMES", repr(names))
    obs, reward, done, _, _ = env.step(f'<write file="solution.py">{forged}</write><run/>')
    assert reward <= unfixed < 1.0 and not done, obs
    obs, reward, done, _, _ = env.step(f'<write file="solution.py">{info["fixed"]}</write><run/>')
    assert (reward, done) == (1.0, True), obs  # the honest fix still scores


@needs_bwrap
def test_a_sessions_limits_may_only_lower_the_servers() -> None:
    for bad in (float("nan"), float("inf"), -3.0):
        with pytest.raises(ValueError, match="timeout_s"):
            CodeSandboxEnv(timeout_s=bad)
    env = CodeSandboxEnv(timeout_s=1e9, memory_mb=10**6)
    assert (env.timeout_s, env.memory_mb) == (sandbox.limits().timeout_s, sandbox.limits().memory_mb)
