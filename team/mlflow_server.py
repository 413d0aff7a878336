"""MLflow's own tracking server with sign-in: ``mlflow server --app-name basic-auth``,
runs and registry on PostgreSQL, artifacts proxied by the server (clients need no
artifact-store credentials), users created through the auth app's REST API."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from team.postgres import StackError


def auth_config(path: Path, auth_db_uri: str, admin: str, admin_password: str) -> Path:
    """The basic-auth app's ini (MLFLOW_AUTH_CONFIG_PATH), readable by its owner only.

    ``default_permission = EDIT``: every signed-in teammate can log runs to any experiment
    and register versions and move aliases of any model; deleting and permissions stay
    with a resource's creator and the admin (MLflow's MANAGE).
    """
    path.write_text(
        "[mlflow]\n"
        "default_permission = EDIT\n"
        f"database_uri = {auth_db_uri}\n"
        f"admin_username = {admin}\n"
        f"admin_password = {admin_password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # Each request otherwise pays a password hash (0.27 s measured here): a trial
        # makes 40-50 requests. A changed password reaches other workers within 60 s.
        "auth_cache_ttl_seconds = 60\n"
    )
    os.chmod(path, 0o600)
    return path


# MLflow 3's server starts a job runner beside a database-backed store: five more Python
# processes (huey consumers) for its GenAI jobs (LLM judges, trace roll-ups), which image
# classification never queues. On 2 quiet cores a sqlite server's start cost 28-30 CPU-s
# with them against 11-12 without, and 15 s to the first /health answer against 11-13. Off
# unless the environment already says otherwise (a team that runs GenAI jobs on the same
# server sets it to true).
JOB_EXECUTION = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


def start(
    folder: Path,
    port: int,
    backend_uri: str,
    db_password: str,
    auth_ini: Path,
    secret_key: str,
    workers: int = 2,
) -> subprocess.Popen:
    """``mlflow server`` on 127.0.0.1:``port`` in its own process group, logging to
    ``folder/mlflow-server.log``; returns once /health answers.

    ``backend_uri`` carries no password: libpq reads PGPASSWORD from the server's
    environment, so it shows neither in ``ps`` nor in MLflow's own log lines.
    """
    artifacts = folder / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    mlflow = Path(sys.executable).with_name("mlflow")
    cmd = [str(mlflow), "server", "--app-name", "basic-auth", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--backend-store-uri", backend_uri, "--workers", str(workers)]
    cmd += ["--artifacts-destination", artifacts.as_uri()]
    env = os.environ | {
        "PGPASSWORD": db_password,
        "MLFLOW_AUTH_CONFIG_PATH": str(auth_ini),
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secret_key,
    }
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        env.pop(key, None)  # the server's own environment, not a client's
    env.setdefault(JOB_EXECUTION, "false")
    log = open(folder / "mlflow-server.log", "ab")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=folder
    )
    log.close()
    wait_healthy(f"http://127.0.0.1:{port}", proc, folder / "mlflow-server.log")
    return proc


def wait_healthy(uri: str, proc: subprocess.Popen | None, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise StackError(f"mlflow server at {uri} did not start:\n{tail}")
        time.sleep(0.5)


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def create_user(uri: str, admin: str, admin_password: str, user: str, password: str) -> None:
    """A sign-in for ``user`` (the auth app's users/create, as the admin); an existing
    user gets ``password`` instead (users/update-password)."""
    headers = {"Authorization": _basic(admin, admin_password)}
    headers["Content-Type"] = "application/json"
    body = json.dumps({"username": user, "password": password}).encode()
    for path, method in (("users/create", "POST"), ("users/update-password", "PATCH")):
        req = urllib.request.Request(
            f"{uri}/api/2.0/mlflow/{path}", data=body, headers=headers, method=method
        )
        try:
            with urllib.request.urlopen(req, timeout=30):
                return
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            if "RESOURCE_ALREADY_EXISTS" not in detail:
                raise StackError(
                    f"MLflow user {user}: {path} answered {err.code}: {detail}"
                ) from None
    raise StackError(f"MLflow user {user}: could not be created or updated")


def warm_up(uri: str, user: str, password: str) -> None:
    """One signed-in API call per worker, so a teammate's first call is not the one that
    waits for the workers' lazy start."""
    req = urllib.request.Request(
        f"{uri}/api/2.0/mlflow/experiments/search?max_results=1",
        headers={"Authorization": _basic(user, password)},
    )
    for _ in range(4):
        with urllib.request.urlopen(req, timeout=120):
            pass
