"""``rollart view RUN_DIR``: a local web page of a run (served on 127.0.0.1, working offline): its curves,
the workers' timeline and a trajectory browser, read from the run folder while the run goes on and after.

:mod:`~rollart.tracking.viewer.data` reads the folder, :mod:`~rollart.tracking.viewer.server` serves the
page (``static/``, shipped with the package) and its JSON API, and :mod:`~rollart.tracking.viewer.tokens`
reads a trained trajectory's tokens from the run's batch record (``record_batches: true``).
"""

from rollart.tracking.viewer.data import PER_TOKEN_NOTE, RunFolder

__all__ = ["PER_TOKEN_NOTE", "RunFolder"]
