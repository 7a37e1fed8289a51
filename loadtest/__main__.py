"""``python -m loadtest COMMAND``: see ``--help``."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time

import httpx

from . import driver, workloads
from . import compare_cli, simulate_cli
from .cluster import LocalCluster


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def cmd_cluster(args: argparse.Namespace) -> int:
    # SIGTERM (a supervisor, `kill`, docker stop) ends the cluster as Ctrl-C does: every
    # process it started is stopped on the way out of the `with` below.
    signal.signal(signal.SIGTERM, _interrupt)
    engine = "torch" if args.model else args.engine
    replica_args = ["--engine", engine, *(["--model", args.model] if args.model else []),
                    *shlex.split(args.replica_args)]
    what = f"replicas of {args.model}" if args.model else f"{engine} replicas"
    print(f"starting {args.replicas} {what} and a router (policy {args.policy}) ...",
          flush=True)
    with LocalCluster(args.replicas, args.policy, replica_args,
                      router_port=args.port or None) as c:
        url = c.router.url
        print(f"router     {url}   (dashboard {url}/dashboard, stats {url}/stats)")
        for r in c.replicas:
            print(f"replica    {r.url}")
        demo = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16})
        body = demo.json()
        print(f"\nPOST /v1/chat/completions -> {demo.status_code} via "
              f"{demo.headers.get('x-replica')}:\n{json.dumps(body, indent=2)}")
        print(f"\ntry: curl {url}/v1/chat/completions -H 'content-type: application/json' "
              "-d '{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'")
        try:
            if args.seconds is not None:
                time.sleep(args.seconds)
                return 0
            print("Ctrl-C (or SIGTERM) stops the cluster.", flush=True)
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    try:
        return driver.run_command(args)
    except (ValueError, OSError, RuntimeError) as exc:  # bad flags, files, or server
        print(f"loadtest run: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("cluster", help="run a local router with replicas until Ctrl-C")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--engine", choices=["sim", "torch"], default="sim")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="a Hugging Face checkpoint directory: torch replicas serving it")
    p.add_argument("--policy", default="prefix")
    p.add_argument("--port", type=int, default=8000, help="router port (0: any free port)")
    p.add_argument("--replica-args", default="", help="extra replica flags, one string")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long")
    p.set_defaults(func=cmd_cluster)
    p = sub.add_parser("run", help="drive a workload against an OpenAI-compatible URL, "
                       "print a report and write it as JSON (see loadtest/report.py)")
    workloads.add_workload_arguments(p)
    driver.add_driver_arguments(p)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("simulate", help="compare policies in the discrete-event simulator "
                       "(no HTTP): hit rate, TTFT, imbalance, pooled and infinite bounds",
                       description=simulate_cli.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    simulate_cli.add_arguments(p)
    p.set_defaults(func=simulate_cli.run)
    p = sub.add_parser("compare", help="policies side by side on live local clusters: JSON, "
                       "a markdown table and PNG plots", description=compare_cli.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    compare_cli.add_arguments(p)
    p.set_defaults(func=compare_cli.run)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
