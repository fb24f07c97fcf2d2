"""When the ``rollart`` command started: the Unix time its command modules began to load, which is the
interpreter's start give or take the import of ``rollart`` itself (milliseconds: it loads neither torch
nor Ray).

The start-up timeline of ``rollart run`` (:mod:`rollart.pipeline.startup`) counts from here, not from
the start of the process: a shell that runs ``bash -c 'pip install ... && rollart run ...'`` starts
the last command in its own process (it execs it), so the process began before the install did.
"""

from __future__ import annotations

import time

STARTED = time.time()
