"""Start a multi-process training job on this machine with JAX's own runtime.

  python -m experiments.launch_local --processes 2 --devices-per-process 4 -- \
      --workdir runs/mp --preset tiny --steps 20 --strategy zero3

Starts P copies of `experiments.train` (or --module), each with D fake CPU devices, joined by
`jax.distributed.initialize` (coordinator on 127.0.0.1, gloo CPU collectives): one global mesh of
P*D devices. If any process fails, the others are stopped at once and the launcher exits with
that process's status and a one-line message, so a dead peer never leaves the job hanging.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from experiments.cli.config import Parser

PROG = "experiments.launch_local"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, required=True)
    p.add_argument("--devices-per-process", type=int, default=4)
    p.add_argument("--module", default="experiments.train", help="the entry point to run")
    p.add_argument("--heartbeat-s", type=int, default=30,
                   help="JAX's coordinator declares a silent process dead after this long")
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then the entry point's arguments")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.processes < 1:
        print(f"{PROG}: error: processes={args.processes}: must be a positive integer",
              file=sys.stderr)
        return 2
    if args.devices_per_process < 1:
        print(f"{PROG}: error: devices_per_process={args.devices_per_process}: must be a "
              f"positive integer", file=sys.stderr)
        return 2
    if args.heartbeat_s < 1:
        print(f"{PROG}: error: heartbeat_s={args.heartbeat_s}: must be a positive integer",
              file=sys.stderr)
        return 2
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(args.processes):
        env = dict(os.environ, SHARDQ_COORDINATOR=coordinator,
                   SHARDQ_NUM_PROCESSES=str(args.processes), SHARDQ_PROCESS_ID=str(i),
                   SHARDQ_HEARTBEAT_S=str(args.heartbeat_s))
        env.pop("XLA_FLAGS", None)
        cmd = [sys.executable, "-m", args.module, *rest,
               "--devices", str(args.devices_per_process)]
        if i > 0 and "--no-progress" not in cmd and args.module == "experiments.train":
            cmd.append("--no-progress")
        procs.append(subprocess.Popen(cmd, env=env))
    return _supervise(procs)


def _supervise(procs: list[subprocess.Popen]) -> int:
    """Wait for all; on the first failure stop the rest and report which process failed.

    One waiter thread per process queues each exit the moment the kernel reports it, so the
    process that failed first is the one named: when a peer is killed, the others abort inside
    gloo a few milliseconds later, and polling every few hundred ms would see both at once.
    """
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    for i, p in enumerate(procs):
        threading.Thread(target=lambda i=i, p=p: exits.put((i, p.wait())), daemon=True).start()
    try:
        for _ in procs:
            i, code = exits.get()
            if code == 0:
                continue
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.time() + 10
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    p.kill()
            print(f"{PROG}: error: process {i} exited with status {code}; stopped the other "
                  f"{len(procs) - 1}", file=sys.stderr)
            return code if code > 0 else 1
        return 0
    except KeyboardInterrupt:
        for p in procs:
            p.kill()
        raise


if __name__ == "__main__":
    sys.exit(main())
