"""Run under torchrun by test_distributed.py and test_tensor_parallel.py: a short GRPO run
that records, after every step, each rank's engine weight version, a checksum of its weights
and how far each engine parameter (a rank's slice under tensor parallelism) is from the
matching slice of the trainer's full weights."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tandem.rollout.parallel.tensor_parallel import local_slice
from tandem.trainers.config import load_config
from tandem.trainers.data_parallel import full_named_parameters, shutdown
from tandem.trainers.trainer import Trainer


def engine_checksum(trainer: Trainer) -> list[float]:
    """Per engine parameter, in name order, its sum (of a rank's slice under TP)."""
    parameters = dict(trainer.llm.engine.runner.model.named_parameters())
    return [float(parameters[name].double().sum()) for name in sorted(parameters)]


def shard_diff(trainer: Trainer) -> float:
    """The largest difference between an engine parameter and its slice of the trainer's."""
    runner = trainer.llm.engine.runner
    full = dict(full_named_parameters(trainer.policy.model))
    local = dict(runner.model.named_parameters())
    split = {name: target.split for name, target in runner.weight_spec.items()}
    return max(float((local[name] - local_slice(split[name], full[name], runner.model.config,
                                               runner.tp)).abs().max())
               for name in local if name in full)


def main() -> None:
    out_path, *overrides = sys.argv[1:]
    trainer = Trainer(load_config(None, overrides))
    records = []
    for _ in range(trainer.config.steps):
        metrics = trainer.train_step()
        mine = {"version": trainer.llm.weight_version,
                "checksum": engine_checksum(trainer), "reward": metrics["reward"],
                "groups_sampled": metrics.get("groups_sampled"),
                # what the ranks of an engine agree on (the fewest KV blocks): 10 under TP
                "fewest": trainer.llm.engine.runner.tp.fewest(10 + dist.get_rank()),
                "shard_diff": shard_diff(trainer),
                "shard_checksum": sum(float(p.double().sum()) for p in
                                      trainer.llm.engine.runner.model.parameters()),
                "trainer_checksum": [float(p.double().sum()) for _, p in
                                     sorted(full_named_parameters(trainer.policy.model))]}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        records.append(gathered)
    if dist.get_rank() == 0:
        with open(out_path, "w") as file:
            json.dump(records, file)
    shutdown(trainer.context, 0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
