"""Settings: the one place every default lives.

Each setting has one name, used the same way everywhere: `routing_threshold` in YAML,
`DPD_ROUTING_THRESHOLD` in the environment and `--routing-threshold` on the command line.
Precedence, highest first: command-line flags, environment, YAML file, defaults.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
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

from dpd_router.api.keys import checked_digest

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


def without_password(url: str) -> str:
    """A store URL (`limits_store`) fit to show and log: its user and password, if any, replaced."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    if "@" not in authority:
        return url
    return f"{scheme}{sep}<redacted>@{authority.rpartition('@')[2]}{slash}{path}"


PortList = Annotated[list[Annotated[int, Field(ge=1, le=65535)]], NoDecode]


# The groups a setting belongs to (its field's `json_schema_extra["group"]`), in the order the docs'
# configuration reference lists them: name -> (title, what the settings of the group have in common).
SETTING_GROUPS: dict[str, tuple[str, str]] = {
    "engines": ("Engines and the model", "The engines the router serves from, and the model they serve."),
    "connectors": (
        "KV connectors",
        "How a prefiller hands the KV cache it built to a decoder: the protocol the engines speak, and what "
        "the router needs to know to speak it.",
    ),
    "routing": (
        "Routing",
        "Which path a request takes (direct to a decoder, or prefiller then decoder) and which engines serve it.",
    ),
    "adaptive": (
        "The adaptive threshold",
        "With `threshold_mode: adaptive` the router disaggregates when `interference_weight` times the stall "
        "a direct prefill would inflict on the decoder's running streams exceeds the prefill hop's extra "
        "cost, both learned online; the guard rails and service-level objectives below win over the model.",
    ),
    "reliability": (
        "Reliability",
        "Timeouts per phase, health probes, circuit breakers, retries and learned deadlines.",
    ),
    "admission": (
        "Admission and the listener's limits",
        "How much the router takes on at once, and what a client's request may cost it before it is refused.",
    ),
    "auth": ("Authentication and tenants", "API keys, rate limits and engines reserved for one tenant."),
    "responses": (
        "The Responses store",
        "Where the responses the Responses API stores are kept (the router's, not the engines'), and for how long.",
    ),
    "discovery": ("Discovery", "Engines found as Kubernetes pods instead of listed URLs."),
    "observability": ("Observability", "Logs and traces."),
    "server": (
        "The server and its connection pools",
        "The config file, where the router listens, and its connections to clients and engines.",
    ),
}


def _meta(group: str, *, live: bool = False) -> dict[str, JsonValue]:
    """A setting's documentation metadata: its group (a key of SETTING_GROUPS) and whether it is live."""
    return {"group": group, "live": live}


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


# Arm names taken already: `live` labels requests no arm took (observe.DEFAULT_ARM), `shadow` the shadow copies.
RESERVED_ARM_NAMES = frozenset({"live", "shadow"})
# The routing settings an experiment arm may override (the fields of ExperimentArm besides name and share).
ARM_OVERRIDES = (
    "routing_threshold",
    "threshold_mode",
    "prefill_strategy",
    "ttft_slo",
    "ttft_slo_max_tokens",
    "itl_slo",
    "itl_slo_share",
)


class ExperimentArm(BaseModel):
    """One A/B arm: its name (the `arm` label of its requests' metrics and log lines), its share of the
    shared pool's traffic, and the routing settings it overrides (unset: the top-level value)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Lowercase letters, digits, `_` and `-`: a Prometheus label value and a log field as it is.
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$")
    share: float = Field(gt=0, le=1)
    # Bounds as on the top-level fields of the same names: an arm's settings are never validated again.
    routing_threshold: int | None = Field(default=None, ge=1)
    threshold_mode: ThresholdMode | None = None
    prefill_strategy: PrefillStrategy | None = None
    ttft_slo: float | None = Field(default=None, gt=0)
    ttft_slo_max_tokens: int | None = Field(default=None, ge=0)
    itl_slo: float | None = Field(default=None, gt=0)
    itl_slo_share: float | None = Field(default=None, ge=0, le=0.1)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if value in RESERVED_ARM_NAMES:
            raise ValueError(f"{value!r} is reserved (the arm of requests no experiment arm took, or shadow copies)")
        return value

    def overrides(self) -> dict[str, Any]:
        """The settings this arm changes: setting -> value, for those it sets."""
        return {name: value for name in ARM_OVERRIDES if (value := getattr(self, name)) is not None}


class Experiments(BaseModel):
    """A/B arms over the shared pool, and the key that keeps a client in its arm."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sticky_by: Literal["session", "api_key"] = "session"
    arms: list[ExperimentArm] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_arms(self) -> Experiments:
        names = [arm.name for arm in self.arms]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"arm names must be unique; {repeated} repeat")
        total = sum(arm.share for arm in self.arms)
        # A little slack for decimal shares that add up to 1 (0.7 + 0.2 + 0.1 is 1.0000000000000002).
        if total > 1 + 1e-9:
            raise ValueError(f"the arms' shares add up to {total:g}; at most 1 (the rest is arm `live`)")
        return self


ShadowKind = Literal["monolithic", "dpd"]


class ShadowSettings(BaseModel):
    """Where copies of chosen requests go, which ones, and how many at once (the `shadow` setting)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="The shadow's OpenAI-compatible base URL (a trailing `/v1` is dropped).")
    kind: ShadowKind = Field(
        default="monolithic",
        description="What the shadow is: `monolithic` (one plain vLLM endpoint) or `dpd` (a staging dpd-router); "
        "its metrics carry it as their `path`.",
    )
    share: float = Field(default=1.0, ge=0, le=1, description="The share of eligible requests copied.")
    min_prompt_tokens: int = Field(default=0, ge=0, description="Only prompts of at least this many tokens.")
    longest_percentile: float | None = Field(
        default=None,
        gt=0,
        lt=100,
        description="Only prompts longer than this percentile of the last `window` prompt lengths.",
    )
    window: int = Field(default=1000, ge=20, le=10_000, description="Prompt lengths the percentile is taken over.")
    max_concurrent: int = Field(default=4, ge=1, le=1024, description="Shadow calls in flight at most.")
    queue: int = Field(default=64, ge=1, le=100_000, description="Copies waiting for a free call; more are dropped.")
    timeout: float = Field(default=120.0, gt=0, description="Seconds one shadow call may take, whole.")
    api_key: SecretStr | None = Field(default=None, description="Sent to the shadow as `Authorization: Bearer ...`.")
    headers: dict[str, SecretStr] = Field(default_factory=dict, description="More headers for the shadow.")
    model: str | None = Field(default=None, description="The model name the copies ask for (unset: the client's).")

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return _normalise_url(value).removesuffix("/v1")


class Settings(BaseSettings):
    """Everything the router can be told, with its defaults.

    Every field carries its documentation as metadata: `description`, and in `json_schema_extra` its
    `group` (a key of SETTING_GROUPS) and whether it is `live` (changes on a running router). The
    configuration reference in the docs is generated from them, and live.py's LIVE_SETTINGS too.
    """

    model_config = SettingsConfigDict(
        env_prefix="DPD_",
        extra="forbid",
        validate_default=True,
    )

    config: Path | None = Field(
        default=None,
        exclude=True,
        description="The YAML file of settings (`--config FILE` or `DPD_CONFIG`); not itself read from YAML.",
        json_schema_extra=_meta("server"),
    )
    config_watch_interval: float = Field(
        default=2.0,
        ge=0,
        description="Seconds between checks of the config file for changes, which are then applied live; "
        "0 turns watching off.",
        json_schema_extra=_meta("server"),
    )
    # What the settings were built from (flags), so a reload re-reads env and file under them.
    _overrides: dict[str, Any] = PrivateAttr(default_factory=dict)
    # The settings of each entry of `models` (validated with the rest).
    _per_model: dict[str, Settings] = PrivateAttr(default_factory=dict)

    host: str = Field(default="127.0.0.1", description="The address to listen on.", json_schema_extra=_meta("server"))
    port: int = Field(
        default=8000, ge=0, le=65535, description="The port to listen on.", json_schema_extra=_meta("server")
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=256,
        description="Router processes serving the port, each a full router (the chart sets it from the router's "
        "CPU request). With more than one, a supervisor process holds the listening socket, forwards SIGTERM "
        "and SIGHUP to every worker and replaces a worker that dies; `/metrics` sums every worker. Limits are "
        "kept per process, so each worker enforces its share: `max_in_flight`, `max_queued`, per-key "
        "`requests_per_minute` and `prompt_tokens_per_minute` and `auth_failures_per_minute` divided by "
        "`workers` (counts rounded up), which holds the pod's limit approximately, not exactly; `limits_store` "
        "shares the per-key ones exactly.",
        json_schema_extra=_meta("server"),
    )
    client_keepalive_timeout: int = Field(
        default=75,
        ge=1,
        description="Seconds a client's idle keep-alive connection stays open. Longer than clients and load "
        "balancers keep idle connections for (the openai client's 5 s, cloud load balancers' 60 s), so the "
        "router never closes a connection a client is sending its next request on.",
        json_schema_extra=_meta("server"),
    )

    prefill_urls: UrlList = Field(
        default_factory=list,
        description="The prefill engines' base URLs. Empty: every "
        "request is served by a decoder alone, unless discovery finds prefillers.",
        json_schema_extra=_meta("engines"),
    )
    decode_urls: UrlList = Field(
        default_factory=list,
        description="The decode engines' base URLs. At least one is "
        "required unless `discovery: kubernetes` finds them.",
        json_schema_extra=_meta("engines"),
    )

    model: str | None = Field(
        default=None,
        description="The served model name; requests naming another get a 404. Unset: the decoders' "
        "`/v1/models` answer.",
        json_schema_extra=_meta("engines"),
    )
    tokenizer: Path | None = Field(
        default=None,
        description="A local directory holding the model's Hugging Face tokenizer (only its tokenizer files "
        "are read; nothing is downloaded). Unset: the decoders' `POST /tokenize` counts the tokens.",
        json_schema_extra=_meta("engines"),
    )
    models: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Several models behind one router: `{served model name: {settings}}`. Each entry may set "
        "what belongs to one model (its engines and tokenizer, routing, adaptive, connector and per-request "
        "reliability settings: `prefill_urls`, `decode_urls`, `tokenizer`, `routing_threshold`, "
        "`prefill_strategy`, `kv_connector`, `prefill_timeout`, its discovery selectors ...) and takes the top "
        "level's value for the rest. Requests go to the engines of the model (or LoRA adapter) they name; one "
        "that names none goes to the first entry. Unset: one model, the top level's. Live for an entry's live "
        "settings: adding or removing a model, or changing its engines, needs a restart.",
        json_schema_extra=_meta("engines", live=True),
    )

    routing_threshold: int = Field(
        default=4096,
        ge=1,
        description="Prompts with at least this many tokens take the prefiller -> decoder path; shorter ones "
        "go straight to a decoder.",
        json_schema_extra=_meta("routing", live=True),
    )
    threshold_mode: ThresholdMode = Field(
        default="cache_aware",
        description="What the threshold is compared with. `static`: the whole prompt; `cache_aware`: only "
        "the tokens the chosen decoder would still compute (its cached prefix is free); `adaptive`: a cost "
        "model learned online decides per request (see the adaptive group).",
        json_schema_extra=_meta("routing", live=True),
    )
    interference_weight: float = Field(
        default=1.0,
        ge=0,
        description="`adaptive`: the exchange rate between a running stream's stall and one request's wait "
        "for its first token. 1 counts both as equal seconds; above 1 puts stream smoothness first, which "
        "long prompts pay for in time to first token when the prefill pool is busy.",
        json_schema_extra=_meta("adaptive", live=True),
    )
    min_threshold: int = Field(
        default=256,
        ge=0,
        description="`adaptive`: prompts with fewer uncached tokens than this always go direct.",
        json_schema_extra=_meta("adaptive", live=True),
    )
    max_threshold: int = Field(
        default=32768,
        ge=1,
        description="`adaptive`: prompts with at least this many uncached tokens always take the prefill hop.",
        json_schema_extra=_meta("adaptive", live=True),
    )
    explore_share: float = Field(
        default=0.03,
        ge=0,
        le=0.2,
        description="`adaptive`: the share of decisions near the boundary flipped to the prefill hop, so "
        "the hop keeps being measured (at least a quarter until a prefiller has served 8 hops; 0: never). "
        "Exploration only ever sends a prompt to the prefill pool.",
        json_schema_extra=_meta("adaptive", live=True),
    )
    ttft_slo: float | None = Field(
        default=None,
        gt=0,
        description="`adaptive`: a time-to-first-token objective in seconds; when only one path meets it, "
        "that path wins over the cost model.",
        json_schema_extra=_meta("adaptive", live=True),
    )
    ttft_slo_max_tokens: int = Field(
        default=0,
        ge=0,
        description="`adaptive`: `ttft_slo` holds only for prompts of at most this many uncached tokens "
        "(interactive prompts have one, long documents often none); longer ones answer to `itl_slo` alone. "
        "0: every prompt.",
        json_schema_extra=_meta("adaptive", live=True),
    )
    itl_slo: float | None = Field(
        default=None,
        gt=0,
        description="`adaptive`: the longest pause in seconds a direct prefill may put in the decoder's "
        "running streams; a prompt whose prefill would pause them longer takes the hop.",
        json_schema_extra=_meta("adaptive", live=True),
    )
    itl_slo_share: float = Field(
        default=0.0,
        ge=0,
        le=0.1,
        description="`adaptive`: reads `itl_slo` as a percentile: this share of the decoder's recent "
        "inter-token gaps may be longer than the SLO (0: none).",
        json_schema_extra=_meta("adaptive", live=True),
    )
    prefill_strategy: PrefillStrategy = Field(
        default="prefixaware",
        description="How a prefiller is chosen: `roundrobin`, `session` (hash of a session key), "
        "`prefixaware` (where the prompt's own prefix went before, else where its first 1024 tokens hash to: "
        "the same engine on every router replica; a swamped engine gives way to the least loaded), `kvaware` "
        "(where the engines report the prefix cached, else as `prefixaware`) or `leastloaded`.",
        json_schema_extra=_meta("routing", live=True),
    )
    session_header: str = Field(
        default="x-session-id",
        min_length=1,
        description="The `session` strategy's key: this request header, else the body's `user` field.",
        json_schema_extra=_meta("routing", live=True),
    )
    experiments: Experiments | None = Field(
        default=None,
        description="A/B arms for the routing settings: `{sticky_by, arms: [{name, share, ...}]}`. Each arm takes "
        "its `share` of the shared pool's requests and routes them with its own `routing_threshold`, "
        "`threshold_mode`, `prefill_strategy`, `ttft_slo`, `ttft_slo_max_tokens`, `itl_slo` or `itl_slo_share` "
        "(unset: the top-level value); the rest is arm `live`. A request's arm follows a stable hash of its "
        "`sticky_by` key (`session`: the `session_header` header or the body's `user`, else the API key, else "
        "the request id; `api_key`: the API key, else the request id), the same on every worker and replica. "
        "Request metrics and log lines carry the arm. Tenants with reserved engines take no part.",
        json_schema_extra=_meta("routing", live=True),
    )

    block_size: int = Field(
        default=16,
        ge=1,
        description="Prefix affinity hashes prompts in blocks of this many tokens: set it to the engines' KV "
        "block size (their `--block-size`).",
        json_schema_extra=_meta("routing"),
    )
    prefix_index_capacity: int = Field(
        default=1_000_000,
        ge=1,
        description="The most prompt blocks the prefix index remembers the engine of. Each costs a few hundred "
        "bytes of memory (the memory benchmark measures it).",
        json_schema_extra=_meta("routing"),
    )
    balance_abs_threshold: float = Field(
        default=32.0,
        ge=0,
        description="A cached prefix's engine is passed over when its load exceeds the lightest candidate's "
        "by more than this and by more than `balance_rel_threshold` times.",
        json_schema_extra=_meta("routing", live=True),
    )
    balance_rel_threshold: float = Field(
        default=1.5,
        ge=1.0,
        description="See `balance_abs_threshold`: the relative half of the same rule.",
        json_schema_extra=_meta("routing", live=True),
    )

    prefill_busy_queue_depth: int = Field(
        default=8,
        ge=0,
        description="When every prefiller's engine queue is deeper than this, prompts with fewer uncached "
        "tokens than `prefill_busy_max_tokens` go direct rather than wait (0 disables the gate). A trade of "
        "the long prompts' time to first token against the decoder's streams' smoothness.",
        json_schema_extra=_meta("routing", live=True),
    )
    prefill_busy_max_tokens: int = Field(
        default=16384,
        ge=0,
        description="The prefill-busy gate's ceiling: only prompts below it are sent direct when the prefill "
        "pool is busy. In `adaptive` mode it bounds uncached tokens times the decoder's running streams (at "
        "least 1), so a decoder full of streams is not handed long prompts.",
        json_schema_extra=_meta("routing", live=True),
    )
    prefill_busy_queue_tokens: int = Field(
        default=131072,
        ge=0,
        description="The prefill-busy gate in `adaptive` mode, where the model prices each prefiller's queue "
        "itself: closed when every prefiller has more than this many prompt tokens queued (0: never).",
        json_schema_extra=_meta("routing", live=True),
    )

    load_scrape_interval: float = Field(
        default=2.0,
        gt=0,
        description="Seconds between scrapes of every engine's `/metrics` for its load; a load older than "
        "three intervals is ignored.",
        json_schema_extra=_meta("routing"),
    )

    kv_events_endpoints: dict[str, list[str]] = Field(
        default_factory=dict,
        description="`kvaware`: engine URL -> its vLLM KV-event publishers' ZMQ addresses (one per "
        "data-parallel rank).",
        json_schema_extra=_meta("routing"),
    )
    kv_events_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="`kvaware`: subscribe to `tcp://<engine host>:<port>` for every engine not listed in "
        "`kv_events_endpoints`, discovered ones included as they join the pool.",
        json_schema_extra=_meta("routing"),
    )
    lmcache_controller_url: str | None = Field(
        default=None,
        description="`kvaware`: an LMCache controller asked per request where the prompt's KV is cached.",
        json_schema_extra=_meta("routing"),
    )
    lmcache_instance_ids: dict[str, str] = Field(
        default_factory=dict,
        description="`kvaware`: engine URL -> its LMCache instance id; instances not listed are learnt by engine host.",
        json_schema_extra=_meta("routing"),
    )
    kv_lookup_timeout: float = Field(
        default=0.05,
        gt=0,
        description="Seconds an LMCache controller lookup may take before the request is routed without it.",
        json_schema_extra=_meta("routing"),
    )
    kv_connector: KVConnectorName = Field(
        default="nixl",
        description="The KV-transfer protocol the engines speak: `nixl` (vLLM `NixlConnector`), "
        "`shared_storage` (vLLM `ExampleConnector`), `lmcache` (LMCache PD) or `sglang` (SGLang bootstrap: "
        "every request takes the prefill hop, and one no prefiller can take gets a 503).",
        json_schema_extra=_meta("connectors"),
    )
    lmcache_receiver_init_ports: PortList = Field(
        default_factory=lambda: [8300],
        min_length=1,
        description="`lmcache`: every decoder's LMCache receiver init ports, one per TP rank, on the "
        "decoder's own host unless `lmcache_receivers` names it.",
        json_schema_extra=_meta("connectors"),
    )
    lmcache_receiver_alloc_ports: PortList = Field(
        default_factory=lambda: [8400],
        min_length=1,
        description="`lmcache`: the receivers' alloc ports, one per TP rank, as `lmcache_receiver_init_ports`.",
        json_schema_extra=_meta("connectors"),
    )
    lmcache_receivers: dict[str, LMCacheReceiver] = Field(
        default_factory=dict,
        description="`lmcache`: `{decoder URL: {host, init_ports, alloc_ports}}` for decoders whose receiver "
        "differs from the default ports on the decoder's host.",
        json_schema_extra=_meta("connectors"),
    )
    lmcache_notify_address: str = Field(
        default="tcp://127.0.0.1:8500",
        description="`lmcache`: the router's ZMQ PULL socket for the prefillers' `ProxyNotif` messages (their "
        "`pd_proxy_host`/`pd_proxy_port` must name it). Bound at startup; the default is reachable from this "
        "host only, and the router warns when a prefiller is elsewhere.",
        json_schema_extra=_meta("connectors"),
    )
    lmcache_notify_count: int | None = Field(
        default=None,
        ge=1,
        description="`lmcache`: how many `ProxyNotif` messages confirm one hand-off (one per prefiller worker). "
        "Unset: one per init port.",
        json_schema_extra=_meta("connectors"),
    )
    lmcache_notify_timeout: float = Field(
        default=5.0,
        gt=0,
        description="`lmcache`: seconds after the prefill answer within which every `ProxyNotif` must arrive, "
        "or the hop has failed.",
        json_schema_extra=_meta("connectors"),
    )
    sglang_bootstrap_port: int = Field(
        default=8998,
        ge=1,
        le=65535,
        description="`sglang`: the prefillers' bootstrap server port.",
        json_schema_extra=_meta("connectors"),
    )
    sglang_bootstrap_ports: dict[str, Annotated[int, Field(ge=1, le=65535)]] = Field(
        default_factory=dict,
        description="`sglang`: `{prefiller URL: port}` for prefillers whose bootstrap port differs.",
        json_schema_extra=_meta("connectors"),
    )

    connect_timeout: float = Field(
        default=5.0,
        gt=0,
        description="Seconds to connect to an engine.",
        json_schema_extra=_meta("reliability", live=True),
    )
    tokenize_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Seconds an engine has to answer a `/tokenize` or `/detokenize` call (relayed, or counting a "
        "prompt where the router has no local tokenizer) before the next engine is asked: these are quick on "
        "a live engine, so a hung one costs this, not `request_timeout`.",
        json_schema_extra=_meta("reliability"),
    )
    prefill_timeout: float = Field(
        default=120.0,
        gt=0,
        description="Seconds the whole prefill hop may take.",
        json_schema_extra=_meta("reliability", live=True),
    )
    first_token_timeout: float = Field(
        default=120.0,
        gt=0,
        description="Seconds from the decode call to the first token of a stream.",
        json_schema_extra=_meta("reliability", live=True),
    )
    idle_timeout: float = Field(
        default=120.0,
        gt=0,
        description="Seconds between two chunks of a stream.",
        json_schema_extra=_meta("reliability", live=True),
    )
    request_timeout: float = Field(
        default=600.0,
        gt=0,
        description="Seconds a non-streamed answer may take, whole.",
        json_schema_extra=_meta("reliability", live=True),
    )

    upstream_transport: Literal["aiohttp", "httpx"] = Field(
        default="aiohttp",
        description="The engine calls' connection pools: `aiohttp` (the request path's calls on the router's "
        "own kept-alive pool, the others on aiohttp's: far less CPU per request under load, httpx's pool walks "
        "every pooled connection on each request) or `httpx` (httpcore's, for every call).",
        json_schema_extra=_meta("server"),
    )
    max_connections: int = Field(
        default=4096,
        ge=1,
        description="The most connections open to the engines at once by the request path's pool (and as "
        "many by the pool of the other engine calls: probes, scrapes, remote tokenizing).",
        json_schema_extra=_meta("server"),
    )
    max_keepalive_connections: int = Field(
        default=512,
        ge=0,
        description="The most idle connections kept to the engines (the `httpx` transport only).",
        json_schema_extra=_meta("server"),
    )
    keepalive_expiry: float = Field(
        default=4.0,
        gt=0,
        description="Seconds an idle engine connection is kept. Below the engines' own keep-alive (vLLM's "
        "uvicorn: 5 s), so the router never sends on a connection the engine is closing.",
        json_schema_extra=_meta("server"),
    )

    tokenize_inline_max_chars: int = Field(
        default=2048,
        ge=0,
        description="Prompts longer than this many characters are tokenized in a worker thread, so a long "
        "prompt does not hold up the event loop (bodies over 1 MiB in a lane of their own); shorter ones are "
        "encoded on the event loop, which costs less than the hand-off to a thread. A prompt put together from "
        "the words the router keeps (byte-level BPE tokenizers) is read on the event loop up to twice this.",
        json_schema_extra=_meta("server"),
    )
    tokenizer_threads: int = Field(
        default=2,
        ge=1,
        description="Worker threads for tokenizing long prompts.",
        json_schema_extra=_meta("server"),
    )
    count_whole_prompts: bool = Field(
        default=False,
        description="Encode every prompt the router read only in part (as far as its plan and the context "
        "window needed) whole as well, in the background, so every request is counted by the router where no "
        "engine reports usage. Off, a prompt is encoded whole only where the prefix index needs its blocks for "
        "a cache-aware threshold's next decision and no prefill answer brought its ids; otherwise its count "
        "comes from the engine's usage.",
        json_schema_extra=_meta("server"),
    )
    tokenize_piece_cache_chars: int = Field(
        default=8_000_000,
        ge=0,
        description="Characters of chat prompts' pieces (the text between the chat template's markers, each of "
        "which a tokenizer encodes alone) kept with their encodings, so a conversation sent again every turn "
        "encodes only its new messages; about 1.7 bytes of memory a character (14 MB) in each worker process. "
        "0 turns it off. Used only with a tokenizer whose prompts are read in part (a byte-level BPE, a "
        "SentencePiece BPE whose tokens keep to words) and whose startup check shows its texts encode as their "
        "pieces do.",
        json_schema_extra=_meta("server"),
    )
    tokenize_background_max_chars: int = Field(
        default=4_000_000,
        ge=0,
        description="With `count_whole_prompts`: characters of prompts waiting for their whole encoding in the "
        "background (one thread). A prompt beyond it is not encoded whole: its plan's blocks stay indexed, its "
        "count comes from the engine (`background_encodes_skipped_total`).",
        json_schema_extra=_meta("server"),
    )

    health_interval: float = Field(
        default=5.0,
        gt=0,
        description="Seconds between active `GET /health` probes of every engine.",
        json_schema_extra=_meta("reliability"),
    )
    health_timeout: float = Field(
        default=2.0,
        gt=0,
        description="Seconds a health probe may take before it counts as failed.",
        json_schema_extra=_meta("reliability"),
    )
    health_unhealthy_threshold: int = Field(
        default=2,
        ge=1,
        description="Failed probes in a row that mark an engine unhealthy (no traffic). When no decoder "
        "passes its probes, those failing nothing else still serve (`last_resort_routes_total`).",
        json_schema_extra=_meta("reliability"),
    )
    health_healthy_threshold: int = Field(
        default=1,
        ge=1,
        description="Passing probes in a row that bring an unhealthy engine back.",
        json_schema_extra=_meta("reliability"),
    )

    breaker_failures: int = Field(
        default=3,
        ge=1,
        description="Failed calls in a row that open an engine's circuit breaker (passive outlier detection).",
        json_schema_extra=_meta("reliability"),
    )
    breaker_cooldown: float = Field(
        default=5.0,
        gt=0,
        description="Seconds before an open breaker half-opens: one trial call at a time while other engines "
        "are up (when every decoder is recovering, they take the requests rather than refuse them).",
        json_schema_extra=_meta("reliability"),
    )
    breaker_max_cooldown: float = Field(
        default=60.0,
        gt=0,
        description="The cool-down doubles after each failed trial, up to this many seconds.",
        json_schema_extra=_meta("reliability"),
    )

    prefill_retries: int = Field(
        default=1,
        ge=0,
        description="Other prefillers a failed prefill hop is retried on before `prefill_failure_policy` applies.",
        json_schema_extra=_meta("reliability", live=True),
    )
    prefill_failure_policy: Literal["fallback", "fail"] = Field(
        default="fallback",
        description="When the prefill hop has failed on every prefiller tried: `fallback` serves the request "
        "on the decoder alone (a failing prefill pool costs only speed), `fail` answers 503.",
        json_schema_extra=_meta("reliability", live=True),
    )
    decode_retries: int = Field(
        default=1,
        ge=0,
        description="Times a decoder failing before the client saw a byte is replaced (by another one, or by "
        "the same one when it is the only decoder).",
        json_schema_extra=_meta("reliability", live=True),
    )
    stream_continuations: int = Field(
        default=1,
        ge=0,
        description="Times a stream whose decoder fails after the client saw output is continued on another "
        "decoder as one uninterrupted answer (0: it ends with an in-band error, as before): a chat or text "
        "completion stream from the token ids already generated, a Messages or Responses stream from its "
        "text. See Failures and fallbacks for what is not continued.",
        json_schema_extra=_meta("reliability", live=True),
    )
    stream_continuation_max_tokens: int = Field(
        default=131_072,
        ge=0,
        description="The most tokens (prompt and output) a chat or text completion stream keeps for its "
        "continuation, about 6 bytes each; a longer one is not continued. A Messages or Responses stream "
        "keeps its events within as many bytes (about 150 a token, so fewer tokens).",
        json_schema_extra=_meta("reliability", live=True),
    )
    hop_deadline_factor: float = Field(
        default=4.0,
        ge=0,
        description="Learned deadlines: a prefill hop, a decoder's first token or a non-streamed answer taking "
        "this many times what recent ones of its size took is abandoned, a prefill for another prefiller "
        "then the decoder alone, a decoder the client has no byte from yet for another decoder. Catches hung "
        "engines long before the timeouts. 0 turns it off.",
        json_schema_extra=_meta("reliability", live=True),
    )
    hop_deadline_floor: float = Field(
        default=2.0,
        gt=0,
        description="A learned deadline is at least this many seconds (and at most the phase's timeout).",
        json_schema_extra=_meta("reliability", live=True),
    )
    hang_probe_timeout: float = Field(
        default=5.0,
        ge=0,
        description="A hop that has run as long as it should (its learned deadline, or before there is history "
        "a prior from its size) while its engine produced nothing for any call is asked about: the engine gets "
        "a one-token completion, and one that leaves it unanswered this many seconds is taken for hung: the hop "
        "goes to another engine (or fails), and the engine's breaker opens. An engine whose other calls move is "
        "busy, not hung: its hops wait, as they do when its calls move while the probe waits. Keep it above the "
        "engine's longest step, which the probe waits for (milliseconds on a GPU; seconds for a CPU engine over a "
        "long prompt). 0 turns the probe off (then the timeouts alone bound a hop without history).",
        json_schema_extra=_meta("reliability", live=True),
    )
    hop_deadline_samples: int = Field(
        default=20,
        ge=1,
        description="Hops of a kind to learn from before learned deadlines apply; until then the timeouts alone do.",
        json_schema_extra=_meta("reliability", live=True),
    )

    max_in_flight: int = Field(
        default=4096,
        ge=0,
        description="Requests served at once (0: no cap). The shared pool and each tenant with reserved "
        "engines have a budget of their own (a tenant's entry in `tenants` may set its own limits; keys with a "
        "tenant but no reserved engines share the shared pool's).",
        json_schema_extra=_meta("admission", live=True),
    )
    max_queued: int = Field(
        default=1024,
        ge=0,
        description="Requests that may wait for a place beyond `max_in_flight`; more get 503 with `Retry-After`.",
        json_schema_extra=_meta("admission", live=True),
    )
    queue_timeout: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a queued request waits at most before its 503.",
        json_schema_extra=_meta("admission", live=True),
    )
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=1024,
        description="Larger request bodies get 413.",
        json_schema_extra=_meta("admission", live=True),
    )
    client_header_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Seconds a request's line and headers have to arrive (as nginx's `client_header_timeout`); "
        "else 408 and the connection is closed (`connections_refused_total`).",
        json_schema_extra=_meta("admission"),
    )
    client_body_timeout: float = Field(
        default=60.0,
        gt=0,
        description="Seconds a request's body has to arrive after its headers (as nginx's "
        "`client_body_timeout`); else 408 and the connection is closed.",
        json_schema_extra=_meta("admission"),
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="A request's line and headers larger than this get 431 and the connection is closed "
        "(as nginx's `large_client_header_buffers`).",
        json_schema_extra=_meta("admission"),
    )
    max_headers: int = Field(
        default=100,
        ge=8,
        description="Requests with more header lines than this get 431 and the connection is closed.",
        json_schema_extra=_meta("admission"),
    )
    trust_request_chat_template: bool = Field(
        default=False,
        description="A chat template sent with a request (`chat_template`, or "
        "`chat_template_kwargs.chat_template`) is refused with 400 unless this is on, as vLLM refuses it "
        "without `--trust-request-chat-template`.",
        json_schema_extra=_meta("admission"),
    )
    chat_template_timeout: float = Field(
        default=5.0,
        gt=0,
        description="A trusted client template renders in a sandboxed subprocess (capped memory and output), "
        "stopped after this many seconds with a 400.",
        json_schema_extra=_meta("admission"),
    )

    api_key_hashes: UrlList = Field(
        default_factory=list,
        description="SHA-256 hex digests of the API keys (`dpd-router hash-key`); any key turns "
        "authentication on. No keys: no auth.",
        json_schema_extra=_meta("auth"),
    )
    admin_key_hashes: UrlList = Field(
        default_factory=list,
        description="SHA-256 hex digests of the keys for `/admin/*`.",
        json_schema_extra=_meta("auth"),
    )
    api_keys_file: Path | None = Field(
        default=None,
        description="A YAML file of `keys:` entries with `sha256`, and optionally `tenant`, `admin`, "
        "`requests_per_minute` and `prompt_tokens_per_minute` (429 with `Retry-After` beyond them).",
        json_schema_extra=_meta("auth"),
    )
    limits_store: str | None = Field(
        default=None,
        description="Where per-key `requests_per_minute` and `prompt_tokens_per_minute` budgets are kept: unset, "
        "each router process keeps its own share (the limit divided by `workers`, and again per replica); "
        "`redis://HOST:PORT/DB` (or `rediss://`, with `user:password@` if needed), one budget shared by every "
        "worker and replica, spent atomically in Redis. While Redis is unreachable or slower than 100 ms, "
        "each process decides on its own share again (counted in `dpd_router_limits_store_errors_total`, "
        "logged once per outage).",
        json_schema_extra=_meta("auth"),
    )
    auth_failures_per_minute: float = Field(
        default=60.0,
        ge=0,
        description="Failed authentications a source address, and a wrong key, may make per minute; past that "
        "their wrong keys get 429 instead of 401 until they slow down. A valid key is never refused for what "
        "others sent from its address (behind a proxy every client shares the proxy's address unless "
        "`trusted_proxies` names it; 0: no limit).",
        json_schema_extra=_meta("auth"),
    )
    trusted_proxies: UrlList = Field(
        default_factory=list,
        description="Addresses or CIDR networks (`10.0.0.0/8`) of the proxies in front of the router (an "
        "ingress, a load balancer) whose `X-Forwarded-For` is believed: for a request from one of them, "
        "failed authentications count against the client it names (the rightmost entry that is not itself "
        "a trusted proxy). Empty: the peer's address, and the header is ignored.",
        json_schema_extra=_meta("auth"),
    )
    responses_store: str = Field(
        default="",
        description="Where stored responses (`store`, the API's default) and the history `previous_response_id` "
        "continues are kept: unset, an SQLite file in the user's state directory "
        "(`$XDG_STATE_HOME/dpd-router/responses.sqlite3`, else `~/.local/state/...`), shared by every worker and "
        "kept across restarts; a path, that SQLite file; `redis://HOST:PORT/DB` (or `rediss://`), one store for "
        "every replica; `off`, nothing kept (a request is served, its `previous_response_id` gets 404). The engines "
        "never store: each is sent `store: false`.",
        json_schema_extra=_meta("responses"),
    )
    responses_ttl: float = Field(
        default=30 * 24 * 3600.0,
        gt=0,
        description="Seconds a stored response is kept. A conversation continues only while every response in "
        "it is kept: past that, its follow-ups get 404.",
        json_schema_extra=_meta("responses"),
    )
    responses_store_max_mb: float = Field(
        default=1024.0,
        gt=0,
        description="The most the stored responses may take, in MiB (their input items and response objects); "
        "past it, the oldest are dropped first.",
        json_schema_extra=_meta("responses"),
    )
    tenants: dict[str, TenantPools] = Field(
        default_factory=dict,
        description="Tenants pinned to engines of their own: `{tenant: {prefill_urls, decode_urls}}`, "
        "optionally with their own `max_in_flight`, `max_queued` and `queue_timeout`. Their engines serve no "
        "one else, and their requests (and prompts to tokenize) reach no other engine.",
        json_schema_extra=_meta("auth"),
    )
    engine_api_key: SecretStr | None = Field(
        default=None,
        description="Sent to the engines as `Authorization: Bearer ...` (clients' own credentials never are).",
        json_schema_extra=_meta("engines"),
    )
    model_aliases: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="Model names that are aliases over served models with weights: `{alias: {model: weight}}` "
        "(say a new version taking 5% of a name's traffic). A request naming an alias goes to one of its models "
        "by weight, the same one for every request of a session (the `session_header` header or the body's "
        "`user`, else the API key; requests with neither are spread by weight), and is served and reported "
        "as that model.",
        json_schema_extra=_meta("engines", live=True),
    )
    lora_adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters the router loads on its engines when a request names one that no engine of "
        "a role serves yet: `{adapter name: its path on the engines}`, loaded with vLLM's "
        "`/v1/load_lora_adapter` (engines started with `--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) "
        "on one decoder, and one prefiller, of the model's pool. Empty: the router loads nothing.",
        json_schema_extra=_meta("engines"),
    )

    discovery: DiscoveryMode = Field(
        default="static",
        description="Where the shared pool's engines come from. `static`: `prefill_urls` and `decode_urls`. "
        "`kubernetes`: engine pods watched through the Kubernetes API, for each role whose URL list is empty "
        "(a role given URLs keeps them, like a sidecar router's own decoder); tenants' pools stay static.",
        json_schema_extra=_meta("discovery"),
    )
    kubernetes_namespace: str | None = Field(
        default=None,
        description="The engine pods' namespace. Unset: the router's own, from its service account, else `default`.",
        json_schema_extra=_meta("discovery"),
    )
    kubernetes_role_label: str = Field(
        default="dpd-router.io/role",
        min_length=1,
        description="Prefill pods carry `<label>=prefill` and decode pods `<label>=decode` (the Helm chart "
        "labels its engines so).",
        json_schema_extra=_meta("discovery"),
    )
    kubernetes_selector: str = Field(
        default="",
        description="A Kubernetes label selector both roles' pods must also match, for example "
        "`app.kubernetes.io/instance=my-release`.",
        json_schema_extra=_meta("discovery"),
    )
    kubernetes_prefill_selector: str | None = Field(
        default=None,
        description="When set, replaces the role label and `kubernetes_selector` rule for prefill pods.",
        json_schema_extra=_meta("discovery"),
    )
    kubernetes_decode_selector: str | None = Field(
        default=None,
        description="When set, replaces the role label and `kubernetes_selector` rule for decode pods.",
        json_schema_extra=_meta("discovery"),
    )
    kubernetes_port: int = Field(
        default=8000,
        ge=1,
        le=65535,
        description="An engine pod serves at `http://<pod IP>:<port>`: this port, unless the pod's "
        "`kubernetes_port_annotation` names another.",
        json_schema_extra=_meta("discovery"),
    )
    kubernetes_port_annotation: str = Field(
        default="dpd-router.io/port",
        min_length=1,
        description="The pod annotation that names an engine's port.",
        json_schema_extra=_meta("discovery"),
    )
    kubernetes_api_url: str | None = Field(
        default=None,
        description="The API server. Unset: in-cluster (`KUBERNETES_SERVICE_HOST`/`PORT`, the service "
        "account's token and CA); set, out of the cluster: this URL with `kubernetes_token_file` and "
        "`kubernetes_ca_file`.",
        json_schema_extra=_meta("discovery"),
    )
    kubernetes_token_file: Path | None = Field(
        default=None,
        description="With `kubernetes_api_url`: the bearer token's file, read again when the server answers 401.",
        json_schema_extra=_meta("discovery"),
    )
    kubernetes_ca_file: Path | None = Field(
        default=None,
        description="With `kubernetes_api_url`: the CA bundle the API server's TLS is verified against.",
        json_schema_extra=_meta("discovery"),
    )
    drain_timeout: float = Field(
        default=120.0,
        gt=0,
        description="A pod that stops being Ready, starts terminating or is deleted drains (no new calls) and "
        "leaves the pool when its last call ends, or this many seconds after it began draining.",
        json_schema_extra=_meta("discovery"),
    )

    otel_tracing: bool = Field(
        default=False,
        description="OpenTelemetry spans for each request and its two hops (needs the `otel` extra; configure "
        "the exporter as usual).",
        json_schema_extra=_meta("observability"),
    )

    shadow: ShadowSettings | None = Field(
        default=None,
        description="Shadow traffic: a copy of a chosen share of requests goes to a second set of engines (`kind: "
        "monolithic`, one plain vLLM endpoint, or `dpd`, a staging dpd-router), as a stream whose answer is "
        'timed and dropped; its TTFT, ITL and E2E metrics carry `arm="shadow"` and `path` = the kind. The client '
        "never waits for it: copies wait in a bounded queue (`queue`) for one of `max_concurrent` calls, and "
        "one that finds the queue full is dropped and counted. An object: `url` (required), `kind` "
        "(`monolithic`), `share` (1: 0..1 of the eligible prompts, decided by a hash of the session key, else "
        "the request id, the same on every replica), `min_prompt_tokens` (0) and `longest_percentile` (unset: "
        "0..100 of the last `window` (1000) prompt lengths; both must hold when both are set), `max_concurrent` "
        "(4), `queue` (64), `timeout` (120 s a call), `api_key`, `headers`, `model` (unset: the client's). "
        "In the environment, "
        "JSON. Each worker process keeps its own queue, calls and window. A live change starts a new shadow "
        "for the requests that start from then on; the old one's calls are cut short.",
        json_schema_extra=_meta("observability", live=True),
    )

    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info",
        description="The log level.",
        json_schema_extra=_meta("observability", live=True),
    )
    log_format: LogFormat = Field(
        default="json",
        description="One structured line per request, as `json` or `text`.",
        json_schema_extra=_meta("observability"),
    )

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

    @field_validator("lora_adapters")
    @classmethod
    def _check_lora_adapters(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if not name.strip() or len(name) > 256:
                raise ValueError("an adapter's name is 1 to 256 characters")
            if not path.strip():
                raise ValueError(f"{name}: the adapter's path on the engines is empty")
        return value

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

    @field_validator("api_key_hashes", "admin_key_hashes", "trusted_proxies", mode="before")
    @classmethod
    def _parse_hash_list(cls, value: Any) -> Any:
        return _split_urls(value)

    @field_validator("trusted_proxies")
    @classmethod
    def _check_networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"trusted_proxies: {entry!r} is not an IP address or CIDR network") from None
        return value

    @field_validator("api_key_hashes", "admin_key_hashes")
    @classmethod
    def _check_hashes(cls, value: list[str]) -> list[str]:
        return [checked_digest(digest) for digest in value]

    @field_validator("limits_store")
    @classmethod
    def _check_limits_store(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        value = value.strip()
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"limits_store must be a redis://, rediss:// or unix:// URL, got {value.split('@')[-1]!r}")
        return value

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
        if self.models:
            self._per_model = self._each_model()
            self._check_aliases(set(self.models))
            return self
        self._check_aliases({self.model} if self.model else set())
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

    def _check_aliases(self, served: set[str]) -> None:
        """Each alias names served models (by their configured names) with positive weights, and is not one."""
        for alias, targets in self.model_aliases.items():
            if alias in served:
                raise ValueError(f"model_aliases.{alias}: a served model's name cannot be an alias")
            if not targets:
                raise ValueError(f"model_aliases.{alias}: name the models it stands for, with their weights")
            for target, weight in targets.items():
                if target not in served:
                    raise ValueError(
                        f"model_aliases.{alias}: {target} is not a served model "
                        f"(served: {', '.join(sorted(served)) or 'none configured: set model or models'})"
                    )
                if not weight > 0:
                    raise ValueError(f"model_aliases.{alias}.{target}: a weight is above 0")

    def _each_model(self) -> dict[str, Settings]:
        """The settings of each entry of `models`: the top level's, with the entry's own on top, checked
        as a whole (so an entry's pools are checked as a one-model router's are) and apart from each other."""
        if self.tenants:
            raise ValueError("tenants: engines reserved for tenants are not yet supported beside `models`")
        shared = {
            name: getattr(self, name)
            for name in Settings.model_fields
            if name not in ("config", "models", "model_aliases")  # aliases are over every model
        }
        each: dict[str, Settings] = {}
        owners: dict[str, str] = {}
        for name, entry in self.models.items():
            if not name or len(name) > 256:
                raise ValueError("models: a model's name is 1 to 256 characters")
            unknown = sorted(set(entry) - MODEL_SETTINGS)
            if unknown:
                raise ValueError(
                    f"models.{name}: {', '.join(unknown)} cannot be set for one model "
                    f"(a model may set: {', '.join(sorted(MODEL_SETTINGS))})"
                )
            try:
                settings = Settings(**{**shared, **entry, "model": name})
            except ValidationError as exc:
                raise ValueError(f"models.{name}: {describe_validation_error(exc, prefix=False)}") from None
            if settings.discovery == "kubernetes" and not _narrows_discovery(entry, settings):
                raise ValueError(
                    f"models.{name}: with discovery: kubernetes, each model names its own pods: set its "
                    "kubernetes_selector (a label only its engine pods carry), or the selector of each role "
                    "it discovers"
                )
            for url in (*settings.prefill_urls, *settings.decode_urls):
                if url in owners:
                    raise ValueError(
                        f"models.{name}: {url} is already an engine of model {owners[url]}; "
                        "an engine serves one model (its LoRA adapters are found on it)"
                    )
                owners[url] = name
            each[name] = settings
        return each

    def each_model(self) -> dict[str | None, Settings]:
        """Each served model's settings by its name: the entries of `models`, or the one model of the top
        level (under its configured name, None when it is learnt from the engines)."""
        if not self.models:
            return {self.model: self}
        return {name: settings for name, settings in self._per_model.items()}

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


def _narrows_discovery(entry: Mapping[str, Any], settings: Settings) -> bool:
    """Whether a model's entry selects pods of its own for every role it discovers (a role left without URLs):
    its own `kubernetes_selector`, or that role's selector."""
    if "kubernetes_selector" in entry and settings.kubernetes_selector.strip():
        return True
    discovered = [role for role in ("prefill", "decode") if not getattr(settings, f"{role}_urls")]
    return all(f"kubernetes_{role}_selector" in entry for role in discovered)


# What one entry of `models` may set: its pools, tokenizer, routing and transfer, and the timeouts and
# retries of its requests. Process-wide parts (health probes and load scrapes, which watch every engine,
# the engines' credentials, listeners, keys, admission, stores) are set once, at the top level.
MODEL_SETTINGS = frozenset(
    name
    for name, field in Settings.model_fields.items()
    if isinstance(field.json_schema_extra, dict)
    and field.json_schema_extra.get("group")
    in ("engines", "connectors", "routing", "adaptive", "reliability", "discovery")
) - {
    "model",
    "models",
    "model_aliases",
    "engine_api_key",
    # One API server for every model's discovery.
    "kubernetes_api_url",
    "kubernetes_token_file",
    "kubernetes_ca_file",
    "load_scrape_interval",
    "health_interval",
    "health_timeout",
    "health_unhealthy_threshold",
    "health_healthy_threshold",
}


def models_restart_needed(current: Settings, new: Settings) -> list[str]:
    """What differs between the models of `current` and `new` that cannot change while the router runs:
    a model added or removed, or an entry's setting that is not live (`models.NAME.SETTING`)."""
    old_models, new_models = current.each_model(), new.each_model()
    if set(old_models) != set(new_models):
        return ["models (the served models)"]
    return [
        f"models.{name}.{field}"
        for name, settings in new_models.items()
        for field in sorted(MODEL_SETTINGS)
        if not is_live(field) and getattr(settings, field) != getattr(old_models[name], field)
    ]


def setting_group(name: str) -> str:
    """The group a Settings field belongs to, from its metadata."""
    return str(_field_meta(name)["group"])


def is_live(name: str) -> bool:
    """Whether a Settings field changes on a running router without a restart, from its metadata."""
    return _field_meta(name).get("live") is True


def _field_meta(name: str) -> dict[str, Any]:
    extra = Settings.model_fields[name].json_schema_extra
    return dict(extra) if isinstance(extra, dict) else {}


def live_settings() -> frozenset[str]:
    """The settings that change on a running router without a restart: the fields marked `live`."""
    return frozenset(name for name in Settings.model_fields if is_live(name))


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


def describe_validation_error(exc: ValidationError, *, prefix: bool = True) -> str:
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown setting"
        lines.append(f"{where}: {message}")
    return ("invalid configuration: " if prefix else "") + "; ".join(lines)
