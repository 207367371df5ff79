"""Tensor parallelism: which slice of each tensor a rank holds and the group's collectives
(``tensor_parallel.py``), the driver's worker processes (``executor.py``), a worker rank's
loop (``worker_process.py``) and their messages (``wire.py``)."""
