"""The reference policy for the KL term (ROLL Flash §2.2; RollArt paper §5.3 "reference" cluster).

A frozen copy of the initial policy: it never trains, and only answers ``compute_logprobs`` so the
trainer can add ``kl_coef * KL(π_θ || π_ref)`` over the action tokens (estimator ``kl_kind``: k1, k2,
k3 or abs, see :func:`rollart.algorithms.kl_penalty`). Its rows line up with the batch's
``input_ids`` and carry ``log π_ref(token_t | tokens_<t)`` at position ``t`` (0 at position 0).
"""

from __future__ import annotations

import torch

from rollart.cluster.batch import Batch
from rollart.cluster.devices import worker_device
from rollart.cluster.worker import Worker
from rollart.decorators.register import register
from rollart.decorators.specs import Dispatch
from rollart.training.placement import model_path
from rollart.training.torch_strategy import batch_logprobs


class ReferenceWorker(Worker):
    """One data-parallel rank of the reference model; ``model`` defaults to the built-in tiny model."""

    def __init__(self, model: str | None = None, max_tokens_per_microbatch: int = 16384, packing: bool | None = None):
        """``packing``: the trainer's ``train.packing`` (its passes packed, see :mod:`rollart.training.packing`)."""
        from rollart.models.shapes import load_causal_lm
        from rollart.training.packing import packing_on, use_packed_attention

        self.device = worker_device(self.device_ids)
        path = model_path(model)
        self.packing = packing_on(packing, path, self.device)  # fp32 passes: padded on a GPU
        self.model = load_causal_lm(path, dtype=torch.float32).to(self.device).eval()
        if self.packing:
            use_packed_attention(self.model)
        self.model.requires_grad_(False)
        self.max_tokens = max_tokens_per_microbatch

    @register(dispatch=Dispatch.DP_SPLIT)
    def compute_logprobs(self, batch: Batch) -> list[list[float]]:
        return batch_logprobs(self.model, batch, self.max_tokens, self.device, packed=self.packing)
