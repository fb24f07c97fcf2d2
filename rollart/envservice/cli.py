"""``rollart serve env ENV [...] --host 127.0.0.1 --port 8200 [--token-env VAR | --tenants FILE]
[--max-body-bytes N] [--sandbox-timeout-s S ...] [--unsafe-no-sandbox]``: serve text envs over the env
session protocol (:mod:`rollart.envservice.protocol`). ``ENV`` is a registry name (``reverse``), a
user's ``MODULE:CLASS`` (a :class:`~rollart.envs.TextEnv` subclass, imported from the working directory
or ``--plugin-path``, searched after the installed packages: a module there never shadows one the
server needs), or ``alias=MODULE:CLASS``. It listens on 127.0.0.1 unless ``--host`` says
otherwise; on any other address give it a token. Once the app is built the token variables are removed
from the server's environment."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def parse_env_args(specs: list[str]) -> dict[str, str]:
    """``["reverse", "copy=my_envs:CopyEnv"]`` → ``{"reverse": "reverse", "copy": "my_envs:CopyEnv"}``."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, target = spec.partition("=")
        if not sep:
            name, target = spec, spec
        if not name or not target:
            raise ValueError(f"env {spec!r}: write NAME, MODULE:CLASS or ALIAS=MODULE:CLASS")
        if name in out:
            raise ValueError(f"env {name!r} is named twice")
        out[name] = target
    return out


def cmd_serve_env(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        log.error("rollart serve env needs the 'serve' extra (%s): pip install 'rollart[serve]'", err)
        return 2
    from rollart.envservice.server import EnvServerSettings, build_env_app
    from rollart.plugins import add_search_path
    from rollart.reward.cli import sandbox_limits
    from rollart.reward.http_guard import beyond_loopback, forget_env_secrets, tenant_token_envs
    from rollart.reward.sandbox import SandboxUnavailable

    # after the installed packages: a yaml.py or h11.py in the working directory never runs as the server
    add_search_path([*args.plugin_path, "."])
    try:
        envs = parse_env_args(args.envs)
        settings = EnvServerSettings(
            max_sessions=args.max_sessions,
            session_ttl_s=args.session_ttl_s,
            call_timeout_s=args.call_timeout_s,
            token_env=args.token_env,
            tenants_file=str(Path(args.tenants).resolve()) if args.tenants else None,
            max_body_bytes=args.max_body_bytes,
            sandbox=sandbox_limits(args),
            unsafe_no_sandbox=args.unsafe_no_sandbox,
            max_connections=args.max_connections,
            read_timeout_s=args.read_timeout_s,
            tenant_max_sessions=args.tenant_max_sessions,
            max_threads=args.max_threads,
            tenant_threads=args.tenant_threads,
            max_kwargs_bytes=args.max_kwargs_bytes,
        )
        app = build_env_app(envs, settings)
    except (ValueError, SandboxUnavailable) as err:  # an env that does not resolve, a bad token: fail now
        log.error("%s", err)
        return 2
    secrets = [args.token_env or ""] + (tenant_token_envs(settings.tenants_file) if settings.tenants_file else [])
    forget_env_secrets(secrets)
    if beyond_loopback(args.host) and not (args.token_env or args.tenants):
        log.warning(
            "env server on %s without a token: anyone who reaches it can open sessions; give --token-env or --tenants",
            args.host,
        )
    log.info(
        "serving envs %s on http://%s:%d (protocol: rollart.envservice.protocol)", sorted(envs), args.host, args.port
    )
    from rollart.reward.http_server import GuardedConfig, run_server

    run_server(GuardedConfig(app, limits=settings.connection_limits(), host=args.host, port=args.port))
    return 0


def add_env_parser(what: Any) -> None:
    """Mount ``env`` under ``rollart serve``."""
    p = what.add_parser("env", help="text environments as an HTTP session service")
    p.add_argument("envs", nargs="+", metavar="ENV", help="registry name, MODULE:CLASS, or ALIAS=MODULE:CLASS")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface, for other hosts)"
    )
    p.add_argument("--port", type=int, default=8200, help="TCP port to listen on")
    p.add_argument("--max-sessions", type=int, default=1024, help="open sessions at most (429 past it)")
    p.add_argument(
        "--tenant-max-sessions",
        type=int,
        default=None,
        help="sessions one tenant has open or opening (429 past it; default: --max-sessions shared evenly by the "
        "tenants of --tenants)",
    )
    p.add_argument("--max-threads", type=int, default=32, help="threads running env calls (build, reset, step)")
    p.add_argument(
        "--tenant-threads",
        type=int,
        default=None,
        help="threads one tenant's env calls hold at once, a timed-out call until it returns (default: "
        "--max-threads shared evenly by the tenants of --tenants)",
    )
    p.add_argument(
        "--max-kwargs-bytes", type=int, default=64 * 1024, help="a session's kwargs as JSON, at most (422 past it)"
    )
    p.add_argument("--session-ttl-s", type=float, default=900.0, help="seconds after which an idle session is closed")
    p.add_argument(
        "--call-timeout-s",
        type=float,
        default=60.0,
        help="seconds a reset or step may take when the call names no timeout_s",
    )
    p.add_argument("--plugin-path", action="append", default=[], help="folder to import MODULE:CLASS envs from")
    p.add_argument("--token-env", default=None, help="environment variable holding the bearer token")
    p.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="YAML/JSON 'tenants: {NAME: {token_env: VAR}}': a token per client; a session belongs to its tenant",
    )
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger requests get 413")
    from rollart.reward.cli import add_connection_arguments, add_sandbox_arguments

    add_connection_arguments(p)
    add_sandbox_arguments(p)
    p.set_defaults(func=cmd_serve_env)
