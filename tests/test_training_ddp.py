"""The torch strategy with two data-parallel ranks (DDP over gloo on 127.0.0.1) takes the same step as
one rank on the whole batch: gradients are weighted to the global token mean, and ranks stay equal."""

import pytest
import torch
from ray_helpers import kill_and_wait

import rollart as ra
from rollart.models import build_tiny
from rollart.resource_manager.net import free_port
from rollart.training import columns as C
from rollart.training.placement import start_data_parallel
from rollart.training.torch_strategy import TorchTrainWorker

pytestmark = pytest.mark.timeout(300)


def batch_of(n: int) -> ra.Batch:
    g = torch.Generator().manual_seed(0)
    ids, masks, adv = [], [], []
    for i in range(n):
        length = 4 + i % 5  # uneven lengths: micro-batches pad only within themselves
        row = torch.randint(3, 60, (length,), generator=g).tolist()
        ids.append(row)
        masks.append([0, 0] + [1] * (length - 2))
        adv.append([float((-1) ** i)] * length)
    return ra.Batch(
        {C.INPUT_IDS: ids, C.LOSS_MASK: masks, C.ADVANTAGES: adv, C.BEHAVIOUR_LOGPROBS: [[0.0] * len(r) for r in ids]}
    )


def test_two_ranks_match_one_rank_on_the_whole_batch(make_rm, tmp_path):
    model = str(build_tiny(tmp_path / "tiny", hidden_size=32, num_layers=1, intermediate_size=64, seed=1))
    cfg = {"model": model, "lr": 1e-2, "loss": "ppo", "max_tokens_per_microbatch": 16}
    rm = make_rm({"dp": {"hardware": "CPU", "cpus": 2}, "single": {"hardware": "CPU", "cpus": 1}})
    dp = ra.Cluster("dp", TorchTrainWorker, rm, pool="dp", worker_kwargs={"config": cfg})
    one = ra.Cluster("one", TorchTrainWorker, rm, pool="single", worker_kwargs={"config": cfg})
    assert start_data_parallel(dp) == ["gloo", "gloo"]  # rank 0 names the rendezvous (127.0.0.1 here)
    batch = batch_of(7)  # 4 rows on rank 0, 3 on rank 1
    for _ in range(2):
        metrics = dp.train_step(batch)
        one.train_step(batch)
    assert metrics["rows"] == [4.0, 3.0]
    dp_sums, one_sum = dp.weight_checksum(), one.weight_checksum()[0]
    assert dp_sums[0] == pytest.approx(dp_sums[1], rel=1e-6)  # the ranks hold identical weights
    assert dp_sums[0] == pytest.approx(one_sum, rel=1e-5)  # and the same as one rank on the whole batch


def rows_of(lengths: list[int]) -> ra.Batch:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 60, (n,), generator=g).tolist() for n in lengths]
    return ra.Batch(
        {
            C.INPUT_IDS: ids,
            C.LOSS_MASK: [[0] + [1] * (n - 1) for n in lengths],
            C.ADVANTAGES: [[float((-1) ** i)] * n for i, n in enumerate(lengths)],
            C.BEHAVIOUR_LOGPROBS: [[0.0] * n for n in lengths],
        }
    )


def test_ranks_with_uneven_or_empty_shares_still_step_together(make_rm, tmp_path):
    """Rank 0 gets three micro-batches and rank 1 one; then a one-row batch leaves rank 1 nothing.
    Every rank still joins each all-reduce, so the step neither hangs nor drifts from one rank's."""
    model = str(build_tiny(tmp_path / "tiny", hidden_size=32, num_layers=1, intermediate_size=64, seed=4))
    cfg = {"model": model, "lr": 1e-2, "loss": "ppo", "max_tokens_per_microbatch": 16, "ppo_epochs": 2}
    rm = make_rm({"dp": {"hardware": "CPU", "cpus": 2}, "single": {"hardware": "CPU", "cpus": 1}})
    dp = ra.Cluster("dp_uneven", TorchTrainWorker, rm, pool="dp", worker_kwargs={"config": cfg})
    one = ra.Cluster("one_uneven", TorchTrainWorker, rm, pool="single", worker_kwargs={"config": cfg})
    dp.setup_distributed("127.0.0.1", free_port())
    uneven = rows_of([10, 10, 10, 4, 4])  # rank 0: three 10-token rows, one per micro-batch; rank 1: 8 tokens
    metrics = dp.train_step(uneven)
    one.train_step(uneven)
    assert metrics["microbatches"] == [3.0, 1.0]
    single = rows_of([7])
    metrics = dp.train_step(single)
    one.train_step(single)
    assert metrics["rows"] == [1.0]  # only rank 0 had rows to report
    dp_sums, one_sum = dp.weight_checksum(), one.weight_checksum()[0]
    assert dp_sums[0] == pytest.approx(dp_sums[1], rel=1e-7)
    assert dp_sums[0] == pytest.approx(one_sum, rel=1e-5)


def test_a_killed_trainer_is_restarted_and_resumes_from_its_checkpoint(make_rm, tmp_path):
    import ray

    model = str(build_tiny(tmp_path / "tiny", hidden_size=32, num_layers=1, intermediate_size=64, seed=2))
    rm = make_rm({"train": {"hardware": "CPU", "cpus": 1}})
    train = ra.Cluster(
        "trainer", TorchTrainWorker, rm, pool="train", worker_kwargs={"config": {"model": model, "lr": 1e-2}}
    )
    batch = batch_of(6)
    train.train_step(batch)
    train.train_step(batch)
    ckpt = str(tmp_path / "ckpt" / "last.pt")
    train.save_checkpoint(ckpt, {"step": 1, "consumed": ["g0", "g1"]})
    saved = train.weight_checksum()[0]
    train.train_step(batch)  # progress after the checkpoint is lost with the worker
    kill_and_wait(train.workers[0])
    with pytest.raises(ra.WorkerDiedError, match=r"trainer\[rank 0\] on CPU died"):
        train.weight_checksum()
    train.restart_worker(0)
    assert train.weight_checksum()[0] != pytest.approx(saved)  # a fresh worker starts from the base model
    state = train.load_checkpoint(ckpt)[0]
    assert state == {"version": 2, "extra": {"step": 1, "consumed": ["g0", "g1"]}}
    assert train.weight_checksum()[0] == pytest.approx(saved, rel=1e-7)
    train.train_step(batch)
    refs = train.snapshot_weights()  # the weights as buckets, each an object the caller owns
    assert refs and all(isinstance(ref, ray.ObjectRef) for ref in refs)
    assert {k for part in ray.get(refs) for k in part} >= {"model.embed_tokens.weight"}
