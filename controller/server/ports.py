"""A listener that finds its port taken: whether it is, and who holds it.

Both listeners bind exclusively (no SO_REUSEPORT), so a second controller on the same port fails
at start-up instead of splitting the first one's connections with it. The failure names the
process that holds the port: Linux lists each socket's inode in /proc/net/tcp{,6}, and a
process's open sockets are /proc/<pid>/fd links to ``socket:[inode]``. A process of another user,
or of another PID namespace (another container of the pod), stays hidden; the message says so.

``taken_by`` and ``port_in_use`` read the system; ``holding_inodes`` and ``in_use_message`` are
pure.
"""

from __future__ import annotations

import errno
import os
import pwd
import socket
from dataclasses import dataclass
from pathlib import Path

from specpilot.controller.logsafe import shown

# The proc tables of TCP sockets, IPv4 and IPv6 (dual-stack listeners are in the latter).
_TCP_TABLES = ("net/tcp", "net/tcp6")
# Characters of a holder's command line kept in the message.
_COMMAND_CHARS = 160
# Holders named in one message (a port shared with SO_REUSEPORT may have many).
_MAX_HOLDERS = 3


@dataclass(frozen=True)
class Holder:
    """A process that has a socket on the port open."""

    pid: int
    command: str  # its command line, arguments joined by spaces ("" when unreadable)


@dataclass(frozen=True)
class PortUse:
    """What the system says of a port: the owners of the sockets on it (user names) and the
    processes found holding them."""

    users: tuple[str, ...]
    holders: tuple[Holder, ...]


def holding_inodes(table: str, port: int) -> dict[int, int]:
    """Inode -> owner uid of every socket bound to local ``port`` in a /proc/net/tcp{,6}
    ``table`` (the header line first). Sockets without an inode (TIME_WAIT) hold nothing."""
    found: dict[int, int] = {}
    for line in table.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10:
            continue
        _, _, local_port = cols[1].rpartition(":")
        try:
            if int(local_port, 16) != port:
                continue
            uid, inode = int(cols[7]), int(cols[9])
        except ValueError:
            continue
        if inode:
            found[inode] = uid
    return found


def taken_by(port: int, proc: Path = Path("/proc")) -> PortUse:
    """The sockets on ``port`` and the processes holding them, as far as this user can see."""
    inodes: dict[int, int] = {}
    for name in _TCP_TABLES:
        try:
            inodes.update(holding_inodes((proc / name).read_text(), port))
        except OSError:
            continue
    wanted = {f"socket:[{inode}]" for inode in inodes}
    holders: list[Holder] = []
    if wanted:
        for entry in sorted(proc.iterdir(), key=lambda p: p.name):
            if not entry.name.isdigit():
                continue
            if _holds(entry / "fd", wanted):
                holders.append(Holder(int(entry.name), _command(entry / "cmdline")))
                if len(holders) >= _MAX_HOLDERS:
                    break
    return PortUse(tuple(_user(u) for u in sorted(set(inodes.values()))), tuple(holders))


def _holds(fd_dir: Path, wanted: set[str]) -> bool:
    try:
        names = os.listdir(fd_dir)
    except OSError:  # another user's process, or one that just exited
        return False
    for name in names:
        try:
            if os.readlink(fd_dir / name) in wanted:
                return True
        except OSError:
            continue
    return False


def _command(cmdline: Path) -> str:
    try:
        raw = cmdline.read_bytes()
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def port_in_use(host: str, port: int) -> bool:
    """Whether binding ``host``:``port`` fails because something holds it (a trial bind, as
    gRPC binds: SO_REUSEADDR, no SO_REUSEPORT). Port 0 is never in use; any other failure
    (an address not on this host) is left to the listener to report."""
    if port == 0:
        return False
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError:
        return False
    for family, kind, protocol, _, address in infos:
        with socket.socket(family, kind, protocol) as trial:
            trial.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                trial.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def in_use_message(listener: str, address: str, port: int, setting: str, flag: str,
                   use: PortUse, own_pid: int) -> str:
    """One line: ``listener`` (e.g. "gRPC") cannot listen on ``address``, port ``port`` is
    held by whom ``use`` found, and what to do: another port with ``flag`` or ``setting``, or
    stop the holder."""
    where = f"cannot listen for {listener} on {address}: port {port} is in use"
    if use.holders:
        named = "; ".join(
            f"pid {h.pid}" + (" (this process)" if h.pid == own_pid else "")
            + (f" ({shown(h.command[:_COMMAND_CHARS])})" if h.command and h.pid != own_pid
               else "")
            for h in use.holders)
        who = f" by {named}"
        stop = "or stop that process"
    elif use.users:
        who = (f" by a process of {', '.join(use.users)} that this user cannot see (another "
               f"user's or another container's; `ss -ltnp 'sport = :{port}'` as root names it)")
        stop = "or stop that process"
    else:
        who = (" (what holds it could not be found here; `ss -ltnp 'sport = :"
               f"{port}'` as root names it)")
        stop = "or stop what holds it"
    return (f"{where}{who}: pass another port with {flag} (or the {setting} setting; 0 picks "
            f"a free one), {stop}")
