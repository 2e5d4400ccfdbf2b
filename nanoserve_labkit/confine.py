"""What the operating system keeps the student's code from: the worker's confinement, and the checker's.

The student's code runs as the teacher's user, so file permissions and `kill`'s
same-user rule protect nothing. The kernel has three mechanisms that do hold
for a same-user process; each is used where this machine has it, in this order:

1. **Landlock** (Linux 5.13+, `landlock_restrict_self`): the worker gives up,
   for itself and everything it starts, the right to create, change or delete
   any file outside its scratch folder (reading stays allowed: it imports
   torch). A process in a Landlock domain also cannot ptrace, or open the
   `/proc/PID/{fd,environ,mem}` files of, a process outside it. With ABI 6
   (Linux 6.12+) the domain is also *scoped*: no signal to a process outside
   it (the checker, the guardian, the teacher's shell), no connection to an
   abstract unix socket outside it.
2. **A user and PID namespace** (`unshare`, where unprivileged namespaces are
   allowed), for signals when Landlock cannot scope them: the worker is PID 1
   of a namespace of its own and cannot name (so cannot signal) any process
   outside it. Set up by the guardian before it starts the worker.
3. **`PR_SET_DUMPABLE(0)`** in the checker: a same-user process without
   `CAP_SYS_PTRACE` can no longer open its `/proc/PID/{fd,environ,mem}` (it
   can still signal it).

`describe()` says which of them hold here (`nanoserve lab check --json` and
the teacher's page print it). What no level stops: reading the user's files,
the network, and, without Landlock, writing the user's files by absolute
path; `lab grade` copes with the rest (a checker per file, snapshots of the
submissions taken before any runs).
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

# Linux's syscall numbers (the same on x86-64 and arm64: the generic table) and the uapi constants.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1 << 0
LANDLOCK_RULE_PATH_BENEATH = 1
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
CLONE_NEWUSER, CLONE_NEWPID = 0x10000000, 0x20000000

# LANDLOCK_ACCESS_FS_*: what a path rule may allow. Reading and executing are not handled (allowed everywhere).
WRITE_FILE, REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG = 1 << 1, 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE = 1 << 13, 1 << 14          # ABI 2, ABI 3
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1     # ABI 6

LEVELS = ("landlock", "namespace", "dumpable", "none")   # what `confine=` may ask for: the best, down to nothing


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """Landlock's ABI version on this kernel (0: none, or not Linux, or switched off at boot)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        abi = _libc().syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                              ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(abi), 0)


def _writes(abi: int) -> int:
    """Every right that creates, changes or removes a file, that this ABI knows."""
    rights = WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_CHAR | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO | \
        MAKE_BLOCK | MAKE_SYM
    return rights | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)


def landlock(scratch: str) -> int:
    """Confine this process (and what it starts) to writing under `scratch` (and /dev/null); with ABI >= 6
    also to signalling processes in its own domain. Returns the ABI used; 0 where Landlock is missing."""
    abi = landlock_abi()
    if abi < 1:
        return 0
    libc = _libc()
    handled = _writes(abi)
    attr = _RulesetAttr(handled, 0, SCOPE_SIGNAL | SCOPE_ABSTRACT_UNIX_SOCKET if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8     # the struct grew with the ABI; pass what it knows
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        file_rights = WRITE_FILE | (TRUNCATE if abi >= 3 else 0)
        for path, rights in ((scratch, handled), ("/dev/null", file_rights)):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneathAttr(rights, fd)
                if libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule),
                                ctypes.c_uint32(0)) < 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}: {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
                libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset)
    return abi


def own_namespace() -> bool:
    """Put this process into a new user namespace (its own uid mapped to itself) whose next child starts a
    new PID namespace. True when the kernel allowed it. Call while single-threaded, before starting the child."""
    if not sys.platform.startswith("linux"):
        return False
    uid, gid = os.getuid(), os.getgid()
    if _libc().unshare(CLONE_NEWUSER | CLONE_NEWPID) != 0:
        return False
    try:
        for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError:
        return False
    return True


def undumpable() -> bool:
    """PR_SET_DUMPABLE(0) for this process: its /proc/PID/{fd,environ,mem} closed to same-user processes."""
    if not sys.platform.startswith("linux"):
        return False
    return _libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0


@dataclass(frozen=True, slots=True)
class Confinement:
    """What holds for the worker, as asked (`level`) and as this machine allows."""

    level: str              # one of LEVELS: the best mechanism the caller allows
    landlock_abi: int       # 0: not used (missing, or not allowed by `level`)
    namespace: bool         # the worker gets a user and PID namespace of its own
    dumpable_closes: bool   # PR_SET_DUMPABLE(0) in the checker closes its /proc files to the worker

    @property
    def writes_confined(self) -> bool:
        return self.landlock_abi >= 1

    @property
    def signals_confined(self) -> bool:
        return self.landlock_abi >= 6 or self.namespace

    @property
    def proc_closed(self) -> bool:
        """/proc/CHECKER/{fd,environ,mem}: Landlock closes fd and mem but (measured on Linux 6.18, as root) not
        environ; PR_SET_DUMPABLE closes all three unless the worker holds CAP_SYS_PTRACE, which it loses in
        a user namespace of its own."""
        return self.dumpable_closes

    def text(self) -> str:
        writes = f"only in its scratch folder (Landlock ABI {self.landlock_abi})" if self.writes_confined else \
            "anywhere the user may (no Landlock)"
        how = " and ".join(w for w, on in (("Landlock scope", self.landlock_abi >= 6),
                                           ("PID namespace", self.namespace)) if on)
        signals = f"refused ({how})" if self.signals_confined else "possible (no Landlock scope, no PID namespace)"
        proc = "closed (PR_SET_DUMPABLE" + (", user namespace)" if self.namespace else ")") if self.proc_closed \
            else "fd and mem closed (Landlock), environ open" if self.writes_confined else "open"
        return f"worker writes: {writes}; signals to the checker: {signals}; the checker's /proc files: {proc}"


def plan(level: str = "landlock") -> Confinement:
    """The confinement the worker gets under `level` on this machine (nothing is applied here)."""
    if level not in LEVELS:
        raise ValueError(f"confine: {level!r} is not one of {', '.join(LEVELS)}")
    abi = landlock_abi() if level == "landlock" else 0
    namespace = level in ("landlock", "namespace") and namespaces_allowed()
    dumpable = level != "none" and sys.platform.startswith("linux") and (namespace or not _can_ptrace())
    return Confinement(level, abi, namespace, dumpable)


def _can_ptrace() -> bool:
    """Whether this process holds CAP_SYS_PTRACE (root usually does): PR_SET_DUMPABLE does not stop it."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 19 & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def namespaces_allowed() -> bool:
    """Whether an unprivileged process may create a user namespace here (tried in a throwaway child)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if _libc().unshare(CLONE_NEWUSER) == 0 else 1)
        except BaseException:   # noqa: BLE001 -- the child must never return into the caller's code
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


def describe(level: str = "landlock") -> str:
    return plan(level).text()
