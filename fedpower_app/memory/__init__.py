"""The memory one ClientApp needs, without training (``fedpower-memory``; the command's own
description is in ``fedpower_app.memory.cli``). Four parts:

* ``meta``: the run's model on PyTorch's meta device, and a training step dry-run on it with every
  allocation counted;
* ``plan``: the memory plan of one ClientApp (``plan_memory``, ``MemoryPlan``);
* ``gpu``: sizes, and how many ClientApps fit a GPU (``gpu_fit``: Ray's ``num-gpus``);
* ``cli``: the command line (``main``).

``fedpower_app.memory_plan`` re-exports them under their old names.
"""
