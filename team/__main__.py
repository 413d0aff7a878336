"""``python -m team up|down|env`` (``make team-up`` / ``make team-down``): a local team
stack of the real servers a team runs, for trying trainyard as a team (docs/team.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from team.postgres import StackError
from team.stack import Ports, Stack, down, up


def describe(stack: Stack) -> str:
    """The URLs, and what each teammate sets (their env file) and runs once per clone."""
    first = stack.users[0]
    lines = [
        f"MLflow (sign in)   {stack.mlflow_uri}        users: {', '.join(stack.users)}",
        f"PostgreSQL         127.0.0.1:{stack.ports.postgres}  (MLflow's store; Optuna: "
        f"tune.storage={stack.optuna_url})",
        f"DVC remote (SSH)   {stack.dvc_remote}",
        "",
        f"A teammate ({first}; passwords in {stack.folder}/<user>.env, mode 600):",
        f"  . {stack.folder}/{first}.env     # MLFLOW_TRACKING_URI/USERNAME/PASSWORD, PGPASSWORD",
        f"  dvc remote add -d team {stack.dvc_remote}",
        f"  dvc remote modify --local team keyfile {stack.ssh_key}   # .dvc/config.local",
        "  make run && dvc push",
        "",
        "Stop: make team-down (TEAM_ARGS=--purge deletes the data too)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m team", description=__doc__)
    parser.add_argument("command", choices=("up", "down"))
    parser.add_argument("--dir", type=Path, default=Path(".team"), help="the stack's folder")
    parser.add_argument("--purge", action="store_true", help="down: delete the data too")
    parser.add_argument("--postgres-port", type=int, default=Ports.postgres)
    parser.add_argument("--mlflow-port", type=int, default=Ports.mlflow)
    parser.add_argument("--ssh-port", type=int, default=Ports.ssh)
    args = parser.parse_args(argv)
    try:
        if args.command == "down":
            down(args.dir, purge=args.purge)
            print(f"team stack in {args.dir} stopped" + (" and deleted" if args.purge else ""))
            return 0
        ports = Ports(args.postgres_port, args.mlflow_port, args.ssh_port)
        print(describe(up(args.dir, ports)))
    except StackError as err:
        print(f"team {args.command}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
