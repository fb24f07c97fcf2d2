"""The README and the documentation site: what a newcomer runs first, links that resolve, papers cited by
title, and a configuration reference that covers (and describes) every config key."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from rollart.config_reference import markdown, page, sections, undocumented

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_the_readme_has_the_two_set_up_commands_and_stays_short():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    install, tests = bash_blocks(text)
    # one command that makes and activates the venv, installs and runs the quickstart: the commands that
    # follow it (here and in the docs) say `rollart`, so the venv must be active in that shell
    assert install.count("\n") == 0 and ". .venv/bin/activate" in install
    assert install.startswith("python3 -m venv .venv") and install.endswith("rollart run quickstart")
    assert tests == "bash scripts/test.sh"
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_getting_started_begins_with_the_readme_command():
    page = (DOCS / "getting-started.md").read_text()
    assert bash_blocks(page)[0] == bash_blocks(README.read_text())[0]


@pytest.mark.parametrize("path", [README, ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_papers_are_cited_by_title_and_only_files_of_the_repository(path):
    text = path.read_text()
    assert not re.search(r"\bseed 00\d", text, flags=re.I), "cite the paper by its title"
    assert "DESIGN.md" not in text
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (path.parent / target).exists(), f"{path.name} links to {target}, which does not exist"


def test_every_docs_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    assert {p.name for p in DOCS.glob("*.md")} == set(re.findall(r":\s+(\S+\.md)\s*$", nav, flags=re.M))


def test_the_home_page_links_every_page():
    text = (DOCS / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w-]+\.md)(?:#[^)]*)?\)", text))
    assert {p.name for p in DOCS.glob("*.md")} - {"index.md"} <= linked


def test_the_gpus_page_says_which_hardware_a_cpu_machine_declares_as_the_code_does(monkeypatch):
    """A machine without GPUs declares the types of cluster.local_resources when it is set (every shipped
    config sets it but those the page names), and refuses a pool naming another type before Ray starts."""
    from rollart.config import load_config, shipped_configs
    from rollart.resource_manager import launcher, manager
    from rollart.resource_manager.specs import ResourceSpecError

    text = (DOCS / "gpus.md").read_text()
    bullet = re.search(r"- `cluster.local_resources` set \(as in every shipped config but ([^,]+), e.g.", text)
    unset = sorted(re.findall(r"`(\w+)`", bullet.group(1)))
    assert unset == sorted(n for n in shipped_configs() if load_config(n).cluster.local_resources is None)
    assert "skipped: not built" not in text  # quickstart_colocated ships
    monkeypatch.setattr(manager, "starts_local_ray", lambda: True)
    monkeypatch.setattr(launcher, "detect_gpus", lambda: launcher.DetectedGpus())
    with pytest.raises(ResourceSpecError) as err:
        manager.check_local_pools({"train": {"hardware": "GPU", "devices": 1}}, {"CPU": 4})
    quoted = re.search(r"\(`(pools\.train\.hardware: 'GPU' is not in the local Ray[^`]*?); \.\.\.\)`", text)
    assert quoted and str(err.value).startswith(quoted.group(1)), (quoted, str(err.value))
    # without local_resources the pools' own types are declared as logical devices
    plan = manager.check_local_pools({"train": {"hardware": "GPU", "devices": 1}}, None)
    assert plan is not None and plan.logical == {"GPU": 1.0}


def test_the_agents_page_says_what_the_examples_first_run_spends_before_training():
    """The calculator example warms its starting policy up for minutes before the first step: the page
    says so where it gives the command, with the warm-up's steps as run.py's default has them."""
    text = (DOCS / "agents.md").read_text()
    after = text.split("cd examples/calculator_agent && python run.py --out runs\n```", 1)[1].split("\n\n")[2]
    default = re.search(
        r'"--warmup-steps", type=int, default=(\d+)', (ROOT / "examples/calculator_agent/run.py").read_text()
    )
    assert re.search(r"about \d+ minutes", after) and f"warm-up of {default.group(1)} steps" in after, after
    assert (
        "building the starting policy" in after
        and "building the starting policy" in (ROOT / "examples/calculator_agent/warmup.py").read_text()
    )


def test_every_config_field_has_a_description():
    assert undocumented() == []


def test_the_config_reference_lists_every_key_of_every_section():
    text = markdown()
    for section in sections():
        assert f"{{#{section.anchor}}}" in text
        for name in section.model.model_fields:
            assert f"| `{name}` |" in text, f"{section.path}.{name} is missing"
    # a few rows in full: type with its bound, default, description
    assert re.search(r"\| `steps` \| integer \(≥ 1\) \| `20` \| \S", text)
    assert re.search(r'\| `sharding` \| `"ddp"` \\\| `"fsdp"` \| `"ddp"` \| \S', text)
    assert re.search(r"\| `pools` \| mapping of string to any \| required \| \S", text)


def test_the_committed_config_reference_is_the_one_the_models_generate():
    """docs/config.md holds the generated reference (it reads whole as Markdown, without the site)."""
    text = (DOCS / "config.md").read_text()
    assert text == page(text), "docs/config.md is stale: python -m rollart.config_reference --write docs/config.md"
    assert markdown() in text and "| `alpha` | integer | `0` | The asynchronous bound" in text


def test_the_architecture_page_names_every_layer_package_and_example():
    import tomllib

    text = (DOCS / "architecture.md").read_text()
    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    for layer in layers:
        assert re.search(rf"^{re.escape(layer)}\s", block, flags=re.M), f"layer {layer!r} is not on the page"
    layout = text.split("## Layout", 1)[1]
    for package in sorted(p.name for p in (ROOT / "rollart").iterdir() if (p / "__init__.py").exists()):
        assert f"rollart/{package} " in layout, f"rollart/{package} is not in the layout"
    examples = layout.split("examples/", 1)[1].split("\ndocs/", 1)[0]
    for example in sorted(p.name for p in (ROOT / "examples").iterdir() if not p.name.startswith((".", "_"))):
        assert example in examples, f"examples/{example} is not in the layout"


def test_code_cites_papers_by_title_and_no_file_outside_the_repository():
    """Comments and docstrings name the papers (see docs/index.md), never a document number or a file
    that is not in the repository."""
    pattern = re.compile(r"\bseed 00\d|DESIGN\.md|shared/seeds|00\d_[0-9a-f]{16}\.txt", flags=re.I)
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    offenders = [
        f"{name}:{n}"
        for name in listed.split()
        if name.endswith((".py", ".yaml", ".sh", ".toml")) and name != "tests/test_docs.py"
        for n, line in enumerate((ROOT / name).read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
