"""Chat templates token-in/token-out: the trajectory holds exactly the tokens generated and observed.

The tokenizer is a BPE built here offline whose merges cross message boundaries (``"=\\nAssistant: "``
is one token), so encoding the whole rendered conversation gives other ids than the turns did.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer, decoders, models, trainers
from transformers import PreTrainedTokenizerFast

from rollart.rollout.chat import ChatFormat, ChatTemplateError, chat_format
from rollart.rollout.config import EnvManagerConfig
from rollart.rollout.env_manager import EnvManager, HFCodec
from rollart.rollout.types import GenerateOutput, GenerateRequest

TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}System: {{ m.content }}\n"
    "{% elif m.role == 'user' %}User: {{ m.content }}\n"
    "{% elif m.role == 'tool' %}Tool: {{ m.content }}\n"
    "{% else %}Assistant:{{ m.content }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _bpe_tokenizer(template: str | None = TEMPLATE) -> Any:
    corpus = [
        f"System: Add them.\nUser: {a}+{b}=\nAssistant: {a + b}\nUser: wrong, try {a}+{b} again\n"
        f"Assistant: {a + b}\nTool: ok {a}\n"
        for a in range(40)
        for b in range(0, 40, 7)
    ]
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    alphabet = list("0123456789+=:!?., \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    tk.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<unk>", "</s>"], initial_alphabet=alphabet, show_progress=False
        ),
    )
    kwargs = {"chat_template": template} if template else {}
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>", **kwargs)


@pytest.fixture(scope="module")
def tok() -> Any:
    return _bpe_tokenizer()


class AddEnv:
    """Three turns: the answer is never accepted until the third step."""

    tag = "add"
    instructions = "Add them."
    max_steps = 5
    max_new_tokens = 8

    def __init__(self, turns: int = 3, prompt: str = "3+4="):
        self.turns, self.prompt, self.t = turns, prompt, 0

    def reset(self, seed=None):
        self.t = 0
        return self.prompt, {}

    def step(self, action: str):
        self.t += 1
        return f"wrong, try {self.t} again", float(self.t == self.turns), self.t >= self.turns, False, {}


class ScriptedProxy:
    """Returns the scripted token ids turn by turn and records every prompt it was given."""

    def __init__(self, outputs: list[tuple[list[int], str]]):
        self.outputs = list(outputs)
        self.prompts: list[list[int]] = []

    async def generate(self, request: GenerateRequest, tag: str, *, trace=None, cost=None) -> GenerateOutput:
        ids, reason = self.outputs.pop(0)
        self.prompts.append(list(request.prompt_token_ids))
        return GenerateOutput(
            request_id=request.request_id,
            output_token_ids=ids,
            output_logprobs=[-0.5] * len(ids),
            token_versions=[0] * len(ids),
            finish_reason=reason,  # type: ignore[arg-type]
        )

    async def abort(self, request_ids: list[str]) -> None:
        return None


def _chars(tok: Any, text: str) -> list[int]:
    """``text`` one character per token: not what encoding it would give."""
    return [tok.convert_tokens_to_ids(c) for c in text]


def _render(tok: Any, messages: list[dict[str, str]], gen: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


async def test_trajectory_tokens_are_exactly_generated_and_observed(tok):
    eos = tok.eos_token_id
    gens = [
        (_chars(tok, " 7") + [eos], "stop"),  # ended its turn itself
        (_chars(tok, " 12"), "length"),  # cut by the length limit: the turn's end is observed
        (_chars(tok, " 7") + [eos], "stop"),
    ]
    proxy = ScriptedProxy(gens)
    traj = await EnvManager(AddEnv(), proxy, HFCodec(tok)).run(seed=0)  # type: ignore[arg-type]
    assert traj.status == "ok" and traj.reward == 1.0

    # loss mask: exactly the generated tokens, which are kept as generated (never re-encoded)
    generated = [t for t, m in zip(traj.token_ids, traj.loss_mask) if m]
    assert generated == [t for ids, _ in gens for t in ids]
    assert [traj.token_ids[s:e] for s, e in traj.turns] == [ids for ids, _ in gens]
    assert sum(traj.loss_mask) == sum(len(ids) for ids, _ in gens)
    # token-in: each generation was given exactly the trajectory so far
    assert proxy.prompts == [traj.token_ids[:s] for s, _ in traj.turns]

    # the first prompt: the env's instructions as system prompt, the observation as user message
    first = [{"role": "system", "content": "Add them."}, {"role": "user", "content": "3+4="}]
    assert traj.token_ids[: traj.prompt_length] == tok.encode(_render(tok, first, True), add_special_tokens=False)
    assert tok.decode(traj.token_ids[: traj.prompt_length]) == "System: Add them.\nUser: 3+4=\nAssistant:"
    assert traj.info["prompt_text"] == "3+4="  # the env's text, for a reward service

    # the text is the template's rendering of the whole conversation (minus the closing after the end)
    conversation = [
        *first,
        {"role": "assistant", "content": " 7"},
        {"role": "user", "content": "wrong, try 1 again"},
        {"role": "assistant", "content": " 12"},
        {"role": "user", "content": "wrong, try 2 again"},
        {"role": "assistant", "content": " 7"},
    ]
    rendered = _render(tok, conversation, False)
    assert tok.decode(traj.token_ids) + "\n" == rendered
    # ... and encoding that rendering again gives other ids (the drift this avoids), even against the
    # per-turn texts each encoded on its own: BPE merges cross the message boundaries
    assert tok.encode(rendered, add_special_tokens=False)[:-1] != traj.token_ids
    cuts = [0, *[b for span in traj.turns for b in span], len(traj.token_ids)]
    pieces = [tok.decode(traj.token_ids[a:b]) for a, b in zip(cuts, cuts[1:])]
    per_turn = [t for piece in pieces for t in tok.encode(piece, add_special_tokens=False)]
    whole = tok.encode("".join(pieces), add_special_tokens=False)
    assert per_turn != whole
    assert any("\n" in tok.decode([t]) and "Assistant" in tok.decode([t]) for t in whole)


async def test_observation_role_tool(tok):
    proxy = ScriptedProxy([(_chars(tok, " 1") + [tok.eos_token_id], "stop")] * 2)
    cfg = EnvManagerConfig(observation_role="tool")
    traj = await EnvManager(AddEnv(turns=2), proxy, HFCodec(tok), config=cfg).run(seed=0)  # type: ignore[arg-type]
    assert tok.decode(traj.token_ids) == (
        "System: Add them.\nUser: 3+4=\nAssistant: 1</s>\nTool: wrong, try 1 again\nAssistant: 1</s>"
    )


def test_generation_stops_at_the_turn_end(tok):
    fmt = chat_format(tok)
    assert isinstance(fmt, ChatFormat) and fmt.stop_token_ids == [tok.eos_token_id]
    manager = EnvManager(AddEnv(), ScriptedProxy([]), HFCodec(tok))  # type: ignore[arg-type]
    assert manager.sampling.stop_token_ids == [tok.eos_token_id]


def test_im_end_style_template_stops_on_its_special_token():
    """A ChatML-style template: the turn ends with its own special token, which is a stop token."""
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = _bpe_tokenizer(chatml)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fmt = chat_format(tok)
    assert fmt is not None
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert fmt.stop_token_ids == [im_end]
    text = fmt.observation_text("hi", _chars(tok, "5") + [im_end])
    assert text == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert fmt.observation_text("hi", _chars(tok, "5")) == "<|im_end|>" + text


async def test_without_a_template_prompts_stay_raw_text(tok):
    raw = _bpe_tokenizer(template=None)
    assert chat_format(raw, "auto") is None
    proxy = ScriptedProxy([(_chars(raw, " 7"), "stop")])
    traj = await EnvManager(AddEnv(turns=1), proxy, HFCodec(raw)).run(seed=0)  # type: ignore[arg-type]
    assert traj.token_ids[: traj.prompt_length] == raw.encode("3+4=", add_special_tokens=False)
    # none turns a tokenizer's own template off
    none = await EnvManager(
        AddEnv(turns=1),
        ScriptedProxy([(_chars(tok, " 7"), "stop")]),  # type: ignore[arg-type]
        HFCodec(tok),
        config=EnvManagerConfig(chat_template="none"),
    ).run(seed=0)
    assert none.token_ids[: none.prompt_length] == tok.encode("3+4=", add_special_tokens=False)


def test_template_setting_inline_path_and_errors(tok, tmp_path):
    raw = _bpe_tokenizer(template=None)
    inline = chat_format(raw, TEMPLATE)
    assert inline is not None and inline.prompt_ids("1+1=") == raw.encode(
        "User: 1+1=\nAssistant:", add_special_tokens=False
    )
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    cfg = EnvManagerConfig(chat_template=str(path))
    fmt = HFCodec(raw).chat_format(cfg.chat_template)
    assert fmt is not None and fmt.template == TEMPLATE
    with pytest.raises(ValidationError, match="(?s)chat_template.*not 'auto', 'none'"):
        EnvManagerConfig(chat_template="/no/such/template.jinja")
    with pytest.raises(ValidationError, match="truncation"):
        EnvManagerConfig(truncation="right")  # type: ignore[arg-type]
    unstable = "{% for m in messages %}{{ loop.length }}:{{ m.content }};{% endfor %}"
    with pytest.raises(ChatTemplateError, match="re-renders the earlier ones"):
        chat_format(raw, unstable).observation_text("x", [])  # type: ignore[union-attr]


async def test_max_prompt_length_left_keeps_the_last_tokens(tok):
    env = AddEnv(turns=1, prompt="12+34=" * 5)
    full = chat_format(tok).prompt_ids(env.prompt, "Add them.")  # type: ignore[union-attr]
    limit = len(full) - 4
    cfg = EnvManagerConfig(max_prompt_length=limit, truncation="left")
    proxy = ScriptedProxy([(_chars(tok, " 46"), "stop")])
    traj = await EnvManager(env, proxy, HFCodec(tok), config=cfg).run(seed=0)  # type: ignore[arg-type]
    assert traj.status == "ok" and traj.prompt_length == limit
    assert traj.token_ids[:limit] == full[-limit:] == proxy.prompts[0]
    assert traj.info["prompt_truncated"] == 4
    # a prompt within the limit is untouched
    cfg = EnvManagerConfig(max_prompt_length=len(full), truncation="left")
    proxy = ScriptedProxy([(_chars(tok, " 46"), "stop")])
    traj = await EnvManager(env, proxy, HFCodec(tok), config=cfg).run(seed=0)  # type: ignore[arg-type]
    assert traj.token_ids[: traj.prompt_length] == full and "prompt_truncated" not in traj.info


async def test_max_prompt_length_error_fails_the_trajectory(tok):
    cfg = EnvManagerConfig(max_prompt_length=3, truncation="error")
    proxy = ScriptedProxy([])
    traj = await EnvManager(AddEnv(), proxy, HFCodec(tok), config=cfg).run(seed=0)  # type: ignore[arg-type]
    assert traj.status == "failed" and traj.reward is None and not traj.token_ids
    assert "env_manager.max_prompt_length=3" in (traj.error or "") and proxy.prompts == []


def test_builtin_tiny_model_has_no_template():
    """The quickstart's tokenizer has no chat template: ``auto`` keeps its prompts raw."""
    from transformers import AutoTokenizer

    from rollart.models import default_tiny_path

    tiny = AutoTokenizer.from_pretrained(str(default_tiny_path()))
    assert HFCodec(tiny).chat_format("auto") is None


def test_a_bad_chat_template_in_a_pipeline_config_names_the_field(tmp_path):
    from rollart.config import ConfigError, load_config

    path = tmp_path / "p.yaml"
    path.write_text(
        "pools: {train: {hardware: CPU, cpus: 1}, rollout: {hardware: CPU, cpus: 1}}\n"
        "envs: [{name: addition, groups: 1}]\n"
        "rollout: {num_env_groups: 1, group_size: 2, batch_groups: 1}\n"
        "env_manager: {chat_template: chatml.jinja, max_prompt_length: 64, truncation: error}\n"
    )
    with pytest.raises(ConfigError, match=r"env_manager\.chat_template: 'chatml.jinja' is not 'auto'"):
        load_config(path)
    (tmp_path / "chatml.jinja").write_text(TEMPLATE)
    cfg = load_config(path, {"env_manager.chat_template": str(tmp_path / "chatml.jinja")})
    assert cfg.env_manager.max_prompt_length == 64 and cfg.env_manager.truncation == "error"


async def test_an_observation_that_carries_the_instructions_gets_no_system_prompt(tok):
    env = AddEnv(turns=1, prompt="Add them.\n3+4=")  # as an env built with with_instructions=True
    proxy = ScriptedProxy([(_chars(tok, " 7"), "stop")])
    traj = await EnvManager(env, proxy, HFCodec(tok)).run(seed=0)  # type: ignore[arg-type]
    assert tok.decode(traj.token_ids[: traj.prompt_length]) == "User: Add them.\n3+4=\nAssistant:"
