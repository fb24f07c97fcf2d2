"""Sharded training: FSDP2 over the data-parallel ranks, tensor parallelism inside a group of ranks.

``train.sharding: fsdp`` splits every parameter, its gradient and its AdamW states across the train
pool's ranks (torch's ``fully_shard`` on each decoder layer, then on the root module): a rank holds
``1/dp`` of them and all-gathers one layer's parameters at a time for its forward and backward passes.
``train.tensor_parallel: N`` also splits each decoder layer's linear layers across ``N`` consecutive
ranks (DTensor column- and row-wise plans: q, k, v, gate and up by output features, o and down by input
features), so the ranks form a 2-D mesh ``(dp, tp)`` with ``dp = ranks / N``; the ranks of one
tensor-parallel group train on the same rows.

Building: the module is made with its parameters on the ``meta`` device, parallelised, allocated on
the rank's device, then filled one full tensor at a time (:func:`rollart.models.streaming.iter_weights`)
into each rank's shard: no rank ever holds the whole model.

Weights leaving the trainer (:func:`gather_buckets`): every rank takes part in gathering the same
tensors in the same order; rank 0 keeps the CPU copies and hands them out a bucket (at most
``bucket_bytes``) at a time; a tensor larger than a bucket goes as row pieces of at most ``bucket_bytes``
(:class:`~rollart.weights.stream.TensorPiece`), one a bucket. A tensor sharded by rows over a 1-D mesh
(FSDP's layout) is not all-gathered: the ranks holding a piece's rows send them to rank 0 point to point,
straight into the piece, so the other ranks hold nothing extra and rank 0 the one bucket it hands out.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rollart.weights.stream import Part, TensorPiece, row_pieces

log = logging.getLogger(__name__)

# the linear layers of a Qwen2 / Llama-style decoder layer and how tensor parallelism splits them
TP_COLUMNWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
TP_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


@dataclass(frozen=True)
class ShardLayout:
    """How a train pool's ranks split the model: ``sharding`` (``ddp`` or ``fsdp``), the tensor-parallel
    degree ``tensor_parallel`` and the pool's ``world_size``; ``dp = world_size / tensor_parallel``."""

    sharding: str
    tensor_parallel: int
    world_size: int

    @property
    def dp(self) -> int:
        return self.world_size // self.tensor_parallel

    @property
    def sharded(self) -> bool:
        return self.sharding == "fsdp"

    def as_dict(self) -> dict[str, Any]:
        return {"sharding": self.sharding, "tensor_parallel": self.tensor_parallel, "ranks": self.world_size}


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers``), each a unit of sharding."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"train.sharding: fsdp: {type(model).__name__} has no model.layers (a decoder-only Hugging Face "
            "causal LM is expected); use train.sharding: ddp"
        )
    return list(layers)


def tensor_parallel_plan(model: torch.nn.Module) -> dict[str, Any]:
    """The DTensor plan of every decoder layer (see the module docstring); a model whose layers lack one
    of those linear layers is refused."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i, layer in enumerate(decoder_layers(model)):
        for names, style in ((TP_COLUMNWISE, ColwiseParallel), (TP_ROWWISE, RowwiseParallel)):
            for name in names:
                try:
                    layer.get_submodule(name)
                except AttributeError:
                    raise ValueError(
                        f"train.tensor_parallel: {type(model).__name__} layer {i} has no {name} (the plan covers "
                        "Qwen2/Llama-style layers); set train.tensor_parallel: 1"
                    ) from None
                plan[f"model.layers.{i}.{name}"] = style()
    return plan


def device_mesh(layout: ShardLayout, device: torch.device) -> Any:
    """A 1-D ``("dp",)`` mesh, or the 2-D ``("dp", "tp")`` one with tensor parallelism (ranks
    ``d * tp .. d * tp + tp - 1`` form tensor-parallel group ``d``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.tensor_parallel == 1:
        return init_device_mesh(device.type, (layout.world_size,), mesh_dim_names=("dp",))
    return init_device_mesh(device.type, (layout.dp, layout.tensor_parallel), mesh_dim_names=("dp", "tp"))


def shard_model(
    model: torch.nn.Module,
    layout: ShardLayout,
    mesh: Any,
    *,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
    offload: bool = False,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """Parallelise ``model`` (parameters on ``meta``) in place: the tensor-parallel plan on the ``tp``
    dimension, then ``fully_shard`` per decoder layer and on the root over ``dp``; ``param_dtype``
    (bf16 on GPUs) is the compute dtype of the gathered parameters, gradients are reduced in fp32 and
    the sharded parameters and optimizer states stay fp32; ``offload`` keeps the shards on the CPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if layout.tensor_parallel > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))
    dp_mesh = mesh["dp"] if layout.tensor_parallel > 1 else mesh
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    off = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, offload_policy=off, reshard_after_forward=reshard_after_forward)
    # the root (embeddings, final norm, output layer) is gathered once per pass and kept until its backward
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=off, reshard_after_forward=False)
    return model


def materialize(model: torch.nn.Module, device: torch.device, offload: bool) -> None:
    """Allocate the (sharded) parameters of a ``meta`` model on ``device`` (the CPU when offloaded),
    keeping the buffers it was built with (computed ones, e.g. rotary frequencies)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device="cpu" if offload else device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name].to(b.device))
    if offload:  # FSDP's offload keeps parameters on the CPU; the buffers go to the compute device
        for module in model.modules():
            for key, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[key] = b.to(device)


def load_full_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Fill the sharded ``model`` from full tensors given one at a time (every rank gives the same ones
    in the same order); each rank keeps its shard. Returns how many were loaded; names that are not the
    model's, or parameters left unfilled, are refused."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    expected = set(model.state_dict())
    tied = {k for k in expected if k.endswith("lm_head.weight")} if _tied(model) else set()
    options = StateDictOptions(full_state_dict=True, strict=False)
    loaded: set[str] = set()
    for name, tensor in weights:
        if name not in expected:
            raise KeyError(f"weight {name!r} is not a parameter of {type(model).__name__}")
        set_model_state_dict(model, {name: tensor}, options=options)
        loaded.add(name)
    missing = sorted(expected - loaded - tied)
    if missing:
        raise KeyError(f"weights missing for {missing[:5]} ({len(missing)} in all)")
    return len(loaded)


def _tied(model: torch.nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def sparse_tied_embedding(model: torch.nn.Module) -> bool:
    """Make the input embedding's own gradient sparse when it shares its weight with the output layer.

    The root unit of a sharded model holds the embedding; in the backward pass it has the gathered
    weight, the output layer's (dense) gradient and, with a dense embedding, a second vocab-sized
    gradient of which only the batch's token rows are non-zero. A sparse one holds just those rows and
    is summed into the dense gradient, so the root's peak is one vocab-sized tensor lower (0.55 GiB at
    the Qwen2.5-0.5B shape). Only with tied weights: the sum is then dense, as FSDP's reduce-scatter
    needs. Returns whether it was switched on."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(embed, torch.nn.Embedding) or head is None or head.weight is not embed.weight:
        return False
    embed.sparse = True
    return True


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float | None) -> float:
    """The global L2 norm of the gradients of ``params`` (sharded or not, over every rank and mesh), and
    with ``max_norm`` every gradient scaled by ``min(1, max_norm / (norm + 1e-6))`` (what
    ``torch.nn.utils.clip_grad_norm_`` does for unsharded ones)."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else ("local", g.device)
        groups.setdefault(key, []).append(g)
    total = torch.zeros((), dtype=torch.float64)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total += norm.detach().to("cpu", torch.float64) ** 2
    norm_value = float(total.sqrt())
    if max_norm:
        coef = max_norm / (norm_value + 1e-6)
        if coef < 1.0:
            for grads in groups.values():
                torch._foreach_mul_(grads, coef)
    return norm_value


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t`` (its local shard for a sharded tensor)."""
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A (possibly sharded) tensor's whole value on every rank (a collective for a sharded one)."""
    return _full(t)


def unique_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module.state_dict()`` in order, a tensor shared under two names (tied embeddings) once, under
    its first name (an engine ties the other name itself)."""
    from torch.distributed.tensor import DTensor

    seen: set[Any] = set()
    out = []
    for name, t in module.state_dict().items():
        local = t._local_tensor if isinstance(t, DTensor) else t
        key: Any = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(t.shape), t.dtype)
        if not local.numel():
            key = name
        if key in seen:
            continue
        seen.add(key)
        out.append((name, t))
    return out


def _row_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is split by rows over a 1-D mesh (FSDP's ``Shard(0)``) that :func:`_gather_row_pieces`
    takes apart: a mesh of every rank, or a sub-mesh (the dp ranks of one tensor-parallel index) whose
    first rank is rank 0 (the rank that keeps the weights) or that does not hold rank 0 at all (its ranks
    hold a replica of what rank 0's sub-mesh holds and take no part)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor) or t.device_mesh.ndim != 1 or len(t.placements) != 1 or t.dim() == 0:
        return False
    placement = t.placements[0]
    if not (isinstance(placement, Shard) and placement.dim == 0):
        return False
    ranks = t.device_mesh.mesh.flatten().tolist()
    return 0 not in ranks or ranks[0] == 0


def row_ranges(rows: int, ranks: int) -> list[tuple[int, int]]:
    """The rows each rank of a ``Shard(0)`` tensor holds: ``torch.chunk``'s split (the last ranks may hold
    fewer rows, or none)."""
    per = -(-rows // ranks)
    return [(min(r * per, rows), min((r + 1) * per, rows)) for r in range(ranks)]


def _gather_row_pieces(
    t: torch.Tensor, pieces: list[tuple[int, int]], dtype: torch.dtype | None
) -> Iterator[tuple[int, torch.Tensor | None]]:
    """The rows ``pieces`` (consecutive ranges) of a row-sharded DTensor, ``(first row, CPU tensor)`` per range on its
    mesh's rank 0 (None on the other ranks, and on every rank of a sub-mesh without global rank 0, which
    sends nothing): the ranks holding a piece's rows send them point to point, into the piece itself (CPU
    shards of the same dtype) or into one buffer on rank 0's device, then copied (GPU shards, or a cast).
    A piece is freed by the caller before the next one is made: rank 0 holds one piece at a time."""
    mesh = t.device_mesh
    if 0 not in mesh.mesh.flatten().tolist():
        for a, _ in pieces:
            yield a, None
        return
    group, me, ranks = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    local = t.to_local().detach()
    rows = int(t.shape[0])
    ranges = row_ranges(rows, ranks)
    if local.shape[0] != ranges[me][1] - ranges[me][0]:
        raise RuntimeError(
            f"a row-sharded tensor of {rows} rows holds {local.shape[0]} rows on rank {me}, "
            f"not torch.chunk's {ranges[me][1] - ranges[me][0]}"
        )
    # CPU shards of the same dtype are received into the piece itself; else through one device buffer
    direct = local.device.type == "cpu" and (dtype is None or dtype == t.dtype)
    buf: torch.Tensor | None = None
    for a, b in pieces:
        out = torch.empty((b - a, *t.shape[1:]), dtype=dtype or t.dtype, device="cpu") if me == 0 else None
        if out is not None and not direct and (buf is None or buf.shape[0] != b - a):
            buf = torch.empty((b - a, *t.shape[1:]), dtype=t.dtype, device=local.device)
        dst = out if direct else buf
        for r, (s, e) in enumerate(ranges):
            lo, hi = max(a, s), min(b, e)
            if lo >= hi or (r != me and me != 0):
                continue
            if r == me == 0:
                dst[lo - a : hi - a].copy_(local[lo - s : hi - s])  # type: ignore[index]
            elif me == 0:
                dist.recv(dst[lo - a : hi - a], group=group, group_src=r)  # type: ignore[index]
            else:
                dist.send(local[lo - s : hi - s].contiguous(), group=group, group_dst=0)
        if out is not None and not direct:
            out.copy_(buf)
        del dst
        yield a, out
        del out  # the caller's piece is the only reference left: freed before the next one is made


def _pieces(
    t: torch.Tensor, pieces: list[tuple[int, int]], keep: bool, dtype: torch.dtype | None
) -> Iterator[tuple[int, torch.Tensor | None]]:
    """The row ranges ``pieces`` of ``t`` (sharded or not) as ``(first row, CPU tensor of its own)``, one at a
    time (None where ``keep`` is False). A row-sharded tensor comes straight from its shards; any other sharded one is
    gathered whole first (a tensor-parallel layer's weight, split over the 2-D mesh)."""
    from torch.distributed.tensor import DTensor

    if _row_sharded(t):
        for a, piece in _gather_row_pieces(t, pieces, dtype):
            if (piece is not None) != keep and 0 in t.device_mesh.mesh.flatten().tolist():
                raise RuntimeError("a row-sharded weight: the rank keeping the weights must be rank 0 of the mesh")
            yield a, piece if keep else None
            del piece
        return
    whole = _full(t.detach()) if isinstance(t, DTensor) else t.detach()
    for a, b in pieces:
        yield a, whole[a:b].to("cpu", dtype=dtype or whole.dtype, copy=True) if keep else None
    del whole


def gather_buckets(
    items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, keep: bool, dtype: torch.dtype | None = None
) -> Iterator[dict[str, Part]]:
    """CPU copies of ``items`` (sharded or not), a bucket of at most ``bucket_bytes`` at a time: small tensors
    whole, several to a bucket; a tensor larger than a bucket as :class:`~rollart.weights.stream.TensorPiece`
    s (row ranges of at most ``bucket_bytes``, at least one row), one piece a bucket, so no rank holds more
    than a bucket of gathered weights. Every rank must iterate it to the end (the gathers are collectives),
    freeing each bucket before it asks for the next; only ranks with ``keep`` get the tensors, the others
    get empty buckets at the same points. A row-sharded tensor goes to rank 0 point to point
    (:func:`_gather_row_pieces`): ``keep`` must then be rank 0's."""
    from torch.distributed.tensor import DTensor

    bucket: dict[str, Part] = {}
    size = 0
    for name, t in items:
        itemsize = dtype.itemsize if dtype is not None else t.element_size()
        nbytes = t.numel() * itemsize
        pieces = row_pieces(tuple(t.shape), itemsize, bucket_bytes)
        if len(pieces) > 1:
            if bucket or size:
                yield bucket
                bucket, size = {}, 0
            shape = tuple(t.shape)
            # the pieces come with their first row from the generator itself: zip() or enumerate() over it
            # would keep the last piece alive in their cached result tuple while the next one is gathered
            for first, data in _pieces(t, pieces, keep, dtype):
                yield {name: TensorPiece(data, first, shape)} if data is not None else {}
                del data  # freed before the next piece is gathered
            continue
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        if _row_sharded(t):
            for _, full in _gather_row_pieces(t, pieces, dtype):  # one piece: the whole tensor
                if (full is not None) != keep and 0 in t.device_mesh.mesh.flatten().tolist():
                    raise RuntimeError(f"{name}: the rank keeping the weights must be rank 0 of the mesh")
                if full is not None and keep:
                    bucket[name] = full
                del full
        else:
            gathered = isinstance(t, DTensor)  # full_tensor() is a new tensor: no second copy of it is needed
            whole = _full(t.detach())
            if keep:
                bucket[name] = whole.to("cpu", dtype=dtype or whole.dtype, copy=not gathered)
            del whole
        size += nbytes
    if bucket or size:
        yield bucket


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered parameter of a sharded ``model`` (after forward passes without gradients: FSDP
    keeps a module gathered when it was not resharded after its forward, the root's among them, and a
    training pass that starts from there would miss the gradient reduction of those parameters)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def no_grad_sync(model: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Nothing for FSDP (each backward reduce-scatters into the sharded gradients: no unsharded
    gradient is kept between micro-batches); a DDP model's ``no_sync`` when ``sync`` is False."""
    if not sync and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield


def group_of(mesh: Any, dim: str) -> Any:
    """The process group of a mesh dimension (``dp`` or ``tp``) of a 1-D or 2-D mesh."""
    if mesh.ndim == 1:
        return mesh.get_group()
    return mesh[dim].get_group()


def all_gather_objects(obj: Any, group: Any) -> list[Any]:
    """``obj`` of every rank of ``group``, in group-rank order."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


__all__ = [
    "ShardLayout",
    "clip_grad_norm",
    "device_mesh",
    "gather_buckets",
    "load_full_weights",
    "materialize",
    "row_ranges",
    "shard_model",
    "tensor_parallel_plan",
    "unique_state",
]
