"""Weight updates across processes: the staged protocol over a dedicated torch.distributed group.

The trainer runs a ``WeightSender`` (rank 0); each engine process runs a ``WeightReceiver``
(ranks 1..N) around its ``LLM`` or ``LLMEngine``. The pair builds its own ``TCPStore`` (the
sender hosts it) and constructs its process groups directly, so it never calls
``init_process_group`` and never touches either side's default group.

One update, in order:

1. Header, through the store: update number, layout number, version, full. The layout
   (every tensor's name, dtype, shape, bucket and byte offset) is published once under its
   number and reused while the names, shapes and dtypes stay the same.
2. Buckets: the tensors packed into flat byte buffers of ``bucket_bytes`` (a larger tensor
   gets a bucket of its own), two buffers alternating so the sender fills one while the
   other is in flight. Each engine ``load``s a bucket's views as it arrives: the staged
   protocol of ``tandem.sync.protocol``, streamed bucket by bucket.
3. Vote, the control message: an all-reduce of one slot per rank. The sender's slot says
   commit (everything packed) or abort; each engine's says whether its loads passed. Every
   engine commits only on a unanimous vote, so engines never end on different weights.
4. Result: an all-reduce of each engine's committed version (-1 where its commit failed).

A refusal's reason goes through the store, so both ends raise ``WeightUpdateError`` naming
the engine and the reason; the engines keep serving their previous weights.

Transport modes, agreed at construction from every rank's device (the device passed in):

- ``gloo``: some rank is on CPU; buckets live on CPU and go through gloo broadcasts.
- ``nccl``: every rank on a GPU of its own; buckets are broadcast by NCCL.
- ``cuda_ipc``: every rank on the same GPU (same UUID), where NCCL refuses two ranks. The
  sender's two bucket buffers are shared once per layout as CUDA IPC handles
  (``torch.multiprocessing.reductions.reduce_tensor``, through the store, as verl and
  OpenRLHF do, but as plain JSON fields rather than a pickle, rebuilt by one fixed function
  in ``group.py``); a gloo all-reduce per bucket is the barrier that says "filled" to the
  engines and "read" (of the bucket before) to the sender.

The store holds JSON only (``wire.py`` reads it strictly): whoever can write to it can send
any weights, but never make an engine run code. A malformed entry makes the receiver raise
``WeightUpdateError`` naming it and abort the pair.

Some ranks on the trainer's GPU and others elsewhere is refused (``ValueError``).

Every collective waits at most ``timeout``, so a sender that dies mid-update is detected
within it: the receiver aborts the update, the engine keeps serving its old weights, and
``WeightUpdateError`` says so. After a lost peer the pair's groups are aborted: build a new
sender and new receivers (on a fresh port) to go on.

The pieces: ``layout.py`` (buckets and their layout), ``group.py`` (the store, the process
groups, the mode and the IPC handles), ``wire.py`` (checked JSON), ``sender.py``
(``WeightSender``) and ``receiver.py`` (``WeightReceiver``).
"""

from .group import DEFAULT_TIMEOUT
from .layout import Layout
from .receiver import WeightReceiver
from .sender import DEFAULT_BUCKET_BYTES, WeightSender

__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_TIMEOUT", "Layout", "WeightReceiver",
           "WeightSender"]
