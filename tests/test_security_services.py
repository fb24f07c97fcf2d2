"""Hostile surroundings of the services' command lines: tokens that must leave every process's
environment (``--workers``), a working directory whose modules must not run as the server, a server
bound off the loopback without a token."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from reward_fixtures import free_port, start_reward_server
from security_fixtures import descendants, wait_until

pytestmark = pytest.mark.timeout(300)
TOKEN = "services-suite-token-0123456789"
TRAJ = {"trajectories": [{"response": "abc"}]}


def environ_of(pid: int) -> bytes:
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        return Path(f"/proc/{pid}/environ").read_bytes()
    return b""


def test_reward_workers_their_master_and_its_helpers_hold_no_token() -> None:
    """``--workers 2``: the uvicorn master, its worker processes and multiprocessing's resource tracker
    never hold the token in their environment; the workers still authenticate with it."""
    port = free_port()
    env = {**os.environ, "REWARD_TOKEN": TOKEN}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    proc = start_reward_server(["pid=reward_fixtures:process_id", "--workers", "2", "--token-env", "REWARD_TOKEN"],
                               port, env)  # fmt: skip
    try:
        below = descendants(proc.pid)
        assert len(below) >= 2  # two workers (and a resource tracker where multiprocessing started one)
        for pid in [proc.pid, *below]:
            assert TOKEN.encode() not in environ_of(pid), Path(f"/proc/{pid}/cmdline").read_bytes()
        url = f"http://127.0.0.1:{port}/rewards/pid"
        assert httpx.post(url, json=TRAJ).status_code == 401
        served = {httpx.post(url, json=TRAJ, headers={"Authorization": f"Bearer {TOKEN}"}).json()["result"][0]
                  for _ in range(6)}  # fmt: skip
        assert served <= {float(p) for p in below}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_serve_env_runs_no_module_of_the_working_directory_in_place_of_its_own(tmp_path: Path) -> None:
    """A ``yaml.py`` and an ``h11.py`` in the directory ``rollart serve env`` starts in stay unimported
    (the server's own modules come first); a user's env module there is still found."""
    marker = tmp_path / "hijacked"
    for name in ("yaml", "h11", "httptools", "uvicorn", "fastapi"):
        (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write('{name} ')\nraise SystemExit(7)\n")
    (tmp_path / "my_envs.py").write_text(
        "from rollart.envs.reverse import ReverseTask\n\nclass Mine(ReverseTask):\n    pass\n"
    )
    port = free_port()
    # -P: the interpreter itself does not put the working directory first (as the `rollart` script runs)
    cmd = [sys.executable, "-P", "-m", "rollart.cli", "serve", "env", "reverse", "mine=my_envs:Mine"]
    proc = subprocess.Popen([*cmd, "--port", str(port)], cwd=tmp_path, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip

    def up() -> bool:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(up, 60, "the env server answers /healthz")
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").json()["envs"] == ["mine", "reverse"]
        r = httpx.post(f"http://127.0.0.1:{port}/describe", json={"env": "mine", "kwargs": {"length": 4}})
        assert r.status_code == 200 and r.json()["tag"] == "reverse-4"
        assert not marker.exists(), marker.read_text()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.parametrize("service", ["rewards", "env"])
def test_serve_warns_when_it_listens_beyond_the_loopback_without_a_token(service: str) -> None:
    """Bound to an address other hosts may reach (192.0.2.1, a documentation address no machine has, so
    nothing is ever exposed: binding it fails after the warning), a server without a token says so."""
    target = "rollart.reward.builtin:math_answer" if service == "rewards" else "reverse"
    env = {**os.environ, "SERVICE_TOKEN": TOKEN}
    for extra, warned in (([], True), (["--token-env", "SERVICE_TOKEN"], False)):
        cmd = [sys.executable, "-m", "rollart.cli", "serve", service, target, "--host", "192.0.2.1", *extra]
        done = subprocess.run([*cmd, "--port", str(free_port())], env=env, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip
        assert done.returncode != 0  # the address is not this machine's
        assert ("without a token" in done.stderr) is warned, done.stderr[-2000:]


@pytest.mark.parametrize("existing", [False, True])
def test_the_ray_token_of_a_local_ray_is_readable_by_its_owner_only(tmp_path: Path, existing: bool) -> None:
    """A local Ray started by rollart with token authentication (Ray's default) has its token in
    ``~/.ray/auth_token`` mode 0600 (Ray writes it 0644); an existing token file of the user that others
    can read is made 0600 too."""
    token = tmp_path / ".ray" / "auth_token"
    if existing:
        token.parent.mkdir()
        token.write_text("f" * 64)
        token.chmod(0o644)
    driver = (
        "import ray\n"
        "from rollart.resource_manager.launcher import ensure_ray\n"
        "ensure_ray({'CPU': 1}, job_id='token-mode-test')\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert token.is_file() and token.stat().st_mode & 0o777 == 0o600, oct(token.stat().st_mode)
    assert existing or token.parent.stat().st_mode & 0o077 == 0
    assert (token.read_text() == "f" * 64) is existing  # an existing token is kept
