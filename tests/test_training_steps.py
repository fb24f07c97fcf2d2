"""Training steps in-process (no Ray): the proximal-policy pass is skipped exactly when it cannot change
the update, the shared accumulation loop, and the batch column names every consumer relies on."""

import pytest
import torch

import rollart as ra
from rollart.cluster.worker import WorkerContext, host_class
from rollart.models import build_tiny
from rollart.training import columns as C
from rollart.training.accumulation import Share, accumulate_step
from rollart.training.torch_strategy import TorchTrainWorker

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("steps") / "tiny"
    return str(build_tiny(path, hidden_size=32, num_layers=1, intermediate_size=64, seed=1))


def local_worker(cls, **config):
    ctx = WorkerContext(cluster="local", job_id="test", rank=0, world_size=1, pool=None, hardware="CPU")
    return host_class(cls)(ctx, (), {"config": config})


def batch_of(n: int) -> ra.Batch:
    g = torch.Generator().manual_seed(0)
    ids, masks, adv, behaviour = [], [], [], []
    for i in range(n):
        length = 4 + i % 5
        ids.append(torch.randint(3, 60, (length,), generator=g).tolist())
        masks.append([0, 0] + [1] * (length - 2))
        adv.append([float((-1) ** i)] * length)
        # a sampling engine a little off the trainer: the ratios and IS weights are not trivially 1
        behaviour.append([0.0, 0.0] + (-4.0 - torch.rand(length - 2, generator=g)).tolist())
    return ra.Batch({C.INPUT_IDS: ids, C.LOSS_MASK: masks, C.ADVANTAGES: adv, C.BEHAVIOUR_LOGPROBS: behaviour})


def count_forwards(worker) -> list[int]:
    """Training passes: calls of the forward the train step runs (one per micro-batch pass, the
    shared-prefix passes of one micro-batch included)."""
    calls = [0]
    worker.forward_module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def params(worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.module.named_parameters()}


CASES = [
    pytest.param({"loss": "ppo"}, id="ppo"),
    pytest.param({"loss": "ppo", "tis_cap": 2.0}, id="ppo+tis_cap"),
    pytest.param({"loss": "decoupled_ppo"}, id="decoupled_ppo"),
    pytest.param({"loss": "dis"}, id="dis"),
    pytest.param({"loss": "cispo", "loss_agg": "seq-mean-token-mean"}, id="cispo-seq"),
]


@pytest.mark.parametrize("loss", CASES)
def test_one_ppo_epoch_skips_the_proximal_forward_and_takes_the_same_step(tiny, loss):
    cfg = {"model": tiny, "lr": 1e-2, "max_tokens_per_microbatch": 16, "ppo_epochs": 1, **loss}
    auto = local_worker(TorchTrainWorker, **cfg)
    recompute = local_worker(TorchTrainWorker, **cfg, proximal="recompute")
    assert params(auto).keys() == params(recompute).keys()
    n_auto, n_re = count_forwards(auto), count_forwards(recompute)
    batch = batch_of(9)
    m_auto = auto.train_step(batch)
    m_re = recompute.train_step(batch)
    mbs = int(m_auto["microbatches"])
    assert mbs > 1 and m_re["microbatches"] == mbs
    assert n_auto[0] == mbs and n_re[0] == 2 * mbs  # one forward per micro-batch instead of two
    assert m_auto["proximal_recomputed"] == 0.0 and m_re["proximal_recomputed"] == 1.0
    after_auto, after_re = params(auto), params(recompute)
    for name, p in after_auto.items():
        torch.testing.assert_close(p, after_re[name], atol=1e-6, rtol=0)
    for key in ("rollout_abs_logprob_diff", "entropy", "grad_norm"):
        assert m_auto[key] == pytest.approx(m_re[key], rel=1e-5, abs=1e-7)
    assert m_auto["rollout_abs_logprob_diff"] > 1.0  # measured against the engine's log-probs, not zero


def test_several_ppo_epochs_recompute_the_proximal_policy_only_when_the_loss_reads_it(tiny):
    base = {"model": tiny, "lr": 1e-2, "max_tokens_per_microbatch": 16, "ppo_epochs": 2}
    ppo = local_worker(TorchTrainWorker, **base, loss="ppo")
    dis = local_worker(TorchTrainWorker, **base, loss="dis")
    dis_tis = local_worker(TorchTrainWorker, **base, loss="dis", tis_cap=2.0)
    assert ppo.needs_proximal_pass() and not dis.needs_proximal_pass() and dis_tis.needs_proximal_pass()
    calls = count_forwards(dis)
    m = dis.train_step(batch_of(9))
    assert calls[0] == 2 * int(m["microbatches"]) and m["proximal_recomputed"] == 0.0  # the two epochs only
    calls = count_forwards(ppo)
    m = ppo.train_step(batch_of(9))
    assert calls[0] == 3 * int(m["microbatches"]) and m["proximal_recomputed"] == 1.0


def test_train_step_names_a_missing_column(tiny):
    worker = local_worker(TorchTrainWorker, model=tiny)
    batch = batch_of(2)
    old_style = ra.Batch({k: v for k, v in batch.items() if k != C.BEHAVIOUR_LOGPROBS})
    old_style["old_logprobs"] = batch[C.BEHAVIOUR_LOGPROBS]
    with pytest.raises(KeyError, match="behaviour_logprobs"):
        worker.train_step(old_style)


def test_accumulate_step_matches_one_pass_over_the_whole_batch_and_zero_passes_add_nothing():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(6, 3), torch.randn(6, 1)
    whole = torch.nn.Linear(3, 1)
    whole.load_state_dict(model.state_dict())
    ((whole(x) - y) ** 2).mean().backward()
    expected = [p.grad.clone() for p in whole.parameters()]

    class NoStep(torch.optim.SGD):
        def step(self, closure=None):  # keep the gradients and weights as accumulated
            return None

    opt = NoStep(model.parameters(), lr=0.1)
    chunks = [[0, 1], [2, 3, 4], [5]]
    share = Share(lengths=[1] * 6, plans=chunks, microbatches=chunks, passes=5)  # 2 zero passes at the end
    seen = []

    def backward(rows):
        seen.append(rows)
        (((model(x[rows]) - y[rows]) ** 2).sum() / 6).backward()

    norm = accumulate_step(
        model=model,
        params=list(model.parameters()),
        optimizer=opt,
        share=share,
        backward=backward,
        zero_forward=lambda ids, att: model(ids.float().expand(-1, 3)),
        device=torch.device("cpu"),
        grad_clip=None,
    )
    assert seen == chunks
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
    assert norm == pytest.approx(float(torch.sqrt(sum((e**2).sum() for e in expected))), rel=1e-6)
