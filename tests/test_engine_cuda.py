"""The torch engine on a CUDA device: the decode step replayed from CUDA graphs gives what the eager step
and the dynamic-cache engine give, through joins, aborts, a weight update and a sleep (runs where CUDA is)."""

import pytest
import torch
from engine_fixtures import assert_same, drive, greedy, lively_model, run_mixed

from rollart.engines.base import EngineRequest
from rollart.engines.torch_engine import TorchEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

COMPARED = ["a", "b", "twin1", "twin2", "one", "s", "c", "d", "e", "s2", "turn2"]


@pytest.fixture(scope="module")
def lively(tmp_path_factory):
    return lively_model(tmp_path_factory.mktemp("lively"))


def test_graph_replayed_decode_equals_eager_decode_and_the_dynamic_engine(lively):
    state = {k: v.clone() for k, v in TorchEngine(lively, kv_cache="dynamic").model.state_dict().items()}
    graphs = TorchEngine(lively, device="cuda")
    eager = TorchEngine(lively, device="cuda", cuda_graphs=False)
    dynamic = TorchEngine(lively, device="cuda", kv_cache="dynamic")
    got, want, ref = run_mixed(graphs, state), run_mixed(eager, state), run_mixed(dynamic, state)
    assert graphs.graphs is not None and eager.graphs is None
    assert graphs.decoder.ops.compiled and not eager.decoder.ops.compiled  # the fused steps were captured
    assert graphs.stats["graph_captures"] > 0 and graphs.stats["graph_replays"] > graphs.stats["graph_captures"]
    assert_same(got, want, COMPARED)
    assert_same(got, ref, COMPARED, tol=1e-4)  # other kernels (HF's attention over left-padded rows)
    assert graphs.stats["prefix_cache_hits"] > 0


def test_a_sleep_drops_the_graphs_and_the_woken_engine_captures_them_again(lively):
    engine = TorchEngine(lively, device="cuda")
    prompts = {f"p{i}": [5 + i] * (3 + 4 * i) for i in range(5)}
    script = [[("add", rid, p, greedy(12)) for rid, p in prompts.items()]]
    before, _ = drive(engine, script)
    captures = engine.stats["graph_captures"]
    weights = {k: v.detach().cpu().clone() for k, v in engine.model.state_dict().items()}
    engine.sleep(2)
    assert engine.memory().kv_cache_bytes == 0 and engine.memory().weight_bytes == 0
    engine.wake_up(weights, 1)
    again, _ = drive(engine, [[("add", rid, p, greedy(12)) for rid, p in prompts.items()]])
    assert_same(again, before, prompts)
    assert engine.stats["graph_captures"] > captures  # the old graphs held the freed storage


def test_bf16_graphs_decode_as_the_eager_step_does(lively):
    """In bf16 the plain steps replayed from graphs equal the eager step (the fused torch.compile'd steps keep
    float32 inside a kernel and round differently in bf16: compared in float32 above)."""
    outs = []
    for graphs in (True, False):
        engine = TorchEngine(
            lively, device="cuda", dtype="bfloat16", cuda_graphs=graphs, torch_compile=False, prefix_cache_tokens=0
        )
        for i in range(24):
            engine.add_request(EngineRequest(f"r{i}", [3 + i, 7, 11 + i % 5] * (1 + i % 4), greedy(6 + i % 9)))
        outs.append(drive(engine, [[]])[0])
        assert (engine.stats["graph_captures"] > 0) == graphs
    assert_same(outs[0], outs[1], [f"r{i}" for i in range(24)], tol=1e-3)
