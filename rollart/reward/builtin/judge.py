"""An LLM judge over any OpenAI-compatible ``/v1/chat/completions`` endpoint.

The judge's address and token come from the server's configuration only (``rollart serve rewards
--judge-url URL``, or ``$ROLLART_JUDGE_URL`` in the server's environment; ``$ROLLART_JUDGE_TOKEN``).
A trajectory that names a judge URL itself (``metadata.judge_url``) is refused with 422 rather than
ignored: otherwise anyone who may post a trajectory could make the server send its judge token to an
address of their choosing, and a caller who expected its own judge would be scored silently by another.

The judge's token is read once when the server starts (:func:`capture_credentials`) and then removed
from the server's environment. The score is the *last* ``Score: N`` of the judge's answer (the line the
prompt asks it to end with): a response that quotes a score of its own, echoed earlier by the judge,
does not win.
"""

from __future__ import annotations

import os
import re
from typing import Any

import httpx

from rollart.reward.errors import RewardInputError

PROMPT = (
    "Rate how well the response answers the prompt against the reference, from 0 to 10.\n"
    "Prompt: {prompt}\nReference: {ground_truth}\nResponse: {response}\nEnd your answer with a last line 'Score: N'."
)
_SCORE = re.compile(r"score\s*[:=]\s*(\d+(?:\.\d+)?)", re.IGNORECASE)
URL_ENV, TOKEN_ENV, MODEL_ENV = "ROLLART_JUDGE_URL", "ROLLART_JUDGE_TOKEN", "ROLLART_JUDGE_MODEL"
_captured: dict[str, str] = {}


def capture_credentials() -> None:
    """Keep ``$ROLLART_JUDGE_TOKEN`` in this process's memory (servers call it before they remove their
    secrets from the environment)."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        _captured[TOKEN_ENV] = token


def _token() -> str | None:
    return os.environ.get(TOKEN_ENV) or _captured.get(TOKEN_ENV)


def llm_judge(trajectory: dict[str, Any]) -> dict[str, Any]:
    """Asks the model at ``$ROLLART_JUDGE_URL`` (model ``$ROLLART_JUDGE_MODEL``, or
    ``metadata.judge_model``; bearer ``$ROLLART_JUDGE_TOKEN``) for a 0–10 score, returned scaled to
    [0, 1]. An unreachable judge or an answer without a score raises — never a default score."""
    meta = trajectory.get("metadata") or {}
    if "judge_url" in meta:
        raise RewardInputError(
            "metadata.judge_url is not accepted: the judge URL is set by the reward server "
            f"(rollart serve rewards --judge-url, or ${URL_ENV}); drop the field"
        )
    url = os.environ.get(URL_ENV)
    if not url:
        raise ValueError(
            f"llm_judge needs the server's judge URL: start it with --judge-url URL or set ${URL_ENV} "
            "(an OpenAI-compatible base URL)"
        )
    model = meta.get("judge_model")
    if model is not None and not isinstance(model, str):
        raise RewardInputError(f"metadata.judge_model={model!r}: give the judge model's name as a string")
    headers = {}
    token = _token()
    if token:
        headers["Authorization"] = f"Bearer {token}"
    body = {
        "model": model or os.environ.get(MODEL_ENV, "judge"),
        "messages": [
            {
                "role": "user",
                "content": PROMPT.format(**{k: trajectory.get(k) for k in ("prompt", "ground_truth", "response")}),
            }
        ],
        "temperature": 0.0,
    }
    resp = httpx.post(
        url.rstrip("/") + "/v1/chat/completions", json=body, headers=headers, timeout=60, follow_redirects=False
    )
    resp.raise_for_status()
    text = resp.json()["choices"][0]["message"]["content"]
    scores = _SCORE.findall(text) if isinstance(text, str) else []
    if not scores:
        raise ValueError(f"judge answer has no 'Score: N': {str(text)[:200]!r}")
    return {"score": min(10.0, float(scores[-1])) / 10.0, "judge": text[:500]}
