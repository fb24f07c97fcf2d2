"""``rollart serve rewards MODULE:FUNC [...] --host 127.0.0.1 --port 8100 [--token-env VAR | --tenants FILE]
[--tenant-max-concurrency N] [--slots N] [--workers N] [--ray-serve]``."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def app_factory() -> Any:
    """Uvicorn factory for ``--workers N`` (each worker process rebuilds the app from the environment)."""
    import json
    import os

    from rollart.reward.loader import load_functions
    from rollart.reward.server import ServerSettings, build_app

    return build_app(
        load_functions(json.loads(os.environ["ROLLART_REWARD_FUNCTIONS"])),
        ServerSettings.model_validate_json(os.environ["ROLLART_REWARD_SETTINGS"]),
    )


def cmd_serve_rewards(args: argparse.Namespace) -> int:
    import json
    import os

    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as err:
        log.error("rollart serve rewards needs the 'serve' extra (%s): pip install 'rollart[serve]'", err)
        return 2

    from rollart.reward.loader import load_functions
    from rollart.reward.server import ServerSettings, build_app

    settings = ServerSettings(
        token_env=args.token_env,
        max_body_bytes=args.max_body_bytes,
        timeout_s=args.timeout_s,
        max_concurrency=args.max_concurrency,
        max_tenants=args.max_tenants,
        tenants_file=str(Path(args.tenants).resolve()) if args.tenants else None,
        tenant_max_concurrency=args.tenant_max_concurrency,
        slots=args.slots,
    )
    if args.judge_url is not None:
        from rollart.reward.builtin.judge import URL_ENV

        if not args.judge_url.startswith(("http://", "https://")):
            log.error("--judge-url %r: give an http:// or https:// base URL", args.judge_url)
            return 2
        # the environment reaches every uvicorn worker process and Ray Serve replica started from here
        os.environ[URL_ENV] = args.judge_url
    functions = load_functions(args.functions)  # fail here, before anything listens
    try:
        build_app(functions, settings)  # a bad tenants file or unset token variable fails here too
    except ValueError as err:
        log.error("%s", err)
        return 2
    if args.ray_serve:
        try:
            from ray import serve  # noqa: F401
        except ImportError:
            log.error("--ray-serve needs Ray Serve: pip install 'rollart[ray-serve]'")
            return 2
        from rollart.reward.ray_serve import deploy

        deploy(args.functions, settings, host=args.host, port=args.port, max_replicas=args.max_replicas)
        return 0
    log.info("serving %s on http://%s:%d/rewards/<name>", sorted(functions), args.host, args.port)
    if args.workers > 1:
        os.environ["ROLLART_REWARD_FUNCTIONS"] = json.dumps(args.functions)
        os.environ["ROLLART_REWARD_SETTINGS"] = settings.model_dump_json()
        uvicorn.run(
            "rollart.reward.cli:app_factory",
            factory=True,
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_level="warning",
        )
    else:
        uvicorn.run(build_app(functions, settings), host=args.host, port=args.port, log_level="warning")
    return 0


def add_rewards_parser(what: Any) -> None:
    """Mount ``rewards`` under ``rollart serve``."""
    p = what.add_parser("rewards", help="reward functions as an HTTP service")
    p.add_argument("functions", nargs="+", metavar="MODULE:FUNC", help="reward functions (name=MODULE:FUNC renames)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--token-env", default=None, help="environment variable holding the bearer token")
    p.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--timeout-s", type=float, default=60.0, help="per-request timeout (504 past it)")
    p.add_argument("--max-concurrency", type=int, default=64, help="requests computed at once (429 past it)")
    p.add_argument(
        "--max-tenants",
        type=int,
        default=100,
        help="distinct X-Rollart-Tenant labels kept in /metrics (later ones count as 'other')",
    )
    p.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="YAML/JSON 'tenants: {NAME: {token_env: VAR, max_concurrency: N}}': a token (and quota) per job",
    )
    p.add_argument(
        "--tenant-max-concurrency",
        type=int,
        default=None,
        help="requests of one tenant computed at once (429 past it, for that tenant only)",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=None,
        help="trajectories computed at once across all requests (the service's capacity)",
    )
    p.add_argument(
        "--judge-url",
        default=None,
        help="llm_judge: the OpenAI-compatible judge's base URL (else $ROLLART_JUDGE_URL); requests cannot choose it",
    )
    p.add_argument("--ray-serve", action="store_true", help="deploy on Ray Serve with autoscaling from zero")
    p.add_argument("--max-replicas", type=int, default=4, help="Ray Serve: most replicas")
    p.set_defaults(func=cmd_serve_rewards)
