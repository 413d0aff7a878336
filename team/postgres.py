"""Debian's PostgreSQL server, one cluster of its own, on a loopback port.

The binaries are Debian's (``apt-get install postgresql``: /usr/lib/postgresql/<v>/bin).
PostgreSQL refuses to run as root, so as root the cluster belongs to Debian's ``postgres``
user and its files live where that user can reach them: a folder under /var/tmp named
after the stack's folder (a test's tmp folder is root's alone, mode 700).
"""

from __future__ import annotations

import getpass
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

SUPERUSER = "postgres"


class StackError(RuntimeError):
    """A piece of the team stack could not be set up or started: the message says which."""


def pg_bin(tool: str) -> str:
    """Debian's ``tool`` (initdb, pg_ctl, psql) of the newest PostgreSQL installed."""
    versions = sorted(
        Path("/usr/lib/postgresql").glob(f"*/bin/{tool}"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if versions:
        return str(versions[-1])
    found = shutil.which(tool)
    if found is None:
        raise StackError(
            f"PostgreSQL's {tool} not found: apt-get install postgresql (Debian's server)"
        )
    return found


def as_root() -> bool:
    return os.geteuid() == 0


def run_as_owner() -> list[str]:
    """The prefix that runs a PostgreSQL tool as the cluster's owner."""
    return ["runuser", "-u", SUPERUSER, "--"] if as_root() else []


def cluster_home(stack_dir: Path) -> Path:
    """Where the cluster's files go: in the stack's folder, or (as root) under /var/tmp,
    where Debian's postgres user can reach them."""
    if not as_root():
        return stack_dir / "postgres"
    tag = hashlib.sha256(str(stack_dir.resolve()).encode()).hexdigest()[:12]
    return Path("/var/tmp") / f"trainyard-team-pg-{tag}"


@dataclass
class Postgres:
    """A running cluster: its folder, port and superuser password."""

    home: Path
    port: int
    password: str

    @property
    def data(self) -> Path:
        return self.home / "data"

    def url(self, user: str, db: str, password: str | None = None) -> str:
        """A SQLAlchemy URL; without ``password`` libpq takes it from PGPASSWORD or
        ~/.pgpass, so the URL itself can be written down anywhere."""
        secret = f":{quote(password, safe='')}" if password else ""
        return f"postgresql://{user}{secret}@127.0.0.1:{self.port}/{db}"

    def sql(self, statement: str, db: str = "postgres") -> str:
        """Run ``statement`` as the superuser over loopback TCP; return psql's output."""
        cmd = [pg_bin("psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER]
        cmd += ["-d", db, "-v", "ON_ERROR_STOP=1", "-tAc", statement]
        env = os.environ | {"PGPASSWORD": self.password, "PGCONNECT_TIMEOUT": "5"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
        if out.returncode != 0:
            raise StackError(f"psql on port {self.port}: {out.stderr.strip()}")
        return out.stdout.strip()

    def role_and_db(self, role: str, password: str, db: str) -> None:
        """Role ``role`` (login, ``password``) owning database ``db``; both made if missing."""
        secret = password.replace("'", "''")
        exists = self.sql(f"SELECT 1 FROM pg_roles WHERE rolname = '{role}'")
        verb = "ALTER" if exists == "1" else "CREATE"
        self.sql(f"{verb} ROLE \"{role}\" LOGIN PASSWORD '{secret}'")
        if self.sql(f"SELECT 1 FROM pg_database WHERE datname = '{db}'") != "1":
            self.sql(f'CREATE DATABASE "{db}" OWNER "{role}"')

    def stop(self) -> None:
        """pg_ctl stop -m fast; a cluster that is not running is fine."""
        if not (self.data / "postmaster.pid").exists():
            return
        subprocess.run(
            [*run_as_owner(), pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"],
            capture_output=True,
            timeout=60,
        )


def start(stack_dir: Path, port: int, password: str) -> Postgres:
    """initdb (first time) and start the cluster on 127.0.0.1:``port``; wait until ready."""
    pg = Postgres(cluster_home(stack_dir), port, password)
    owner = run_as_owner()
    pg.home.mkdir(parents=True, exist_ok=True)
    if as_root():
        shutil.chown(pg.home, SUPERUSER, SUPERUSER)
    os.chmod(pg.home, 0o700)
    if not (pg.data / "PG_VERSION").exists():
        _initdb(pg, owner)
    status = [*owner, pg_bin("pg_ctl"), "-D", str(pg.data), "status"]
    if subprocess.run(status, capture_output=True, timeout=30).returncode == 0:
        return pg  # already running (a second `make team-up`)
    log = pg.home / "server.log"
    cmd = [pg_bin("pg_ctl"), "-D", str(pg.data), "-l", str(log), "-w", "-t", "60", "start"]
    # Unix socket in the cluster's own folder: /var/run/postgresql may be missing or owned
    # by the system cluster.
    cmd += ["-o", f"-p {port} -h 127.0.0.1 -k {pg.home}"]
    out = subprocess.run([*owner, *cmd], capture_output=True, text=True, timeout=90)
    if out.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise StackError(f"PostgreSQL did not start on port {port}: {out.stderr}{tail}")
    return pg


def _initdb(pg: Postgres, owner: list[str]) -> None:
    pwfile = pg.home / "superuser.pw"
    pwfile.write_text(pg.password)
    os.chmod(pwfile, 0o600)
    if as_root():
        shutil.chown(pwfile, SUPERUSER, SUPERUSER)
    cmd = [pg_bin("initdb"), "-D", str(pg.data), "-U", SUPERUSER, f"--pwfile={pwfile}"]
    # Passwords over TCP (scram); the local socket only for the cluster's owner.
    cmd += ["--auth-host=scram-sha-256", "--auth-local=peer", "-E", "UTF8", "--no-instructions"]
    try:
        out = subprocess.run([*owner, *cmd], capture_output=True, text=True, timeout=120)
    finally:
        pwfile.unlink(missing_ok=True)
    if out.returncode != 0:
        raise StackError(f"initdb {pg.data} failed ({getpass.getuser()}): {out.stderr.strip()}")


def remove(stack_dir: Path) -> None:
    """Stop the cluster if it runs and delete its files."""
    home = cluster_home(stack_dir)
    if (home / "data" / "postmaster.pid").exists():
        Postgres(home, 0, "").stop()
    shutil.rmtree(home, ignore_errors=True)
