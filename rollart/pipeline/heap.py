"""The driver's heap during the steps: what was built during set-up is kept out of the garbage collector's
full collections.

A run's driver holds a few million objects once it has started (Ray, torch, transformers, the tokenizer,
the config, the workers' handles), nearly all of them alive until the run ends. Python's full (generation
2) collection walks every one of them each time it runs, and the steps' allocations (requests, token
lists, trajectories, trace events) start one every few steps: on the quickstart about 150 ms each, one
every four to five 0.2-second steps, ~17% of the driver's time (``rollart bench traces`` showed them as
the steps whose rollout took 0.3-0.4 s). :func:`setup_objects_frozen` moves the objects alive when the
steps begin to the collector's permanent generation (:func:`gc.freeze`), so a full collection walks only
what the steps made, and hands them back when the steps end (:func:`gc.unfreeze`). Meanwhile objects of the
set-up that die are still freed by their reference counts; only a reference cycle among them waits for the
end of the steps.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


@contextmanager
def setup_objects_frozen() -> Iterator[int]:
    """Collect what set-up left as garbage, freeze what is alive for the duration of the block (yields how
    many objects were frozen), unfreeze after it."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug(
        "heap: %d set-up objects kept out of full collections (%.0f ms)", frozen, 1e3 * (time.perf_counter() - t0)
    )
    try:
        yield frozen
    finally:
        gc.unfreeze()
