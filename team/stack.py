"""The whole local team stack: PostgreSQL, an MLflow server on it with sign-in and proxied
artifacts, an SSH server for the DVC remote. ``up`` is idempotent (a second call starts
what is not running, with the same passwords); ``down`` stops everything and, with
``purge``, deletes the data.

Files in the stack's folder (``.team/`` by default, ignored by git):
``stack.json`` (ports, pids: no secrets), ``secrets.json`` and ``<user>.env`` (mode 600),
``artifacts/`` (the server's artifact store), ``dvc-remote/``, ``ssh/``, the servers' logs.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import secrets
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from team import mlflow_server, postgres, sshd
from team.postgres import StackError

USERS = ("alice", "bob")
ADMIN = "admin"


@dataclass
class Ports:
    postgres: int = 5433
    mlflow: int = 5050
    ssh: int = 2222


@dataclass
class Stack:
    """What a teammate needs to know about a running stack (secrets in ``secrets``)."""

    folder: Path
    ports: Ports
    secrets: dict[str, str]
    users: tuple[str, ...] = USERS
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def mlflow_uri(self) -> str:
        return f"http://127.0.0.1:{self.ports.mlflow}"

    @property
    def optuna_url(self) -> str:
        """``tune.storage`` for a shared study: no password (libpq reads PGPASSWORD)."""
        return f"postgresql://optuna@127.0.0.1:{self.ports.postgres}/optuna"

    @property
    def dvc_remote(self) -> str:
        path = (self.folder / "dvc-remote").resolve()
        return f"ssh://{getpass.getuser()}@127.0.0.1:{self.ports.ssh}{path}"

    @property
    def ssh_key(self) -> Path:
        return (self.folder / "ssh" / "id_ed25519").resolve()

    def env(self, user: str) -> dict[str, str]:
        """The environment a teammate sets: MLflow's own variables and libpq's."""
        return {
            "MLFLOW_TRACKING_URI": self.mlflow_uri,
            "MLFLOW_TRACKING_USERNAME": user,
            "MLFLOW_TRACKING_PASSWORD": self.secrets[f"user:{user}"],
            "PGPASSWORD": self.secrets["optuna"],
        }


def _load_secrets(folder: Path, users: tuple[str, ...]) -> dict[str, str]:
    path = folder / "secrets.json"
    have = json.loads(path.read_text()) if path.exists() else {}
    names = ["postgres", "mlflow", "optuna", "admin", "flask", *(f"user:{u}" for u in users)]
    for name in names:
        have.setdefault(name, secrets.token_urlsafe(18))
    path.write_text(json.dumps(have, indent=1))
    os.chmod(path, 0o600)
    return have


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def up(folder: Path, ports: Ports | None = None, users: tuple[str, ...] = USERS) -> Stack:
    """Start what is not running yet; write the teammates' env files; return the stack."""
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    state = read_state(folder)
    ports = ports or (Ports(**state["ports"]) if state else Ports())
    stack = Stack(folder, ports, _load_secrets(folder, users), users, state.get("pids", {}))
    pg = postgres.start(folder, ports.postgres, stack.secrets["postgres"])
    pg.role_and_db("mlflow", stack.secrets["mlflow"], "mlflow")
    pg.role_and_db("mlflow", stack.secrets["mlflow"], "mlflow_auth")
    pg.role_and_db("optuna", stack.secrets["optuna"], "optuna")
    if not _alive(stack.pids.get("mlflow")):
        ini = mlflow_server.auth_config(
            folder / "auth.ini",
            pg.url("mlflow", "mlflow_auth"),
            ADMIN,
            stack.secrets["admin"],
        )
        proc = mlflow_server.start(
            folder,
            ports.mlflow,
            pg.url("mlflow", "mlflow"),
            stack.secrets["mlflow"],
            ini,
            stack.secrets["flask"],
        )
        stack.pids["mlflow"] = proc.pid
    for user in users:
        mlflow_server.create_user(
            stack.mlflow_uri, ADMIN, stack.secrets["admin"], user, stack.secrets[f"user:{user}"]
        )
    mlflow_server.warm_up(stack.mlflow_uri, ADMIN, stack.secrets["admin"])
    (folder / "dvc-remote").mkdir(exist_ok=True)
    if not _alive(stack.pids.get("ssh")):
        stack.pids["ssh"] = sshd.start(folder / "ssh", ports.ssh)
    write_state(stack)
    for user in users:
        env_file = folder / f"{user}.env"
        env_file.write_text("".join(f"export {k}={v}\n" for k, v in stack.env(user).items()))
        os.chmod(env_file, 0o600)
    return stack


def read_state(folder: Path) -> dict:
    path = folder / "stack.json"
    return json.loads(path.read_text()) if path.exists() else {}


def write_state(stack: Stack) -> None:
    state = {"ports": asdict(stack.ports), "pids": stack.pids, "users": list(stack.users)}
    (stack.folder / "stack.json").write_text(json.dumps(state, indent=1))


def stop_mlflow(stack: Stack, timeout: float = 20) -> None:
    """Stop the MLflow server's process group (gunicorn and its workers)."""
    pid = stack.pids.pop("mlflow", None)
    if not _alive(pid):
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap it when this process started it
    if _alive(pid):
        os.killpg(pid, signal.SIGKILL)


def down(folder: Path, purge: bool = False) -> None:
    """Stop the MLflow server, sshd and PostgreSQL; ``purge`` deletes their data too."""
    folder = folder.resolve()
    state = read_state(folder)
    if state:
        stack = Stack(folder, Ports(**state["ports"]), {}, pids=state.get("pids", {}))
        stop_mlflow(stack)
    sshd.stop(folder / "ssh")
    if purge:
        postgres.remove(folder)
        shutil.rmtree(folder, ignore_errors=True)
        return
    postgres.Postgres(postgres.cluster_home(folder), 0, "").stop()
    if state:
        state["pids"] = {}
        (folder / "stack.json").write_text(json.dumps(state, indent=1))


__all__ = ["Ports", "Stack", "StackError", "down", "up"]
