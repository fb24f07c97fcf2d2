"""The ray weight channel with ``weights.background_load``: the driver trains the next batch while the
inference workers load the last snapshot (the newest one wins), the α bound still holds, nothing is lost
or trained twice, and the run ends with every worker serving the last version."""

import json

from test_pipeline import small_config

from rollart.pipelines.agentic import AgenticPipeline


def test_snapshots_load_in_the_background_and_the_run_ends_on_the_last_version(ray_local, tmp_path):
    cfg = small_config(tmp_path, steps=6, checkpoint_every=0, weights={"background_load": True})
    assert cfg.rollout.alpha == 1
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        history = pipe.run()
        served = [m["weight_version"] for m in pipe.infer.metrics().result()]
        loader = pipe.weights.loader
    finally:
        pipe.shutdown()
    assert [h["version"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert all(h["max_staleness"] <= cfg.rollout.alpha for h in history)
    assert served == [6]
    # every load went through the background loader, in increasing order, the last one included
    assert loader is not None and loader.loads >= 1
    assert loader.loaded == sorted(loader.loaded) and loader.loaded[-1] == 6
    assert not pipe.weights.snapshots  # no snapshot kept once loaded
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0 and ledger["trained"] == 6 * 2 * 4


def test_without_background_load_every_step_waits_for_its_load(ray_local, tmp_path):
    cfg = small_config(tmp_path, steps=3, checkpoint_every=0)
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        history = pipe.run()
    finally:
        pipe.shutdown()
    assert pipe.weights.loader is None
    # the load is inside the step's weight sync: the driver's wait includes the workers' load
    assert all(h["time"]["weight_sync_s"] >= h["time"]["weight_load_s"] > 0 for h in history)
