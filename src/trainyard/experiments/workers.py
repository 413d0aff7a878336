"""How the workers of a ``trainyard tune`` study coordinate outside Optuna (no Optuna here):
the storage URL as logs and tags show it (no password), its errors in one line, the study's
lock (a lock file among this machine's workers; PostgreSQL's advisory lock among all the
machines sharing a PostgreSQL storage), and who a worker is and whether it is gone.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
from pathlib import Path
from typing import Any, Self

import sqlalchemy
import sqlalchemy.engine
import sqlalchemy.pool

from trainyard.core.errors import TrainyardError

log = logging.getLogger(__name__)

# A PostgreSQL server that does not answer within this many seconds is down (libpq's own
# default waits forever).
CONNECT_TIMEOUT_S = 10


class StudyError(TrainyardError):
    """The Optuna storage cannot be opened or does not hold what the study needs."""


def redacted(url: str) -> str:
    """The storage URL without its password, for logs and tags."""
    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL sqlalchemy parses: open_storage says what is wrong
        return url


def cannot_open(url: str, err: BaseException) -> StudyError:
    """One line: the storage (its URL without a password) and the driver's own reason; a
    PostgreSQL sign-in failure says where the password comes from."""
    cause = getattr(err, "orig", None) or err  # the driver's error inside SQLAlchemy's
    text = " ".join(str(cause).split()) or type(cause).__name__
    if "password authentication failed" in text or "no password supplied" in text:
        text += " (libpq reads the password from PGPASSWORD or ~/.pgpass)"
    return StudyError(
        f"tune.storage {redacted(url)}: cannot open the Optuna storage: "
        f"{type(cause).__name__}: {text}"
    )


def connect_args(url: str) -> dict[str, Any]:
    """The driver's connect arguments for a storage URL."""
    if url.startswith("sqlite:"):
        # Several workers write one file: wait for its lock up to a minute (sqlite's own
        # default is 5 s) rather than fail a trial on "database is locked".
        return {"timeout": 60}
    if url.startswith("postgresql"):
        return {"connect_timeout": CONNECT_TIMEOUT_S}
    return {}


class _Held:
    """A lock whose ``with`` block holds it: ``acquire`` on entry, ``release`` on exit."""

    def acquire(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class StudyLock(_Held):
    """An exclusive lock among this machine's workers of one storage (a file lock), held
    while a worker counts the study's trials and creates the next one (two workers never
    both start the last trial) and while the parent run is looked up or created. A
    PostgreSQL storage, shared by machines, gets ``AdvisoryLock`` instead (``for_storage``);
    other servers (MySQL) only this: workers on two machines may then end a trial or two
    past ``--trials``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: Any = None

    @classmethod
    def for_storage(
        cls, url: str, study: str, root: str | os.PathLike[str]
    ) -> StudyLock | AdvisoryLock:
        if url.startswith("postgresql"):
            return AdvisoryLock(url, study)
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            return cls(Path(url.removeprefix("sqlite:///") + ".lock"))
        return cls(Path(root) / ".cache" / "tune" / f"{study}.lock")

    def acquire(self) -> None:
        if self._fh is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a")  # noqa: SIM115  (held across calls until release)
        fcntl.flock(fh, fcntl.LOCK_EX)
        self._fh = fh

    def release(self) -> None:
        """Idempotent: the trial's objective releases it as soon as its trial exists."""
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


def lock_key(study: str) -> int:
    """The study's advisory lock id: a signed 64-bit number from its name."""
    digest = hashlib.sha256(f"trainyard tune {study}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class AdvisoryLock(_Held):
    """The StudyLock of a PostgreSQL storage: ``pg_advisory_lock`` on a connection of its
    own, so every worker of the study on any machine counts and starts trials one at a
    time (the study holds exactly ``--trials``). A worker that dies holding it loses its
    connection, and PostgreSQL releases the lock with it."""

    def __init__(self, url: str, study: str) -> None:
        self.url, self.key = url, lock_key(study)
        self._engine: sqlalchemy.engine.Engine | None = None
        self._conn: sqlalchemy.engine.Connection | None = None

    def acquire(self) -> None:
        if self._conn is not None:
            return
        try:
            if self._engine is None:  # NullPool: closing the connection ends its session
                self._engine = sqlalchemy.create_engine(
                    self.url,
                    poolclass=sqlalchemy.pool.NullPool,
                    connect_args=connect_args(self.url),
                )
            conn = self._engine.connect()
        except Exception as err:  # a bad URL, a wrong password, a server down
            raise cannot_open(self.url, err) from None
        conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": self.key})
        self._conn = conn

    def release(self) -> None:
        """Idempotent, like StudyLock's; never raises (a lost connection freed the lock)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), {"key": self.key})
        except Exception as err:
            log.debug("advisory unlock: %s (the closed connection releases it)", err)
        finally:
            conn.close()


# ---------------------------------------------------------------- workers


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, /proc): a reused pid differs."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rpartition(")")[2].split()[19] if stat else ""


def worker_id(pid: int | None = None) -> str:
    """This process, unique on this machine and across its reboots: host, boot, pid, start."""
    pid = os.getpid() if pid is None else pid
    boot = _read("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot}/{pid}/{_start_ticks(pid)}"


def worker_dead(worker: str) -> bool:
    """True only for a worker of this machine that is certainly gone (another machine's
    workers are left to the heartbeats)."""
    parts = worker.split("/")
    if len(parts) != 4:
        return False
    host, boot, pid, ticks = parts
    if host != socket.gethostname() or boot != _read("/proc/sys/kernel/random/boot_id"):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    return bool(ticks) and _start_ticks(int(pid)) != ticks
