"""``--unsafe-no-sandbox`` (no bubblewrap, the operator opted in) against hostile code: with a root
server the code runs as a uid of its own per sandbox (never root, never a uid another sandbox shares),
cannot read the server's secrets, kill its supervisor or leave a process behind; where that cannot be
done the server refuses, naming the fix; the log says which isolation is in force; and a child killed by
a signal is reported as killed by it, in every mode."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from pathlib import Path

import pytest
from security_fixtures import alive, no_bwrap, processes_of_uid, run_python_as

from rollart.reward import isolation, sandbox

pytestmark = pytest.mark.timeout(300)

SERVERS = ["root", "nobody"]


def test_a_root_server_runs_unsafe_code_as_a_uid_of_its_own_not_root() -> None:
    server = os.getpid()
    code = f"""
import os
print(os.getuid(), os.geteuid())
for path in ('/etc/shadow', '/proc/{server}/mem', '/proc/{server}/environ', '/proc/1/environ'):
    try:
        with open(path, 'rb') as f:
            f.read(1)
        print('read', path)
    except OSError:
        pass
"""
    out = run_python_as("root", code, unsafe=True)
    if "unavailable" in out:  # only where no user but root can run this Python: then it must refuse
        pytest.fail(f"refused although a Python every user can run was used: {out['unavailable']}")
    ids, *leaks = out["stdout"].split("\n")
    uid, euid = map(int, ids.split())
    assert uid == euid >= isolation.uid_base(), out["stdout"]  # a leased uid: not 0, not nobody
    assert [line for line in leaks if line] == [], out["stdout"]
    assert "a uid of its own" in out["describe"] and "UNSAFE" in out["describe"]


def test_a_root_server_refuses_unsafe_code_where_only_root_can_run_its_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(isolation, "world_readable_python", lambda: False)  # a Python under /root
    with no_bwrap(tmp_path, opt_in=True):
        if os.geteuid() != 0:
            pytest.skip("the case of a root server")
        with pytest.raises(sandbox.SandboxUnavailable, match=r"bubblewrap.*Python every user can run"):
            sandbox.run_python("print(open('/etc/shadow').read())")


DAEMON_AND_PARRICIDE = """
import os, signal, sys, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        while True:
            time.sleep(0.05)
    os._exit(0)
os.close(w)
print(os.read(r, 64).decode(), flush=True)
try:
    os.kill(os.getppid(), signal.SIGKILL)  # the supervisor
    print('killed the supervisor', flush=True)
except OSError as err:
    print('supervisor kept', err.errno, flush=True)
time.sleep(60)
"""


def test_unsafe_code_of_a_root_server_cannot_kill_its_supervisor_nor_outlive_it() -> None:
    out = run_python_as("root", DAEMON_AND_PARRICIDE, unsafe=True, timeout_s=1)
    daemon, verdict = out["stdout"].split("\n")[:2]
    assert verdict.startswith("supervisor kept"), out["stdout"]
    assert not alive(int(daemon))  # the double-forked setsid daemon died with its sandbox


def test_two_unsafe_sandboxes_of_a_root_server_cannot_read_each_others_files() -> None:
    meet = Path("/tmp") / f"rollart-meet-{uuid.uuid4().hex}"
    owner = f"""
import os, time
with open('secret', 'w') as f:
    f.write('s3cret')
with open({str(meet)!r} + '.tmp', 'w') as f:
    f.write(os.path.abspath('secret'))
os.chmod({str(meet)!r} + '.tmp', 0o644)
os.rename({str(meet)!r} + '.tmp', {str(meet)!r})
end = time.monotonic() + 20
while not os.path.exists({str(meet)!r} + '.done') and time.monotonic() < end:
    time.sleep(0.02)
print(os.getuid())
"""
    thief = f"""
import os, time
end = time.monotonic() + 20
while not os.path.exists({str(meet)!r}) and time.monotonic() < end:
    time.sleep(0.02)
path = open({str(meet)!r}).read()
try:
    print(open(path).read())
except OSError as err:
    print('refused', err.errno)
open({str(meet)!r} + '.done', 'w').close()
print(os.getuid())
"""
    results: dict[str, dict] = {}

    def run(name: str, code: str) -> None:
        results[name] = run_python_as("root", code, unsafe=True, timeout_s=30)

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("owner", owner), ("thief", thief))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for leftover in (meet, Path(str(meet) + ".done"), Path(str(meet) + ".tmp")):
            leftover.unlink(missing_ok=True)
    stolen, thief_uid = results["thief"]["stdout"].split("\n")[:2]
    assert stolen.startswith("refused"), results
    assert thief_uid != results["owner"]["stdout"].split("\n")[0]  # and a process limit each: their own uid


@pytest.mark.parametrize("server", SERVERS)
def test_a_non_root_server_says_plainly_that_unsafe_code_runs_as_itself(server: str) -> None:
    out = run_python_as(server, "import os\nprint(os.getuid())", unsafe=True)
    said = out["describe"]
    assert "UNSAFE, NO ISOLATION" in said
    if server == "nobody":
        assert int(out["stdout"]) == 65534
        assert "this server's own uid" in said and "kill" in said and "process limit" in said


@pytest.mark.parametrize("mode", ["bwrap", "unsafe-root", "unsafe-nobody"])
def test_a_child_killed_by_a_signal_is_reported_as_killed(mode: str) -> None:
    if mode == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("needs bubblewrap")
    code = "import os, signal\nprint('before', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n"
    server = "nobody" if mode == "unsafe-nobody" else "root"
    out = run_python_as(server, code, unsafe=mode != "bwrap")
    assert out["stdout"] == "before\n" and out["killed_by"] == "SIGKILL", out
    assert out["returncode"] == -9, out


def test_no_process_of_an_unsafe_sandbox_uid_is_left() -> None:
    # a daemon (double fork, its own session) left running as the code exits at once
    code = (
        "import os, time\nprint(os.getuid(), flush=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\n"
    )
    out = run_python_as("root", code, unsafe=True)
    assert out["returncode"] == 0 and not out["timed_out"], out
    assert processes_of_uid(int(out["stdout"])) == []
