"""``python -m fedpower_app.launcher.measure``: run a command (``fedpower-run ...``) and measure it:
wall time, the start-up cost, the time of every round and per sampled client (from the round lines
the ServerApp prints), and the memory of the whole process tree (RSS and PSS summed over the
command and every descendant, sampled every ``--interval`` seconds).

    python -m fedpower_app.launcher.measure --json /tmp/ray-1000.json -- \\
        fedpower-run --preset conf/cross-device-sst2.toml --supernodes 1000 --set num-server-rounds=3

* **Process tree.** The command and everything below it (psutil ``children(recursive=True)``):
  with ``fedpower-run`` on the Ray engine that is the SuperLink, SuperExec, ``flwr-simulation`` (the
  ServerApp), the local Ray instance (GCS, raylet, agents) and every ClientApp actor. Processes
  orphaned on the way come back to ``fedpower-run`` (a child subreaper), so they stay counted.
  The Ray processes of an *existing* cluster (``--ray-address``) are not descendants and are not
  counted.
* **RSS vs PSS.** RSS counts a shared page in every process that maps it (torch's libraries in each
  actor), so the RSS sum overstates what the machine holds; PSS splits shared pages between their
  users, and its sum is the tree's real share of RAM. Both are recorded; the peak of each is the
  maximum of its sums over the samples.
* **Rounds.** ``[round r/T ...] ... | clients K sent ... | round S s | elapsed E s``: S is the
  round's wall time (training, release, evaluation), K the clients sampled. The start-up cost is
  the time from the command's start to the start of round 1 (the wall clock at round 1's line
  minus S): processes, Ray, actors, the size query to every client, the initial evaluation.

The JSON holds every sample and round, the load average at start and end, and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROUND_RE = re.compile(r"\[round (?P<round>\d+)/(?P<total>\d+)[^\]]*\].*?\|\s*round (?P<seconds>[0-9.]+) s")
SAMPLED_RE = re.compile(r"clients (?P<sampled>\d+) (?:sent|sampled)")
GRID_RE = re.compile(r"in-process grid: \d+/(?P<n>\d+) train messages")


def _role(proc) -> str:
    """A short name for a process of the tree (for the peak breakdown)."""
    try:
        name = proc.name()
        cmd = " ".join(proc.cmdline()[:3])
    except Exception:  # gone, or no access
        return "?"
    if name.startswith("ray::"):
        return name
    for key in ("flwr-simulation", "flower-superlink", "flower-superexec", "flwr-serverapp", "flwr-clientapp",
                "gcs_server", "raylet", "dashboard", "runtime_env", "log_monitor", "fedpower-run", "fedpower_app"):
        if key in name or key in cmd:
            return key
    return name


def sample_tree(root_pid: int, cpu: dict | None = None) -> tuple[int, int, int, dict[str, int]]:
    """(RSS sum, PSS sum, number of processes, RSS by role) of ``root_pid`` and its descendants.
    ``cpu``, if given, is updated with each process's CPU seconds so far ({pid: (role, seconds,
    {thread id: seconds} for the simulation process)})."""
    try:
        import psutil
    except ImportError as exc:  # a measuring tool's own dependency, not the product's
        raise SystemExit("fedpower_app.launcher.measure needs psutil: pip install -e '.[bench]'") from exc

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0, 0, {}
    rss = pss = 0
    roles: dict[str, int] = {}
    count = 0
    for proc in procs:
        try:
            info = proc.memory_full_info()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        except psutil.AccessDenied:
            try:
                info = proc.memory_info()
            except psutil.Error:
                continue
        count += 1
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
        role = _role(proc)
        roles[role] = roles.get(role, 0) + info.rss
        if cpu is not None:
            try:
                times = proc.cpu_times()
                seen_role, _, threads = cpu.get(proc.pid, (role, 0.0, {}))
                role = seen_role if role == "?" else role  # a process on its way out has no name
                if role == "flwr-simulation":
                    threads = {**threads, **{t.id: t.user_time + t.system_time for t in proc.threads()}}
                cpu[proc.pid] = (role, times.user + times.system, threads)
            except psutil.Error:
                pass
    return rss, pss, count, roles


def parse_rounds(lines: list[tuple[float, str]]) -> list[dict]:
    """The round lines of a run: round, seconds, clients sampled, and when (s after start) it was printed.
    A private client-level run withholds its cohort size from the round line; the in-process grid's
    progress lines (``k/N train messages``) still show it."""
    rounds = []
    cohort = None
    for t, line in lines:
        g = GRID_RE.search(line)
        if g:
            cohort = int(g.group("n"))
        m = ROUND_RE.search(line)
        if not m or m.group("round") == "0":
            continue
        s = SAMPLED_RE.search(line)
        rounds.append({"round": int(m.group("round")), "seconds": float(m.group("seconds")),
                       "sampled": int(s.group("sampled")) if s else cohort, "printed_at": round(t, 2)})
        cohort = None
    return rounds


def summarize(rounds: list[dict]) -> dict:
    """Per round and per sampled client, and the start-up cost (see the module docstring)."""
    out: dict = {}
    if not rounds:
        return out
    first = rounds[0]
    out["startup_seconds"] = round(first["printed_at"] - first["seconds"], 2)
    out["round_seconds"] = [r["seconds"] for r in rounds]
    per_client = [r["seconds"] / r["sampled"] for r in rounds if r.get("sampled")]
    if per_client:
        out["seconds_per_sampled_client"] = [round(x, 4) for x in per_client]
    return out


def measure(cmd: list[str], *, interval: float = 2.0, echo: bool = True, env: dict | None = None) -> dict:
    """Run ``cmd``, sample its process tree every ``interval`` seconds, return the measurement."""
    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    load_start = os.getloadavg()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            errors="replace", env=env)
    samples: list[list[float]] = []
    peak = {"rss": 0, "pss": 0, "rss_by_role": {}, "at": 0.0, "processes": 0}
    done = threading.Event()
    cpu: dict = {}

    def sampler() -> None:
        while not done.is_set():
            rss, pss, n, roles = sample_tree(proc.pid, cpu)
            t = time.monotonic() - t0
            if n:
                samples.append([round(t, 2), rss, pss, n])
                if pss > peak["pss"]:
                    peak.update(pss=pss, at=round(t, 2), processes=n, rss_by_role=roles)
                peak["rss"] = max(peak["rss"], rss)
            done.wait(interval)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    lines: list[tuple[float, str]] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - t0, line))
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()
        proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: let the command clean up after itself
            proc.terminate()
            proc.wait()
        done.set()
        thread.join(timeout=interval + 30)
    rounds = parse_rounds(lines)
    mib = 1024 * 1024
    cpu_by_role: dict[str, float] = {}
    threads: list[float] = []
    for role, seconds, per_thread in cpu.values():
        cpu_by_role[role] = cpu_by_role.get(role, 0.0) + seconds
        threads += per_thread.values()
    return {
        "command": cmd,
        "started": started,
        "exit_code": proc.returncode,
        "wall_seconds": round(time.monotonic() - t0, 2),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "cpus": os.cpu_count(),
        "rounds": rounds,
        **summarize(rounds),
        "peak_rss_mib": round(peak["rss"] / mib, 1),
        "peak_pss_mib": round(peak["pss"] / mib, 1),
        "peak_pss_at_seconds": peak["at"],
        "peak_pss_processes": peak["processes"],
        "rss_by_role_at_peak_mib": {k: round(v / mib, 1) for k, v in
                                    sorted(peak["rss_by_role"].items(), key=lambda kv: -kv[1])},
        # CPU seconds of each role, as last sampled (a process's CPU after its last sample is missed)
        "cpu_seconds_by_role": {k: round(v, 1) for k, v in sorted(cpu_by_role.items(), key=lambda kv: -kv[1])},
        # the busiest threads of flwr-simulation (ServerApp + Flower's simulation engine), CPU seconds
        "simulation_top_thread_cpu_seconds": [round(x, 1) for x in sorted(threads, reverse=True)[:4]],
        "samples": samples,  # [seconds, rss bytes, pss bytes, processes]
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m fedpower_app.launcher.measure [--interval S] [--json OUT] -- COMMAND ...",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m fedpower_app.launcher.measure",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--interval", type=float, default=2.0, help="seconds between memory samples (default 2)")
    p.add_argument("--json", help="write the measurement here")
    args = p.parse_args(argv[:split])
    cmd = argv[split + 1:]
    if not cmd:
        p.error("no command after --")
    result = measure(cmd, interval=args.interval)
    brief = {k: v for k, v in result.items() if k not in ("samples", "rounds", "command")}
    print("\nmeasure: " + json.dumps(brief), flush=True)
    if args.json:
        Path(args.json).expanduser().parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).expanduser().write_text(json.dumps(result, indent=1))
    return int(result["exit_code"] or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
