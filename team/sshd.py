"""Debian's OpenSSH server on a loopback port, for a DVC remote over SSH (dvc-ssh).

Its own host key, one client key (authorized for the user who starts it), keys only: no
passwords, no PAM. The remote's URL names no secret; the key file's path is set in the
clone's ``.dvc/config.local`` (never committed).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import subprocess
import time
from pathlib import Path

from team.postgres import StackError

SSHD = "/usr/sbin/sshd"


def keygen(path: Path, comment: str) -> Path:
    if not path.exists():
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
            check=True,
            capture_output=True,
        )
    return path


def config(folder: Path, port: int) -> Path:
    """sshd_config of this server: 127.0.0.1:``port``, this folder's keys, keys only."""
    folder.mkdir(parents=True, exist_ok=True)
    host_key = keygen(folder / "host_ed25519", "trainyard-team-host")
    client_key = keygen(folder / "id_ed25519", "trainyard-team-dvc")
    authorized = folder / "authorized_keys"
    authorized.write_text(client_key.with_suffix(".pub").read_text())
    os.chmod(authorized, 0o600)
    user = getpass.getuser()
    text = f"""\
Port {port}
ListenAddress 127.0.0.1
HostKey {host_key}
PidFile {folder / "sshd.pid"}
AuthorizedKeysFile {authorized}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AllowUsers {user}
PermitRootLogin prohibit-password
# the stack's folder may sit in a world-writable temp folder
StrictModes no
Subsystem sftp internal-sftp
"""
    path = folder / "sshd_config"
    path.write_text(text)
    return path


def start(folder: Path, port: int) -> int:
    """Start sshd (it detaches itself); return its pid once it accepts connections."""
    if not Path(SSHD).exists():
        raise StackError("sshd not found: apt-get install openssh-server (Debian's server)")
    cfg = config(folder, port)
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(exist_ok=True)  # its privilege-separation folder
    log = folder / "sshd.log"
    out = subprocess.run([SSHD, "-f", str(cfg), "-E", str(log)], capture_output=True, text=True)
    if out.returncode != 0:
        raise StackError(f"sshd did not start on port {port}: {out.stderr.strip()}")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pid_file = folder / "sshd.pid"
        if pid_file.exists() and pid_file.read_text().strip() and reachable(folder, port):
            return int(pid_file.read_text())
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise StackError(f"sshd on port {port} did not answer:\n{tail}")


def reachable(folder: Path, port: int) -> bool:
    """One real login with the client key (``ssh ... true``)."""
    cmd = ["ssh", "-i", str(folder / "id_ed25519"), "-p", str(port), "-o", "BatchMode=yes"]
    cmd += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    cmd += ["-o", "LogLevel=ERROR", f"{getpass.getuser()}@127.0.0.1", "true"]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def stop(folder: Path) -> None:
    pid_file = folder / "sshd.pid"
    if not pid_file.exists():
        return
    with contextlib.suppress(ProcessLookupError, ValueError):
        os.kill(int(pid_file.read_text()), 15)
    pid_file.unlink(missing_ok=True)
