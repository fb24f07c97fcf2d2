"""The reward service on Ray Serve, autoscaling from zero replicas (RollArt paper §4.3: stateless rewards
scale elastically to and from zero). Needs ``pip install rollart[serve]``."""

from __future__ import annotations

import logging
from typing import Any

from rollart.reward.server import ServerSettings

log = logging.getLogger(__name__)


def deployment(
    function_specs: list[str], settings: ServerSettings, max_replicas: int = 4, downscale_delay_s: float = 60.0
) -> Any:
    """A bound Ray Serve application serving the same FastAPI app, ``min_replicas=0``.

    Each replica builds the app (and loads the reward functions) itself: a FastAPI app holds thread
    queues that cannot be pickled, and a function loaded on the replica runs there."""
    from ray import serve

    from rollart.reward.loader import load_functions
    from rollart.reward.server import build_app

    build_app(load_functions(function_specs), settings)  # a bad spec or setting fails here, before any replica

    def build() -> Any:
        return build_app(load_functions(function_specs), settings)

    @serve.deployment(
        name="rollart-rewards",
        autoscaling_config={
            "min_replicas": 0,
            "initial_replicas": 1,
            "max_replicas": max_replicas,
            "target_ongoing_requests": settings.max_concurrency // 2 or 1,
            "downscale_delay_s": downscale_delay_s,
        },
        max_ongoing_requests=settings.max_concurrency,
    )
    @serve.ingress(build)
    class RewardService:
        pass

    return RewardService.bind()


def deploy(
    function_specs: list[str],
    settings: ServerSettings,
    *,
    host: str = "127.0.0.1",
    port: int = 8100,
    max_replicas: int = 4,
    blocking: bool = True,
) -> None:
    import ray
    from ray import serve

    from rollart.resource_manager.launcher import ensure_ray

    ensure_ray({"CPU": 2})
    serve.start(http_options={"host": host, "port": port})
    serve.run(deployment(function_specs, settings, max_replicas), name="rollart-rewards", route_prefix="/")
    log.info("reward service on Ray Serve at http://%s:%d/rewards/<name> (min_replicas=0)", host, port)
    if blocking:
        import threading

        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            serve.shutdown()
            ray.shutdown()
