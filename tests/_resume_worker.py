"""Run the real ServerApp and ClientApp in-process (InProcessGrid) with a JSON run config; used by
tests/test_checkpoint.py to SIGKILL a run at a fault point (FEDPOWER_FAULT) and resume it."""

import json
import sys

from client_app.app import app as client_app
from fedpower_app.config import parse_config
from fedpower_app.inprocess import InProcessGrid
from server_app import app as server

if __name__ == "__main__":
    cfg = parse_config(json.loads(sys.argv[1]))
    nodes = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    server.run_server(InProcessGrid(client_app, nodes, cfg.to_dict()), cfg)
