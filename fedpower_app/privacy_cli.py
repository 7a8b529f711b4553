"""``fedpower-privacy``: calibrate the DP noise of a fedpower run and print its epsilon trajectory.

Examples::

    fedpower-privacy --method fedpower --level sample --epsilon 3 --rounds 200 \\
        --client-rate 0.5 --num-clients 6 --dataset-size 67349 --batch-size 128 --local-steps 1
    fedpower-privacy --method fedpower --level client --epsilon 3 --rounds 200 \\
        --client-rate 0.5 --num-clients 6 --json
    fedpower-privacy ... --noise-multiplier 0.8        # epsilon of a fixed z instead of calibrating

Exit codes: 0 success, 2 invalid input (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional, Sequence

from fedpower_app import accounting as acc


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # raise instead of sys.exit so main() can return 2
        raise _ArgError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="fedpower-privacy",
        description="Calibrate the Gaussian noise of a fedpower run (corrected accounting) and "
                    "report the epsilon trajectory.",
    )
    p.add_argument("--method", default="fedpower", help=f"one of {list(acc.METHODS)} (default fedpower)")
    p.add_argument("--level", default="sample", help="sample or client (default sample)")
    p.add_argument("--epsilon", type=float, required=True, help="target epsilon")
    p.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    p.add_argument("--rounds", type=int, required=True, help="number of rounds T")
    p.add_argument("--client-rate", type=float, required=True, help="Poisson client sampling rate q_c")
    p.add_argument("--num-clients", type=int, required=True, help="number of clients N")
    sizes = p.add_mutually_exclusive_group()
    sizes.add_argument("--client-sizes", default=None, help="comma-separated client dataset sizes n_i")
    sizes.add_argument("--dataset-size", type=int, default=None,
                       help="total training examples, split equally over --num-clients")
    p.add_argument("--batch-size", type=int, default=128, help="expected local batch size b (default 128)")
    p.add_argument("--local-steps", type=int, default=1, help="local steps L per round (default 1)")
    p.add_argument("--clip", type=float, default=1.0, help="server clip norm C (default 1.0)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r (default 8)")
    p.add_argument("--num-modules", type=int, default=1, help="number of adapted modules M (default 1)")
    p.add_argument("--refactor-every", type=int, default=1, help="FedPower refactor period F (default 1)")
    p.add_argument("--sample-mode", default="two-stage", help="two-stage (default, rigorous) or product")
    p.add_argument("--accountant", default="rdp", help="rdp (default, opacus) or pld (dp_accounting)")
    p.add_argument("--calibration", default="rigorous", help="rigorous (default) or paper")
    p.add_argument("--pld-interval", type=float, default=acc.DEFAULT_PLD_INTERVAL,
                   help=f"PLD value discretisation interval (default {acc.DEFAULT_PLD_INTERVAL:g})")
    p.add_argument("--noise-multiplier", type=float, default=None,
                   help="report epsilon for this effective z instead of calibrating "
                        "(with --calibration paper: the paper's sigma_alg)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--every", type=int, default=10, help="trajectory print stride (default 10)")
    return p


def _sizes(args) -> Optional[list]:
    if args.client_sizes is not None:
        try:
            out = [int(x) for x in args.client_sizes.replace(" ", "").split(",") if x != ""]
        except ValueError:
            raise ValueError(f"--client-sizes must be a comma-separated list of integers, got {args.client_sizes!r}")
        if not out:
            raise ValueError("--client-sizes is empty")
        return out
    if args.dataset_size is not None:
        if args.num_clients is None or args.num_clients <= 0:
            raise ValueError(f"num_clients must be a positive integer, got {args.num_clients!r}")
        if args.dataset_size < args.num_clients:
            raise ValueError(f"--dataset-size ({args.dataset_size}) must be >= --num-clients ({args.num_clients})")
        d, n = args.dataset_size, args.num_clients
        return [d // n + (1 if i < d % n else 0) for i in range(n)]
    return None


def make_plan(args) -> acc.PrivacyPlan:
    acc._norm_name(args.method, acc.METHODS, "method")
    level = acc._norm_name(args.level, acc.LEVELS, "level")
    sizes = _sizes(args)
    if level == "sample" and sizes is None:
        raise ValueError("sample level needs --client-sizes or --dataset-size")
    return acc.PrivacyPlan(
        method=args.method, level=level, epsilon=args.epsilon, delta=args.delta,
        num_rounds=args.rounds, client_rate=args.client_rate, num_clients=args.num_clients,
        client_sizes=sizes, batch_size=args.batch_size, local_steps=args.local_steps, clip=args.clip,
        rank=args.rank, num_modules=args.num_modules, refactor_every=args.refactor_every,
        sample_mode=args.sample_mode, accountant=args.accountant, calibration=args.calibration,
        pld_interval=args.pld_interval,
    )


def run(plan: acc.PrivacyPlan, noise_multiplier: Optional[float]) -> acc.Calibration:
    if noise_multiplier is None:
        return acc.calibrate(plan)
    if plan.calibration == "paper":
        return acc.epsilon_for_sigma_alg(plan, noise_multiplier)
    return acc.epsilon_for_noise_multiplier(plan, noise_multiplier)


def _fmt(x: Optional[float], nd: int = 6) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{nd}g}"


def render(plan: acc.PrivacyPlan, cal: acc.Calibration, every: int) -> str:
    L = []
    mode = f" ({plan.sample_mode})" if plan.level == "sample" else ""
    L.append(f"fedpower-privacy: method={plan.method}, {plan.level} level{mode}, "
             f"accountant={plan.accountant}, calibration={cal.mode}")
    L.append("inputs:")
    L.append(f"  target epsilon={_fmt(plan.epsilon)}  delta={plan.delta:g}  rounds T={plan.num_rounds}  "
             f"client rate q_c={_fmt(plan.client_rate)}  clients N={plan.num_clients}")
    L.append(f"  clip C={_fmt(plan.clip)}  rank r={plan.rank}  modules M={plan.num_modules}  "
             f"refactor every F={plan.refactor_every}")
    if plan.level == "sample":
        sz = plan.client_sizes
        L.append(f"  client sizes: {len(sz)} clients, min {min(sz)}, max {max(sz)}, total {sum(sz)}; "
                 f"batch b={plan.batch_size}, local steps L={plan.local_steps}")
        L.append(f"  q_s = b/min(n_i) = {_fmt(plan.q_s)}   pi = 1-(1-q_s)^L = {_fmt(plan.pi)}   "
                 f"q_c*pi = {_fmt(plan.client_rate * plan.pi)}")
    L.append("schedule: " + ", ".join(f"{rt} x{n}" for rt, n in cal.schedule_counts.items()))
    if cal.mode == "paper":
        L.append(f"paper sigma_alg = {_fmt(cal.sigma_alg)} (per-entry noise std sigma_alg*C on every block)")
        L.append("effective noise multiplier per round type (worst case k=1): "
                 + ", ".join(f"{rt} z={_fmt(z)}" for rt, z in cal.z_per_round_type.items()))
    else:
        what = "calibrated" if cal.mode == "rigorous" else "given"
        L.append(f"effective noise multiplier z = {_fmt(cal.z)} ({what}; the same in every round)")
    L.append("noise std per block (per entry):")
    for rt, stds in cal.noise_std.items():
        names = acc.BLOCK_NAMES[rt]
        sens = acc.block_sensitivities(rt, plan.level, plan.clip, k=None, rank=plan.rank,
                                       num_modules=plan.num_modules)
        blocks = ", ".join(f"{n}: s={_fmt(s)} (Delta={_fmt(d)})" for n, s, d in zip(names, stds, sens))
        extra = ""
        if plan.level == "sample" and rt not in ("powerdp", "output"):
            extra = ("   [at k=1; the server divides by the realised k]" if cal.mode != "paper"
                     else "   [fixed; Delta shown at k=1]")
        L.append(f"  {rt:8s} {blocks}{extra}")
    L.append(f"epsilon trajectory (delta={plan.delta:g}, {cal.trajectory_accountant}):")
    T = len(cal.trajectory)
    stride = max(1, int(every))
    shown = sorted(set([1] + list(range(stride, T + 1, stride)) + [T]))
    for t in shown:
        L.append(f"  t={t:<6d} epsilon={cal.trajectory[t - 1]:.4f}")
    if cal.mode == "paper":
        L.append(f"claimed epsilon {_fmt(plan.epsilon)}; TRUE epsilon after T={plan.num_rounds}: "
                 f"{cal.epsilon:.4f} ({cal.accountant})")
    else:
        L.append(f"epsilon after T={plan.num_rounds}: {cal.epsilon:.4f} ({cal.accountant}; target {_fmt(plan.epsilon)})")
    if cal.accountant == "pld":
        L.append(f"  (RDP for comparison: {cal.epsilon_rdp:.4f})")
    L.append(f"valid DP guarantee: {'yes' if cal.is_valid_guarantee else 'NO'} -- {cal.label}")
    for n in cal.notes:
        L.append(f"note: {n}")
    return "\n".join(L)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except _ArgError as e:
        print(f"fedpower-privacy: error: {e}", file=sys.stderr)
        parser.print_usage(sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    try:
        if args.every <= 0:
            raise ValueError(f"--every must be a positive integer, got {args.every}")
        plan = make_plan(args)
        cal = run(plan, args.noise_multiplier)
    except ValueError as e:
        print(f"fedpower-privacy: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"plan": plan.to_dict(), "pi": plan.pi, "calibration": cal.to_dict()},
                         allow_nan=False))
    else:
        print(render(plan, cal, args.every))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
