"""Slurm backend: one heterogeneous job (rollout component + train component), via submitit."""
