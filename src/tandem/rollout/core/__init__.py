"""The engine core, with no torch: sequences, the scheduler, the block manager (KV blocks,
prefix cache, copy-on-write) and finished sequences held with their KV."""
