"""RL trainers colocated with a Tandem engine: GRPO and PPO (``Trainer``, ``tandem train``),
their recipes' configuration, tasks and rewards, and the TRL drop-in (``trl_integration``).

Importing this package needs neither TRL, peft nor wandb; each is imported where it is used.
"""
