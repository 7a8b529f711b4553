"""Run the real ServerApp and ClientApp in-process (InProcessGrid) with a JSON run config; used by
tests/test_checkpoint.py to SIGKILL a run at a fault point (FEDPOWER_FAULT) and resume it."""

import json
import sys

from client_app.app import app as client_app
from fedpower_app.config import parse_config
from fedpower_app.runs.inprocess_grid import InProcessGrid
from server_app import app as server

if __name__ == "__main__":
    cfg = parse_config(json.loads(sys.argv[1]))
    nodes = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    node_config = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None  # e.g. {"ledger-file": ...}
    grid = InProcessGrid(client_app, nodes, cfg.to_dict())
    if node_config:  # per partition: {"0": {...}, "1": {...}}
        for i, nid in enumerate(grid.node_ids):
            grid._contexts[nid].node_config.update(node_config.get(str(i), {}))
    server.run_server(grid, cfg)
