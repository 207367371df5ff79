"""Mapping a trainer's parameter names onto the engine's (Hugging Face) names.

Trainers wrap their models: PEFT (``base_model.model.`` and ``.base_layer``), DDP
(``module.``), FSDP (``_fsdp_wrapped_module.``), activation checkpointing
(``_checkpoint_wrapped_module.``), ``torch.compile`` (``_orig_mod.``). Underneath, the names
are Hugging Face's, which the engine keeps.
"""

from __future__ import annotations

WRAPPER_PREFIXES = ("base_model.model.", "module.", "_orig_mod.")
WRAPPER_INFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.",
                   "base_layer.")


def engine_name(trainer_name: str) -> str:
    """The engine's name for a trainer's parameter name (wrapper prefixes removed)."""
    name = trainer_name
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    for infix in WRAPPER_INFIXES:
        name = name.replace(infix, "")
    return name
