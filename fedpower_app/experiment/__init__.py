"""``fedpower-experiment``: grids of methods x epsilon x tasks x seeds, and the paper's tables.

The package, by concern (the command's help is in ``cli``):

* ``spec``: what a grid is, its cells and each cell's run-config overrides;
* ``store``: the grid's output directory (results, status, manifest, locks);
* ``backends``: running one cell (``flwr run`` or the in-process grid);
* ``runner``: running a whole grid, shared by workers;
* ``report``: tables and figures from the finished cells;
* ``cli``: the command line.

Every public name is re-exported here (``from fedpower_app import experiment as X; X.run_grid``).
"""

from __future__ import annotations

from . import backends, cli, report, runner, spec, store  # noqa: F401 (the submodules)
from .spec import (  # noqa: F401
    BACKENDS,
    CLIENT_LEVEL_VARIANTS,
    Cell,
    FINISHED,
    FORMAT,
    GridError,
    GridSpec,
    METHOD_LABELS,
    SPLIT_LABELS,
    TABLE_EPSILONS,
    TABLE_METHODS,
    TABLE_TITLES,
    TASK_LABELS,
    _CELL_KEYS,
    _F_RE,
    _eps_sort_key,
    _resolve_path,
    canonical_method,
    cell_overrides,
    eps_label,
    eps_tag,
    method_label,
    method_overrides,
    parse_epsilon,
    refactor_every,
    validate,
)
from .store import (  # noqa: F401
    PACK_FILE,
    has_cells,
    pack_cells,
    packed_cells,
    unpack_cells,
    COMPACT_MARK,
    compact_cells,
    compact_results,
    CODE_PATHS,
    CellProgress,
    GridBusy,
    Manifest,
    PROBE_PATIENCE_S,
    _LOCATION_KEYS,
    _UNSET,
    _fmt_seconds,
    _held,
    _inside,
    _try_lock,
    _write_json,
    cell_metrics,
    cell_progress,
    cell_status,
    code_version,
    config_changes,
    eval_splits_of,
    grid_status,
    is_done,
    is_finished,
    read_results,
    results_path,
    resumable_round,
    supersede,
)
from .backends import (  # noqa: F401
    _ANSI,
    _Watchdog,
    _finish_inprocess_cell,
    _flwr_log_excerpt,
    _last_error_line,
    _lines_until,
    _round_line,
    _stop_run,
    run_cell,
)
from .runner import (  # noqa: F401
    _f4,
    run_grid,
)
from .report import (  # noqa: F401
    Collected,
    Table,
    _pm,
    _seed_average_over_columns,
    accuracy_table,
    collect,
    curve,
    grid_summary_markdown,
    mean_curve,
    mean_std,
    plot_curves,
    refactor_table,
    task_columns,
    write_report,
)
from .cli import (  # noqa: F401
    _GRID_KEYS,
    _load_grid_file,
    _parse_set,
    build_spec,
    main,
    make_parser,
)
from ..runs import default_flwr_home, default_port, is_inside as _inside  # noqa: F401
