"""Run under torchrun by test_distributed.py: a short GRPO run that records, after every step,
each rank's engine weight version and a checksum of its weights."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tandem.trainers.config import load_config
from tandem.trainers.data_parallel import full_named_parameters, shutdown
from tandem.trainers.trainer import Trainer


def engine_checksum(trainer: Trainer) -> list[float]:
    parameters = trainer.llm.engine.weight_parameters()
    return [float(parameters[name].double().sum()) for name in sorted(parameters)]


def main() -> None:
    out_path, *overrides = sys.argv[1:]
    trainer = Trainer(load_config(None, overrides))
    records = []
    for _ in range(trainer.config.steps):
        metrics = trainer.train_step()
        mine = {"version": trainer.llm.weight_version,
                "checksum": engine_checksum(trainer), "reward": metrics["reward"],
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
