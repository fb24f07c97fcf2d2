"""Finding the memory cgroup for code sandboxes (rollart.reward.sandbox_cgroup.detect): each reason a
machine offers none is told, naming what would enable one; and a sandbox that cannot start is a
failure, never a score."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rollart.reward import sandbox, sandbox_cgroup
from rollart.reward.builtin import code_tests
from rollart.reward.sandbox_cgroup import CgroupSupport, detect


def mountinfo(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "mountinfo"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


V1_MEMORY = "30 25 0:26 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory"
V1_CPU = "31 25 0:27 / /sys/fs/cgroup/cpu rw,nosuid - cgroup cgroup rw,cpu"


def fake_cgroup2(tmp_path: Path, controllers: str) -> Path:
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("")
    return root


def test_cgroup_v1_only_is_named_and_not_used(tmp_path: Path) -> None:
    found = detect(mountinfo=mountinfo(tmp_path, V1_MEMORY, V1_CPU), environ={}, euid=0)
    assert found.parent is None
    assert found.reason == "no cgroup v2 file system is mounted (cgroup v1 only, with cpu, memory: not used)"


def test_cgroup_v2_without_its_memory_controller_is_told(tmp_path: Path) -> None:
    root = fake_cgroup2(tmp_path, "hugetlb")
    info = mountinfo(tmp_path, V1_MEMORY, f"32 25 0:28 / {root} rw,nosuid - cgroup2 cgroup2 rw")
    found = detect(mountinfo=info, environ={}, euid=0)
    assert (
        found.parent is None
        and found.reason == f"cgroup v2 at {root} offers no memory controller (cgroup.controllers: hugetlb)"
    )


def test_a_server_that_is_not_root_needs_a_delegated_cgroup(tmp_path: Path) -> None:
    root = fake_cgroup2(tmp_path, "cpu memory pids")
    info = mountinfo(tmp_path, f"32 25 0:28 / {root} rw - cgroup2 cgroup2 rw")
    found = detect(mountinfo=info, environ={}, euid=1000)
    assert found.parent is None and sandbox_cgroup.CGROUP_ENV in found.reason and "Delegate=yes" in found.reason
    outside = detect(mountinfo=info, environ={sandbox_cgroup.CGROUP_ENV: str(tmp_path)}, euid=1000)
    assert outside.parent is None and "is not under a cgroup v2 mount" in outside.reason
    missing = detect(mountinfo=info, environ={sandbox_cgroup.CGROUP_ENV: str(root / "nope")}, euid=1000)
    assert missing.parent is None and "no such cgroup" in missing.reason


def test_this_machine_is_described() -> None:
    found = sandbox_cgroup.support()
    assert (found.parent is not None) == ("memory" in found.controllers)
    assert found.reason
    if shutil.which("bwrap"):
        said = sandbox.describe()
        assert ("memory cgroup per sandbox" in said) if found.parent else (f"no memory cgroup ({found.reason})" in said)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_a_sandbox_that_cannot_start_fails_the_reward_never_scores_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a cgroup the sandbox's first process cannot join: the sandbox never starts the code
    group = tmp_path / "sandbox-broken"
    (group / "cgroup.procs").mkdir(parents=True)
    monkeypatch.setattr(sandbox_cgroup, "support", lambda: CgroupSupport(str(tmp_path), frozenset({"memory"})))
    monkeypatch.setattr(
        sandbox_cgroup.SandboxCgroup, "create", classmethod(lambda cls, found, **_: cls(str(group), found.controllers))
    )
    with pytest.raises(sandbox.SandboxError, match="did not start the code.*cgroup"):
        sandbox.run_python("print('x')")
    with pytest.raises(sandbox.SandboxError):
        code_tests({"response": "print('x')", "ground_truth": {"tests": [{"output": "x"}]}})
