"""Settings: the one place every default lives.

Each setting has one name, used the same way everywhere: `routing_threshold` in YAML,
`DPD_ROUTING_THRESHOLD` in the environment and `--routing-threshold` on the command line.
Precedence, highest first: command-line flags, environment, YAML file, defaults.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from dpd_router.keys import checked_digest

PrefillStrategy = Literal["roundrobin", "session", "prefixaware", "kvaware", "leastloaded"]
ThresholdMode = Literal["static", "cache_aware", "adaptive"]
KVConnectorName = Literal["nixl", "shared_storage", "lmcache", "sglang"]
LogFormat = Literal["json", "text"]
DiscoveryMode = Literal["static", "kubernetes"]

UrlList = Annotated[list[str], NoDecode]


class SettingsError(ValueError):
    """The configuration is invalid; the message names the offending setting."""


def _split_urls(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def _normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    scheme = url.split("://", 1)[0]
    if scheme not in ("http", "https"):
        raise ValueError(f"{url!r} must be an http:// or https:// URL")
    return url


PortList = Annotated[list[Annotated[int, Field(ge=1, le=65535)]], NoDecode]


class LMCacheReceiver(BaseModel):
    """One decoder's LMCache PD receiver: its host (default: the decoder URL's) and one init and one
    alloc port per TP rank."""

    model_config = ConfigDict(extra="forbid")

    host: str | None = None
    init_ports: list[Annotated[int, Field(ge=1, le=65535)]] = Field(min_length=1)
    alloc_ports: list[Annotated[int, Field(ge=1, le=65535)]] = Field(min_length=1)

    @model_validator(mode="after")
    def _same_ranks(self) -> LMCacheReceiver:
        if len(self.init_ports) != len(self.alloc_ports):
            raise ValueError("init_ports and alloc_ports need one port per TP rank each")
        return self


class TenantPools(BaseModel):
    """The engines reserved for one tenant, and its own admission limits (unset: the top-level ones)."""

    model_config = ConfigDict(extra="forbid")

    prefill_urls: list[str] = Field(default_factory=list)
    decode_urls: list[str] = Field(min_length=1)
    max_in_flight: int | None = Field(default=None, ge=0)
    max_queued: int | None = Field(default=None, ge=0)
    queue_timeout: float | None = Field(default=None, gt=0)

    @field_validator("prefill_urls", "decode_urls", mode="before")
    @classmethod
    def _parse_url_list(cls, value: Any) -> Any:
        return _split_urls(value)

    @field_validator("prefill_urls", "decode_urls")
    @classmethod
    def _check_urls(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(_normalise_url(url) for url in value))


class Settings(BaseSettings):
    """Everything the router can be told, with its defaults."""

    model_config = SettingsConfigDict(
        env_prefix="DPD_",
        extra="forbid",
        validate_default=True,
    )

    # Where the config file came from (set by the CLI or DPD_CONFIG); not itself read from YAML.
    config: Path | None = Field(default=None, exclude=True)
    # Seconds between checks of the config file for changes (applied live); 0 turns watching off.
    config_watch_interval: float = Field(default=2.0, ge=0)
    # What the settings were built from (flags), so a reload re-reads env and file under them.
    _overrides: dict[str, Any] = PrivateAttr(default_factory=dict)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # Seconds a client's idle keep-alive connection stays open. Longer than what clients and load
    # balancers keep idle connections for (httpx and the openai client: 5 s; cloud load balancers:
    # 60 s), so the router never closes a connection a client is sending its next request on.
    client_keepalive_timeout: int = Field(default=75, ge=1)

    prefill_urls: UrlList = Field(default_factory=list)
    decode_urls: UrlList = Field(default_factory=list)

    model: str | None = None
    tokenizer: Path | None = None

    routing_threshold: int = Field(default=4096, ge=1)
    # cache_aware: compare the tokens the chosen decoder would still compute; static: the whole prompt.
    threshold_mode: ThresholdMode = "cache_aware"
    # threshold_mode adaptive: disaggregate when interference_weight x (the stall a direct prefill inflicts
    # on the decoder's running streams) exceeds the hop's extra cost, both learned online; never below
    # min_threshold uncached tokens, always from max_threshold; explore_share of the decisions near the
    # boundary are flipped to the hop to keep measuring it (at least a quarter until a prefiller has served
    # 8 hops; 0: never); known SLOs (seconds) win when only one path meets
    # them: ttft_slo by first-token time, itl_slo by the pause a direct prefill puts in the decoder's streams,
    # of which itl_slo_share of the decoder's recent inter-token gaps may be longer (0: none); ttft_slo holds
    # only for prompts of at most ttft_slo_max_tokens uncached tokens (0: every prompt), longer ones have none.
    interference_weight: float = Field(default=1.0, ge=0)
    min_threshold: int = Field(default=256, ge=0)
    max_threshold: int = Field(default=32768, ge=1)
    explore_share: float = Field(default=0.03, ge=0, le=0.2)
    ttft_slo: float | None = Field(default=None, gt=0)
    ttft_slo_max_tokens: int = Field(default=0, ge=0)
    itl_slo: float | None = Field(default=None, gt=0)
    itl_slo_share: float = Field(default=0.0, ge=0, le=0.1)
    prefill_strategy: PrefillStrategy = "prefixaware"
    # The `session` strategy's key: this header, else the body's `user` field.
    session_header: str = Field(default="x-session-id", min_length=1)

    # Prefix affinity: prompts are hashed in blocks of the engines' KV block size (their --block-size),
    # and the router keeps at most prefix_index_capacity blocks (about 230 bytes each, measured) of where they went.
    block_size: int = Field(default=16, ge=1)
    prefix_index_capacity: int = Field(default=1_000_000, ge=1)
    # A cached prefix is passed over when its endpoint's load exceeds the lightest candidate's by more
    # than balance_abs_threshold and is more than balance_rel_threshold times it.
    balance_abs_threshold: float = Field(default=32.0, ge=0)
    balance_rel_threshold: float = Field(default=1.5, ge=1.0)

    # When every prefiller's engine queue is deeper than this, prompts with fewer uncached tokens than
    # prefill_busy_max_tokens go direct (0 disables the gate). In threshold_mode adaptive the model
    # prices each prefiller's queue itself, so the gate counts queued prompt tokens instead of waiting
    # requests: closed when every prefiller has more than prefill_busy_queue_tokens queued (0: never),
    # and its ceiling is on uncached tokens times the decoder's running streams (at least 1).
    prefill_busy_queue_depth: int = Field(default=8, ge=0)
    prefill_busy_max_tokens: int = Field(default=16384, ge=0)
    prefill_busy_queue_tokens: int = Field(default=131072, ge=0)

    # Seconds between scrapes of every engine's /metrics; a load older than three intervals is ignored.
    load_scrape_interval: float = Field(default=2.0, gt=0)

    # kvaware sources. vLLM KV events: engine URL -> its publishers' ZMQ addresses (one per data-parallel
    # rank), and/or kv_events_port for tcp://<engine host>:<port> on every engine not listed.
    kv_events_endpoints: dict[str, list[str]] = Field(default_factory=dict)
    kv_events_port: int | None = Field(default=None, ge=1, le=65535)
    # LMCache controller, asked per request within kv_lookup_timeout seconds; its instance ids are learnt
    # by engine host, or given here as engine URL -> instance id.
    lmcache_controller_url: str | None = None
    lmcache_instance_ids: dict[str, str] = Field(default_factory=dict)
    kv_lookup_timeout: float = Field(default=0.05, gt=0)
    kv_connector: KVConnectorName = "nixl"
    # kv_connector lmcache (LMCache PD): every decoder's receiver takes the KV on these ports (one per TP
    # rank) on its own host, unless lmcache_receivers names it; the prefillers' workers confirm each
    # hand-off with lmcache_notify_count ProxyNotif messages (default: one per init port) on the
    # router's ZMQ PULL socket at lmcache_notify_address, within lmcache_notify_timeout seconds of the
    # prefill answer, or the hop has failed.
    lmcache_receiver_init_ports: PortList = Field(default_factory=lambda: [8300], min_length=1)
    lmcache_receiver_alloc_ports: PortList = Field(default_factory=lambda: [8400], min_length=1)
    lmcache_receivers: dict[str, LMCacheReceiver] = Field(default_factory=dict)
    lmcache_notify_address: str = "tcp://127.0.0.1:8500"
    lmcache_notify_count: int | None = Field(default=None, ge=1)
    lmcache_notify_timeout: float = Field(default=5.0, gt=0)
    # kv_connector sglang: the prefillers' bootstrap server port, and per-prefiller exceptions.
    sglang_bootstrap_port: int = Field(default=8998, ge=1, le=65535)
    sglang_bootstrap_ports: dict[str, Annotated[int, Field(ge=1, le=65535)]] = Field(default_factory=dict)

    # Timeouts per phase, in seconds.
    connect_timeout: float = Field(default=5.0, gt=0)
    prefill_timeout: float = Field(default=120.0, gt=0)
    first_token_timeout: float = Field(default=120.0, gt=0)
    idle_timeout: float = Field(default=120.0, gt=0)
    request_timeout: float = Field(default=600.0, gt=0)

    # The shared HTTP client's connection pool. `upstream_transport`: engine calls go through aiohttp's
    # pool (the default: a third of the CPU per request of httpx's own under load) or httpx's (`httpx`).
    # Idle connections close after `keepalive_expiry` s, below the engines' own 5 s (vLLM's uvicorn),
    # so the router never sends on a connection the engine is closing. `max_keepalive_connections`
    # caps idle connections with the `httpx` transport only.
    upstream_transport: Literal["aiohttp", "httpx"] = "aiohttp"
    max_connections: int = Field(default=4096, ge=1)
    max_keepalive_connections: int = Field(default=512, ge=0)
    keepalive_expiry: float = Field(default=4.0, gt=0)

    # Prompts longer than this many characters are tokenized in a worker thread.
    tokenize_inline_max_chars: int = Field(default=2048, ge=0)
    tokenizer_threads: int = Field(default=2, ge=1)

    # Active health probes: GET /health every interval; this many failures in a row mark an engine
    # unhealthy (no traffic), this many passes in a row bring it back.
    health_interval: float = Field(default=5.0, gt=0)
    health_timeout: float = Field(default=2.0, gt=0)
    health_unhealthy_threshold: int = Field(default=2, ge=1)
    health_healthy_threshold: int = Field(default=1, ge=1)

    # Passive outlier detection: this many failed calls in a row open an engine's circuit breaker;
    # it half-opens (one trial call at a time, unless no other engine is up) after the cool-down, which
    # doubles after each failed trial.
    breaker_failures: int = Field(default=3, ge=1)
    breaker_cooldown: float = Field(default=5.0, gt=0)
    breaker_max_cooldown: float = Field(default=60.0, gt=0)

    # A failed prefill hop is retried on another prefiller this many times, then the policy applies:
    # fallback serves the request on the decoder alone, fail answers 503.
    prefill_retries: int = Field(default=1, ge=0)
    prefill_failure_policy: Literal["fallback", "fail"] = "fallback"
    # A decoder that fails before the first byte reaches the client is replaced this many times.
    decode_retries: int = Field(default=1, ge=0)
    # Learned deadlines (deadlines.py): a prefill hop, a decoder's first token or a non-streamed answer
    # taking hop_deadline_factor times what recent ones of its size took (at least hop_deadline_floor
    # seconds; the phase's timeout at most) is abandoned: the prefill for another prefiller or the
    # decoder alone, a decoder that the client has no byte from yet for another decoder. Until
    # hop_deadline_samples hops of a kind are learned, the timeouts alone apply; factor 0 turns it off.
    hop_deadline_factor: float = Field(default=4.0, ge=0)
    hop_deadline_floor: float = Field(default=2.0, gt=0)
    hop_deadline_samples: int = Field(default=20, ge=1)

    # Admission control: at most max_in_flight requests are served at once (0: no cap); up to
    # max_queued more wait at most queue_timeout seconds; beyond that, 503 with Retry-After. The
    # shared pool and each tenant with reserved engines have a budget of these limits each (a tenant's
    # entry in `tenants` may set its own).
    max_in_flight: int = Field(default=4096, ge=0)
    max_queued: int = Field(default=1024, ge=0)
    queue_timeout: float = Field(default=30.0, gt=0)
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    # The HTTP listener's own limits (nginx's client_header_timeout / client_body_timeout and
    # large_client_header_buffers): a request's line and headers must arrive within
    # client_header_timeout seconds and fit in max_header_bytes and max_headers lines (else 408 / 431);
    # its body within client_body_timeout seconds of its headers (else 408). Connections closed for
    # these are counted in dpd_router_connections_refused_total.
    client_header_timeout: float = Field(default=10.0, gt=0)
    client_body_timeout: float = Field(default=60.0, gt=0)
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    max_headers: int = Field(default=100, ge=8)
    # A chat template sent with a request (chat_template, or chat_template_kwargs.chat_template) is
    # refused with 400, as vLLM refuses it without --trust-request-chat-template. When trusted, it is
    # rendered in a sandboxed subprocess, stopped after chat_template_timeout seconds.
    trust_request_chat_template: bool = False
    chat_template_timeout: float = Field(default=5.0, gt=0)

    # API keys, as SHA-256 hex digests (`dpd-router hash-key`): plain keys, admin keys, and a YAML
    # file whose entries may add a tenant, admin rights and per-minute limits. No keys: no auth.
    api_key_hashes: UrlList = Field(default_factory=list)
    admin_key_hashes: UrlList = Field(default_factory=list)
    api_keys_file: Path | None = None
    # Failed authentications a source address may make per minute before its requests get 429
    # unchecked for a while (0: no limit).
    auth_failures_per_minute: float = Field(default=60.0, ge=0)
    # Tenants pinned to their own engines: {tenant: {prefill_urls: [...], decode_urls: [...]}}, and
    # optionally their own max_in_flight, max_queued and queue_timeout. Their engines serve no one else,
    # and their requests (and prompts to tokenize) reach no other engine.
    tenants: dict[str, TenantPools] = Field(default_factory=dict)
    # Sent to the engines as `Authorization: Bearer ...` (clients' own credentials never are).
    engine_api_key: SecretStr | None = None

    # Where the shared pool's engines come from. static: prefill_urls and decode_urls. kubernetes: engine
    # pods watched through the Kubernetes API, for each role whose URL list is empty (a role given URLs
    # keeps them, like a sidecar router's own decoder); tenants' pools stay static. A pod serves once it is
    # Ready; one that stops being Ready, starts terminating or is deleted drains (no new calls) and leaves
    # the pool when its last call ends, or drain_timeout seconds after it began draining.
    discovery: DiscoveryMode = "static"
    # The pods' namespace (default: the router's own, from its service account, else "default").
    kubernetes_namespace: str | None = None
    # Prefill pods carry <role label>=prefill and decode pods <role label>=decode, and both match
    # kubernetes_selector (for example app.kubernetes.io/instance=my-release). A role's own selector,
    # when set, replaces that rule for the role. Selectors are Kubernetes label selectors
    # (key=value, key!=value, key in (a,b), key notin (a,b), key, !key; comma-separated).
    kubernetes_role_label: str = Field(default="dpd-router.io/role", min_length=1)
    kubernetes_selector: str = ""
    kubernetes_prefill_selector: str | None = None
    kubernetes_decode_selector: str | None = None
    # An engine's URL is http://<pod IP>:<port>, the port from the pod's annotation, else kubernetes_port.
    kubernetes_port: int = Field(default=8000, ge=1, le=65535)
    kubernetes_port_annotation: str = Field(default="dpd-router.io/port", min_length=1)
    # The API server. Unset: in-cluster (KUBERNETES_SERVICE_HOST/PORT, the service account's token and CA).
    # Set (out of the cluster, tests): this URL, with the bearer token read from kubernetes_token_file
    # (re-read when the server answers 401) and TLS verified against kubernetes_ca_file when given.
    kubernetes_api_url: str | None = None
    kubernetes_token_file: Path | None = None
    kubernetes_ca_file: Path | None = None
    drain_timeout: float = Field(default=120.0, gt=0)

    # OpenTelemetry spans for each request and its two hops (needs the `otel` extra).
    otel_tracing: bool = False

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: LogFormat = "json"

    @field_validator("prefill_urls", "decode_urls", mode="before")
    @classmethod
    def _parse_url_list(cls, value: Any) -> Any:
        return _split_urls(value)

    @field_validator("prefill_urls", "decode_urls")
    @classmethod
    def _check_urls(cls, value: list[str]) -> list[str]:
        urls = [_normalise_url(url) for url in value]
        return list(dict.fromkeys(urls))

    @field_validator("kv_events_endpoints", mode="before")
    @classmethod
    def _parse_kv_events_endpoints(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {url: [addresses] if isinstance(addresses, str) else addresses for url, addresses in value.items()}
        return value

    @field_validator("kv_events_endpoints")
    @classmethod
    def _check_kv_events_endpoints(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for addresses in value.values():
            for address in addresses:
                if not address.startswith(("tcp://", "ipc://")):
                    raise ValueError(f"{address!r} must be a ZMQ tcp:// or ipc:// address")
        return {_normalise_url(url): addresses for url, addresses in value.items()}

    @field_validator("lmcache_instance_ids")
    @classmethod
    def _check_instance_ids(cls, value: dict[str, str]) -> dict[str, str]:
        return {_normalise_url(url): instance for url, instance in value.items()}

    @field_validator("lmcache_receiver_init_ports", "lmcache_receiver_alloc_ports", mode="before")
    @classmethod
    def _parse_port_list(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return [value]
        return _split_urls(value)

    @field_validator("lmcache_receivers", "sglang_bootstrap_ports")
    @classmethod
    def _check_engine_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        return {_normalise_url(url): entry for url, entry in value.items()}

    @field_validator("lmcache_notify_address")
    @classmethod
    def _check_notify_address(cls, value: str) -> str:
        if not value.startswith(("tcp://", "ipc://")):
            raise ValueError(f"{value!r} must be a ZMQ tcp:// or ipc:// address to bind")
        return value

    @field_validator("lmcache_controller_url")
    @classmethod
    def _check_controller_url(cls, value: str | None) -> str | None:
        return None if value is None else _normalise_url(value)

    @field_validator("session_header")
    @classmethod
    def _lower_header(cls, value: str) -> str:
        return value.strip().lower()

    @field_validator("api_key_hashes", "admin_key_hashes", mode="before")
    @classmethod
    def _parse_hash_list(cls, value: Any) -> Any:
        return _split_urls(value)

    @field_validator("api_key_hashes", "admin_key_hashes")
    @classmethod
    def _check_hashes(cls, value: list[str]) -> list[str]:
        return [checked_digest(digest) for digest in value]

    @field_validator("kubernetes_api_url")
    @classmethod
    def _check_kubernetes_api_url(cls, value: str | None) -> str | None:
        return None if value is None else _normalise_url(value)

    @field_validator("kubernetes_token_file", "kubernetes_ca_file", "api_keys_file")
    @classmethod
    def _check_files(cls, value: Path | None) -> Path | None:
        if value is not None and not value.expanduser().is_file():
            raise ValueError(f"{value} does not exist")
        return None if value is None else value.expanduser()

    @field_validator("tokenizer")
    @classmethod
    def _check_tokenizer(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        value = value.expanduser()
        if not value.is_dir():
            raise ValueError(f"{value} is not a directory holding a Hugging Face tokenizer")
        return value

    @model_validator(mode="after")
    def _check_pools(self) -> Settings:
        if self.discovery == "static" and not self.decode_urls:
            raise ValueError("decode_urls: at least one decoder URL is required (or discovery: kubernetes)")
        if self.discovery == "kubernetes" and self.prefill_urls and self.decode_urls:
            raise ValueError(
                "discovery: kubernetes discovers the roles whose URL list is empty, but prefill_urls and "
                "decode_urls are both set"
            )
        overlap = set(self.prefill_urls) & set(self.decode_urls)
        if overlap:
            raise ValueError(f"prefill_urls and decode_urls both list {sorted(overlap)}")
        engines = {*self.prefill_urls, *self.decode_urls}
        for tenant, pools in self.tenants.items():
            reserved = {*pools.prefill_urls, *pools.decode_urls}
            if reserved & engines:
                raise ValueError(
                    f"tenants.{tenant}: {sorted(reserved & engines)} are already in another pool; "
                    "a tenant's engines must serve that tenant alone"
                )
            engines |= reserved
        if len(self.lmcache_receiver_init_ports) != len(self.lmcache_receiver_alloc_ports):
            raise ValueError(
                "lmcache_receiver_init_ports and lmcache_receiver_alloc_ports need one port per decoder TP rank each"
            )
        for name in ("kv_events_endpoints", "lmcache_instance_ids", "lmcache_receivers", "sglang_bootstrap_ports"):
            unknown = set(getattr(self, name)) - engines
            if unknown:
                raise ValueError(f"{name} names {sorted(unknown)}, which are not in prefill_urls or decode_urls")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = _config_file_from(init_settings)
        if config_file is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=config_file))
        return tuple(sources)


def _config_file_from(init_settings: PydanticBaseSettingsSource) -> Path | None:
    given = init_settings().get("config") or os.environ.get("DPD_CONFIG")
    if not given:
        return None
    path = Path(given).expanduser()
    if not path.is_file():
        raise SettingsError(f"config: file {path} does not exist")
    return path


def load_settings(**overrides: Any) -> Settings:
    """Build Settings from flags, env and YAML; raise SettingsError naming the bad setting."""
    given = {key: value for key, value in overrides.items() if value is not None}
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from None
    settings._overrides = given
    return settings


def updated_settings(current: Settings, changes: dict[str, Any]) -> Settings:
    """`current` with `changes` applied and everything validated again; raise SettingsError."""
    values = {name: getattr(current, name) for name in Settings.model_fields}
    values.update(changes)
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from None
    settings._overrides = current._overrides
    return settings


def describe_validation_error(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown setting"
        lines.append(f"{where}: {message}")
    return "invalid configuration: " + "; ".join(lines)
