"""A run's checkpoints: the format on disk (format), writing, rotating and restoring them (manager), which one
a job continues from (resume), the sharded state of a run over several processes (sharded_state), the RNG
states (rng_state) and the free-disk check (disk_space). Imports from the rest of trainer/ only modules
below it (distributed, sharding, optim, metrics, build), never one that uses it, such as the loop
(tests/test_layering.py)."""
