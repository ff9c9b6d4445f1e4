"""hpc_asyncppo: a Slurm-native, fully asynchronous PPO/GRPO trainer for language models."""

__version__ = "0.1.0"
