"""``rollart serve rewards ...``, ``rollart serve env ...`` and ``rollart serve policy ...``: the services'
commands, mounted under ``serve``. Each service's module defines its own arguments and runs it."""

from __future__ import annotations

from typing import Any


def add_serve_parser(sub: Any) -> None:
    from rollart.cli.policy import add_policy_parser
    from rollart.envservice.cli import add_env_parser
    from rollart.reward.cli import add_rewards_parser

    serve = sub.add_parser(
        "serve",
        help="serve reward functions (rewards), environments (env) or a policy as an OpenAI-compatible "
        "endpoint (policy) over HTTP",
        description="The services: reward functions (rollart serve rewards), environments (rollart serve env) "
        "and a policy as an OpenAI-compatible endpoint (rollart serve policy). rollart serve SERVICE --help "
        "describes each.",
    )
    what = serve.add_subparsers(dest="service", required=True)
    add_rewards_parser(what)
    add_env_parser(what)
    add_policy_parser(what)
