"""``trainyard promote``: move a registered model's `champion` by hand, with the shadow's
evidence from the prediction log (docs/serving.md, "Promote and roll back"); what a move
prints is shared with ``trainyard rollback`` (trainyard.commands.rollback).

A version is promoted only after it ran as the service's shadow (``serve.shadow``) on at
least ``--min-rows`` logged requests (``serve.log_predictions``): its agreement with the
answering model and both latencies are recorded on it. ``--force`` promotes without them,
and records that it did. Exit codes: 0 moved, 1 the registry failed, 2 refused (with what
is missing and how to get it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.commands import Command, Subparsers, command_parser, serve_log_dir
from trainyard.core.config import load_params
from trainyard.core.errors import PromotionRefused, TrainyardError
from trainyard.core.model_ref import ModelRef, registered_alias, registered_version
from trainyard.stages.runner import configure_logging

MIN_ROWS = 200
HELP = "move a registered model's champion alias to a version that ran as the shadow"


def add_parser(subparsers: Subparsers) -> None:
    """``trainyard promote NAME (--version N | --from ALIAS) [...]``."""
    p = command_parser(subparsers, "promote", HELP, CmdPromote)
    p.add_argument("name", metavar="NAME", help="the registered model")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--version", type=int, metavar="N", help="the version to promote")
    which.add_argument(
        "--from", dest="from_alias", metavar="ALIAS", help="the version an alias points at"
    )
    p.add_argument("--reason", default="", help="why: recorded on the version")
    p.add_argument(
        "--force", action="store_true", help="promote without the shadow's figures (recorded)"
    )
    p.add_argument("--log", type=Path, help="the prediction log's folder (default serve.log_dir)")
    p.add_argument(
        "--min-rows",
        type=int,
        default=MIN_ROWS,
        help=f"logged requests the version must have shadowed (default {MIN_ROWS})",
    )
    p.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file")


class CmdPromote(Command):
    def run(self) -> int:
        """0 moved, 1 a registry failure, 2 refused."""
        configure_logging("promote")
        a = self.args

        if a.version is not None:
            target = registered_version(a.name, a.version, "--version")
        else:
            target = registered_alias(a.name, a.from_alias, "--from")

        def move() -> dict[str, Any]:
            return promote(
                target,
                reason=a.reason,
                force=a.force,
                log=a.log,
                params_file=a.params,
                min_rows=a.min_rows,
            )

        return report_move("promote", move, a.params)


def promote(
    which: ModelRef,
    *,
    reason: str,
    force: bool,
    log: Path | None,
    params_file: Path,
    min_rows: int = MIN_ROWS,
) -> dict[str, Any]:
    """Move the champion of ``which``'s model to the version it names (``models:/NAME/N``,
    or the one ``models:/NAME@ALIAS`` points at), with the figures of its shadow run in the
    prediction log (the folder ``log``, else the params file's serve.log_dir);
    PromotionRefused below ``min_rows`` logged requests unless ``force``."""
    from trainyard.track import promotion  # MLflow: imported when a command moves a model
    from trainyard.watch.agreement import shadow_figures  # pyarrow.compute: not at start-up
    from trainyard.watch.log import read_log

    name, from_alias = which.name, which.alias
    client, _ = promotion.registry_client()
    target = promotion.find_version(client, which)
    registry_version = f"{name}/{target.version}"
    folder = log or serve_log_dir(load_params(params_file), params_file)
    figures = shadow_figures(read_log(folder), registry_version)
    if figures["rows"] < min_rows and not force:
        raise PromotionRefused(
            f"{name} v{target.version} ran as the shadow on {figures['rows']} logged "
            f"request(s) in {folder}, {min_rows} needed (--min-rows) to record its "
            "agreement with the champion. Serve the champion with the candidate as its "
            f"shadow and the prediction log on (params.yaml: serve.model: "
            f"models:/{name}@champion, serve.shadow: "
            f"{from_alias or target.version}, serve.log_predictions: true, "
            "serve.log_dir), let traffic come, and run this again; or --force to promote "
            "without the figures (recorded as forced)"
        )
    return promotion.promote(
        client,
        target,
        reason=reason,
        figures=figures if figures["rows"] else None,
        forced=force and figures["rows"] < min_rows,
        from_alias=from_alias,
    )


def _reload_s(params_file: Path) -> float | None:
    try:
        return load_params(params_file).serve.reload_s
    except TrainyardError:  # a command run outside the repository: say it without the number
        return None


def report_move(command: str, move: Callable[[], dict[str, Any]], params_file: Path) -> int:
    """Run ``move``; print what moved (or why not) and when a following service sees it."""
    try:
        done = move()
    except PromotionRefused as err:
        print(f"trainyard {command}: refused: {err}", file=sys.stderr)
        return 2
    except TrainyardError as err:
        print(f"trainyard {command}: error: {err}", file=sys.stderr)
        return 1
    name, tags = done["model_name"], done["tags"]
    was = f"v{done['previous_champion']}" if done["previous_champion"] else "no champion"
    print(f"{name}: champion is now v{done['version']} (was {was}); {_evidence(tags)}")
    if done["accuracy"]:
        print(f"v{done['version']}: {done['accuracy']}")
    reload_s = _reload_s(params_file)
    within = f"serve.reload_s ({reload_s:g} s)" if reload_s else "serve.reload_s"
    print(
        f"A service serving models:/{name}@champion picks it up within {within}; one "
        "serving a file or a version number keeps what it serves."
    )
    return 0


def _evidence(tags: dict[str, str]) -> str:
    """The recorded figures, in words."""
    from trainyard.track import promotion

    if tags[promotion.ACTION_TAG] == "rollback":
        return "rolled back"
    rows = tags.get("shadow.rows")
    if rows is None:
        return "forced, no shadow figures"
    against = tags.get("shadow.against", "?")
    agreement = tags.get("shadow.agreement")
    share = f"{float(agreement):.1%}" if agreement is not None else "an unknown share"
    words = f"shadow of {against}: agreed on {share} of {rows} requests"
    if "shadow.shadow_p99_ms" in tags and "shadow.answer_p99_ms" in tags:
        words += (
            f"; p50/p99 {tags['shadow.shadow_p50_ms']}/{tags['shadow.shadow_p99_ms']} ms "
            f"(answering {tags['shadow.answer_p50_ms']}/{tags['shadow.answer_p99_ms']} ms)"
        )
    if tags[promotion.FORCED_TAG] == "true":
        words += " (forced: fewer than --min-rows)"
    return words
