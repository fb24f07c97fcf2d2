r"""``rollart serve rewards MODULE:FUNC [...] --host 127.0.0.1 --port 8100 [--token-env VAR | --tenants FILE]
[--tenant-max-concurrency N] [--slots N] [--workers N] [--ray-serve] [--sandbox-timeout-s S ...]
[--unsafe-no-sandbox]``.

Once the app is built, the token variables (``--token-env``, the tenants file's ``token_env``\ s and
``$ROLLART_JUDGE_TOKEN``) are removed from the server's environment (:func:`rollart.reward.http_guard.forget_env_secrets`):
nothing the server starts inherits them."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def add_sandbox_arguments(p: argparse.ArgumentParser) -> None:
    """The code sandbox's limits and the opt-in to run code without isolation (``serve rewards|env``)."""
    from rollart.reward.sandbox import SandboxLimits

    d = SandboxLimits()
    p.add_argument(
        "--sandbox-timeout-s", type=float, default=d.timeout_s, help="code sandbox: most CPU seconds per run"
    )
    p.add_argument(
        "--sandbox-wall-factor",
        type=float,
        default=d.wall_factor,
        help="code sandbox: wall-clock seconds per run, as a multiple of --sandbox-timeout-s",
    )
    p.add_argument("--sandbox-memory-mb", type=int, default=d.memory_mb, help="code sandbox: most MB per process")
    p.add_argument("--sandbox-processes", type=int, default=d.max_processes, help="code sandbox: most processes")
    p.add_argument("--sandbox-disk-mb", type=int, default=d.disk_mb, help="code sandbox: most MB written in all")
    p.add_argument(
        "--sandbox-shm-mb", type=int, default=d.shm_mb, help="code sandbox: most MB of /dev/shm, and of SysV shm"
    )
    p.add_argument(
        "--unsafe-no-sandbox",
        action="store_true",
        help="run untrusted code WITHOUT isolation when bubblewrap is not usable (a root server runs it as a "
        "uid of its own; any other server as itself, with its files, tokens and processes; either way it "
        "reaches the network); without it, code is refused",
    )


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    """Connection limits of the HTTP services (``serve rewards|env``)."""
    p.add_argument("--max-connections", type=int, default=512, help="connections open at once (503 and closed past it)")
    p.add_argument(
        "--read-timeout-s",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's headers, and as long again for its body (408 past it)",
    )


def sandbox_limits(args: argparse.Namespace) -> Any:
    """The :class:`~rollart.reward.sandbox.SandboxLimits` of the command line (a ``ValueError`` naming the flag)."""
    from pydantic import ValidationError

    from rollart.reward.sandbox import SandboxLimits

    try:
        return SandboxLimits(
            timeout_s=args.sandbox_timeout_s,
            wall_factor=args.sandbox_wall_factor,
            memory_mb=args.sandbox_memory_mb,
            max_processes=args.sandbox_processes,
            disk_mb=args.sandbox_disk_mb,
            shm_mb=args.sandbox_shm_mb,
        )
    except ValidationError as err:
        flags = {"timeout_s": "timeout-s", "memory_mb": "memory-mb", "max_processes": "processes", "disk_mb": "disk-mb",
                 "shm_mb": "shm-mb", "wall_factor": "wall-factor"}  # fmt: skip
        raise ValueError(
            "; ".join(f"--sandbox-{flags.get(str(e['loc'][0]), e['loc'][0])}: {e['msg']}" for e in err.errors())
        ) from None


def secret_variables(settings: Any) -> list[str]:
    """The environment variables holding the server's secrets."""
    from rollart.reward.builtin.judge import TOKEN_ENV
    from rollart.reward.http_guard import tenant_token_envs

    names = [TOKEN_ENV]
    if settings.token_env:
        names.append(settings.token_env)
    if settings.tenants_file:
        names += tenant_token_envs(settings.tenants_file)
    return names


def app_factory() -> Any:
    """Uvicorn factory for ``--workers N`` (each worker process rebuilds the app from the environment,
    then forgets the secrets in it)."""
    import json
    import os

    from rollart.reward.builtin.judge import capture_credentials
    from rollart.reward.http_guard import forget_env_secrets
    from rollart.reward.loader import load_functions
    from rollart.reward.server import ServerSettings, build_app

    settings = ServerSettings.model_validate_json(os.environ["ROLLART_REWARD_SETTINGS"])
    app = build_app(load_functions(json.loads(os.environ["ROLLART_REWARD_FUNCTIONS"])), settings)
    capture_credentials()
    forget_env_secrets(secret_variables(settings))
    return app


def cmd_serve_rewards(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        log.error("rollart serve rewards needs the 'serve' extra (%s): pip install 'rollart[serve]'", err)
        return 2

    from rollart.reward.loader import load_functions
    from rollart.reward.sandbox import SandboxUnavailable
    from rollart.reward.server import build_app

    try:
        limits = sandbox_limits(args)
    except ValueError as err:
        log.error("%s", err)
        return 2
    settings = _server_settings(args, limits)
    if args.judge_url is not None and not _export_judge_url(args.judge_url):
        return 2
    functions = load_functions(args.functions)  # fail here, before anything listens
    try:
        # a bad tenants file, an unset or short token, code functions without isolation fail here
        app = build_app(functions, settings)
    except (ValueError, SandboxUnavailable) as err:
        log.error("%s", err)
        return 2
    if args.ray_serve:
        return _deploy_ray_serve(args, settings)
    return _serve_http(args, settings, app, sorted(functions))


def _server_settings(args: argparse.Namespace, limits: Any) -> Any:
    """The :class:`~rollart.reward.server.ServerSettings` of the command line."""
    from rollart.reward.server import ServerSettings

    return ServerSettings(
        sandbox=limits,
        unsafe_no_sandbox=args.unsafe_no_sandbox,
        token_env=args.token_env,
        max_body_bytes=args.max_body_bytes,
        timeout_s=args.timeout_s,
        max_concurrency=args.max_concurrency,
        max_tenants=args.max_tenants,
        tenants_file=str(Path(args.tenants).resolve()) if args.tenants else None,
        tenant_max_concurrency=args.tenant_max_concurrency,
        slots=args.slots,
        threads_per_function=args.threads_per_function,
        tenant_slots=args.tenant_slots,
        max_connections=args.max_connections,
        read_timeout_s=args.read_timeout_s,
        idempotency_cache=args.idempotency_cache,
        idempotency_cache_mb=args.idempotency_cache_mb,
    )


def _export_judge_url(url: str) -> bool:
    """``--judge-url``: set in the environment, for every worker process and replica (False: not a URL)."""
    import os

    from rollart.reward.builtin.judge import URL_ENV

    if not url.startswith(("http://", "https://")):
        log.error("--judge-url %r: give an http:// or https:// base URL", url)
        return False
    # the environment reaches every uvicorn worker process and Ray Serve replica started from here
    os.environ[URL_ENV] = url
    return True


def _deploy_ray_serve(args: argparse.Namespace, settings: Any) -> int:
    """``--ray-serve``: deploy the functions on Ray Serve instead of serving them here."""
    try:
        from ray import serve  # noqa: F401
    except ImportError:
        log.error("--ray-serve needs Ray Serve: pip install 'rollart[ray-serve]'")
        return 2
    from rollart.reward.ray_serve import deploy

    deploy(args.functions, settings, host=args.host, port=args.port, max_replicas=args.max_replicas)
    return 0


def _serve_http(args: argparse.Namespace, settings: Any, app: Any, names: list[str]) -> int:
    """Serve ``app`` (``--workers N``: N processes that each rebuild it) until stopped; the secrets are
    forgotten from the environment before it listens."""
    import json
    import os

    from rollart.reward.builtin.judge import capture_credentials
    from rollart.reward.http_guard import beyond_loopback, forget_env_secrets
    from rollart.reward.http_server import GuardedConfig, run_server

    if beyond_loopback(args.host) and not (args.token_env or args.tenants):
        log.warning(
            "reward service on %s without a token: anyone who reaches it can run its functions (and the code "
            "they run); give --token-env or --tenants",
            args.host,
        )
    log.info("serving %s on http://%s:%d/rewards/<name>", names, args.host, args.port)
    if args.workers > 1:
        # each worker process rebuilds the app: the secrets travel in the configuration it is spawned
        # with, and this process forgets them before it starts any (workers, resource tracker)
        secrets = {n: os.environ[n] for n in secret_variables(settings) if n in os.environ}
        os.environ["ROLLART_REWARD_FUNCTIONS"] = json.dumps(args.functions)
        os.environ["ROLLART_REWARD_SETTINGS"] = settings.model_dump_json()
        forget_env_secrets(list(secrets))
        config = GuardedConfig(
            "rollart.reward.cli:app_factory",
            factory=True,
            limits=settings.connection_limits(),
            secrets=secrets,
            host=args.host,
            port=args.port,
            workers=args.workers,
        )
    else:
        capture_credentials()
        forget_env_secrets(secret_variables(settings))
        config = GuardedConfig(app, limits=settings.connection_limits(), host=args.host, port=args.port)
    run_server(config)
    return 0


def add_rewards_parser(what: Any) -> None:
    """Mount ``rewards`` under ``rollart serve``."""
    p = what.add_parser("rewards", help="reward functions as an HTTP service")
    p.add_argument("functions", nargs="+", metavar="MODULE:FUNC", help="reward functions (name=MODULE:FUNC renames)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface, for other hosts)"
    )
    p.add_argument("--port", type=int, default=8100, help="TCP port to listen on")
    p.add_argument("--token-env", default=None, help="environment variable holding the bearer token")
    p.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="largest request body (413 past it)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per-request timeout (504 past it)")
    p.add_argument("--max-concurrency", type=int, default=64, help="requests computed at once (429 past it)")
    add_connection_arguments(p)
    p.add_argument(
        "--idempotency-cache",
        type=int,
        default=10_000,
        help="answers kept for a retry with the same Idempotency-Key (0: none), the oldest forgotten first",
    )
    p.add_argument(
        "--idempotency-cache-mb",
        type=float,
        default=32.0,
        help="and at most this many MB of them (encoded answers plus ~0.5 KB per answer)",
    )
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
    p.add_argument(
        "--threads-per-function",
        type=int,
        default=8,
        help="threads of each synchronous reward function's own pool (slow functions cannot starve the others)",
    )
    p.add_argument(
        "--tenant-slots",
        type=int,
        default=None,
        help="trajectories one tenant computes at once in a function's pool and of --slots (default: all but "
        "one, so another tenant always finds one free); freed ones go to the tenant computing the fewest",
    )
    add_sandbox_arguments(p)
    p.add_argument("--ray-serve", action="store_true", help="deploy on Ray Serve with autoscaling from zero")
    p.add_argument("--max-replicas", type=int, default=4, help="Ray Serve: most replicas")
    p.set_defaults(func=cmd_serve_rewards)
