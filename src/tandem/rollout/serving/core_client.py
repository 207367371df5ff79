"""The two places an ``EngineCore`` runs, behind one interface (``start``, ``send``,
``observe``, ``close`` and ``engine``, what the routes read of the engine):

- ``ThreadCore``: a thread of the API process, around an engine built there (tests, and
  whoever hands the server an ``LLMEngine``). The event loop and the steps share one
  interpreter lock.
- ``ProcessCore``: a process of its own (multiprocessing's ``spawn``), which builds the
  engine from its ``EngineConfig`` (``tandem serve``'s default, as vLLM V1's engine core):
  the API process's HTTP, detokenizing and JSON never hold the lock a step needs.
  Commands and reports cross two pipes, pickled: anonymous pipes between this process
  and its own child, which nothing else can reach (what comes from outside, HTTP bodies
  and weight transfers, stays JSON and raw bytes). A reader thread hands the reports to
  the event loop. The API process keeps only the tokenizer and input processing
  (``EngineMirror``).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import signal
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from ..config import EngineConfig
from ..default_model import resolve_model
from ..engine import LLMEngine
from ..input_processor import InputMethods, InputProcessor
from ..model_folder import load_tokenizer
from .core_messages import CallResult, CoreCall, CoreDied, CoreReady, StepReport
from .engine_core import Emit, EngineCore

CORE_START_POLL_SECONDS = 1.0
CORE_STOP_SECONDS = 30.0


class EngineDeadError(RuntimeError):
    """The engine core process ended: this server can answer nothing more (503)."""


class ThreadCore:
    """An ``EngineCore`` on a thread of this process.

    Args:
        engine: the engine it drives (nothing else may call it once started).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[CoreCall] = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self, deliver: Emit) -> None:
        """Start the core; it calls ``deliver`` (from its threads) with each message."""
        core = EngineCore(self.engine, _QueueInbox(self._inbox), deliver)
        self._thread = threading.Thread(target=core.run, name="tandem-engine", daemon=True)
        self._thread.start()

    def send(self, command: CoreCall) -> None:
        """Queue a command for the core."""
        self._inbox.put(command)

    def observe(self, message: CallResult | StepReport) -> None:
        """Nothing: the engine here is read directly."""

    def close(self) -> None:
        """Stop the core after its current step and wait for its thread."""
        if self._thread is not None:
            self.send(CoreCall(None, "shutdown"))
            self._thread.join()


class _QueueInbox:
    """A ``queue.Queue`` as a ``CoreInbox``."""

    def __init__(self, commands: queue.Queue[CoreCall]) -> None:
        self.commands = commands

    def get(self, block: bool) -> CoreCall | None:
        try:
            return self.commands.get(block)
        except queue.Empty:
            return None


class EngineMirror(InputMethods):
    """What the API process reads of an engine in another process: its configuration and
    limits, input processing with its own tokenizer, and the weight version and sleep level
    as of the core's last message.

    Args:
        config: the engine's configuration.
        ready: the facts its core sent once the engine was built.
    """

    def __init__(self, config: EngineConfig, ready: CoreReady) -> None:
        self.config = config
        self.max_model_len = ready.max_model_len
        self.tokenizer = load_tokenizer(Path(ready.model_dir))
        self.input_processor = InputProcessor(self.tokenizer, ready.vocab_size,
                                              ready.max_model_len, ready.eos_token_ids)
        self.weight_version = 0
        self.is_sleeping = False


class ProcessCore:
    """An ``EngineCore`` in a process of its own, which builds the engine from ``config``;
    returns once it is built.

    Args:
        config: the engine's configuration.
        api_nice: the niceness ``start`` adds to the calling thread (the event loop's; the
            threads it starts later inherit it), so that where CPUs are few the core's
            steps come first.

    Raises:
        Exception: what building the engine raised in the core process.
        EngineDeadError: when the core process ended before its engine was built.
    """

    def __init__(self, config: EngineConfig, api_nice: int = 0) -> None:
        self.api_nice = api_nice
        context = mp.get_context("spawn")
        command_reader, self._commands = context.Pipe(duplex=False)
        self._reports, report_writer = context.Pipe(duplex=False)
        self.process = context.Process(target=run_core_process, name="tandem-engine-core",
                                       args=(config, command_reader, report_writer),
                                       daemon=True)
        self.process.start()
        command_reader.close()  # the child's ends: their end of file is the child's death
        report_writer.close()
        self.engine = EngineMirror(config, self._wait_ready())
        self._reader: threading.Thread | None = None
        self._closing = False

    def _wait_ready(self) -> CoreReady:
        while not self._reports.poll(CORE_START_POLL_SECONDS):
            if not self.process.is_alive():
                raise EngineDeadError(f"the engine core process exited (code "
                                      f"{self.process.exitcode}) before its engine was built.")
        ready = self._reports.recv()
        if ready.error is not None:
            self.process.join(CORE_STOP_SECONDS)
            raise ready.error
        return ready

    def start(self, deliver: Emit) -> None:
        """Lower this thread's priority by ``api_nice``, then start reading the core's
        messages; ``deliver`` gets each (on the reader thread), and a ``CoreDied`` if the
        process ends unasked."""
        os.nice(self.api_nice)
        self._reader = threading.Thread(target=self._read, args=(deliver,),
                                        name="tandem-core-reader", daemon=True)
        self._reader.start()

    def _read(self, deliver: Emit) -> None:
        while True:
            try:
                message = self._reports.recv()
            except (EOFError, OSError):
                break
            deliver(message)
        if not self._closing:
            self.process.join(CORE_STOP_SECONDS)
            deliver(CoreDied(self.process.exitcode))

    def send(self, command: CoreCall) -> None:
        """Send a command to the core.

        Raises:
            EngineDeadError: when the core process has ended.
        """
        try:
            self._commands.send(command)
        except (OSError, ValueError) as exc:
            raise EngineDeadError(f"the engine core process has ended (code "
                                  f"{self.process.exitcode}).") from exc

    def observe(self, message: CallResult | StepReport) -> None:
        """Keep the mirror's weight version (and, after a call, whether it sleeps) current."""
        self.engine.weight_version = message.weight_version
        if isinstance(message, CallResult):
            self.engine.is_sleeping = message.is_sleeping

    def close(self) -> None:
        """Ask the core to stop, wait for it (terminating it past ``CORE_STOP_SECONDS``)."""
        self._closing = True
        try:
            self.send(CoreCall(None, "shutdown"))
        except EngineDeadError:
            pass
        self.process.join(CORE_STOP_SECONDS)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self._commands.close()
        if self._reader is not None:
            self._reader.join()
        self._reports.close()


def run_core_process(config: EngineConfig, commands: Connection, reports: Connection) -> None:
    """A core process's body: build the engine, say ``CoreReady``, run the core until
    ``shutdown`` or the API process's end (its pipe closes)."""
    # Ctrl-C reaches the whole process group: the API process decides when the core ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = LLMEngine(config)
        model_dir = resolve_model(config.model)
        vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    except Exception as exc:
        _PipeEmit(reports)(CoreReady(error=exc))
        return
    gc.collect()
    gc.freeze()  # the model's and libraries' objects, out of every collection's reach
    emit = _PipeEmit(reports)
    emit(CoreReady(str(model_dir), vocab_size, engine.max_model_len,
                   set(engine.eos_token_ids)))
    EngineCore(engine, _PipeInbox(commands), emit).run()


class _PipeInbox:
    """The read end of the command pipe as a ``CoreInbox``; its end of file (the API
    process is gone) reads as ``shutdown``."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def get(self, block: bool) -> CoreCall | None:
        if not block and not self.connection.poll():
            return None
        try:
            return self.connection.recv()
        except (EOFError, OSError):
            return CoreCall(None, "shutdown")


class _PipeEmit:
    """Sends messages on the report pipe, one at a time (threaded calls emit too); an
    error that cannot be pickled goes as a ``RuntimeError`` naming it."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.lock = threading.Lock()

    def __call__(self, message: Any) -> None:
        with self.lock:
            try:
                self.connection.send(message)
            except Exception:
                error = getattr(message, "error", None)
                if error is None:
                    raise
                message.error = RuntimeError(f"{type(error).__name__}: {error}")
                self.connection.send(message)


def open_core(engine: LLMEngine | EngineConfig, engine_core: str,
              api_nice: int = 0) -> ThreadCore | ProcessCore:
    """Where a server's engine core runs: on a thread around a given engine; for a
    configuration, in a process of its own (``engine_core`` "process", this process then
    ``api_nice`` nicer once it starts) or on a thread around an engine built here
    ("thread").

    Raises:
        Exception: what building the engine raised.
    """
    if isinstance(engine, LLMEngine):
        return ThreadCore(engine)
    if engine_core == "process":
        return ProcessCore(engine, api_nice)
    return ThreadCore(LLMEngine(engine))
