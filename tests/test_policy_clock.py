"""The policy version has one owner (rollart.rollout.policy_clock.PolicyClock): the trainer's and the served
version move only through its methods; the scheduler, the LLMProxy and the pipeline read it and cannot
write it, and no module assigns its fields."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rollart.rollout.policy_clock import PolicyClock

ROOT = Path(__file__).resolve().parents[1]


def test_the_clock_moves_only_through_its_methods() -> None:
    clock = PolicyClock()
    assert (clock.trained, clock.served) == (0, 0)
    assert clock.step_trained() == 1 and clock.step_trained() == 2
    clock.serve(2)
    clock.restored(7)  # a resumed run's trainer, from its checkpoint
    assert (clock.trained, clock.served) == (7, 2)
    clock.serve(9)
    assert clock.after_restart() == 10  # newer than anything trained or served
    with pytest.raises(AttributeError):
        clock.trained = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        clock.served = 3  # type: ignore[misc]


def test_the_readers_have_no_setter() -> None:
    from rollart.pipelines.agentic import AgenticPipeline
    from rollart.rollout.llm_proxy import LLMProxy
    from rollart.rollout.scheduler import RolloutScheduler

    for owner, name in ((RolloutScheduler, "version"), (LLMProxy, "version"), (AgenticPipeline, "train_version")):
        attr = getattr(owner, name)
        assert isinstance(attr, property) and attr.fset is None, f"{owner.__name__}.{name} can be written"


def test_no_module_assigns_a_policy_version_but_the_clock() -> None:
    """Assignments to ``*.version``, ``*.train_version`` or the clock's fields in the driver's code (the
    rollout, the pipeline and its parts, the ready pipelines): only the clock writes them. A trainer's own
    version (training/) is its checkpointed state, set by the pipeline from the clock; ``rollart replay``
    (pipeline/replay.py) runs no rollout and reports the version of the checkpoint it wrote."""
    written = []
    folders = ["rollart/rollout", "rollart/pipeline", "rollart/serving", "pipelines"]
    for path in sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py")):
        if path.name in ("policy_clock.py", "replay.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in ("version", "train_version", "_trained", "_served"):
                    written.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(t)}")
    assert written == []
