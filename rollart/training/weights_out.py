"""How weights leave a trainer: a bucket at a time, in Hugging Face names, from every rank.

Every way out (the Ray object store, a weight channel, a Hugging Face export) goes through
:meth:`WeightsOut.weight_stream`: the trainer's tensors (gathered from the shards on a sharded trainer,
where every rank takes part in each gather), copied to the CPU a bucket of at most ``bucket_bytes`` at a
time, a tensor larger than a bucket in row pieces (:class:`~rollart.weights.stream.TensorPiece`); rank 0
keeps the copies, the other ranks only take part. So no rank holds more than one bucket of gathered
weights beside its own shards, and what an engine receives (the pieces written into their rows) is the
same, bit for bit, as what an unsharded trainer with the same weights sends.

A tensor shared under two names (tied input and output embeddings) goes once, under its first name; the
engines and the export tie the other. The methods are called on every rank (``EVERY_RANK``): a sharded
trainer's gathers are collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from rollart.decorators.register import register
from rollart.training.sharding import gather_buckets
from rollart.weights.base import WeightChannel
from rollart.weights.stream import Part, TensorMeta, channel_order, merge_buckets, publish_stream

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 << 20


def _every_rank(world_size: int, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    return [(args, kwargs)] * world_size


def _rank_zero(results: list[Any]) -> Any:
    return results[0] if results else None


EVERY_RANK = (_every_rank, _rank_zero)
"""Every rank is called with the same arguments (they all take part in the gathers); the answer is rank
0's."""


class WeightsOut:
    """Mixin of the training workers: the weight stream and the methods built on it. The worker provides
    ``rank``, ``version``, :meth:`weight_items` and :meth:`weights_sharded`."""

    rank: int
    version: int

    def weight_items(self) -> list[tuple[str, torch.Tensor]]:
        """The weights in Hugging Face names (local shards or whole tensors), a tied tensor once."""
        raise NotImplementedError

    def weights_sharded(self) -> bool:
        """Whether every rank must take part in gathering the weights."""
        return False

    def weight_metas(self) -> list[TensorMeta]:
        """Name, full shape and dtype of every weight (known on every rank without a gather)."""
        return [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in self.weight_items()]

    def weight_stream(self, bucket_bytes: int, order: list[str] | None = None) -> Iterator[dict[str, Part]]:
        """Buckets of CPU tensors, in ``order`` (names; default: the trainer's): whole tensors, or one piece of a
        tensor larger than ``bucket_bytes`` (:func:`~rollart.training.sharding.gather_buckets`). Rank 0 gets them;
        on a sharded trainer the other ranks get empty buckets at the same points (each must iterate to the
        end); on an unsharded one they get nothing at all."""
        if not self.weights_sharded() and self.rank != 0:
            return iter(())
        items = self.weight_items()
        if order is not None:
            by_name = dict(items)
            items = [(name, by_name[name]) for name in order]
        return gather_buckets(items, bucket_bytes, keep=self.rank == 0)

    def _tensor_stream(self, bucket_bytes: int, order: list[str]) -> Iterator[tuple[str, Part]]:
        for bucket in self.weight_stream(bucket_bytes, order):
            while bucket:
                name = next(iter(bucket))
                yield name, bucket.pop(name)  # the channel's copy is the only one left once it moves on
            del bucket

    @register(dispatch=EVERY_RANK, by_ref=True)
    def snapshot_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[dict[str, Part]]:
        """The weights (CPU, Hugging Face names) as buckets (a tensor larger than ``bucket_bytes`` in row
        pieces, one a bucket: :func:`~rollart.weights.stream.merge_buckets` puts them together). Through the
        Cluster the answer is the list of rank 0's buckets as ObjectRefs that the caller owns: each bucket goes
        into the object store as soon as it is gathered (the trainer holds one at a time), inference workers
        load them from there, and they are freed when the caller drops the refs."""
        for bucket in self.weight_stream(bucket_bytes):
            if self.rank == 0:
                yield bucket
            del bucket

    @register(dispatch=EVERY_RANK)
    def publish_to(self, channel: WeightChannel, wait: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Rank 0 publishes the weights to a weight channel as its current version, streamed: the tensors
        reach the channel in its order, a bucket at a time (every rank of a sharded trainer takes part). An
        unsharded trainer with ``wait=False`` hands a snapshot to the channel and trains on while it is
        written (the next publish, or :meth:`wait_published`, surfaces its error); a sharded one always
        publishes before it returns."""
        self.wait_published()
        if not wait and not self.weights_sharded():
            if self.rank == 0:
                self._publish_in_background(channel)
            return self.version
        metas = self.weight_metas()
        order = channel_order(channel, metas)
        if self.rank != 0:
            for _ in self.weight_stream(bucket_bytes, order):  # take part in every gather
                pass
            return self.version
        stream = self._tensor_stream(bucket_bytes, order)
        try:
            publish_stream(channel, metas, stream, self.version)
        finally:
            for _ in stream:  # a channel that failed part-way: the other ranks still finish their gathers
                pass
        return self.version

    def _publish_in_background(self, channel: WeightChannel) -> None:
        if channel.packs_on_publish:
            # the channel packs the tensors into a buffer of its own before it returns: the module's own
            # tensors go as they are, no snapshot-sized copy per publish
            self._publishing = channel.publish_async(self.publish_state(), self.version, copy=True)
        else:
            self._publishing = channel.publish_async(self.cpu_state_dict(), self.version, copy=False)

    def publish_state(self) -> dict[str, torch.Tensor]:
        """The weights for a channel that copies them at once (unsharded trainers): the module's own tensors."""
        return dict(self.weight_items())

    def cpu_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole weights as CPU copies on rank 0 (unsharded trainers; tests and background publishes)."""
        return merge_buckets(self.weight_stream(DEFAULT_BUCKET_BYTES))

    @register(dispatch=EVERY_RANK)
    def wait_published(self) -> None:
        """Block until the last background publish is written; re-raise its error if it failed."""
        pending = getattr(self, "_publishing", None)
        self._publishing = None
        if pending is not None:
            pending.result()

    def export_to(self, out: str, base_model: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> str | None:
        """The weights as a Hugging Face folder at ``out``, one safetensors file per bucket, a tensor larger
        than a bucket written into its own file piece by piece (rank 0 writes; every rank takes part);
        returns the folder on rank 0."""
        from rollart.training.export import HFShardWriter

        writer = HFShardWriter(base_model, out) if self.rank == 0 else None
        for bucket in self.weight_stream(bucket_bytes):
            if writer is not None:
                writer.add(bucket)
            del bucket
        return str(writer.finish()) if writer is not None else None


__all__ = ["DEFAULT_BUCKET_BYTES", "EVERY_RANK", "WeightsOut"]
