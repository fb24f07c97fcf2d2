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
