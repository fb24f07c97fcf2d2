"""Weights larger than a bucket leave a trainer in row pieces: what a piece carries, how receivers put the
pieces back (any boundaries, checked for gaps), the checksums computed piece by piece equal to the whole
snapshot's, the export written a piece at a time, and the measured memory of a sharded trainer's publish: at
most one bucket beyond its shards, whatever the size of its largest tensor."""

from __future__ import annotations

import argparse

import pytest
import torch

from rollart.training.sharding import gather_buckets
from rollart.weights.snapshot import StateDigest, pack_state, packed_chunks, snapshot_layout, state_checksum
from rollart.weights.stream import Assembler, PartReader, TensorPiece, merge_buckets

BUCKET = 1024


def sample_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.bias": torch.randn(100, generator=g),  # 400 B: whole
        "b.embed": torch.randn(1000, 16, generator=g),  # 64 000 B: 63 pieces of 16 rows (1 024 B) and one of 8
        "c.scale": torch.tensor(3.0),  # 0-D
        "d.long": torch.randn(700, generator=g).to(torch.bfloat16),  # 1-D, 1 400 B: pieces of 512 elements
        "e.empty": torch.zeros(0, 4),
    }


def stream_of(buckets):
    for bucket in buckets:
        yield from bucket.items()


def test_a_tensor_larger_than_a_bucket_leaves_in_row_pieces_of_at_most_a_bucket():
    state = sample_state()
    buckets = list(gather_buckets(state.items(), BUCKET, keep=True))
    assert all(
        sum(p.data.nbytes if isinstance(p, TensorPiece) else p.nbytes for p in b.values()) <= BUCKET for b in buckets
    )
    embed = [b["b.embed"] for b in buckets if "b.embed" in b]
    assert all(isinstance(p, TensorPiece) and p.shape == (1000, 16) for p in embed)
    assert [(p.start, p.stop) for p in embed] == [(a, min(a + 16, 1000)) for a in range(0, 1000, 16)]
    long = [b["d.long"] for b in buckets if "d.long" in b]
    assert [(p.start, p.stop) for p in long] == [(0, 512), (512, 700)]  # a 1-D tensor: element ranges
    merged = merge_buckets(buckets)
    assert set(merged) == set(state) and all(torch.equal(merged[k], state[k]) for k in state)
    # the snapshot checksum over the pieces is the whole snapshot's
    digest = StateDigest()
    for name, part in stream_of(buckets):
        digest.update(name, part)
    assert digest.hexdigest() == state_checksum(state)
    # the Mooncake packing of the pieces is byte for byte the packing of the whole tensors
    layout = snapshot_layout(state)
    chunks = packed_chunks(layout, stream_of(buckets), 4096, torch.empty(4096, dtype=torch.uint8))
    assert b"".join(bytes(c) for c in chunks) == bytes(pack_state(state)[0].numpy())


def test_a_reader_takes_any_row_range_whatever_the_pieces_boundaries():
    state = sample_state()
    reader = PartReader(stream_of(gather_buckets(state.items(), BUCKET, keep=True)))  # pieces of 16 rows
    assert torch.equal(reader.whole("a.bias", (100,)), state["a.bias"])
    got = [reader.rows("b.embed", a, min(a + 15, 1000)) for a in range(0, 1000, 15)]  # ranges of 15 rows
    assert torch.equal(torch.cat(got), state["b.embed"])
    with pytest.raises(ValueError, match="out of order: got 'c.scale', expected 'd.long'"):
        reader.whole("d.long", (700,))


def test_receivers_refuse_a_missing_or_misplaced_piece():
    data = torch.arange(12.0).reshape(6, 2)
    asm = Assembler()
    asm.add("w", TensorPiece(data[:2], 0, (6, 2)))
    with pytest.raises(ValueError, match="a piece at row 4 of .*expected row 2"):
        asm.add("w", TensorPiece(data[4:], 4, (6, 2)))
    with pytest.raises(ValueError, match="'w': only its first 2 rows arrived"):
        asm.result()
    with pytest.raises(ValueError, match="'v': a piece at row 2 before its first piece"):
        Assembler().add("v", TensorPiece(data[2:4], 2, (6, 2)))


def test_the_export_writes_a_tensor_larger_than_a_bucket_a_piece_at_a_time(tmp_path):
    from safetensors import safe_open

    from rollart.training.export import HFShardWriter

    state = sample_state()
    writer = HFShardWriter(tmp_path / "base", tmp_path / "out")
    for bucket in gather_buckets(state.items(), BUCKET, keep=True):
        writer.add(bucket)
    assert writer._open is None and writer.total == sum(t.nbytes for t in state.values())
    files = {name: writer.tmp / f for name, f in writer.weight_map.items()}
    for name, t in state.items():
        with safe_open(str(files[name]), "pt") as f:
            assert torch.equal(f.get_tensor(name), t), name


def test_a_sharded_trainers_publish_holds_at_most_one_bucket_beyond_its_shards(tmp_path):
    """``rollart bench train-memory``'s measure, small: two FSDP ranks of a model whose largest tensors (16 MiB)
    are 16 buckets of 1 MiB; the peak resident memory of rank 0 while the weights stream out (reset before,
    ``VmHWM``) rises by at most one bucket plus 2 MiB for the allocator and the interpreter (the stream's
    Python objects, gloo's buffers; measured 0.2 MiB). Gathering a tensor whole raised it by 16 MiB or more."""
    from rollart.benchmarks import train_memory
    from rollart.models import build_tiny

    model = build_tiny(
        tmp_path / "wide", hidden_size=2048, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=1
    )
    parser = argparse.ArgumentParser()
    train_memory.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(model), "--layouts", "fsdp", "--ranks", "2", "--batch", "2", "--seq-len", "8"]
        + ["--steps", "1", "--bucket-mb", "1", "--device", "cpu", "--out", str(tmp_path / "bench")]
    )
    (row,) = train_memory.run(args)["rows"]
    mib = 1 << 20
    assert row["bucket_gib"] * 2**30 == mib
    extra = row["publish_extra_rss_gib"] * 2**30
    assert extra <= mib + 2 * mib, f"the publish raised the peak RSS by {extra / mib:.1f} MiB"
