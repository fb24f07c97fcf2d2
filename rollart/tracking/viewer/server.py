"""The viewer's web server: the page (``/``, its script and style, shipped in this package) and its JSON API
(``/api/run``, ``/api/curves``, ``/api/timeline``, ``/api/trajectories``, ``/api/trajectories/{id}``),
served by uvicorn on 127.0.0.1 only. The page polls ``/api/run`` and re-reads the rest when the run's files
changed, so a live run's page follows it."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from rollart.tracking.viewer.data import RunFolder

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
STATIC = {"index.html": "text/html", "viewer.js": "text/javascript", "viewer.css": "text/css"}
"""The page's files (package data of ``rollart.tracking.viewer``: nothing is fetched from elsewhere)."""
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'"
"""The page may load and fetch from the viewer only."""


def static_file(name: str) -> bytes:
    return resources.files("rollart.tracking.viewer").joinpath("static", name).read_bytes()


def build_app(run_dir: Path, *, live: Callable[[], bool] | None = None) -> Any:
    """The viewer's FastAPI app for ``run_dir``; ``live()``: whether a run is writing the folder now."""
    from fastapi import FastAPI, HTTPException, Query
    from fastapi.responses import Response

    folder = RunFolder(run_dir)
    app = FastAPI(title="rollart view", docs_url=None, redoc_url=None, openapi_url=None)
    pages = {name: static_file(name) for name in STATIC}

    def page(name: str) -> Response:
        return Response(
            pages[name],
            media_type=STATIC[name],
            headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"},
        )

    @app.get("/")
    def index() -> Response:
        return page("index.html")

    @app.get("/static/{name}")
    def static(name: str) -> Response:
        if name not in pages:
            raise HTTPException(404, f"no file {name}")
        return page(name)

    @app.get("/api/run")
    def run() -> dict[str, Any]:
        return {**folder.summary(), "live": bool(live()) if live is not None else False}

    @app.get("/api/curves")
    def curves() -> dict[str, Any]:
        return folder.curves()

    @app.get("/api/timeline")
    def timeline() -> dict[str, Any]:
        return folder.timeline()

    @app.get("/api/trajectories")
    def trajectories(
        tag: str | None = None,
        status: str | None = Query(None, pattern="^(trained|failed|dropped|open)$"),
        reward_min: float | None = None,
        reward_max: float | None = None,
        staleness_min: int | None = None,
        staleness_max: int | None = None,
        offset: int = Query(0, ge=0),
        limit: int = Query(200, ge=1, le=5000),
    ) -> dict[str, Any]:
        return folder.trajectories(
            tag=tag or None,
            status=status or None,
            reward_min=reward_min,
            reward_max=reward_max,
            staleness_min=staleness_min,
            staleness_max=staleness_max,
            offset=offset,
            limit=limit,
        )

    @app.get("/api/trajectories/{n}")
    def trajectory(n: int) -> dict[str, Any]:
        found = folder.trajectory(n)
        if found is None:
            raise HTTPException(404, f"no trajectory {n} in {run_dir} (the list's `id`)")
        return found

    return app


def bind(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:``port`` (0: a free port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    return sock


def serve(run_dir: Path, *, port: int = 0, live: Callable[[], bool] | None = None) -> None:
    """Serve the viewer of ``run_dir`` on 127.0.0.1 until interrupted; logs its URL."""
    import uvicorn

    sock = bind(port)
    url = f"http://{HOST}:{sock.getsockname()[1]}/"
    config = uvicorn.Config(build_app(run_dir, live=live), log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    log.info("rollart view: %s at %s (Ctrl-C stops it)", run_dir, url)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
