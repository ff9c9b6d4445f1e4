"""How ranks get started: local (mpirun) and Slurm (one heterogeneous job) backends."""
