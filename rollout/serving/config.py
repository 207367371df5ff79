"""``ServerConfig``: how ``tandem serve`` listens and what it accepts (no server imports,
so the command line can be built without the ``serve`` extra)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ServerConfig:
    """How ``tandem serve`` listens and what it accepts.

    Attributes:
        host: the address to bind; 127.0.0.1 (this machine only) unless told otherwise.
        port: the TCP port.
        api_key: when set, every endpoint but /health wants ``Authorization: Bearer KEY``.
        enable_weight_transfer: serve the weight-transfer endpoints (off: they answer 403).
        served_model_name: the ``model`` name clients use; default the model argument.
        max_body_bytes: largest request body.
        max_prompt_tokens: longest prompt in tokens; default max_model_len - 1.
        max_n: most completions per prompt.
        max_tokens: most tokens per completion (also the chat default).
        max_logprobs: most top log-probs per token.
        weight_transfer_timeout: seconds any weight-transfer step may wait for the trainer.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    enable_weight_transfer: bool = False
    served_model_name: str | None = None
    max_body_bytes: int = 8 << 20
    max_prompt_tokens: int | None = None
    max_n: int = 64
    max_tokens: int = 4096
    max_logprobs: int = 20
    weight_transfer_timeout: float = 300.0

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
