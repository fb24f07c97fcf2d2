"""``cluster.call(Worker.method, ...)`` is checked by a type checker against the method's signature."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_checks_the_arguments_of_a_typed_cluster_call(tmp_path):
    pytest.importorskip("mypy")
    (tmp_path / "snippet.py").write_text(
        textwrap.dedent("""
        import rollart as ra


        class T(ra.Worker):
            @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
            def step(self, x: int, name: str = "a") -> int:
                return x


        def use(c: ra.Cluster) -> None:
            c.call(T.step, 1, name="b")
            c.call_async(T.step, 2)
            c.call(T.step, "wrong")
            c.call_async(T.step, 1, nope=2)
    """)
    )
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\nignore_missing_imports = True\nfollow_imports = silent\n"
        "[mypy-torch.*,ray.*,transformers.*,numpy.*]\nfollow_imports = skip\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", "cache", "snippet.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        env={"MYPYPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, out.stdout
    assert "snippet.py:14:" in errors[0] and 'incompatible type "str"; expected "int"' in errors[0]
    assert "snippet.py:15:" in errors[1] and 'Unexpected keyword argument "nope"' in errors[1]
