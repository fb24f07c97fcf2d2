"""The built-in tiny model, built offline: a character-level byte-BPE tokenizer trained with the
``tokenizers`` library on generated task text, and a random-init Qwen2-architecture causal LM, saved
as a Hugging Face folder that ``AutoTokenizer`` / ``AutoModelForCausalLM`` load with
``HF_HUB_OFFLINE=1``.

Every character is its own pre-token (a ``Split`` on every character before the byte-level mapping),
so BPE merges never join two characters: each letter and digit a task manipulates is one token
(a ~1M-parameter model then learns reverse-3 from scratch in minutes on one CPU core).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import random
import string
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ChatML: a turn is <|im_start|>ROLE\nCONTENT<|im_end|>\n; a chat model's end of turn is its EOS
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TASK_SYMBOLS = " +-*/()=:;,.?!'\"#_<>[]{}|@%&^~`\\$\n" + "√"


def default_corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Generated task-like text covering every letter, digit and symbol the built-in tasks use."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits
    lines = [alphabet, TASK_SYMBOLS, "reverse: abc= cba\n", "12+34=46\n", "S F H G P # _ O X √\n"]
    for _ in range(n):
        k = rng.randint(1, 12)
        word = "".join(rng.choice(alphabet) for _ in range(k))
        lines.append(f"{word}={word[::-1]}\n")
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(f"{a}+{b}={a + b}\n")
        lines.append("".join(rng.choice("SFHGP#_OX√\n ") for _ in range(16)))
    return lines


def build_tokenizer(corpus: Iterable[str], out_dir: Path, vocab_size: int = 320, chat: bool = False) -> object:
    """The character-level byte-BPE tokenizer. ``chat``: add the ChatML tokens and template, with
    ``<|im_end|>`` (the end of a turn) as the EOS token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("."), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, IM_START, IM_END] if chat else [PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=IM_END if chat else EOS
    )
    if chat:
        fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny(
    out_dir: str | os.PathLike[str],
    *,
    corpus: Iterable[str] | None = None,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    seed: int = 0,
    vocab_size: int = 320,
    chat: bool = False,
) -> Path:
    """Build the tokenizer and a random-init Qwen2 causal LM into ``out_dir``; returns the folder.
    ``chat``: the tokenizer has the ChatML template and ends a turn (its EOS) with ``<|im_end|>``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(corpus if corpus is not None else default_corpus(seed=seed), out, vocab_size, chat)
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(str(out), safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("built tiny model (%d parameters, vocab %d) in %s", n_params, len(tok), out)
    return out


def default_tiny_path(**kwargs: object) -> Path:
    """Build the default tiny model once per set of arguments into ``$ROLLART_CACHE`` (default
    ``~/.cache/rollart``) and return its folder. A file lock keeps concurrent processes from racing."""
    key = hashlib.sha256(json.dumps(kwargs, sort_keys=True, default=str).encode()).hexdigest()[:12]
    root = Path(os.environ.get("ROLLART_CACHE", Path.home() / ".cache" / "rollart"))
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"tiny-{key}"
    with open(root / f"tiny-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            tmp = root / f"tiny-{key}.building"
            build_tiny(tmp, **kwargs)  # type: ignore[arg-type]
            os.replace(tmp, target)
    return target
