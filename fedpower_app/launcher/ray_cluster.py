"""Ray clusters under the simulation engine.

**Joining an existing cluster.** ``fedpower-run --ray-address HOST:PORT`` (or ``RAY_ADDRESS`` in the
environment) runs the simulation's ClientApps on an existing Ray cluster: the address goes to the
SuperLink's environment as ``RAY_ADDRESS``, so Flower's Ray backend (``ray.init()`` with no address,
``flwr/server/superlink/fleet/vce/backend/raybackend.py``) in ``flwr-simulation`` joins it, and
Flower places one ClientApp actor per ``--cpus-per-client`` CPUs of every node. ``auto`` joins the
cluster that ``ray start`` started last on this host. Without an address the simulation gets a
private Ray instance (``RAY_ADDRESS=local``): never a cluster that someone else's ``ray start`` (or
a stale ``/tmp/ray/ray_current_cluster``) left on the machine, which plain ``ray.init()`` would join
silently.

Ray refuses resource arguments on connect ("When connecting to an existing cluster, num_cpus and
num_gpus must not be provided", ``ray/_private/worker.py``): ``--ray-cpus``/``--ray-gpus`` (Flower's
``init-args-num-cpus/num-gpus``) size the private instance only, and are refused with
``--ray-address`` before anything starts. A cluster's nodes get their resources from ``ray start
--num-cpus/--num-gpus``.

**A multi-node cluster on one host** (:class:`LocalRayCluster`, the CLI below): a head and worker
raylets as separate processes, each with its own resources (``ray.cluster_utils.Cluster``), in a
private Ray temp dir, so that no other ``ray.init()`` on the machine finds it; stopped by PID. It is
how the multi-node path is rehearsed and tested on one machine (``tests/test_ray_cluster.py``,
BENCHMARKS.md "Multi-node Ray simulation"):

    python -m fedpower_app.launcher.ray_cluster --nodes 3 --cpus-per-node 1 -- \\
        fedpower-run --preset conf/tiny.toml --supernodes 3 --set dp.noise='"seeded"'

It starts the cluster, runs the command with ``RAY_ADDRESS`` set to it, prints on which nodes the
ClientApps ran (Ray's task events, read from the GCS: no dashboard needed), stops the cluster and
exits with the command's exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from ..config import ConfigError

RAY_ADDRESS_ENV = "RAY_ADDRESS"
CLIENTAPP_TASK = "ClientAppActor.run"  # flwr/simulation/ray_transport/ray_actor.py: one call per message


def ray_address_from(flag: str | None, environ=None) -> str | None:
    """The cluster to join: the flag, else ``RAY_ADDRESS``; None (or ``local``) means a private instance."""
    environ = os.environ if environ is None else environ
    value = (flag if flag is not None else environ.get(RAY_ADDRESS_ENV, "")).strip()
    return None if value in ("", "local") else value


def resolve_ray_address(address: str | None, *, probe: bool = True, timeout: float = 5.0) -> str | None:
    """``host:port`` of the cluster's GCS, checked to answer; ``auto`` resolved as Ray resolves it.
    Raises ConfigError with what to do instead."""
    if address is None:
        return None
    if "://" in address:
        raise ConfigError(f"--ray-address {address}: Ray Client addresses (ray://) are not supported; run "
                          "fedpower-run on a node of the cluster with --ray-address <head-ip>:<gcs-port> (6379 "
                          "for `ray start --head`)")
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address_or_die

        try:
            address = canonicalize_bootstrap_address_or_die("auto")
        except (ConnectionError, ValueError) as exc:
            raise ConfigError(f"--ray-address auto: {exc}") from None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray-address {address!r}: expected HOST:PORT of the cluster's head (the GCS port, "
                          "6379 for `ray start --head`), or 'auto'")
    if probe:
        try:
            socket.create_connection((host, int(port)), timeout=timeout).close()
        except OSError as exc:
            raise ConfigError(f"--ray-address {address}: no Ray cluster answers there ({exc}); start its head with "
                              f"`ray start --head --port={port}`, or leave out --ray-address (and RAY_ADDRESS) to "
                              "run on a private Ray instance") from None
    return f"{host}:{port}"


def check_ray_resources(address: str | None, ray_cpus: float | None, ray_gpus: float | None) -> None:
    """``--ray-cpus/--ray-gpus`` size the private instance; Ray refuses them when joining a cluster."""
    given = [name for name, value in (("--ray-cpus", ray_cpus), ("--ray-gpus", ray_gpus)) if value is not None]
    if address is not None and given:
        raise ConfigError(
            f"{' and '.join(given)} cannot be used with --ray-address {address} (or RAY_ADDRESS): they size the Ray "
            "instance fedpower-run starts itself, and Ray refuses num_cpus/num_gpus when joining an existing cluster "
            "(\"When connecting to an existing cluster, num_cpus and num_gpus must not be provided\"). Give each node "
            "its resources when it joins (`ray start --address=<head>:6379 --num-cpus=N --num-gpus=G`), or leave out "
            "--ray-address to run on a private Ray instance")
    for name, value in (("--ray-cpus", ray_cpus), ("--ray-gpus", ray_gpus)):
        if value is not None and (value < 0 or not float(value).is_integer()):
            raise ConfigError(f"{name} must be a whole number >= 0 (Flower passes it to ray.init as an integer), "
                              f"got {value:g}")
    if ray_cpus is not None and ray_cpus < 1:
        raise ConfigError("--ray-cpus must be >= 1: the ClientApp actors need CPUs")


def ray_env(address: str | None) -> dict[str, str]:
    """The environment that makes ``flwr-simulation`` join ``address`` (or start a private instance)."""
    return {RAY_ADDRESS_ENV: address or "local"}


def cluster_nodes(address: str) -> list[dict]:
    """The live nodes of the cluster at ``address`` (GCS ``host:port``): node id, address and
    resources, read from the GCS without joining the cluster as a driver."""
    import ray._private.state as ray_state
    from ray._raylet import GcsClientOptions

    state = ray_state.GlobalState()
    state._initialize_global_state(GcsClientOptions.create(address, None, allow_cluster_id_nil=True,
                                                           fetch_cluster_id_if_nil=False))
    try:
        return [{"node_id": n["NodeID"], "address": n.get("NodeManagerAddress"),
                 "resources": dict(n.get("Resources") or {})} for n in state.node_table() if n.get("Alive")]
    finally:
        state.disconnect()


def actors_that_fit(nodes: list[dict], cpus_per_client: float, gpus_per_client: float) -> int:
    """ClientApp actors Flower will place on these nodes (``pool_size_from_resources``: per node,
    ⌊CPU / num_cpus⌋, and ⌊GPU / num_gpus⌋ when GPUs are asked for)."""
    total = 0
    for node in nodes:
        res = node["resources"]
        n = int(res.get("CPU", 0) / cpus_per_client)
        if gpus_per_client > 0:
            n = min(n, int(res.get("GPU", 0) / gpus_per_client))
        total += n
    return total


def describe_cluster(address: str, cpus_per_client: float, gpus_per_client: float) -> str:
    """One line on the cluster a run joins; raises ConfigError if no node can host a ClientApp."""
    nodes = cluster_nodes(address)
    fit = actors_that_fit(nodes, cpus_per_client, gpus_per_client)
    cpus = sum(n["resources"].get("CPU", 0) for n in nodes)
    gpus = sum(n["resources"].get("GPU", 0) for n in nodes)
    if fit == 0:
        raise ConfigError(f"the Ray cluster at {address} ({len(nodes)} node(s), {cpus:g} CPUs, {gpus:g} GPUs) has no "
                          f"node with --cpus-per-client {cpus_per_client:g} CPU(s)"
                          + (f" and --gpus-per-client {gpus_per_client:g} GPU" if gpus_per_client else "")
                          + " free: no ClientApp could run")
    return (f"Ray cluster at {address}: {len(nodes)} node(s), {cpus:g} CPUs, {gpus:g} GPUs; room for {fit} "
            f"ClientApp actor(s)")


def clientapp_placement(address: str, *, timeout: float = 30.0) -> dict[str, int]:
    """{Ray node id: number of ClientApp calls (messages) it ran to completion} on the cluster at
    ``address``, from the task events the GCS keeps (``ClientAppActor.run``); no dashboard needed."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    request = gcs_service_pb2.GetTaskEventsRequest(limit=1_000_000)
    name_filter = gcs_service_pb2.GetTaskEventsRequest.Filters.TaskNameFilter(task_name=CLIENTAPP_TASK)
    request.filters.task_name_filters.append(name_filter)
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 512 * 1024 * 1024)]) as ch:
        reply = gcs_service_pb2_grpc.TaskInfoGcsServiceStub(ch).GetTaskEvents(request, timeout=timeout)
    from ray.core.generated import common_pb2

    finished = common_pb2.TaskStatus.Value("FINISHED")
    counts: Counter = Counter()
    for event in reply.events_by_task:
        update = event.state_updates
        if update.node_id and finished in update.state_ts_ns:
            counts[update.node_id.hex()] += 1
    return dict(counts)


class LocalRayCluster:
    """A Ray cluster of ``nodes`` nodes on this host: the head and ``nodes - 1`` worker raylets, each a
    separate set of processes with ``cpus_per_node`` CPUs (``ray.cluster_utils.Cluster``).

    Its Ray temp dir is private (``RAY_TMPDIR``, set in this process while the cluster runs: Ray
    writes the cluster's address to ``<temp>/ray/ray_current_cluster``, where every plain
    ``ray.init()`` on the machine would otherwise find and join it). The temp dir is short, since
    Ray's Unix socket paths live under it. ``stop()`` kills the cluster's processes by PID
    (``Cluster.shutdown``) and removes the temp dir (kept with ``keep_logs``).
    """

    def __init__(self, nodes: int = 3, cpus_per_node: float = 1, *, gpus_per_node: float = 0,
                 object_store_mb: int = 100) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self.nodes, self.cpus_per_node, self.gpus_per_node = nodes, cpus_per_node, gpus_per_node
        self.object_store_mb = object_store_mb
        self.cluster = None
        self.temp_dir: str | None = None
        self._saved_tmpdir: str | None = None

    @property
    def address(self) -> str:
        assert self.cluster is not None, "not started"
        return self.cluster.address

    @property
    def node_ids(self) -> list[str]:
        assert self.cluster is not None, "not started"
        return [node.node_id for node in self.cluster.list_all_nodes()]

    def start(self, timeout: float = 120.0) -> "LocalRayCluster":
        self.temp_dir = tempfile.mkdtemp(prefix="fpray-", dir="/tmp")
        self._saved_tmpdir = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = self.temp_dir
        from ray.cluster_utils import Cluster

        args = {"num_cpus": self.cpus_per_node, "num_gpus": self.gpus_per_node,
                "object_store_memory": self.object_store_mb * 1024 * 1024}
        try:
            self.cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False},
                                   shutdown_at_exit=True)
            for _ in range(self.nodes - 1):
                self.cluster.add_node(**args)
            self.cluster.wait_for_nodes(timeout=timeout)
        except BaseException:
            self.stop(keep_logs=True)
            raise
        return self

    def stop(self, *, keep_logs: bool = False) -> None:
        if self.cluster is not None:
            try:
                self.cluster.shutdown()
            finally:
                self.cluster = None
        if self._saved_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = self._saved_tmpdir
        if self.temp_dir and not keep_logs:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "LocalRayCluster":
        return self.start() if self.cluster is None else self

    def __exit__(self, *exc) -> None:
        self.stop(keep_logs=exc[0] is not None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m fedpower_app.launcher.ray_cluster",
                                description="Start a multi-node Ray cluster on this host, run a command "
                                            "against it (RAY_ADDRESS), report where the ClientApps ran, stop it.",
                                usage="%(prog)s [--nodes N] [--cpus-per-node C] [--json OUT] -- COMMAND ...")
    p.add_argument("--nodes", type=int, default=3, help="Ray nodes: the head and N-1 workers (default 3)")
    p.add_argument("--cpus-per-node", type=float, default=1, help="CPUs of each node (default 1)")
    p.add_argument("--json", help="write the cluster, the command's exit code and the ClientApp placement here")
    args = p.parse_args(argv[:split])
    cmd = argv[split + 1:]
    if not cmd:
        p.error("no command after --")
    cluster = LocalRayCluster(args.nodes, args.cpus_per_node)
    t0 = time.monotonic()
    cluster.start()
    code, placement = 1, {}
    info = {"address": cluster.address, "node_ids": cluster.node_ids}
    try:
        print(f"ray_cluster: {args.nodes} node(s) of {args.cpus_per_node:g} CPU at {cluster.address} (started in "
              f"{time.monotonic() - t0:.1f} s); nodes {', '.join(cluster.node_ids)}", flush=True)
        env = {**os.environ, RAY_ADDRESS_ENV: cluster.address}
        try:
            code = subprocess.call(cmd, env=env)
        except KeyboardInterrupt:
            code = 130
        placement = clientapp_placement(cluster.address)
        used = ", ".join(f"{node}: {n}" for node, n in sorted(placement.items())) or "none"
        print(f"ray_cluster: ClientApp calls per Ray node ({len(placement)} of {args.nodes} node(s) ran ClientApps): "
              f"{used}", flush=True)
    finally:
        cluster.stop(keep_logs=code != 0)
    if args.json:
        Path(args.json).expanduser().write_text(json.dumps(
            {**info, "nodes": args.nodes, "cpus_per_node": args.cpus_per_node, "exit_code": code,
             "clientapp_calls_per_node": placement}, indent=1))
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
