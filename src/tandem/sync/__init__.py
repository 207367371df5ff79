"""Weight updates from a trainer into a running engine: one staged protocol, several
transports (in-process copy or alias; a torch.distributed group), names mapped from trainer
wrappers to Hugging Face's."""

from .distributed import WeightReceiver, WeightSender
from .lora import LoraSpec, LoraSync, peft_adapter_state
from .names import engine_name
from .protocol import LoraTarget, UpdateTarget, WeightUpdate, WeightUpdateError

__all__ = ["LoraSpec", "LoraSync", "LoraTarget", "UpdateTarget", "WeightReceiver", "WeightSender",
           "WeightUpdate", "WeightUpdateError", "engine_name", "peft_adapter_state"]
