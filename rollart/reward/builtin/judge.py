"""An LLM judge over any OpenAI-compatible ``/v1/chat/completions`` endpoint."""

from __future__ import annotations

import os
import re
from typing import Any

import httpx

PROMPT = ("Rate how well the response answers the prompt against the reference, from 0 to 10.\n"
          "Prompt: {prompt}\nReference: {ground_truth}\nResponse: {response}\nAnswer with 'Score: N'.")
_SCORE = re.compile(r"score\s*[:=]\s*(\d+(?:\.\d+)?)", re.IGNORECASE)


def llm_judge(trajectory: dict[str, Any]) -> dict[str, Any]:
    """Asks the model at ``$ROLLART_JUDGE_URL`` (``metadata.judge_url`` overrides; model
    ``$ROLLART_JUDGE_MODEL``, bearer ``$ROLLART_JUDGE_TOKEN``) for a 0–10 score, returned scaled to
    [0, 1]. An unreachable judge or an answer without a score raises — never a default score."""
    meta = trajectory.get("metadata") or {}
    url = meta.get("judge_url") or os.environ.get("ROLLART_JUDGE_URL")
    if not url:
        raise ValueError("llm_judge needs ROLLART_JUDGE_URL (an OpenAI-compatible base URL) or metadata.judge_url")
    headers = {}
    if os.environ.get("ROLLART_JUDGE_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['ROLLART_JUDGE_TOKEN']}"
    body = {"model": meta.get("judge_model") or os.environ.get("ROLLART_JUDGE_MODEL", "judge"),
            "messages": [{"role": "user", "content": PROMPT.format(**{k: trajectory.get(k) for k in
                                                                       ("prompt", "ground_truth", "response")})}],
            "temperature": 0.0}
    resp = httpx.post(url.rstrip("/") + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    resp.raise_for_status()
    text = resp.json()["choices"][0]["message"]["content"]
    m = _SCORE.search(text)
    if m is None:
        raise ValueError(f"judge answer has no 'Score: N': {text[:200]!r}")
    return {"score": min(10.0, float(m.group(1))) / 10.0, "judge": text[:500]}
