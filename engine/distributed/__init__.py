"""torch.distributed: the parallel context the model layers use, and rank launching."""
