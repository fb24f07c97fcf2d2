"""``rollart serve policy CONFIG_OR_CHECKPOINT [--host H] [--port P] [--token-env VAR] [--workers N]``:
the policy endpoint alone (no training), for evaluating or debugging an agent against a model.

``CONFIG_OR_CHECKPOINT`` is a pipeline config (its ``model``, ``engine``, ``sampling`` and ``serving``
sections), a Hugging Face model folder, or a run folder whose final policy was exported (``RUN/hf``,
``export.hf``). The endpoint is the one agents train through (:mod:`rollart.serving.app`): ``/v1`` and
session base URLs ``/sessions/{id}/v1`` (``POST /sessions`` opens one) that record the exact tokens.
It prints its URL on the first line of standard output, then serves until SIGINT or SIGTERM. The token
of ``--token-env`` is read and removed from the environment before Ray starts (its raylet and the
inference workers do not inherit it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def resolve_model(target: str) -> tuple[str, Any]:
    """``(model folder, pipeline config or None)`` of ``CONFIG_OR_CHECKPOINT``; a clear error otherwise."""
    path = Path(target).expanduser()
    if path.suffix in (".yaml", ".yml") or (not path.exists() and not path.suffix):
        from rollart.config import load_config

        cfg = load_config(target)
        model = cfg.model
        if model is None:
            from rollart.models import default_tiny_path

            model = str(default_tiny_path(**cfg.tiny_model))
        return model, cfg
    if (path / "config.json").is_file():
        return str(path), None
    if (path / "hf" / "config.json").is_file():
        return str(path / "hf"), None
    if (path / "checkpoint").is_dir():
        raise ValueError(
            f"{target}: a run folder without an exported policy; export it first "
            f"(rollart export {target} --hf {target}/hf) and serve {target}/hf"
        )
    raise ValueError(f"{target}: not a pipeline config (.yaml), a Hugging Face model folder or a run folder with hf/")


def served_name(model: str, cfg: Any) -> str:
    """The model id clients send: ``serving.model_name``'s default. A pipeline config: its ``name``; a run
    folder or its exported ``hf/``: the run folder's name (the run's ``output_dir``); any other model
    folder: the folder's name."""
    if cfg is not None:
        return str(cfg.name)
    folder = Path(model)
    run = folder.parent if folder.name == "hf" else None
    if run is not None and any((run / part).exists() for part in ("checkpoint", "metrics.jsonl", "ledger.json")):
        return run.resolve().name
    return folder.resolve().name


def cmd_serve_policy(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        log.error("rollart serve policy needs the 'serve' extra (%s): pip install 'rollart[serve]'", err)
        return 2
    from rollart.reward.http_guard import forget_env_secrets
    from rollart.serving.endpoint import job_token

    try:
        model, cfg = resolve_model(args.target)
        settings = _settings(args, cfg)
        token = job_token(settings)
    except ValueError as err:
        log.error("%s", err)
        return 2
    if settings.token_env:  # read: out of the environment before Ray starts (the raylet, the workers)
        forget_env_secrets([settings.token_env])
    return asyncio.run(_serve(args, model, cfg, settings, token))


def _settings(args: argparse.Namespace, cfg: Any) -> Any:
    from rollart.serving.config import ServingConfig

    base = cfg.serving.model_dump() if cfg is not None else {}
    for key in ("host", "port", "token_env", "model_name", "chat_template", "tool_parser", "processes"):
        value = getattr(args, key)
        if value is not None:
            base[key] = value
    base.setdefault("host", "127.0.0.1")
    if args.port is None and (cfg is None or "port" not in cfg.serving.model_fields_set):
        base["port"] = 8000
    return ServingConfig.model_validate(base)


async def _serve(args: argparse.Namespace, model: str, cfg: Any, settings: Any, token: str) -> int:
    from rollart.cluster.cluster import Cluster
    from rollart.engines.base import SamplingParams
    from rollart.resource_manager.manager import ResourceManager
    from rollart.rollout.inference_worker import inference_worker_class
    from rollart.rollout.llm_proxy import LLMProxy
    from rollart.serving.endpoint import PolicyEndpoint, build_service, model_context
    from rollart.serving.service import ProxyBackend

    engine = cfg.engine.model_copy(update={"model": cfg.engine.model or model}) if cfg is not None else None
    engine_dict = engine.model_dump() if engine is not None else {"kind": args.engine, "model": model}
    pools = {"rollout": {"hardware": "CPU", "cpus": args.workers}}
    rm = ResourceManager(pools, local_resources={"CPU": max(2, args.workers + 1)})
    cluster = Cluster(
        "policy", inference_worker_class({"*": ["CPU"]}), rm, pool="rollout", worker_kwargs={"engine": engine_dict}
    )
    proxy = LLMProxy(cluster)
    from transformers import AutoTokenizer

    sampling = cfg.sampling if cfg is not None else SamplingParams(max_new_tokens=256)
    name = settings.model_name or served_name(model, cfg)
    common: dict[str, Any] = {
        "model": name,
        "sampling": sampling,
        "max_context": model_context(model),
        "version_fn": lambda: proxy.version,
    }
    tokenizer = AutoTokenizer.from_pretrained(model)
    endpoint: Any
    if settings.processes:  # the HTTP server in processes of its own (serving.processes)
        from rollart.serving.processes import EndpointProcesses

        endpoint = EndpointProcesses(ProxyBackend(proxy), tokenizer, settings, token=token, **common)
    else:
        endpoint = PolicyEndpoint(
            build_service(ProxyBackend(proxy), tokenizer, settings, **common), settings, token=token
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await endpoint.start()
        print(endpoint.public_url, flush=True)
        where = f"${settings.token_env}" if settings.token_env else endpoint.token
        print(f"model {name!r} from {model}; bearer token: {where}", flush=True)
        if settings.processes > 1:  # each serves its own sessions; sessionless calls reach any of them
            print(f"{settings.processes} processes: {', '.join(endpoint.urls())}", flush=True)
        await stop.wait()
    finally:
        await endpoint.stop()
        proxy.close()
        cluster.shutdown()
        rm.shutdown()
    return 0


def add_policy_parser(what: Any) -> None:
    """Mount ``policy`` under ``rollart serve``."""
    p = what.add_parser("policy", help="the policy behind an OpenAI-compatible API (no training)")
    p.add_argument(
        "target", metavar="CONFIG_OR_CHECKPOINT", help="pipeline config, model folder or run folder with hf/"
    )
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000; 0: a free one, printed)")
    p.add_argument("--token-env", default=None, help="environment variable holding the bearer token (default: random)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the folder's name)")
    p.add_argument(
        "--chat-template", default=None, help="auto, a Jinja file or inline Jinja (tools need one that renders them)"
    )
    p.add_argument("--tool-parser", default=None, help="hermes, none or MODULE:FUNCTION")
    p.add_argument("--engine", default="torch", help="engine kind for a model folder (torch, vllm, sglang)")
    p.add_argument("--workers", type=int, default=1, help="inference workers (one CPU each)")
    p.add_argument(
        "--processes", type=int, default=None, help="HTTP server processes (default 1; 0: in the main process)"
    )
    p.set_defaults(func=cmd_serve_policy)
