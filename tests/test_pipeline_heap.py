"""The driver's heap during the steps (rollart.pipeline.heap)."""

import gc

import pytest

from rollart.pipeline.heap import setup_objects_frozen


def test_the_steps_full_collections_skip_the_objects_alive_when_they_began():
    """The objects alive when the steps begin are frozen out of the collector's full collections, and handed
    back when the steps end, also when they fail."""
    before = gc.get_freeze_count()
    with pytest.raises(RuntimeError), setup_objects_frozen() as frozen:
        assert frozen > before + 1000 and gc.get_freeze_count() > before + 1000  # this process's modules, at least
        raise RuntimeError("a step failed")
    assert gc.get_freeze_count() == 0
