"""``trainyard card REF``: print a model's card (what evaluate wrote: docs/pipeline.md, "The
model card"), Markdown or with ``--json`` JSON, to stdout.

REF is ``models:/NAME@ALIAS``, ``models:/NAME/VERSION``, ``runs:/RUN_ID`` (the card logged in
that version's run) or a path: an exported ``.onnx`` (the card beside it,
``model.card.md``) or a card file itself. Exit codes: 0 printed, 1 no card (the message
says why: a model evaluated before cards, a bad reference, a registry failure).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from trainyard.commands import Command, RegistryOnDemand, Subparsers, command_parser
from trainyard.core.errors import TrainyardError
from trainyard.core.model_ref import ModelRegistry, parse_model_ref
from trainyard.runtime.model_file import card_beside

HELP = "print a model's card: what it is, its data, scores, weak classes, how to call it"
PRINTED, NO_CARD = 0, 1


def add_parser(subparsers: Subparsers) -> None:
    """``trainyard card REF [--json]``."""
    p = command_parser(subparsers, "card", HELP, CmdCard)
    p.add_argument(
        "ref",
        metavar="REF",
        help="models:/NAME@ALIAS, models:/NAME/N, runs:/RUN_ID, an exported .onnx (its card "
        "beside it) or a card file",
    )
    p.add_argument("--json", action="store_true", help="the card as JSON, not Markdown")


class CmdCard(Command):
    def run(self) -> int:
        """0 printed, 1 no card (its message on stderr)."""
        kind = "json" if self.args.json else "md"
        try:
            text = card_text(self.args.ref, kind, RegistryOnDemand())
        except FileNotFoundError as err:
            print(f"trainyard card: no card for this model: {err}", file=sys.stderr)
            return NO_CARD
        except TrainyardError as err:
            print(f"trainyard card: error: {err}", file=sys.stderr)
            return NO_CARD
        sys.stdout.write(text)
        return PRINTED


def card_text(spec: str, kind: str, registry: ModelRegistry) -> str:
    """The card ``spec`` names, as ``kind`` (md or json); FileNotFoundError naming the file
    a path's card would be, a TrainyardError from the registry."""
    ref = parse_model_ref(spec, "REF")
    if ref.from_registry:
        with tempfile.TemporaryDirectory(prefix="trainyard-card-") as cache:
            return registry.fetch_card(ref, Path(cache), kind).read_text(encoding="utf-8")
    assert ref.path is not None
    path = ref.path if ref.path.suffix in (".md", ".json") else card_beside(ref.path, kind)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (evaluate writes it: `dvc repro evaluate`)")
    return path.read_text(encoding="utf-8")
