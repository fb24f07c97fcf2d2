"""Ctrl-C stops a run even where a library swallows the cancellation it causes (rollart.pipeline.interrupt)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from rollart.pipeline.interrupt import Interrupt


def test_a_swallowed_cancellation_still_stops_the_loop_at_the_next_step_and_raises_keyboard_interrupt():
    before = signal.getsignal(signal.SIGINT)  # Python's, or SIG_IGN where the test runner started with it ignored
    interrupt = Interrupt()
    seen = {"steps": 0, "swallowed": 0, "finally": False}

    async def steps() -> None:
        try:
            for _ in range(1000):  # never stopped: the coroutine ends and the test fails, it does not hang
                interrupt.check()
                if seen["steps"] == 1:
                    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during the second step
                try:
                    await asyncio.sleep(0)  # the cancellation lands here...
                except asyncio.CancelledError:
                    if seen["swallowed"]:
                        raise
                    seen["swallowed"] += 1  # ...and a library swallows it
                seen["steps"] += 1
        finally:
            seen["finally"] = True  # the run's own clean-up (ledger, trackers) still runs

    with pytest.raises(KeyboardInterrupt):
        interrupt.run(steps())
    assert interrupt.requested
    assert seen == {"steps": 2, "swallowed": 1, "finally": True}  # stopped at the very next step boundary
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back


def test_a_run_without_sigint_returns_its_result_and_an_error_stays_that_error():
    before = signal.getsignal(signal.SIGINT)
    assert Interrupt().run(asyncio.sleep(0, result=7)) == 7

    async def fails() -> None:
        raise ValueError("a step failed")

    with pytest.raises(ValueError, match="a step failed"):
        Interrupt().run(fails())
    assert signal.getsignal(signal.SIGINT) is before


def test_a_second_sigint_interrupts_at_once():
    before = signal.getsignal(signal.SIGINT)
    interrupt = Interrupt()

    async def deaf() -> None:  # a coroutine that never reaches a step boundary
        os.kill(os.getpid(), signal.SIGINT)
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            pass
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # not interrupted: the coroutine ends and the test fails
            await asyncio.sleep(0)

    with pytest.raises(KeyboardInterrupt):
        interrupt.run(deaf())
    assert signal.getsignal(signal.SIGINT) is before


def test_sigint_ignored_by_the_launching_shell_still_stops_the_run_and_stays_ignored_after():
    """A shell starts a background command with SIGINT ignored (and Ray passes that on to a submitted
    job's driver): SIGINT is still how `rollart stop` ends the run."""
    interrupt = Interrupt()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:

        async def steps() -> None:
            for _ in range(1000):  # not stopped: the coroutine ends and the test fails, it does not hang
                interrupt.check()
                os.kill(os.getpid(), signal.SIGINT)
                await asyncio.sleep(0)

        with pytest.raises(KeyboardInterrupt):
            interrupt.run(steps())
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_while_the_pipeline_starts_ends_the_command_with_130_and_says_nothing_was_trained(
    monkeypatch, tmp_path, capsys
):
    """SIGINT can land before the step loop (workers still starting, `rollart stop` on a job just admitted):
    the command ends as a stopped run does, without a traceback."""
    from rollart.cli import main
    from rollart.cli import run as run_cli

    def interrupted(cfg, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_cli, "build_pipeline", interrupted)
    code = main(["run", "quickstart", "--set", f"output_dir={tmp_path / 'run'}"])
    assert code == 130
    err = capsys.readouterr().err
    assert "stopped while starting, before the first step; nothing was trained" in err
    # the same command starts it again: the folder holds no checkpoint, so it is reused as it is
    assert f"start again with `rollart run quickstart --set output_dir={tmp_path / 'run'}`" in err
    from rollart.cli.run_dir import run_dir_problem

    assert run_dir_problem(tmp_path / "run", resume=False, overwrite=False, command="rollart run quickstart") is None


def test_a_first_sigint_can_let_the_step_finish_and_a_second_one_cancels_it():
    """With on_first choosing to finish: the step in progress completes, the loop stops at the boundary
    (where the pipeline writes its checkpoint); a SIGINT during that finish cancels the step instead."""
    before = signal.getsignal(signal.SIGINT)
    chosen = []
    interrupt = Interrupt(on_first=lambda: chosen.append("finish") or True)
    done = []

    async def steps(kill_again: bool) -> None:
        for step in range(1000):
            interrupt.check()
            if step == 1:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during the second step
                await asyncio.sleep(0)  # the choice is made on the loop
                await asyncio.sleep(0)
                assert interrupt.finishing
                if kill_again:
                    os.kill(os.getpid(), signal.SIGINT)  # and again while it finishes
                for _ in range(3):
                    await asyncio.sleep(0)  # the rest of the step: not cancelled by the first SIGINT
            done.append(step)

    with pytest.raises(KeyboardInterrupt):
        interrupt.run(steps(kill_again=False))
    assert chosen == ["finish"] and done == [0, 1]  # step 1 finished, step 2 never began
    assert signal.getsignal(signal.SIGINT) is before

    interrupt = Interrupt(on_first=lambda: True)
    done.clear()
    with pytest.raises(KeyboardInterrupt):
        interrupt.run(steps(kill_again=True))
    assert done == [0] and not interrupt.finishing  # the second SIGINT cancelled step 1 in its middle


def test_the_first_ctrl_c_checkpoints_only_when_finishing_the_step_and_saving_are_cheap(tmp_path):
    from rollart.pipeline.interrupt import CHEAP_STOP_S, StopChoice

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    choice = StopChoice(tmp_path)
    finish, line = choice.decide(step=1, unsaved=0, last_checkpoint=None)
    assert not finish and "no step has finished yet" in line and "from the start (no checkpoint yet)" in line
    choice.step_done(0.4)
    finish, line = choice.decide(step=7, unsaved=6, last_checkpoint=None)  # the save estimated from the model
    assert finish and line.startswith("Ctrl-C: finishing step 7 (about 0.4 s) and writing a checkpoint")
    assert "press Ctrl-C again to stop at once" in line
    choice.saved(CHEAP_STOP_S)  # a measured save: too slow
    finish, line = choice.decide(step=47, unsaved=6, last_checkpoint="step-00000040")
    assert not finish
    assert line == (
        "Ctrl-C: stopping now, without a checkpoint: finishing step 47 (about 0.4 s) and writing one (about 30 s) "
        "would take longer than 30 s; the run continues from step-00000040: 7 step(s) done again"
    )
    hub = StopChoice("a-model-on-the-hub")
    hub.step_done(0.4)
    finish, line = hub.decide(step=3, unsaved=2, last_checkpoint=None)
    assert (
        not finish and "its cost is unknown until the run writes one" in line
    )  # no local files and no checkpoint yet: the cost is unknown (say so)
