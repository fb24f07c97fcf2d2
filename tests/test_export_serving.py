"""What a run's export carries for serving it: the chat template the run served with
(``serving.chat_template``), and the model id ``rollart serve policy`` gives a run's export."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoTokenizer

from rollart.cli.policy import resolve_model, served_name
from rollart.models import default_tiny_path
from rollart.training.export import write_chat_template

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def _export(tmp_path: Path) -> Path:
    """A run folder with an exported policy (the built-in tiny model, which has no chat template)."""
    run = tmp_path / "reverse-run"
    shutil.copytree(default_tiny_path(), run / "hf")
    (run / "metrics.jsonl").write_text("")
    return run


def test_the_export_carries_the_served_chat_template(tmp_path):
    hf = _export(tmp_path) / "hf"
    assert not AutoTokenizer.from_pretrained(str(hf)).chat_template  # the base tokenizer has none
    assert write_chat_template(hf, "auto") is None  # auto: the base tokenizer's own, left as it is
    assert not AutoTokenizer.from_pretrained(str(hf)).chat_template
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    assert write_chat_template(hf, str(tmp_path / "chat.jinja")) == TEMPLATE
    tok = AutoTokenizer.from_pretrained(str(hf))
    assert tok.chat_template == TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<user>hi</s><assistant>"


def test_serve_policy_names_a_runs_model_after_the_run(tmp_path):
    run = _export(tmp_path)
    for target in (run, run / "hf"):
        model, cfg = resolve_model(str(target))
        assert Path(model) == run / "hf" and cfg is None
        assert served_name(model, cfg) == "reverse-run"
    plain = tmp_path / "my-model"
    shutil.copytree(run / "hf", plain)
    assert served_name(str(plain), None) == "my-model"
    assert served_name(str(plain), SimpleNamespace(name="from-config")) == "from-config"
