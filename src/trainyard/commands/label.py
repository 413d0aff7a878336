"""``trainyard label push|pull [DIR]``: the labelling loop with a Label Studio server
(docs/label.md).

``push`` sends the audit's suspects and the served images the model was least sure of (or
the shadow disagreed on) as tasks, each with the model's answer preselected; ``pull``
brings the reviewed labels back into the folder (files moved or added, a manifest line for
each review). The server is ``--url`` (default ``$TRAINYARD_LABEL_STUDIO_URL``, else
``make label-studio``'s), the token ``$LABEL_STUDIO_USER_TOKEN`` (else the local one).
Exits 0, 1 when the server fails, 2 on bad input (named).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from trainyard.commands import (
    Command,
    Subparsers,
    command_parser,
    serve_log_dir,
    target_folder,
)
from trainyard.core.config import DEFAULT_PARAMS, load_params
from trainyard.core.errors import TrainyardError
from trainyard.stages.runner import configure_logging
from trainyard.track.label_studio import (
    DEFAULT_TOKEN,
    DEFAULT_URL,
    TOKEN_ENV,
    URL_ENV,
    LabelStudio,
    LabelStudioError,
)

HELP = "send the audit's suspects and unsure served images to Label Studio, bring answers back"
SERVER_FAILED, BAD_INPUT = 1, 2


def add_parser(subparsers: Subparsers) -> None:
    p = command_parser(subparsers, "label", HELP, CmdLabel)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    push = actions.add_parser("push", help="create or reuse the folder's project, add tasks")
    pull = actions.add_parser("pull", help="move/add the reviewed files, write the manifest")
    for sub in (push, pull):
        sub.add_argument("dir", nargs="?", help="a class-per-folder tree (default: data.folder)")
        sub.add_argument("--url", default=os.environ.get(URL_ENV, DEFAULT_URL), help="server")
        sub.add_argument("--project", help="the project's title (default: 'trainyard: DIRNAME')")
        sub.add_argument("--params", default=str(DEFAULT_PARAMS), help="params file")
    push.add_argument(
        "--suspects",
        type=Path,
        default=Path("reports/audit/suspects.csv"),
        help="the audit's CSV (default %(default)s)",
    )
    push.add_argument(
        "--reasons", default="label", help="suspect reasons sent, comma-separated (%(default)s)"
    )
    push.add_argument("--limit", type=int, help="the first N suspects only (most likely first)")
    push.add_argument("--served", type=int, default=100, help="served images at most (100)")
    push.add_argument(
        "--below", type=float, default=0.6, help="a served answer less sure is sent (0.6)"
    )
    push.add_argument("--log", type=Path, help="the prediction log (default serve.log_dir)")


class CmdLabel(Command):
    def run(self) -> int:
        from trainyard.review.pull import PullJob, pull
        from trainyard.review.push import PushJob, push

        configure_logging("label")
        a = self.args
        client = LabelStudio(a.url, os.environ.get(TOKEN_ENV, DEFAULT_TOKEN))
        try:
            params_file = Path(a.params)
            params = load_params(params_file)
            folder = target_folder(a.dir, params, params_file)
            if a.action == "pull":
                done = pull(client, PullJob(folder, a.project))
            else:
                log = a.log or serve_log_dir(params, params_file)
                reasons = tuple(r.strip() for r in a.reasons.split(",") if r.strip())
                job = PushJob(
                    folder, a.suspects, log, reasons, a.limit, a.served, a.below, a.project
                )
                done = push(client, job)
        except LabelStudioError as err:
            print(f"trainyard label {a.action}: error: {err}", file=sys.stderr)
            return SERVER_FAILED
        except (TrainyardError, FileNotFoundError) as err:
            print(f"trainyard label {a.action}: error: {err}", file=sys.stderr)
            return BAD_INPUT
        print(json.dumps(done, indent=2))
        if a.action == "pull" and (done["moved"] or done["added"]):
            print(
                f"{folder}: the reviewed labels are in (.trainyard/labels.jsonl); version them "
                f"with `dvc add {folder}` (or `dvc commit`) and train with `dvc exp run`"
            )
        return 0
