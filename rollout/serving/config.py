"""``ServerConfig``: how ``tandem serve`` listens and what it accepts (no server imports,
so the command line can be built without the ``serve`` extra)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ServerConfig:
    """How ``tandem serve`` listens and what it accepts.

    Each field's help is in its metadata (``metadata["help"]``), which ``tandem serve
    --help`` prints.
    """

    host: str = field(default="127.0.0.1", metadata={"help": (
        "the address to bind; 127.0.0.1 (this machine only) unless told otherwise.")})
    port: int = field(default=8000, metadata={"help": "the TCP port."})
    api_key: str | None = field(default=None, metadata={"help": (
        "when set, every endpoint but /health and /metrics wants ``Authorization: Bearer "
        "KEY``.")})
    metrics_require_api_key: bool = field(default=False, metadata={"help": (
        "guard /metrics with the API key too (off: open, as vLLM's, for scrapers).")})
    enable_weight_transfer: bool = field(default=False, metadata={"help": (
        "serve the weight-transfer endpoints (off: they answer 403).")})
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

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_n", "max_tokens", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 1.")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} is invalid: it must be an "
                             "integer >= 0.")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is invalid: it must be in [0, 65535].")
        if self.weight_transfer_timeout <= 0:
            raise ValueError(f"weight_transfer_timeout={self.weight_transfer_timeout} is "
                             "invalid: it must be > 0 seconds.")
