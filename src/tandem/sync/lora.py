"""LoRA adapter updates into a running engine: merged into the base weights, or at run time.

A LoRA adapter changes a linear weight ``W0`` of shape ``[out, in]`` by
``scale · (B @ A)``, with ``A`` ``[r, in]``, ``B`` ``[out, r]`` and ``scale`` ``alpha / r``
(``alpha / sqrt(r)`` with rsLoRA). ``LoraSync`` keeps a copy of each targeted ``W0`` and
pushes ``W0 + scale · (B @ A)`` (computed in float32, then cast to the engine's dtype)
through the staged protocol, so every update starts from ``W0``: a thousand updates drift
no more than one. A refused adapter leaves the engine serving its previous weights.

The rule for ``W0``: it is copied from the engine the first time a module is targeted, when
the engine still serves the base weight (nothing merged there yet). From then on the engine
holds ``W0 + delta`` there and ``W0`` cannot be read back, so ``LoraSync`` owns the targeted
weights: it records the weight version of its own last commit and refuses to merge when the
engine's version has moved without it. New base weights go through ``LoraSync.set_base``
(which keeps the adapter applied, in the same commit); after a full ``update_weights`` from
elsewhere, ``LoraSync.rebase`` adopts the engine's weights as the new ``W0``. Do not mix it
with aliased updates (``alias=True``): its copies would write into the trainer's tensors.

Run-time mode (``LoraSync(llm, mode="runtime")``) leaves the weights alone: the engine adds
``scale · (x A^T) B^T`` in each targeted layer, and each update gets a new LoRA id in the
prefix-cache key. Its output equals the merged model's within float tolerance.

An adapter on a packed module (Phi-3's ``qkv_proj``, ``gate_up_proj``: B ``[sum of the
parts' rows, r]``) becomes one adapter per part the engine's weight spec names (``q_proj``,
...): A shared, each part its rows of B, by the engine's own split of the packed name
(``unalias``). Each part merges its rows of the packed product ``B @ A``, not the product
of its own rows of B: a BLAS picks its kernel by the shape, and a product of fewer rows can
differ in the last bit, where the trainer's merge (peft's, the exact forward's) multiplies the
packed matrix whole.

peft is imported only by ``peft_adapter_state``; the rest needs torch alone.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from .names import engine_name
from .protocol import (
    LoraTarget,
    WeightUpdate,
    WeightUpdateError,
    check_all_finite,
    next_version,
)

NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]

# peft's adapter names: ``<module>.lora_A.weight`` (its state dict) or
# ``<module>.lora_A.<adapter>.weight`` (``named_parameters``).
ADAPTER_TENSOR = re.compile(r"(?P<module>.+)\.lora_(?P<factor>[AB])(?:\.(?P<adapter>[^.]+))?"
                            r"\.weight")
UNSUPPORTED_PEFT_OPTIONS = ("use_dora", "lora_bias", "fan_in_fan_out", "rank_pattern",
                            "alpha_pattern", "target_parameters", "layer_replication",
                            "alora_invocation_tokens")


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """What a LoRA adapter's tensors mean (peft's ``LoraConfig`` fields of the same names).

    Attributes:
        r: the rank; every ``lora_A`` must have ``r`` rows and every ``lora_B`` ``r``
            columns.
        lora_alpha: the scale's numerator.
        use_rslora: scale by ``lora_alpha / sqrt(r)`` instead of ``lora_alpha / r``.
        target_modules: the module names the adapter may touch, matched as peft matches them
            (a name, or a suffix after a dot; a string is a regular expression over the whole
            module name, ``"all-linear"`` any module); None accepts any module.

    Raises:
        ValueError: for a rank that is not a positive integer or a non-finite alpha.
    """

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: Collection[str] | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"r={self.r!r} is invalid: the LoRA rank is a positive integer.")
        if not math.isfinite(self.lora_alpha):
            raise ValueError(f"lora_alpha={self.lora_alpha!r} is invalid: give a finite number.")

    @property
    def scale(self) -> float:
        """The factor on ``B @ A``: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` (rsLoRA)."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def targets(self, module: str) -> bool:
        """Whether ``module`` (a Hugging Face module name) is among ``target_modules``."""
        if self.target_modules is None or self.target_modules == "all-linear":
            return True
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        return any(module == t or module.endswith(f".{t}") for t in self.target_modules)

    @classmethod
    def from_peft(cls, config: Any) -> LoraSpec:
        """The spec of a peft ``LoraConfig`` (read by attribute; peft is not imported).

        Raises:
            ValueError: for a config that is not LoRA, or one using an option a merge here
                does not reproduce (DoRA, LoRA bias, fan-in-fan-out, rank or alpha patterns,
                target parameters, layer replication, activated LoRA).
        """
        if getattr(config, "peft_type", "LORA") != "LORA":
            raise ValueError(f"peft_type={config.peft_type!r}: only LoRA adapters are supported.")
        for option in UNSUPPORTED_PEFT_OPTIONS:
            if getattr(config, option, None):
                raise ValueError(f"{option}={getattr(config, option)!r} is not supported by "
                                 "LoraSync: train the adapter without it.")
        return cls(config.r, config.lora_alpha, bool(getattr(config, "use_rslora", False)),
                   getattr(config, "target_modules", None))


def as_lora_spec(config: LoraSpec | Mapping[str, Any] | Any) -> LoraSpec:
    """A ``LoraSpec`` from itself, a mapping of its fields, or a peft ``LoraConfig``.

    Raises:
        ValueError: see ``LoraSpec`` and ``LoraSpec.from_peft``.
    """
    if isinstance(config, LoraSpec):
        return config
    if isinstance(config, Mapping):
        return LoraSpec(**config)
    return LoraSpec.from_peft(config)


@dataclass(frozen=True, slots=True)
class LoraFactors:
    """One module's adapter: float32 copies of ``lora_A`` ``[r, in]`` and ``lora_B``
    ``[out, r]``, and the scale on their product; for a part of a packed module, the packed
    module's factors and the part's rows of them (``rows``, start and stop)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float
    rows: tuple[int, int] | None = None

    @property
    def part_b(self) -> torch.Tensor:
        """The B of this module (a packed module's part: its rows of the packed B)."""
        return self.lora_b if self.rows is None else self.lora_b[slice(*self.rows)]

    @property
    def shape(self) -> tuple[int, int]:
        """The shape ``[out, in]`` of the change to this module's weight."""
        return self.part_b.shape[0], self.lora_a.shape[1]

    def merged(self, base: torch.Tensor) -> torch.Tensor:
        """``base + scale · (B @ A)`` in float32, on ``base``'s device (a part's rows of the
        packed product, bit for bit the packed merge's)."""
        lora_a, lora_b = self.lora_a.to(base.device), self.lora_b.to(base.device)
        product = lora_b @ lora_a
        return base.float() + (product if self.rows is None else
                               product[slice(*self.rows)]) * self.scale


def adapter_factors(named_tensors: NamedTensors, spec: LoraSpec) -> dict[str, LoraFactors]:
    """Group an adapter's tensors by the engine weight they change (``...q_proj.weight``).

    Accepts peft's names with or without the adapter name, under any wrapper prefix that
    ``engine_name`` strips. The factors are float32 copies, so the trainer may step on.

    Raises:
        WeightUpdateError: for a tensor that is not a LoRA A or B weight, tensors of two
            adapters, a module outside ``spec.target_modules``, a module lacking A or B, or
            factors that are not ``[r, in]`` and ``[out, r]`` matrices.
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    adapters: set[str] = set()
    for trainer_name, tensor in items:
        match = ADAPTER_TENSOR.fullmatch(trainer_name)
        if match is None:
            raise WeightUpdateError(f"{trainer_name!r} is not a LoRA A or B weight "
                                    "(<module>.lora_A.weight, <module>.lora_B.weight); DoRA, "
                                    "embedding LoRA and modules_to_save are not supported.")
        adapters.add(match["adapter"] or "")
        weight = engine_name(f"{match['module']}.weight")
        pairs.setdefault(weight, {})[match["factor"]] = tensor
    if len(adapters) > 1:
        raise WeightUpdateError(f"the tensors belong to several adapters {sorted(adapters)}: "
                                "send one adapter's tensors.")
    return {weight: _module_factors(weight, pair, spec) for weight, pair in pairs.items()}


def _module_factors(weight: str, pair: dict[str, torch.Tensor], spec: LoraSpec) -> LoraFactors:
    module = weight.removesuffix(".weight")
    if not spec.targets(module):
        raise WeightUpdateError(f"module {module!r} is not among target_modules="
                                f"{spec.target_modules!r}.")
    if set(pair) != {"A", "B"}:
        missing = "B" if "A" in pair else "A"
        raise WeightUpdateError(f"module {module!r} lacks its lora_{missing} weight.")
    lora_a, lora_b = pair["A"], pair["B"]
    if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != spec.r or \
            lora_b.shape[1] != spec.r:
        raise WeightUpdateError(f"module {module!r} has lora_A {tuple(lora_a.shape)} and lora_B "
                                f"{tuple(lora_b.shape)}; rank r={spec.r} needs [{spec.r}, in] "
                                f"and [out, {spec.r}].")
    return LoraFactors(_float_copy(lora_a), _float_copy(lora_b), spec.scale)


def _float_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to(dtype=torch.float32, copy=True)


class LoraSync:
    """Merges LoRA adapters into a running engine's weights, always from the kept base ``W0``.

    Args:
        llm_or_engine: an ``LLM`` (its engine is used) or any ``LoraTarget`` (an
            ``LLMEngine``).
        base_device: where the ``W0`` copies live (default: beside the engine's weights;
            ``"cpu"`` keeps them off the accelerator at the cost of merging there).
        mode: ``"merge"`` (default) folds the adapter into the weights; ``"runtime"`` leaves
            the weights alone and has the engine add ``scale (x A^T) B^T`` in each targeted
            layer (no base copies kept; each update is a new LoRA id in the prefix-cache key).

    See the module docstring for who may change the targeted weights.

    Raises:
        ValueError: for an unknown mode.
        TypeError: for a target lacking ``LoraTarget``'s methods.
    """

    def __init__(self, llm_or_engine: Any, base_device: str | torch.device | None = None,
                 mode: str = "merge") -> None:
        if mode not in ("merge", "runtime"):
            raise ValueError(f"mode={mode!r} is invalid: use 'merge' or 'runtime'.")
        engine: LoraTarget = getattr(llm_or_engine, "engine", llm_or_engine)
        missing = [name for name in ("weight_parameters", "commit_weights", "commit_lora",
                                     "unalias") if not hasattr(engine, name)]
        if missing:
            raise TypeError(f"LoraSync needs an LLM or an engine with {', '.join(missing)} "
                            f"(see LoraTarget); {type(engine).__name__} lacks them.")
        self.engine = engine
        self.base_device = base_device
        self.mode = mode
        self.lora_id = 0
        self.bases: dict[str, torch.Tensor] = {}
        self.factors: dict[str, LoraFactors] = {}
        self.weight_version = self.engine.weight_version

    def update(self, adapter_named_tensors: NamedTensors,
               config: LoraSpec | Mapping[str, Any] | Any, version: int | None = None) -> int:
        """Serve ``W0 + scale · (B @ A)`` for every module of this adapter, and ``W0`` again for
        modules an earlier adapter changed and this one does not (an empty adapter removes
        the adapter). Returns the new weight version.

        Raises:
            ValueError: for an invalid config or a version not above the engine's.
            WeightUpdateError: for a refused adapter (see ``adapter_factors``), a module the
                engine lacks or whose weight (a packed module's: its parts' together) does
                not match ``[out, in]``, a non-finite merged weight, or weights changed outside
                ``LoraSync``; the engine keeps serving its previous weights.
        """
        factors = self._by_part(adapter_factors(adapter_named_tensors, as_lora_spec(config)))
        if self.mode == "runtime":
            return self._update_runtime(factors, version)
        self._check_owner()
        parameters = self.engine.weight_parameters()
        bases = dict(self.bases)
        for weight, module_factors in factors.items():
            if weight not in bases:
                bases[weight] = self._base_copy(weight, parameters)
            _check_fits(weight, module_factors, bases[weight].shape)
        update = WeightUpdate(self.engine, version, full=False)
        update.load(_merged_weights(bases, factors))
        self._committed(update, bases, factors)
        return self.weight_version

    def _update_runtime(self, factors: dict[str, LoraFactors], version: int | None) -> int:
        parameters = self.engine.weight_parameters()
        for weight, module_factors in factors.items():
            if weight not in parameters:
                raise WeightUpdateError(f"unknown module: the engine has no weight {weight!r}.")
            _check_fits(weight, module_factors, parameters[weight].shape)
        check_all_finite((weight, factor) for weight, module_factors in factors.items()
                         for factor in (module_factors.lora_a, module_factors.part_b))
        version = next_version(self.engine, version)
        self.engine.commit_lora({w: (f.lora_a, f.part_b, f.scale) for w, f in factors.items()},
                                version, self.lora_id + 1)
        self.lora_id += 1
        self.weight_version = version
        return version

    def _by_part(self, factors: dict[str, LoraFactors]) -> dict[str, LoraFactors]:
        """``factors`` with each adapter on a packed module (a name the engine does not hold
        but splits into weights it holds, ``unalias``) as one adapter per part.

        Raises:
            WeightUpdateError: for a packed module's adapter that does not match its parts'
                weights together.
        """
        parameters = self.engine.weight_parameters()
        by_part = {}
        for weight, module_factors in factors.items():
            parts = None if weight in parameters else \
                self.engine.unalias(weight, module_factors.lora_b)
            if parts and all(part in parameters for part, _ in parts):
                by_part.update(_part_factors(weight, module_factors, {
                    part: parameters[part].shape for part, _ in parts}))
            else:
                by_part[weight] = module_factors
        return by_part

    def set_base(self, named_tensors: NamedTensors, version: int | None = None,
                 full: bool = True) -> int:
        """Push new base weights with the current adapter kept applied, in one commit.

        Takes what ``update_weights`` takes; the targeted weights among them become the new
        ``W0``. Returns the new weight version.

        Raises:
            ValueError: for a version not above the engine's.
            WeightUpdateError: as ``update_weights`` does, or for a partial update after
                weights changed outside ``LoraSync``; the engine keeps its previous weights.
        """
        if not full:
            self._check_owner()
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        update = WeightUpdate(self.engine, version, full)
        update.load(items)
        new_bases = {weight: update.staged[weight] for weight in self.bases
                     if weight in update.staged}
        update.load(_merged_weights(new_bases, self.factors))
        bases = {**self.bases, **{w: b.to(self._device(b)) for w, b in new_bases.items()}}
        self._committed(update, bases, self.factors)
        return self.weight_version

    def rebase(self) -> None:
        """Adopt the engine's current weights as the base and forget the adapter.

        Call it after a full ``update_weights`` from elsewhere (which rewrote every targeted
        weight with a base weight); the next ``update`` copies ``W0`` from the engine again.
        After a partial update that missed a targeted weight this would make that weight's
        ``W0`` include the old adapter: push such updates through ``set_base`` instead.
        """
        self.bases = {}
        self.factors = {}
        self.weight_version = self.engine.weight_version

    def _check_owner(self) -> None:
        if self.bases and self.engine.weight_version != self.weight_version:
            raise WeightUpdateError(
                f"the engine's weights changed outside LoraSync (version "
                f"{self.engine.weight_version}, LoraSync last wrote {self.weight_version}), so "
                "its kept base weights may be stale: push base weights with "
                "LoraSync.set_base, or call LoraSync.rebase() after a full update_weights.")

    def _base_copy(self, weight: str, parameters: dict[str, torch.Tensor]) -> torch.Tensor:
        param = parameters.get(weight)
        if param is None:
            raise WeightUpdateError(f"unknown module: the engine has no weight {weight!r} (or it "
                                    "is tied to another); its names are Hugging Face's, e.g. "
                                    f"{next(iter(parameters))!r}.")
        # An engine split over ranks offers stand-ins of the full shapes: ask for the weight.
        full = self.engine.full_weight(weight) if hasattr(self.engine, "full_weight") else param
        return full.detach().to(self._device(param), copy=True)

    def _device(self, tensor: torch.Tensor) -> torch.device:
        return tensor.device if self.base_device is None else torch.device(self.base_device)

    def _committed(self, update: WeightUpdate, bases: dict[str, torch.Tensor],
                   factors: dict[str, LoraFactors]) -> None:
        self.weight_version = update.commit()
        self.bases = bases
        self.factors = factors


def _check_fits(weight: str, factors: LoraFactors, shape: Iterable[int]) -> None:
    if factors.shape != tuple(shape):
        raise WeightUpdateError(f"the adapter of {weight!r} makes a {list(factors.shape)} "
                                f"change, the engine's weight is {list(shape)}.")


def _part_factors(weight: str, factors: LoraFactors, part_shapes: dict[str, torch.Size]
                  ) -> dict[str, LoraFactors]:
    """A packed module's adapter as one per part (``part_shapes``: each part's weight shape,
    stacked in this order along the packed weight's rows): A shared, each part its rows of
    B.

    Raises:
        WeightUpdateError: for factors that do not match the parts' weights together.
    """
    rows = [shape[0] for shape in part_shapes.values()]
    _check_fits(weight, factors, (sum(rows), next(iter(part_shapes.values()))[1]))
    starts = itertools.accumulate(rows, initial=0)
    return {part: replace(factors, rows=(start, start + count))
            for part, start, count in zip(part_shapes, starts, rows)}


def _merged_weights(bases: dict[str, torch.Tensor], factors: dict[str, LoraFactors]
                    ) -> Iterable[tuple[str, torch.Tensor]]:
    for weight, base in bases.items():
        module_factors = factors.get(weight)
        yield weight, base if module_factors is None else module_factors.merged(base)


def peft_adapter_state(peft_model: Any, adapter_name: str | None = None
                       ) -> tuple[dict[str, torch.Tensor], LoraSpec]:
    """An adapter's tensors (peft's state-dict names) and spec from a peft model.

    ``adapter_name`` defaults to the active adapter. The tensors share the model's memory;
    ``LoraSync.update`` copies them.

    Raises:
        ValueError: see ``LoraSpec.from_peft``.
    """
    from peft import get_peft_model_state_dict

    adapter_name = adapter_name or peft_model.active_adapter
    tensors = get_peft_model_state_dict(peft_model, adapter_name=adapter_name,
                                        save_embedding_layers=False)
    return tensors, LoraSpec.from_peft(peft_model.peft_config[adapter_name])
