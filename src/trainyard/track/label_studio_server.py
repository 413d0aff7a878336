"""A local Label Studio server from its own virtual environment (``.venv-labelstudio``), on
loopback, with a known user and API token: what ``make label-studio`` runs (in the
foreground), and what the tests and ``make bench-label`` start in the background.

Label Studio reads its settings from ``LABEL_STUDIO_*`` variables: ``USERNAME`` /
``PASSWORD`` create the user on the first start, ``USER_TOKEN`` sets that user's API token
(which ``--enable-legacy-api-token`` lets the ``Authorization: Token`` header use),
``BASE_DATA_DIR`` holds its SQLite database and uploads. Its telemetry (Sentry, analytics,
the version check) is off: the server is a local tool. Images travel inside the tasks as
data URLs (docs/label.md), so local-file serving stays off.

    python -m trainyard.track.label_studio_server [--port 8089] [--data-dir .label-studio]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from trainyard.track.label_studio import DEFAULT_PORT, DEFAULT_TOKEN, TOKEN_ENV

DEFAULT_VENV = Path(".venv-labelstudio")
DEFAULT_DATA = Path(".label-studio")
DEFAULT_USER = "reviewer@trainyard.local"
PASSWORD_ENV = "LABEL_STUDIO_PASSWORD"
DEFAULT_PASSWORD = "trainyard-review"  # loopback only; set LABEL_STUDIO_PASSWORD to change it


def server_env(data_dir: Path, token: str, base: Mapping[str, str] = os.environ) -> dict:
    """The environment Label Studio starts with: its user, token, data folder, no telemetry."""
    env = dict(base)
    env.update(
        LABEL_STUDIO_USERNAME=env.get("LABEL_STUDIO_USERNAME", DEFAULT_USER),
        LABEL_STUDIO_PASSWORD=env.get(PASSWORD_ENV, DEFAULT_PASSWORD),
        LABEL_STUDIO_USER_TOKEN=token,
        LABEL_STUDIO_BASE_DATA_DIR=str(data_dir.resolve()),
        SENTRY_DSN="",
        FRONTEND_SENTRY_DSN="",
        COLLECT_ANALYTICS="false",
        LATEST_VERSION_CHECK="false",
        LOCAL_FILES_SERVING_ENABLED="false",
    )
    return env


def server_command(venv: Path, port: int, data_dir: Path) -> list[str]:
    """``label-studio start`` on 127.0.0.1:``port``, no browser, the token header allowed."""
    return [
        str(venv / "bin" / "label-studio"),
        "start",
        "--no-browser",
        "--internal-host",
        "127.0.0.1",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir.resolve()),
        "--enable-legacy-api-token",
        "--log-level",
        "WARNING",
    ]


def start(
    venv: Path, port: int, data_dir: Path, token: str, log: Path | None = None
) -> subprocess.Popen:
    """The server in the background, its own process group (stop it with ``os.killpg``)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child holds it
    return subprocess.Popen(
        server_command(venv, port, data_dir),
        env=server_env(data_dir, token),
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Wait for ``/health`` to answer; RuntimeError if the server exits or takes too long
    (its first start migrates a new database: about 90 s on 2 busy cores)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"label-studio exited {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"label-studio did not answer at {url} within {timeout:g} s")


def main(argv: list[str] | None = None) -> None:
    """Run the server in the foreground (``make label-studio``): Ctrl-C stops it."""
    p = argparse.ArgumentParser(prog="python -m trainyard.track.label_studio_server")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    a = p.parse_args(argv)
    token = os.environ.get(TOKEN_ENV, DEFAULT_TOKEN)
    a.data_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"Label Studio on http://127.0.0.1:{a.port} (data in {a.data_dir}); sign in as "
        f"{os.environ.get('LABEL_STUDIO_USERNAME', DEFAULT_USER)}; trainyard label uses the "
        f"token in {TOKEN_ENV} (default: the local one)",
        flush=True,
    )
    cmd = server_command(a.venv, a.port, a.data_dir)
    os.execve(cmd[0], cmd, server_env(a.data_dir, token))


if __name__ == "__main__":
    sys.exit(main())
