"""Plug-ins from YAML: ``MODULE:NAME`` imports with errors naming the field, envs / pipeline / loss /
aggregation / advantage from a user's module checked against their signatures when the config loads,
every problem in one ConfigError before Ray starts, and the documented plug-in example (docs/pipelines.md) run as written."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rollart.algorithms import aggregate, aggregation_unit, policy_loss, register_loss_agg
from rollart.cluster.batch import Batch
from rollart.config import ConfigError, PipelineConfig, load_config
from rollart.envs import make_env
from rollart.plugins import PipelineLike, PluginError, check_pipeline_class, import_object, signature_problems
from rollart.training import columns as C
from rollart.training.config import TrainConfig
from rollart.training.data import add_advantages

PAGE = Path(__file__).resolve().parent.parent / "docs" / "pipelines.md"
POOLS = {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}}


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write ``name.py`` into ``tmp_path`` (a config's folder); the module and ``sys.path`` are put back
    after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    written = []

    def write(name: str, code: str) -> Path:
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(code))
        written.append(name)
        return path

    yield write
    for name in written:
        sys.modules.pop(name, None)


def write_config(tmp_path: Path, raw: dict, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(raw))  # JSON is YAML
    return path


def base_raw(**over):
    raw = {
        "pools": POOLS,
        "envs": [{"name": "reverse", "groups": 2, "kwargs": {"length": 2}}],
        "rollout": {"num_env_groups": 2, "group_size": 2, "batch_groups": 2},
    }
    raw.update(over)
    return raw


# ---------------------------------------------------------------- import_object


def test_import_object_names_the_field_and_the_fix(tmp_path, user_module):
    user_module("plug_good", "VALUE = 3\nclass Outer:\n    class Inner:\n        pass\n")
    user_module("plug_raises", "raise RuntimeError('boom at import')\n")
    user_module("plug_needs_dep", "import no_such_dependency_xyz\n")
    assert import_object("plug_good:VALUE", "reward.fn", [tmp_path]) == 3
    assert import_object("plug_good:Outer.Inner", "reward.fn").__name__ == "Inner"
    cases = {
        "plug_good": r"reward\.fn: 'plug_good' is not MODULE:NAME; .*e\.g\. my_envs:CopyEnv",
        "plug_good:": r"is not MODULE:NAME",
        "plug_missing_xyz:f": r"reward\.fn: no module named 'plug_missing_xyz' \(looked in .*"
        + re.escape(str(tmp_path))
        + r".*\); put plug_missing_xyz\.py next to the config",
        "plug_raises:f": r"reward\.fn: importing module 'plug_raises' failed: RuntimeError: boom at import",
        "plug_needs_dep:f": r"it imports 'no_such_dependency_xyz', which is not installed",
        "plug_good:VALEU": r"reward\.fn: plug_good \(.*plug_good\.py\) has no attribute 'VALEU'; did you mean 'VALUE'\?",
        "plug_good:Outer.Innr": r"plug_good:Outer .*has no attribute 'Innr'",
    }
    for spec, pattern in cases.items():
        with pytest.raises(PluginError, match=pattern) as err:
            import_object(spec, "reward.fn", [tmp_path])
        assert err.value.field == "reward.fn" and isinstance(err.value, ValueError)


def test_signature_problems_reports_names_missing_arguments_and_types():
    def f(a, b: int, *, c: float = 1.0, d: str = "x"):
        return None

    assert signature_problems(f, {"b": 2, "c": 0.5}, leading=(None,)) == []
    assert signature_problems(f, {"b": 2, "e": 1}, leading=(None,)) == [
        "unknown argument 'e'; accepted: ['b', 'c', 'd']"
    ]
    assert signature_problems(f, {"b": 2, "cc": 1}, leading=(None,))[0].startswith(
        "unknown argument 'cc' (did you mean 'c'?)"
    )
    assert "missing a required argument: 'b'" in signature_problems(f, {}, leading=(None,))[0]
    (bad_type,) = signature_problems(f, {"b": "two"}, leading=(None,))
    assert bad_type.startswith("b='two': Input should be a valid integer")


# ---------------------------------------------------------------- registries and MODULE:FUNC in the algorithms


def test_loss_aggregation_and_advantage_from_a_user_module(tmp_path, user_module):
    user_module(
        "plug_algos",
        """
        import torch
        from rollart.algorithms import register_advantage, register_loss, register_loss_agg

        @register_loss("plug_pg", uses_proximal=False)
        def pg(logprobs, advantages, mask, *, proximal_logprobs, behaviour_logprobs, scale: float = 1.0):
            return -scale * advantages * logprobs, {"scale": scale}

        def unregistered(logprobs, advantages, mask, *, proximal_logprobs, behaviour_logprobs):
            return -advantages * logprobs, {}

        @register_loss_agg("plug_sum", unit="sequence")
        def total(loss, mask, group_ids=None):
            return (loss * mask).sum()

        @register_advantage("plug_shift")
        def shift(rewards, group_ids, *, by: float = 1.0):
            return rewards - by
        """,
    )
    import_object("plug_algos:pg", "plugins", [tmp_path])  # what `plugins: [plug_algos]` does
    lp, adv, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 0.0]])
    loss, metrics = policy_loss("plug_pg", lp, adv, mask, scale=2.0)
    assert float(loss) == pytest.approx(2.0) and metrics["scale"] == 2.0
    loss, _ = policy_loss("plug_algos:unregistered", lp, adv, mask, agg="plug_algos:total")
    assert float(loss) == pytest.approx(1.0)
    assert aggregation_unit("plug_sum") == "sequence" and aggregation_unit("seq-mean-token-mean") == "sequence"
    assert aggregation_unit("plug_algos:total") == "sequence" and aggregation_unit("token-mean") == "token"
    assert float(aggregate(torch.ones(2, 3), torch.ones(2, 3), "plug_sum")) == 6.0
    with pytest.raises(ValueError, match="register_loss_agg.*unit='row'"):
        register_loss_agg("x", unit="row")  # type: ignore[arg-type]

    batch = Batch(
        {
            C.INPUT_IDS: [[1, 2, 3], [4, 5]],
            C.REWARDS: torch.tensor([1.0, 0.5]),
            C.GROUP_INDEX: torch.tensor([0, 0]),
        }
    )
    add_advantages(batch, "plug_shift", params={"by": 0.5})
    assert batch[C.ADVANTAGES] == [[0.5, 0.5, 0.5], [0.0, 0.0]]
    add_advantages(batch, "plug_algos:shift")
    assert batch[C.ADVANTAGES] == [[0.0, 0.0, 0.0], [-0.5, -0.5]]
    add_advantages(batch, "grpo", params={"norm_std": False})  # a registered built-in takes params too
    assert batch[C.ADVANTAGES] == [[0.25, 0.25, 0.25], [-0.25, -0.25]]

    ok = TrainConfig(loss="plug_pg", loss_params={"scale": 0.5}, loss_agg="plug_sum")
    assert ok.loss == "plug_pg"
    with pytest.raises(ValueError) as err:
        TrainConfig(loss="plug_pg", loss_params={"scael": 1.0, "x": 2}, loss_agg="plug_summ")
    text = str(err.value)
    assert "loss_params\n" in text and "unknown argument 'scael' (did you mean 'scale'?)" in text
    assert "loss_agg\n" in text and "did you mean 'plug_sum'?" in text


def test_a_user_env_class_by_module_and_its_kwargs_checked(tmp_path, user_module):
    user_module(
        "plug_envs",
        """
        from rollart.envs import TextEnv

        class Echo(TextEnv):
            tag = "echo"

            def __init__(self, word: str, times: int = 1):
                self.word, self.times = word, times

            def reset(self, seed=None):
                return self.word + "=", {}

            def step(self, action):
                return "", float(action == self.word * self.times), True, False, {}

        class NotAnEnv:
            pass
        """,
    )
    cfg = load_config(
        write_config(
            tmp_path,
            base_raw(envs=[{"name": "plug_envs:Echo", "groups": 2, "kwargs": {"word": "ab", "times": 2}}]),
        )
    )
    env = make_env({"name": cfg.envs[0].name, "kwargs": cfg.envs[0].kwargs})
    assert type(env).__name__ == "Echo" and env.reset(0)[0] == "ab=" and env.step("abab")[1] == 1.0
    bad = [
        {"name": "plug_envs:Echo", "groups": 1, "kwargs": {"times": "twice"}},
        {"name": "plug_envs:NotAnEnv", "groups": 1},
    ]
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, base_raw(envs=bad), "bad.yaml"))
    assert [p.split(":")[0] for p in err.value.problems] == ["envs[0].kwargs", "envs[1].name"]
    assert "missing a required argument: 'word'" in err.value.problems[0]
    assert "times='twice': Input should be a valid integer" in err.value.problems[0]
    assert "not a TextEnv subclass" in err.value.problems[1]


def test_pipeline_class_contract(tmp_path, user_module):
    user_module(
        "plug_pipes",
        """
        class Duck:  # not an AgenticPipeline: the entry points are enough
            def __init__(self, config, *, resume=False, progress=True):
                self.config = config

            def run(self):
                return [{"step": 0, "reward_mean": 1.0}]

            def shutdown(self):
                pass

        class NoRun:
            def __init__(self, config, *, resume=False, progress=True):
                pass

            def shutdown(self):
                pass

        class WrongInit:
            def __init__(self):
                pass

            def run(self):
                return []

            def shutdown(self):
                pass
        """,
    )
    cfg = load_config(write_config(tmp_path, base_raw(pipeline="plug_pipes:Duck")))
    cls = cfg.pipeline_class()
    pipe: PipelineLike = cls(cfg, resume=False, progress=False)
    assert pipe.run() == [{"step": 0, "reward_mean": 1.0}]
    assert load_config(write_config(tmp_path, base_raw(), "plain.yaml")).pipeline_class() is None  # AgenticPipeline
    for name, pattern in {
        "NoRun": r"has no run\(\) method",
        "WrongInit": r"cannot be called .* must take \(config, \*, resume=False, progress=True\)",
    }.items():
        with pytest.raises(PluginError, match=pattern):
            check_pipeline_class(import_object(f"plug_pipes:{name}", "pipeline"))
        with pytest.raises(ConfigError, match=rf"^\S+: pipeline: plug_pipes\.{name}.*{pattern}"):
            load_config(write_config(tmp_path, base_raw(pipeline=f"plug_pipes:{name}"), "bad.yaml"))


def test_advantage_params_go_to_their_estimator_only():
    assert PipelineConfig.model_validate(base_raw(advantage="grpo", advantage_params={"norm_std": False}))
    for raw, pattern in [
        (base_raw(advantage="grpo", advantage_params={"std": False}), "unknown argument 'std'"),
        (base_raw(advantage="grpo_token", advantage_params={"x": 1}), "takes no advantage_params"),
        (base_raw(advantage="grpoo"), "unknown advantage estimator 'grpoo'; did you mean 'grpo'"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            PipelineConfig.model_validate(raw)


def test_unknown_keys_and_failing_plugin_modules_are_named(tmp_path, user_module):
    user_module("plug_broken", "import no_such_dependency_xyz\n")
    raw = base_raw(plugins=["plug_broken", "plug_absent_xyz"], trian={"lr": 1})
    raw["rollout"] = {**raw["rollout"], "batch_group": 2}
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, raw))
    first, second, *rest = sorted(err.value.problems)
    assert first == (
        "plugins[0]: importing module 'plug_broken' failed: it imports 'no_such_dependency_xyz', which is not installed"
    )
    assert re.fullmatch(
        rf"plugins\[1\]: no module named 'plug_absent_xyz' \(looked in .*{re.escape(str(tmp_path))}.* and the "
        r"installed packages\); put plug_absent_xyz\.py next to the config file or in the working directory, or "
        r"install it",
        second,
    )
    assert rest == [
        "rollout.batch_group: unknown key; did you mean 'batch_groups'? remove it or fix its spelling",
        "trian: unknown key; did you mean 'train'? remove it or fix its spelling",
    ]


# ---------------------------------------------------------------- every problem at once, before Ray


FIVE_MISTAKES = {
    "plugins": ["plug_five"],
    "pools": POOLS,
    "envs": [
        {"name": "plug_five:Copy", "groups": 2, "kwargs": {"lenght": 2}},  # 1: a misspelt constructor argument
        {"name": "revrse", "groups": 2},  # 2: an unknown registry name
    ],
    "rollout": {"num_env_groups": 4, "group_size": "two", "batch_groups": 2},  # 3: not a number
    "advantage": "plug_five:nope",  # 4: no such function in the module
    "train": {"loss": "plug_loss", "loss_params": {"temperature": 2.0}},  # 5: a parameter the loss lacks
}
FIVE_FIELDS = ["envs[0].kwargs", "envs[1].name", "rollout.group_size", "advantage", "train.loss_params"]
PLUG_FIVE = """
from rollart.algorithms import register_loss
from rollart.envs import TextEnv

class Copy(TextEnv):
    def __init__(self, length: int = 2):
        self.length = length

    def reset(self, seed=None):
        return "ab=", {}

    def step(self, action):
        return "", 0.0, True, False, {}

@register_loss("plug_loss")
def plug_loss(logprobs, advantages, mask, *, proximal_logprobs, behaviour_logprobs, scale: float = 1.0):
    return -scale * advantages * logprobs, {}
"""


def test_five_mistakes_one_error_naming_every_field(tmp_path, user_module):
    user_module("plug_five", PLUG_FIVE)
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, FIVE_MISTAKES))
    problems = err.value.problems
    assert sorted(p.split(": ")[0] for p in problems) == sorted(FIVE_FIELDS)
    assert str(err.value).startswith(f"{tmp_path / 'config.yaml'}: 5 problems in the config:")
    for field in FIVE_FIELDS:
        assert f"\n  - {field}: " in str(err.value)
    by_field = {p.split(": ")[0]: p for p in problems}
    assert "(did you mean 'length'?)" in by_field["envs[0].kwargs"]
    assert "did you mean 'reverse'?" in by_field["envs[1].name"]
    assert by_field["rollout.group_size"] == "rollout.group_size: expects an integer, got the string 'two'"
    assert "has no attribute 'nope'" in by_field["advantage"]
    assert "unknown argument 'temperature'; accepted: ['scale']" in by_field["train.loss_params"]


def test_cross_section_mistakes_come_with_the_field_mistakes(tmp_path):
    """A pool name, the task groups and the critic are checked across sections; they are reported in
    the same error as a field's own mistake, not only once it is fixed."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "pools: {train: {hardware: CPU, cpus: 1}}\n"
        "envs: [{name: reverse, groups: 3}]\n"
        "rollout: {num_env_groups: 4, group_size: two}\n"
        "advantage: gae\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(config)
    problems = sorted(err.value.problems)
    assert len(problems) == 4
    assert problems[0].startswith("advantage: gae needs a critic")
    assert problems[1] == "envs[*].groups add up to 3 but rollout.num_env_groups is 4; make them equal"
    assert problems[2] == "rollout.group_size: expects an integer, got the string 'two'"
    assert problems[3].startswith("rollout_pool: 'rollout' is not one of pools ['train']")


def test_rollart_run_with_a_bad_config_exits_2_before_ray_starts(tmp_path, user_module):
    """In a fresh process (the test session's Ray must not hide a start): `rollart run` logs the five
    problems and returns 2 without initialising Ray."""
    user_module("plug_five", PLUG_FIVE)
    config = write_config(tmp_path, FIVE_MISTAKES)
    probe = (
        "import json, sys\nfrom rollart.cli import main\nrc = main(['run', sys.argv[1]])\nimport ray\n"
        "print(json.dumps({'rc': rc, 'ray': ray.is_initialized()}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(config)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"rc": 2, "ray": False}, out.stderr
    assert "5 problems in the config" in out.stderr
    for field in FIVE_FIELDS:
        assert f"  - {field}: " in out.stderr


# ---------------------------------------------------------------- the documented example, as written


def page_block(lang: str, first_line: str) -> str:
    text = PAGE.read_text()
    match = re.search(rf"```{lang}\n({re.escape(first_line)}\n.*?)```", text, re.S)
    assert match, f"{PAGE.name} has no ```{lang} block starting with {first_line!r}"
    return match.group(1)


@pytest.mark.timeout(600)
def test_documented_plugin_example_runs_as_written(ray_local, tmp_path, monkeypatch, capsys):
    """The page's my_plugins.py and plugins.yaml, unchanged, through `rollart run plugins.yaml`: the
    user's env next to a registry env, the user's pipeline class, loss and advantage. The Ray workers
    were started from another directory, so the trainer finds my_plugins through the config's folder."""
    from rollart.cli import main

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "my_plugins.py").write_text(page_block("python", "# my_plugins.py, next to the config"))
    (tmp_path / "plugins.yaml").write_text(
        page_block("yaml", "# plugins.yaml: `rollart run plugins.yaml` in the folder of my_plugins.py")
    )
    monkeypatch.chdir(tmp_path)
    try:
        assert main(["run", "plugins.yaml", "--json"]) == 0
    finally:
        sys.modules.pop("my_plugins", None)
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and 0.0 <= summary["final_reward"] <= 1.0
    assert re.search(r"^best reward: \d\.\d\d$", out, re.M)  # MyPipeline.run ran
    records = [json.loads(line) for line in (tmp_path / "runs" / "copy" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    for r in records:
        assert set(r["reward_by_tag"]) == {"copy", "reverse-2"}
        # the plain policy gradient ran (ppo, the default, would report clip_frac and ratio metrics)
        assert "clip_frac" not in r["train"] and r["train"]["grad_norm"] >= 0.0
