"""Overlapped steps: the host schedules and prepares step N+1 while the device runs step N.

With ``EngineConfig.async_scheduling`` (the default on CUDA) a step is launched, its
sequences advanced at once (each sampling one gets a pending token, ``Sequence``), and its
samples read a step later: after the next step is launched, from a non-blocking copy
(``device_sample.py``). The next step's decodes read their pending tokens on the device
(``ModelRunner.launch``). So the host's scheduling, input building and output bookkeeping
run while the device computes, as in vLLM's async scheduling and SGLang's overlap
scheduler.

The cost is one step of lag in what the host knows:
- A sequence that a token stops (EOS, a stop id or string) runs one step more; that
  step's token is dropped, never emitted, and its blocks go back with the sequence's.
  Stops by length (``max_tokens``, ``max_model_len``) are known ahead: the scheduler holds
  such a sequence back instead (``Scheduler._ends_at_length``).
- A step whose next sampling needs the tokens on the host lands at once: a grammar mask
  (structured outputs), repetition / presence / frequency penalties, and chunks that score
  prompt log-probs. So does every step with overlap off.
- A weight commit, sleep and a preemption of everything first land the step in flight
  (``drain``), so its tokens count as sampled under the old weights and held KV is of
  the weights it was computed under. An abort does not wait: the aborted sequences' rows
  are dropped when their step lands (its K/V writes go to freed blocks before any later
  step, on the same stream, reuses them).

Seeded requests sample the same tokens either way, and the same log-probs within the last
bits that a wider batch may round differently: each draws its k-th token's uniform from its
seed and k alone (``sampler.seeded_uniforms``), whatever step samples it. Unseeded requests
share the engine's generator, which those extra rows advance: they sample as validly, but
not the same tokens as with overlap off.
"""

from __future__ import annotations

from dataclasses import dataclass

from .core.scheduled_batch import ScheduledBatch
from .core.scheduler import Scheduler
from .core.sequence import Sequence
from .sampling_params import SamplingParams
from .worker.device_sample import HostCopy
from .worker.model_runner import ModelRunner


@dataclass(slots=True)
class InFlightStep:
    """A launched step: its batch, its sampling sequences (one per output row), the copy
    of its samples on the way to the host, and the weight version they were sampled
    under."""

    batch: ScheduledBatch
    sampled: list[Sequence]
    copy: HostCopy
    weight_version: int

    def waits_for_host(self) -> bool:
        """True when the next step needs this one's tokens on the host (see the module)."""
        distinct = {id(s.sampling_params): s.sampling_params for s in self.sampled}
        return bool(self.copy.prompt_logprobs) or any(map(_reads_host_tokens,
                                                          distinct.values()))


class StepOverlap:
    """Runs the engine's steps, with at most one in flight when ``overlap`` is on.

    Args:
        runner: the engine's model runner.
        overlap: land each step after the next is launched (False: at once).
    """

    def __init__(self, runner: ModelRunner, overlap: bool) -> None:
        self.runner = runner
        self.overlap = overlap
        self.in_flight: InFlightStep | None = None
        self.landed: list[Sequence] = []  # finished by a drain, not reported yet

    def run(self, batch: ScheduledBatch, scheduler: Scheduler,
            weight_version: int) -> list[Sequence]:
        """Launch ``batch`` (when it has work), then land the step before it; returns the
        sequences finished since the last call."""
        launched = self._launch(batch, scheduler, weight_version) if batch.seqs else None
        finished, self.landed = self.landed + self._land(scheduler), []
        self.in_flight = launched
        if launched is not None and (not self.overlap or launched.waits_for_host()):
            finished += self._land(scheduler)
        return finished

    def drain(self, scheduler: Scheduler) -> None:
        """Land the step in flight, if any; the sequences it finishes are reported by the
        next ``run``."""
        self.landed += self._land(scheduler)

    def unreported(self, seq: Sequence) -> bool:
        """True when a drain finished ``seq`` and no ``run`` has reported it yet."""
        return any(landed is seq for landed in self.landed)

    def _launch(self, batch: ScheduledBatch, scheduler: Scheduler,
                weight_version: int) -> InFlightStep:
        copy = self.runner.launch(batch, after_unread=self.in_flight is not None)
        return InFlightStep(batch, scheduler.advance(batch), copy, weight_version)

    def _land(self, scheduler: Scheduler) -> list[Sequence]:
        step, self.in_flight = self.in_flight, None
        if step is None:
            return []
        return scheduler.append_sampled(step.batch, step.sampled, step.copy.result(),
                                        step.weight_version)


def _reads_host_tokens(params: SamplingParams) -> bool:
    """True when sampling under ``params`` reads a sequence's tokens on the host: a
    grammar's matcher, or a penalty over the tokens so far."""
    return (params.structured_outputs is not None or params.repetition_penalty != 1.0
            or bool(params.presence_penalty) or bool(params.frequency_penalty))
