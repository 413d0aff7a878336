"""``trainyard rollback``: move a registered model's `champion` back to the version it
replaced (docs/serving.md, "Promote and roll back"); printed as ``trainyard promote`` prints
a move. Exit codes: 0 moved back, 1 the registry failed, 2 refused (nothing to go back to).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainyard.commands import Command, Subparsers, command_parser
from trainyard.commands.promote import report_move
from trainyard.stages.runner import configure_logging

HELP = "move a registered model's champion alias back to the one it replaced"


def add_parser(subparsers: Subparsers) -> None:
    """``trainyard rollback NAME [--reason TEXT]``."""
    p = command_parser(subparsers, "rollback", HELP, CmdRollback)
    p.add_argument("name", metavar="NAME", help="the registered model")
    p.add_argument("--reason", default="", help="why: recorded on the version")
    p.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file")


class CmdRollback(Command):
    def run(self) -> int:
        """0 moved back, 1 a registry failure, 2 refused."""
        configure_logging("rollback")

        def move() -> dict[str, Any]:
            from trainyard.track import promotion  # MLflow: only when a model moves

            client, _ = promotion.registry_client()
            return promotion.rollback(client, self.args.name, reason=self.args.reason)

        return report_move("rollback", move, self.args.params)
