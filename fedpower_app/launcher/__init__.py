"""``fedpower-run`` and the machinery under it (the command's own help is in ``cli``):

* ``flwr_cli``: the ``flwr`` CLI's environment, ports and executables;
* ``flwr_run``: ``run_flwr``, one run on an owned SuperLink, with its real status;
* ``superlink``: the local SuperLink this process starts and stops;
* ``processes``: stopping process trees by PID, and reaping orphans;
* ``supervisor``: the process between the launcher and the SuperLink that stops the whole run when
  the launcher dies, however it dies;
* ``console``: what the console shows of a run;
* ``cli``: the command line (validation, resume, the run);
* ``ray_cluster``: joining an existing Ray cluster (``--ray-address``), and a multi-node cluster on
  one host for rehearsals and tests;
* ``measure``: a command's wall time, rounds and process-tree memory (BENCHMARKS.md).

Every public name is re-exported here (``from fedpower_app import launcher as L; L.run_flwr``).
"""

from __future__ import annotations

from . import cli, console, flwr_cli, flwr_run, processes, ray_cluster, superlink  # noqa: F401 (the submodules)
from .flwr_cli import (  # noqa: F401
    CONNECTION,
    LauncherError,
    OFFLINE_ENV,
    QUIET_ENV,
    VERBOSE_ENV,
    _flwr,
    _home,
    _num,
    _port_is_free,
    _superlink_exe,
    default_superlink_port,
    flwr_env,
    free_port,
    output_env,
    run_config_arg,
    toml_value,
)
from .processes import (  # noqa: F401
    STOP_GRACE_SECONDS,
    _DeferSignals,
    SUPERVISOR,
    _Terminated,
    _alive,
    _become_subreaper,
    _children,
    _descendants,
    _group_members,
    _on_signal,
    _reap,
    _stop_orphans,
    supervised,
    terminate_tree,
)
from .superlink import (  # noqa: F401
    LocalSuperLink,
    SUPERLINK_START_TIMEOUT,
    _NO_PROXY,
    _STARTED,
    _health,
    _kept_superlink,
    _stop_all_at_exit,
    _superlink_command,
    stop_local_superlink,
)
from .console import (  # noqa: F401
    ANSI_RE,
    CONSOLE_RE,
    ConsoleFilter,
    LEVELS,
    NOISE_PATTERNS,
    ROOT_RE,
    TRACEBACK_START,
    _ACTOR,
    _CHAINED,
    _EXC_LINE,
    _WARN_CONTINUATION,
    filter_lines,
    last_exception_line,
)
from .flwr_run import (  # noqa: F401
    RunOutcome,
    TIMEOUT_GRACE_SECONDS,
    _stop_run,
    _stream,
    run_flwr,
    run_status,
)
from .ray_cluster import (  # noqa: F401
    LocalRayCluster,
    check_ray_resources,
    clientapp_placement,
    cluster_nodes,
    describe_cluster,
    ray_address_from,
    ray_env,
    resolve_ray_address,
)
from .cli import (  # noqa: F401
    _shown_path,
    check_ray,
    check_data,
    check_launch,
    main,
    parse_set,
    resume_overrides,
    resumed_supernodes,
)
