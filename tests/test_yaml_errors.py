"""A YAML syntax error in a config is one line naming the file, the line and the column, from the
library and from `rollart run` (no traceback, exit code 2)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from rollart.config import ConfigError, load_config

GOOD_TOP = "name: t\npools:\n  train: {hardware: CPU, cpus: 1}\n"


@pytest.mark.parametrize(
    ("text", "line", "column", "what"),
    [
        (GOOD_TOP + "  rollout: {hardware: CPU, cpus: 1\nenvs: []\n", 5, 5, "flow mapping (from line 4, column 12)"),
        ("name: t\n  pools: 1\n", 2, 8, "mapping values are not allowed here"),
        (GOOD_TOP + "envs:\n\t- {name: reverse}\n", 5, 1, "found character '\\t'"),
    ],
)
def test_a_syntax_error_names_file_line_and_column(tmp_path, text, line, column, what):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}:{line}:{column}: YAML syntax error: "), msg
    assert what in msg


def test_a_config_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("- name: t\n")
    with pytest.raises(ConfigError, match=r"job.yaml: a config is a mapping of keys .* not a list"):
        load_config(path)


def test_rollart_run_prints_the_one_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: t\n  pools: 1\n")
    out = subprocess.run(
        [sys.executable, "-m", "rollart.cli", "run", str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "<unicode string>" not in out.stderr
    assert re.search(rf"{re.escape(str(path))}:2:8: YAML syntax error: mapping values are not allowed here", out.stderr)
