"""``fedpower-memory``: the memory one ClientApp needs for a run configuration, without training.

The code lives in ``fedpower_app.memory`` (``meta``: the dry run on the meta device; ``plan``: the
plan; ``gpu``: sizes and the Ray ``num-gpus`` fit; ``cli``: the command line, whose docstring
describes the command). This module keeps the names that ``fedpower-memory`` (pyproject
``[project.scripts]``), ``python -m fedpower_app.memory_plan`` and the tests use.
"""

import sys

from .memory.cli import FLAG_KEYS, build_parser, load_config, main, render
from .memory.gpu import DEFAULT_CUDA_CONTEXT, DEFAULT_HEADROOM, GIB, MIB, fmt, gpu_fit, parse_size
from .memory.meta import (StepTrace, dp_sgd_enabled, dry_run_no_grad, dry_run_step, meta_model,
                          num_labels_of)
from .memory.plan import FLOAT32, POISSON_TAIL_SIGMAS, MemoryPlan, physical_chunk, plan_memory

__all__ = ["DEFAULT_CUDA_CONTEXT", "DEFAULT_HEADROOM", "FLAG_KEYS", "FLOAT32", "GIB", "MIB", "MemoryPlan",
           "POISSON_TAIL_SIGMAS", "StepTrace", "build_parser", "dp_sgd_enabled", "dry_run_no_grad",
           "dry_run_step", "fmt", "gpu_fit", "load_config", "main", "meta_model", "num_labels_of",
           "parse_size", "physical_chunk", "plan_memory", "render"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
