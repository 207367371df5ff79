"""``ServerConfig``: how ``tandem serve`` listens and what it accepts (no server imports,
so the command line can be built without the ``serve`` extra)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from tandem.kernels.cpu_threads import parse_cpu_list

from .allowed_hosts import LOOPBACK_HOSTS, AllowedHosts

ENGINE_CORES = ("process", "thread")


@dataclass(slots=True)
class ServerConfig:
    """How ``tandem serve`` listens and what it accepts.

    Each field's help is in its metadata (``metadata["help"]``), which ``tandem serve
    --help`` prints.
    """

    host: str = field(default="127.0.0.1", metadata={"help": (
        "the address to bind; 127.0.0.1 (this machine only) unless told otherwise.")})
    port: int = field(default=8000, metadata={"help": "the TCP port."})
    # Keys stay out of the repr, so a logged configuration never shows them.
    api_key: str | None = field(default=None, repr=False, metadata={"help": (
        "when set, every endpoint but /health, /metrics and the control endpoints wants "
        "``Authorization: Bearer KEY``.")})
    control_api_key: str | None = field(default=None, repr=False, metadata={"help": (
        "the trainer's key: the control endpoints (--enable-control-routes) and the "
        "weight-transfer ones (--enable-weight-transfer) want ``Authorization: Bearer KEY`` "
        "with it and refuse --api-key (403), so a client holding the inference key cannot "
        "sleep, pause or re-weight the engine. Needed to serve either on a --host other "
        "than loopback; without it, on loopback, they want --api-key.")})
    enable_control_routes: bool = field(default=False, metadata={"help": (
        "serve the endpoints a trainer drives the engine with: /sleep, /wake_up, "
        "/release_kv_cache_memory, /pause, /resume, /reset_prefix_cache (vLLM serves them "
        "only with VLLM_SERVER_DEV_MODE=1). Off: they answer 404 naming this option.")})
    metrics_require_api_key: bool = field(default=False, metadata={"help": (
        "guard /metrics with the API key too (off: open, as vLLM's, for scrapers).")})
    enable_weight_transfer: bool = field(default=False, metadata={"help": (
        "serve the weight-transfer endpoints, under --control-api-key (off: they answer 404 "
        "naming this option).")})
    served_model_name: str | None = field(default=None, metadata={"help": (
        "the ``model`` name clients use; default the model argument.")})
    max_body_bytes: int = field(default=8 << 20, metadata={"help": "largest request body."})
    max_prompt_tokens: int | None = field(default=None, metadata={"help": (
        "longest prompt in tokens; default max_model_len - 1.")})
    max_n: int = field(default=64, metadata={"help": "most completions per prompt."})
    max_tokens: int = field(default=4096, metadata={"help": (
        "most tokens per completion (also the chat default).")})
    max_logprobs: int = field(default=20, metadata={"help": "most top log-probs per token."})
    weight_transfer_timeout: float = field(default=300.0, metadata={"help": (
        "seconds any weight-transfer step may wait for the trainer.")})
    weight_transfer_allowed_hosts: str = field(default=LOOPBACK_HOSTS, metadata={"help": (
        "the trainer addresses /init_weight_transfer_engine may make the server join, "
        "comma-separated: host names, IP addresses, CIDR networks (10.0.0.0/8), or '*' "
        "(quoted) for any; this machine only unless told otherwise.")})
    max_num_waiting: int | None = field(default=None, metadata={"help": (
        "most requests accepted but not yet running (queued for the engine, held by a "
        "pause, or in its scheduler's waiting queue); past it a new request gets 503 with "
        "Retry-After, and accepted ones are never dropped. A prompt counts once whatever "
        "its n (its group waits and is admitted as one); a list of prompts counts each. "
        "Default 16 x max_num_seqs: a trainer's step of thousands of prompts fits in one "
        "call, while a flood is refused before it grows memory and latency without bound.")})
    request_timeout: float | None = field(default=None, metadata={"help": (
        "seconds a generation request may take from when it is queued (a pause's wait "
        "included); a request's own ``timeout`` field applies when smaller. Past it the "
        "request is aborted (its KV blocks freed) and answered 504, or its stream ends with "
        "an error event and [DONE]. None: no deadline.")})
    cpu_threads_bind: str = field(default="auto", metadata={"help": (
        "on CPU, pin the engine thread's OpenMP threads one per CPU, as vLLM-CPU does "
        "(VLLM_CPU_OMP_THREADS_BIND), so they keep their cores against lower-priority "
        "processes: 'auto' pins them to the CPUs this process may use when it has as many "
        "threads as CPUs or physical cores (else none), a list such as '0-3' or '0,2' to "
        "those (one per thread), 'none' leaves them to the scheduler (better where other "
        "busy processes share the cores at the same priority).")})
    engine_core: str = field(default="process", metadata={"help": (
        "where the engine core steps, when the server builds the engine: 'process' (its own "
        "process, as vLLM V1's: the server's HTTP, detokenizing and JSON never hold the "
        "interpreter lock a step needs) or 'thread' (a thread of the server's process).")})
    api_nice: int = field(default=10, metadata={"help": (
        "with --engine-core process, the niceness the server's own process adds to itself "
        "once the core process started (0-19; 0: none): where CPUs are few, the core's steps "
        "then come before the server's HTTP, detokenizing and JSON, and streams that fall "
        "behind get bigger chunks instead of slowing the engine. No effect on idle CPUs.")})
    shutdown_timeout: float = field(default=20.0, metadata={"help": (
        "on SIGTERM, seconds the running requests get to finish while new ones are refused; "
        "what is left is then aborted (finish_reason abort) and the server exits 0. 20 so "
        "the whole shutdown fits Kubernetes' default 30 s grace period.")})

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_n", "max_tokens", "max_prompt_tokens",
                     "max_num_waiting"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 1.")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} is invalid: it must be an "
                             "integer >= 0.")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is invalid: it must be in [0, 65535].")
        try:
            AllowedHosts.parse(self.weight_transfer_allowed_hosts)
        except ValueError as exc:
            raise ValueError(f"weight_transfer_allowed_hosts="
                             f"{self.weight_transfer_allowed_hosts!r} is invalid: {exc}") from exc
        for name in ("weight_transfer_timeout", "request_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}={value} is invalid: it must be > 0 seconds.")
        if self.cpu_threads_bind not in ("auto", "none"):
            try:
                parse_cpu_list(self.cpu_threads_bind)
            except ValueError as exc:
                raise ValueError(f"cpu_threads_bind={self.cpu_threads_bind!r} is invalid: "
                                 f"use 'auto', 'none' or a CPU list; {exc}") from exc
        if self.engine_core not in ENGINE_CORES:
            raise ValueError(f"engine_core={self.engine_core!r} is invalid: use one of "
                             f"{', '.join(ENGINE_CORES)}.")
        if not isinstance(self.api_nice, int) or not 0 <= self.api_nice <= 19:
            raise ValueError(f"api_nice={self.api_nice!r} is invalid: it must be an integer "
                             "in [0, 19].")
        self._check_control_key()
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout} is invalid: it must be "
                             ">= 0 seconds (0 aborts the running requests at once).")

    def _check_control_key(self) -> None:
        if self.control_api_key is not None and (
                not self.control_api_key or self.control_api_key == self.api_key):
            raise ValueError("control_api_key is invalid: it must be a non-empty key other "
                             "than api_key, or a client holding the inference key could "
                             "control the engine.")
        serves_control = self.enable_control_routes or self.enable_weight_transfer
        if serves_control and self.control_api_key is None and not is_loopback(self.host):
            option = ("--enable-control-routes" if self.enable_control_routes
                      else "--enable-weight-transfer")
            raise ValueError(f"{option} on host={self.host!r} needs control_api_key: without "
                             "it any client holding --api-key (or none) could sleep, pause or "
                             "re-weight the engine. Set --control-api-key KEY (the trainer's), "
                             "or bind --host 127.0.0.1.")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address) reaches this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
