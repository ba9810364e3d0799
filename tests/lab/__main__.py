"""`python -m tests.lab up|down|status|images|env`: the Slurm test lab by hand."""

from __future__ import annotations

import argparse
import sys
import time

from tests.lab import cluster
from tests.lab.config import LabConfig, Paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.lab", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="(re)build the lab; tears down an earlier instance first")
    up.add_argument("--nodes", type=int, default=3, help="compute nodes (default 3)")
    up.add_argument("--ipv6-only", action="store_true", help="Slurm over IPv6, no IPv4 on the nodes")
    up.add_argument("--grace-time", type=int, default=0, help="GraceTime of the preemptable `debug` partition")
    up.add_argument("--preempt-send-user-signal", action="store_true",
                    help="preemption delivers the job's --signal (SlurmctldParameters)")
    up.add_argument("--no-images", action="store_true", help="do not build/check the container images")
    sub.add_parser("down", help="stop every daemon, remove namespaces, links and state")
    sub.add_parser("status", help="show whether a lab is up and its nodes")
    sub.add_parser("images", help="build (or reuse cached) Podman image and Apptainer SIF")
    sub.add_parser("env", help="print the shell exports a Slurm client needs (eval \"$(... env)\")")
    sub.add_parser("packages", help="install the Debian packages the lab needs (root)")
    args = p.parse_args(argv)
    paths = Paths()
    if args.cmd == "up":
        from tests.lab.packages import ensure_packages

        ensure_packages()
        if not args.no_images:
            from tests.lab.containers import ensure_images

            ensure_images()
        cfg = LabConfig(nodes=args.nodes, ipv6_only=args.ipv6_only, grace_time=args.grace_time,
                        preempt_send_user_signal=args.preempt_send_user_signal)
        t0 = time.monotonic()
        cluster.up(cfg, paths)
        print(f"lab up: {cfg.nodes} nodes ({'IPv6 only' if cfg.ipv6_only else 'IPv4+IPv6'}) "
              f"in {time.monotonic() - t0:.2f} s; export SLURM_CONF={paths.slurm_conf}")
    elif args.cmd == "down":
        t0 = time.monotonic()
        cluster.down(paths)
        left = cluster.leftovers(paths)
        print(f"lab down in {time.monotonic() - t0:.2f} s" + (f"; LEFT BEHIND: {left}" if left else ""))
        return 1 if left else 0
    elif args.cmd == "status":
        cfg = cluster.running_config(paths)
        if cfg is None:
            print("lab: down")
            return 1
        res = cluster.sh("sinfo", "-N", "-o", "%N %P %t", check=False, env={**__import__("os").environ, **paths.env()})
        print(f"lab: up, {cfg.nodes} nodes, ipv6_only={cfg.ipv6_only}, grace_time={cfg.grace_time}\n{res.stdout}{res.stderr}")
    elif args.cmd == "images":
        from tests.lab.containers import ensure_images

        ensure_images(verbose=True)
    elif args.cmd == "env":
        for k, v in paths.env().items():
            print(f"export {k}={v}")
    elif args.cmd == "packages":
        from tests.lab.packages import ensure_packages

        ensure_packages(verbose=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
