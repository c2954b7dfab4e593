"""Where each model of the RL dataflow runs (HybridFlow §4 and §6; verl's ``resource_pool_spec``).

- :mod:`.spec`: a :class:`~.spec.Placement` (named resource pools of workers per node, and which pool
  each role runs on) from the ``trainer.placement*`` config keys, and its validation;
- :mod:`.cost_model`: per-phase times fitted from a short profiling run, and a step's predicted time
  for a placement (phases on one pool queue, phases on different pools overlap);
- :mod:`.memory`: a worker's memory under a placement (FSDP shards + activations, calibrated from
  ``benchmarks/sp_memory.py``) and the Ulysses SP size each role needs to fit;
- :mod:`.planner`: Algorithm 1 — enumerate placements and per-pool device counts (and each role's SP
  size), rank them by the cost model;
- :mod:`.local_cluster`: a multi-node Ray cluster on one machine (tests and trying multi-node runs).

Their command lines are entry points above the trainer (they build and train runs):
``python -m hybridflow.profile_placement`` (the profiling run that calibrates the cost model) and
``python -m hybridflow.plan_placement`` (the ranking). Nothing here imports the trainer, and nothing
here is imported by ``import hybridflow``.
"""
