"""Text envs: registry, determinism, solvable generated levels, noisy actions, truncation, verifiers,
the tokenizer corpus and the fault-injection wrappers."""

import asyncio
import itertools
import pickle
import string
import threading
import time

import pydantic
import pytest

from rollart.envs import EnvError, EnvSpec, EnvTimeout, make_env, registered_envs
from rollart.envs.actions import parse_direction
from rollart.envs.corpus import task_corpus
from rollart.envs.faults import AsyncFailingEnv, AsyncLatencyEnv, FailingEnv, LatencyEnv, ScaledClock, VirtualClock
from rollart.envs.frozen_lake import MOVES, WORDS, solvable
from rollart.envs.verifiable import AdditionTask, CountdownTask, ReverseTask, sample_prompts, verify

ALL = ["frozen_lake", "sokoban", "reverse", "addition", "countdown"]


def wait_until(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.005)


# --- registry -------------------------------------------------------------------------------------


def test_registry_builds_every_env_and_rejects_bad_specs_by_name():
    assert set(ALL) <= set(registered_envs())
    env = make_env(EnvSpec(name="frozen_lake", tag="Lake", max_steps=3, max_new_tokens=2, kwargs={"size": 3}))
    assert (env.tag, env.max_steps, env.max_new_tokens, env.size) == ("Lake", 3, 2, 3)
    assert make_env({"name": "reverse", "kwargs": {"length": 5}}).tag == "reverse-5"
    with pytest.raises(ValueError, match="not registered"):
        make_env("nope")
    with pytest.raises(ValueError, match=r"unknown kwargs \['sise'\]"):
        make_env("frozen_lake", sise=4)
    with pytest.raises(ValueError, match="hole_prob"):
        make_env("frozen_lake", hole_prob=1.0)
    with pytest.raises(ValueError, match="boxes=9"):
        make_env("sokoban", size=4, boxes=9)
    with pytest.raises(pydantic.ValidationError, match="max_steps"):
        EnvSpec(name="sokoban", max_steps=0)


@pytest.mark.parametrize("name", ALL)
def test_episodes_are_deterministic_by_seed(name):
    a, b = make_env(name), make_env(name)
    assert a.reset(11) == b.reset(11)
    assert len({a.reset(s)[0] for s in range(8)}) > 1
    a.reset(4), b.reset(4)
    for action in ["Left", "up", "x", "D"]:
        ra, rb = a.step(action), b.step(action)
        assert ra == rb
        if ra[2] or ra[3]:
            break


def test_instructions_are_prepended_on_request():
    for name in ALL:
        plain, told = make_env(name), make_env(name, with_instructions=True)
        assert told.instructions and told.reset(2)[0] == f"{told.instructions}\n{plain.reset(2)[0]}"


# --- action parsing -------------------------------------------------------------------------------


def test_direction_parser_reads_noisy_text():
    cases = {
        "Left": "L",
        "d": "D",
        " RIGHT\n": "R",
        "I think up is best": "U",
        "<answer>down</answer> not left": "D",
        "go north": "U",
        "→": "R",
        "r.": "R",
        "jump": None,
        "": None,
        "upward": None,
        "lemon": None,
    }
    for text, move in cases.items():
        assert parse_direction(text) == move, text


# --- FrozenLake -----------------------------------------------------------------------------------


@pytest.mark.parametrize("size,hole_prob", [(3, 0.2), (4, 0.5), (6, 0.7)])
def test_frozen_lake_maps_are_solvable_and_the_bfs_plan_reaches_the_goal(size, hole_prob):
    for seed in range(25):
        env = make_env("frozen_lake", size=size, hole_prob=hole_prob, max_steps=4 * size)
        obs, info = env.reset(seed)
        assert obs.count("P") == 1 and obs.count("G") == 1 and obs.endswith("move:")
        plan = info["solution"]
        assert plan and plan == solvable(env.grid)
        for i, a in enumerate(plan):
            obs, reward, terminated, truncated, step_info = env.step(f"I move {WORDS[a]}.")
            assert step_info["valid"] and not truncated
            assert terminated == (i == len(plan) - 1)
        assert reward == 1.0 and step_info["success"]
        assert env.grid[env.pos[0]][env.pos[1]] == "G"


def test_frozen_lake_hole_edge_and_slippery():
    env = make_env("frozen_lake", size=4, hole_prob=0.4)
    for seed in itertools.count():
        env.reset(seed)
        r, c = env.pos
        into = [
            a
            for a, (dr, dc) in MOVES.items()
            if 0 <= r + dr < 4 and 0 <= c + dc < 4 and env.grid[r + dr][c + dc] == "H"
        ]
        if into:
            break
    _, reward, terminated, _, info = env.step(WORDS[into[0]])
    assert (reward, terminated, info["success"]) == (0.0, True, False)
    with pytest.raises(EnvError, match="reset"):
        env.step("Left")

    env = make_env("frozen_lake", size=4, hole_prob=0.0)
    seed = next(s for s in itertools.count() if env.reset(s) and env.pos[0] == 0)  # start on the top row
    before = env.pos
    obs, reward, terminated, _, info = env.step("Up")  # into the edge: stays in place
    assert env.pos == before and info["valid"] and not terminated and obs == env.reset(seed)[0]

    slip_a, slip_b = (
        make_env("frozen_lake", slippery=True, hole_prob=0.0, max_steps=40),
        make_env("frozen_lake", slippery=True, hole_prob=0.0, max_steps=40),
    )
    slip_a.reset(3), slip_b.reset(3)
    moved = []
    for i in range(40):
        ra, rb = slip_a.step("LDRU"[i % 4]), slip_b.step("LDRU"[i % 4])
        assert ra == rb
        moved.append(ra[4]["moved"] != ra[4]["action"])
        if ra[2] or ra[3]:
            break
    assert any(moved)  # a slippery lake does not always obey


def test_invalid_actions_and_max_steps_truncation():
    for name, suffix in [("frozen_lake", "move:"), ("sokoban", "push:")]:
        env = make_env(EnvSpec(name=name, max_steps=3))
        obs, _ = env.reset(1)
        board = obs[: -len(suffix)]
        for i in range(3):
            obs, reward, terminated, truncated, info = env.step("let me think about it")
            assert obs == board + "invalid action; " + suffix and info["valid"] is False
            assert reward == -env.format_penalty and not terminated
            assert truncated == (i == 2)
        with pytest.raises(EnvError, match="reset"):
            env.step("Up")
        env.reset(1)  # a new episode starts over
        assert env.step("?")[3] is False


# --- Sokoban --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [dict(size=6, boxes=1, pulls=8), dict(size=7, boxes=2, pulls=6, wall_prob=0.3), dict(size=5, boxes=1, pulls=2)],
)
def test_sokoban_levels_are_solved_by_replaying_the_generation(kwargs):
    for seed in range(15):
        for key in ("reverse_solution", "solution"):
            env = make_env("sokoban", max_steps=1000, **kwargs)
            obs, info = env.reset(seed)
            assert obs.count("P") + obs.count("S") == 1
            assert obs.count("X") >= 1 and env.boxes != env.targets  # not solved yet
            assert len(env.boxes) == len(env.targets) == kwargs["boxes"]
            total = 0.0
            for i, a in enumerate(info[key]):
                obs, reward, terminated, truncated, step_info = env.step(a)
                total += reward
                assert terminated == (i == len(info[key]) - 1) and not truncated
            assert step_info["success"] and "X" not in obs and obs.count("√") + obs.count("S") >= kwargs["boxes"]
        assert len(info["solution"]) <= len(info["reverse_solution"])


def test_sokoban_rendering_and_rewards_by_hand():
    env = make_env("sokoban", size=5, boxes=1, box_reward=0.5, success_reward=1.0, step_penalty=0.01)
    env.reset(0)
    env.walls = {(r, c) for r in range(5) for c in range(5) if r in (0, 4) or c in (0, 4)} | {(2, 2)}
    env.targets, env.boxes, env.player = frozenset({(1, 3), (3, 1)}), frozenset({(1, 2), (3, 1)}), (1, 1)
    assert env.render() == "#####\n#PXO#\n#_#_#\n#√__#\n#####\n"
    obs, reward, terminated, _, _ = env.step("Right")  # pushes the box onto the last target
    assert obs == "#####\n#_P√#\n#_#_#\n#√__#\n#####\n"
    assert reward == pytest.approx(-0.01 + 0.5 + 1.0) and terminated

    env.reset(0)
    env.walls = {(r, c) for r in range(5) for c in range(5) if r in (0, 4) or c in (0, 4)}
    env.targets, env.boxes, env.player = frozenset({(2, 2), (3, 3)}), frozenset({(2, 2), (1, 3)}), (2, 1)
    obs, reward, terminated, _, info = env.step("R")  # pushes a box off its target; the player stands on it (S)
    assert obs.splitlines()[2] == "#_SX#" and reward == pytest.approx(-0.01 - 0.5) and not terminated
    obs, reward, _, _, info = env.step("R")  # the box is against the wall: nothing moves
    assert info["moved"] is False and reward == pytest.approx(-0.01)


def test_sokoban_max_solution_steps_bounds_the_shortest_solution():
    env = make_env("sokoban", size=6, boxes=1, pulls=8, max_solution_steps=3)
    for seed in range(20):
        assert len(env.reset(seed)[1]["solution"]) <= 3


# --- single-turn verifiable tasks -----------------------------------------------------------------


def test_reverse_prompts_and_partial_credit():
    env = make_env("reverse", length=3)
    assert env.tag == "reverse-3" and env.max_steps == 1 and env.max_new_tokens == 3
    prompt, info = env.reset(1)
    assert len(prompt) == 4 and prompt.endswith("=") and prompt[:3].isalpha()
    word = prompt[:-1]
    obs, reward, terminated, truncated, step_info = env.step(word[::-1])
    assert (obs, reward, terminated, truncated) == ("", 1.0, True, False)
    assert step_info["char_rewards"] == [1.0, 1.0, 1.0]
    assert ReverseTask.verify("cbx", "cba") == pytest.approx(2 / 3)
    assert ReverseTask.verify("cbaa", "cba") == pytest.approx(3 / 4)  # an extra character costs
    assert ReverseTask.verify(" cba\n", "cba") == 1.0
    assert ReverseTask.verify("", "cba") == 0.0 and ReverseTask.verify("abc", "cba") == pytest.approx(1 / 3)


def test_reverse_format_credit_pays_a_share_for_a_well_formed_answer():
    def reward(env, answer: str) -> float:
        env.reset(3)
        return env.step(answer)[1]

    env = make_env("reverse", length=1, format_credit=0.5)
    env.reset(3)
    right = env.ground_truth
    wrong = "a" if right != "a" else "b"
    assert reward(env, right) == 1.0 and reward(env, f" {right}\n") == 1.0
    assert reward(env, wrong) == 0.5  # well formed, wrong letter
    assert reward(env, "7") == 0.0 and reward(env, "") == 0.0
    assert reward(env, right + wrong) == pytest.approx(0.25)  # too long: only accuracy's share, halved
    assert reward(make_env("reverse", length=1), wrong) == 0.0  # no shaping by default
    with pytest.raises(ValueError, match="format_credit must be between 0 and 1"):
        make_env("reverse", format_credit=1.5)


def test_addition_verifier():
    assert AdditionTask.verify(" 46", 46) == 1.0 and AdditionTask.verify("46.", "46") == 1.0
    assert AdditionTask.verify("<answer>46</answer>", 46) == 1.0
    for wrong in ["45", "forty-six", "4_6", "٤٦", "46 47", "", "+"]:
        assert AdditionTask.verify(wrong, 46) == 0.0, wrong
    env = make_env("addition", digits=3)
    for seed in range(10):
        prompt, info = env.reset(seed)
        a, b = prompt.rstrip("=").split("+")
        assert env.step(str(int(a) + int(b)))[1] == 1.0


def test_countdown_verifier_by_hand():
    gt = {"numbers": [3, 4, 5], "target": 12}
    assert CountdownTask.verify("3*4", gt) == 1.0
    assert CountdownTask.verify("(5-3)*4+4", gt) == 0.0  # 4 used twice
    assert CountdownTask.verify("(5+3)*4/3", gt) == 0.0  # 3 used twice
    assert CountdownTask.verify("3*4=12", gt) == 1.0 and CountdownTask.verify("3*4=13", gt) == 0.0
    assert CountdownTask.verify("<answer>4*3</answer>", gt) == 1.0
    assert CountdownTask.verify("3*4.0", gt) == 0.0  # integers only
    assert CountdownTask.verify("12", gt) == 0.0  # 12 is not given
    assert CountdownTask.verify("__import__('os').getcwd()", gt) == 0.0  # never evaluated
    assert CountdownTask.verify("True*12", gt) == 0.0 and CountdownTask.verify("-3*-4", gt) == 0.0
    assert CountdownTask.verify("3*4 +", gt) == 0.0
    zero = {"numbers": [5, 5, 8], "target": 8}
    assert CountdownTask.verify("8/(5-5)", zero) == 0.0  # division by zero
    assert CountdownTask.verify("3+2/(2-2)", {"numbers": [2, 2, 3], "target": 3}) == 0.0  # not "x/0 = 0"
    assert CountdownTask.verify("5/5*8", zero) == 1.0  # a number given twice may be used twice
    assert CountdownTask.verify("8/(3/6)/4/4", {"numbers": [8, 3, 6, 4, 4], "target": 1}) == 1.0  # exact fractions
    env = make_env("countdown", count=4)
    for seed in range(30):
        prompt, info = env.reset(seed)
        truth = info["ground_truth"]
        assert prompt == f"{' '.join(map(str, truth['numbers']))}->{truth['target']}:"
        assert CountdownTask.verify(truth["solution"], truth) == 1.0


def test_sample_prompts_match_resets_and_verify_by_name():
    rows = sample_prompts("reverse", 5, seed=10, length=3)
    env = make_env("reverse", length=3)
    for i, row in enumerate(rows):
        assert row["tag"] == "reverse-3" and (row["prompt"], {"ground_truth": row["ground_truth"]}) == env.reset(10 + i)
        assert verify("reverse", row["ground_truth"], row["ground_truth"]) == 1.0
    rows = sample_prompts("countdown", 5, seed=3, count=4)
    assert all(verify("countdown", r["ground_truth"]["solution"], r["ground_truth"]) == 1.0 for r in rows)
    assert verify("addition", "7", 7) == 1.0 and verify("countdown", "2+2", {"numbers": [2, 2], "target": 4}) == 1.0
    with pytest.raises(ValueError, match="unknown"):
        sample_prompts("sudoku", 1)


# --- corpus ---------------------------------------------------------------------------------------


def test_corpus_covers_what_the_envs_show():
    corpus = task_corpus(200, seed=0)
    assert corpus == task_corpus(200, seed=0) and len(corpus) > 200
    chars = set("".join(corpus))
    assert set(string.ascii_lowercase + string.digits) <= chars
    shown = []
    for name in ALL:
        env = make_env(name)
        for seed in range(1000, 1010):
            shown.append(env.reset(seed)[0])
            shown.append(env.step("Down")[0])
    assert set("".join(shown)) <= chars
    assert any("->" in line and ":" in line for line in corpus)  # countdown prompts with answers


# --- fault injection ------------------------------------------------------------------------------


def test_latency_env_waits_on_its_clock_and_passes_results_through():
    clock = VirtualClock()
    draws = iter([2.0, 0.5, -1.0, 3.0])
    env = LatencyEnv(
        make_env("addition"), reset_latency=lambda: next(draws), step_latency=lambda: next(draws), clock=clock
    )
    assert not isinstance(env, AsyncLatencyEnv) and env.tag == "addition" and env.max_steps == 1
    prompt, info = env.reset(5)
    assert (prompt, info) == make_env("addition").reset(5) and clock.now == 2.0
    assert env.step(str(info["ground_truth"]))[1] == 1.0 and clock.now == 2.5
    env.reset(6)
    assert clock.now == 2.5 and env.total_latency == 2.5  # a negative draw waits nothing

    async def run():
        aenv = LatencyEnv(make_env("reverse"), step_latency=lambda: 1.0, clock=ScaledClock(0.001))
        assert isinstance(aenv, AsyncLatencyEnv)
        prompt, info = await aenv.reset(1)
        return await aenv.step(info["ground_truth"]), aenv.total_latency

    (obs, reward, terminated, _, _), waited = asyncio.run(run())
    assert reward == 1.0 and terminated and waited == 1.0
    with pytest.raises(ValueError, match="async sleep"):
        LatencyEnv(AsyncLatencyEnv(make_env("reverse"), clock=ScaledClock(1.0)), clock=VirtualClock())


def test_failing_env_raises_env_errors_reproducibly():
    env = FailingEnv(make_env("frozen_lake"), fail_prob_reset=1.0)
    with pytest.raises(EnvError, match="injected reset"):
        env.reset(0)
    pattern = []
    for _ in range(2):
        env = FailingEnv(make_env("reverse"), fail_prob_reset=0.5, seed=7)
        outcome = []
        for s in range(20):
            try:
                env.reset(s)
                outcome.append(True)
            except EnvError:
                outcome.append(False)
        pattern.append(outcome)
        assert env.failures == outcome.count(False)
    assert pattern[0] == pattern[1] and True in pattern[0] and False in pattern[0]

    def outcomes(e, n=10):
        out = []
        for s in range(n):
            try:
                out.append(e.reset(s)[0])
            except EnvError:
                out.append(None)
        return out

    env = FailingEnv(make_env("reverse"), fail_prob_reset=0.5, seed=3)
    outcomes(env, 3)
    clone = pickle.loads(pickle.dumps(env))  # envs can be shipped to another process mid-stream
    assert outcomes(clone) == outcomes(env) and None in outcomes(env, 20)
    fine = FailingEnv(make_env("reverse"), fail_prob_step=0.0)
    _, info = fine.reset(0)
    assert fine.step(info["ground_truth"])[1] == 1.0
    with pytest.raises(ValueError, match="fail_prob_step"):
        FailingEnv(make_env("reverse"), fail_prob_step=1.5)


def test_failing_env_hang_ends_on_release_or_timeout():
    env = FailingEnv(make_env("reverse"), fail_prob_step=1.0, hang=True)
    env.reset(0)
    errors: list[BaseException] = []

    def call():
        try:
            env.step("abc")
        except BaseException as err:
            errors.append(err)

    t = threading.Thread(target=call)
    t.start()
    wait_until(lambda: env.hung == 1)
    assert not errors  # still hanging
    env.release()
    t.join(timeout=10)
    assert not t.is_alive() and isinstance(errors[0], EnvTimeout)
    with pytest.raises(EnvTimeout):
        FailingEnv(make_env("reverse"), fail_prob_reset=1.0, hang=True, hang_timeout_s=0.01).reset(0)

    async def run():
        aenv = FailingEnv(LatencyEnv(make_env("reverse"), clock=ScaledClock(0.001)), fail_prob_step=1.0, hang=True)
        assert isinstance(aenv, AsyncFailingEnv)
        await aenv.reset(0)
        task = asyncio.ensure_future(aenv.step("x"))
        deadline = time.monotonic() + 10
        while aenv.hung == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0)
        assert not task.done()
        aenv.release()
        with pytest.raises(EnvTimeout):
            await asyncio.wait_for(task, 10)

    asyncio.run(run())
