"""The worker: the model runner and what it owns on the device (the models, their loading,
the KV pool's sizing and memory, the persistent batch, decode graphs, sampling)."""
