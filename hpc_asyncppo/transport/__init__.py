"""What crosses between ranks: sample groups (MPI, rollout -> trainer) and weights
(torch.distributed broadcast, trainer leader -> rollout ranks). Numpy/torch buffers with
JSON headers only: nothing is pickled on the wire."""
