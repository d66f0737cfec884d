"""Run a model's Python tool call in a sandbox: `await run_python(code)` -> SandboxResult.

Three processes per call (docs/tools.md has the why and the measurements):
- the *wrapper*, `python -I -S sandbox.py ARGS` started by `run_python` in its own session: it reads
  the code from stdin, unshares new network, mount, PID and IPC namespaces (plus a user namespace
  when it is not root) and forks
- *init*, PID 1 of the new PID namespace: it builds a minimal read-only root filesystem (the
  interpreter, /usr, a few /dev nodes, a fresh /proc, a small tmpfs /tmp holding the code),
  pivots into it, forks the tool and reports its exit status on a status pipe; when init exits the
  kernel kills every process left in the namespace, so nothing the code started outlives the call
- the *tool*: drops root to `nobody`, enters a user namespace of its own (so RLIMIT_NPROC counts
  this call's processes only), sets its rlimits and execs `python -I -S tool.py`, with an empty
  environment and no network (the namespace has only a loopback device, and it is down).

The parent enforces the wall clock and the output bound: SIGTERM to the wrapper makes it SIGKILL
init (the namespace goes with it); SIGKILL to the wrapper's process group is the fallback. Every
process dies with its parent (PR_SET_PDEATHSIG). Isolation that cannot be set up is a RuntimeError:
the sandbox fails closed, never runs code without it.

This file is also the wrapper's script, so it imports nothing but the standard library.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import math
import os
import platform
import resource
import signal
import sys
from dataclasses import dataclass

_MAX_CODE_BYTES = 1 << 20
_TMP_MB = 16  # the tool's only writable place: a tmpfs, so files count against a bound and vanish with it
_FSIZE_BYTES = 1 << 20  # largest file the tool can write
_NOFILE = 256
_ERR_TAIL_BYTES = 8192  # of stderr only the tail is kept: the exception's line is last
_ERR_LIMIT_BYTES = 1 << 20  # more stderr than this is runaway output: the call is stopped
_STOP_GRACE_S = 2.0  # after SIGTERM, the wrapper's time to kill init before SIGKILL to its group
_SLOT_WAIT_S = 60.0  # a call that finds every node slot taken this long returns error "busy"
_NOBODY = 65534  # uid/gid of "nobody" (the kernel's overflow id): root's tool code runs as this

# <linux/sched.h>, <linux/mount.h>, <linux/prctl.h>
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 14, 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NAME, PR_SET_NO_NEW_PRIVS = 1, 4, 15, 38
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # glibc has no wrapper for pivot_root(2)


@dataclass
class SandboxResult:
    """What a tool call returns to the agent as its observation."""

    output: str  # stdout (+ stderr's last line on an error), at most max_output_chars
    ok: bool  # the code exited with status 0 (and was not stopped)
    error: str | None  # None, "timeout", "cpu", "memory", "output too long", "exit N", "signal N", "busy"


async def run_python(code: str, *, cpu_s: float = 2, wall_s: float = 5, mem_mb: int = 256,
                     max_output_chars: int = 2000, max_procs: int = 8) -> SandboxResult:
    """Run `code` with `python -I -S` (standard library only) in the sandbox.

    cpu_s: CPU seconds of each process (RLIMIT_CPU, rounded up to whole seconds); wall_s: wall clock
    of the whole call; mem_mb: address space of each process (RLIMIT_AS); max_procs: processes and
    threads of the call, the tool's interpreter included (RLIMIT_NPROC in its own user namespace).
    Raises RuntimeError when the machine cannot isolate the code (no namespaces). Under
    `bound_node_calls` the call first waits for a node slot (up to 60 s, else error "busy")."""
    data = _check_args(code, cpu_s, wall_s, mem_mb, max_output_chars, max_procs)
    if _node_slots is None:
        return await _run(data, cpu_s, wall_s, mem_mb, max_output_chars, max_procs)
    slot = await _take_slot(*_node_slots)
    if slot is None:
        return SandboxResult("", False, "busy")
    try:
        return await _run(data, cpu_s, wall_s, mem_mb, max_output_chars, max_procs)
    finally:
        os.close(slot)  # releases the flock


# (folder, n) of this process's node-wide bound, set by bound_node_calls; None: unbounded.
_node_slots: tuple[str, int] | None = None


def node_slots_folder(output_dir: str) -> str:
    """Where a run's processes on this host keep their slot files (one folder per host, so a
    shared output dir bounds each node, not the cluster)."""
    return os.path.join(output_dir, "sandbox_slots", os.uname().nodename)


def bound_node_calls(folder: str, n: int) -> None:
    """From now on each run_python call of this process holds one of `n` slot files in `folder`
    (an exclusive flock) while it runs: the processes of a node that name the same folder run at
    most n calls at once, so their memory is bounded by n x (max_procs x mem_mb), not by their
    number. A process that dies releases its slots with its file descriptors."""
    global _node_slots
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"bound_node_calls: n={n!r} must be an int >= 1")
    _node_slots = (folder, n)  # the folder is made at the first call: most runs make none


@contextlib.contextmanager
def node_bound(folder: str, n: int):
    """bound_node_calls for the calls inside the block (evaluation); the previous bound after it."""
    global _node_slots
    before = _node_slots
    bound_node_calls(folder, n)
    try:
        yield
    finally:
        _node_slots = before


async def _take_slot(folder: str, n: int) -> int | None:
    """A locked slot file's descriptor, or None when none was free within _SLOT_WAIT_S."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _SLOT_WAIT_S
    while True:
        first = int.from_bytes(os.urandom(2), "little") % n  # processes start apart: fewer failed tries
        for i in range(n):
            fd = os.open(os.path.join(folder, f"slot-{(first + i) % n}"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                os.close(fd)
        if loop.time() >= deadline:
            return None
        await asyncio.sleep(0.02)


async def _run(data: bytes, cpu_s, wall_s, mem_mb, max_output_chars, max_procs) -> SandboxResult:
    args = {"parent": os.getpid(), "cpu_s": math.ceil(cpu_s), "mem_mb": mem_mb, "max_procs": max_procs}
    status_r, status_w = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps({**args, "status_fd": status_w}),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            pass_fds=(status_w,), start_new_session=True, env={}, cwd="/")
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    try:
        out, err, stopped = await _collect(proc, data, wall_s, 4 * max_output_chars)
        records = _read_records(status_r)
    finally:
        if proc.returncode is None:  # cancelled, or a bug above: the sandbox must not outlive the call
            await _stop(proc)
        os.close(status_r)
    return _result(records, out, err, stopped, max_output_chars)


def _check_args(code, cpu_s, wall_s, mem_mb, max_output_chars, max_procs) -> bytes:
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be str, got {type(code).__name__}")
    data = code.encode("utf-8", "surrogatepass")
    if len(data) > _MAX_CODE_BYTES:
        raise ValueError(f"run_python: code of {len(data)} bytes is over the {_MAX_CODE_BYTES}-byte limit")
    for name, value in (("cpu_s", cpu_s), ("wall_s", wall_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"run_python: {name}={value!r} must be a finite number > 0")
    # The interpreter alone maps about 12 MB, hence the 32 MB floor.
    for name, value, low in (("mem_mb", mem_mb, 32), ("max_output_chars", max_output_chars, 1), ("max_procs", max_procs, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"run_python: {name}={value!r} must be an int >= {low}")
    return data


async def _collect(proc, data: bytes, wall_s: float, out_cap: int) -> tuple[bytes, bytes, str | None]:
    """Feed the code, read both outputs with a bound, wait for the exit until the deadline. Returns
    (stdout head, stderr tail, why the sandbox was stopped or None)."""
    out, err = bytearray(), bytearray()
    too_long = asyncio.Event()
    tasks = [asyncio.ensure_future(t) for t in (
        _feed(proc.stdin, data),
        _pump(proc.stdout, out, keep=out_cap, limit=out_cap, tail=False, too_long=too_long),
        _pump(proc.stderr, err, keep=_ERR_TAIL_BYTES, limit=_ERR_LIMIT_BYTES, tail=True, too_long=too_long))]
    exited, overflow = asyncio.ensure_future(proc.wait()), asyncio.ensure_future(too_long.wait())
    try:
        done, _ = await asyncio.wait({exited, overflow}, timeout=wall_s, return_when=asyncio.FIRST_COMPLETED)
        stopped = None if exited in done else "output too long" if overflow in done else "timeout"
        if stopped:
            await _stop(proc)
        # All writers are dead now (the namespace went with init): the pipes reach EOF at once.
        await asyncio.wait_for(asyncio.gather(*tasks), _STOP_GRACE_S)
    finally:
        for t in (*tasks, exited, overflow):
            t.cancel()
    return bytes(out), bytes(err), stopped


async def _feed(stdin, data: bytes) -> None:
    try:
        stdin.write(data)
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):  # the wrapper died first: its status says why
        pass


async def _pump(stream, buf: bytearray, *, keep: int, limit: int, tail: bool, too_long: asyncio.Event) -> None:
    """Read `stream` to EOF, keeping its first (or last) `keep` bytes; set `too_long` past `limit`
    bytes. It reads on after that, discarding, because asyncio reports the exit only after EOF."""
    total = 0
    while chunk := await stream.read(1 << 16):
        total += len(chunk)
        if tail:
            buf += chunk
            del buf[:-keep]
        elif len(buf) < keep:
            buf += chunk[: keep - len(buf)]
        if total > limit:
            too_long.set()


async def _stop(proc) -> None:
    """SIGTERM makes the wrapper SIGKILL init, whose exit takes the whole PID namespace; SIGKILL to
    the wrapper's process group is the fallback."""
    try:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), _STOP_GRACE_S)
        return
    except ProcessLookupError:
        return
    except asyncio.TimeoutError:  # noqa: UP041 -- not yet the builtin TimeoutError on Python 3.10
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # pgid = pid (start_new_session); not reaped yet, so not reused
    except ProcessLookupError:
        pass
    await asyncio.wait_for(proc.wait(), _STOP_GRACE_S)


def _read_records(fd: int) -> list[dict]:
    """The JSON lines the wrapper, init and the tool wrote on the status pipe (all exited by now)."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return [json.loads(line) for line in b"".join(chunks).splitlines() if line.strip()]


def _result(records: list[dict], out: bytes, err: bytes, stopped: str | None, max_chars: int) -> SandboxResult:
    err_lines = [line for line in err.decode("utf-8", "replace").splitlines() if line.strip()]
    last_err = err_lines[-1].strip() if err_lines else ""
    for r in records:
        if "setup" in r:
            raise RuntimeError(r["setup"])
    final = next((r for r in records if "exit" in r or "signal" in r), None)
    if final is None and stopped is None:
        raise RuntimeError(f"sandbox died without a result: {last_err or 'no message'}")
    ok = stopped is None and final.get("exit") == 0
    error = stopped or _classify(final, last_err)
    text = out.decode("utf-8", "replace")
    if len(text) > max_chars and error is None:
        error = "output too long"
    if not ok and last_err:
        return SandboxResult(_with_last_line(text, last_err, max_chars), ok, error)
    return SandboxResult(text[:max_chars], ok, error)


def _classify(final: dict, last_err: str) -> str | None:
    sig = final.get("signal")
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and final["cpu_s"] >= final["cpu_limit_s"]):
        return "cpu"  # SIGXCPU at the soft limit, or SIGKILL at the hard one when SIGXCPU was caught
    if sig is not None:
        return f"signal {sig}"
    if final["exit"] == 0:
        return None
    if last_err.startswith("MemoryError"):
        return "memory"
    return f"exit {final['exit']}"


def _with_last_line(text: str, line: str, max_chars: int) -> str:
    """stdout then the error's line, the line kept whole (as far as it fits) when stdout is cut."""
    line = line[:max_chars]
    room = max_chars - len(line) - 1
    if room <= 0:
        return line
    text = text[:room]
    return f"{text}\n{line}" if text and not text.endswith("\n") else f"{text}{line}"


# ----------------------------------------------------------------------------------------------
# Sandbox side: runs as `python -I -S sandbox.py ARGS` (the wrapper), then in its forks.


def _wrapper_main(args: dict) -> None:
    status = args["status_fd"]
    os.set_inheritable(status, False)  # init gets it by fork; the tool's exec closes it
    libc = ctypes.CDLL(None, use_errno=True)
    _die_with_parent(libc, b"rc-sandbox")
    if os.getppid() != args["parent"]:  # the parent died before PR_SET_PDEATHSIG
        os._exit(1)
    code = sys.stdin.buffer.read(_MAX_CODE_BYTES + 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the tool's stdin
    os.close(devnull)
    try:
        _unshare_namespaces(libc)
    except OSError as e:
        _report(status, setup=f"cannot isolate the network: {_describe(e)}")
        os._exit(1)
    alive_r, alive_w = os.pipe()  # init sees EOF on it when the wrapper is gone
    init_pid = os.fork()
    if init_pid == 0:
        os.close(alive_w)
        _init_main(libc, args, code, alive_r)
    os.close(alive_r)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(init_pid, signal.SIGKILL))
    os.waitid(os.P_PID, init_pid, os.WEXITED | os.WNOWAIT)  # exited (with its namespace), not reaped
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # so the handler never signals a reused pid
    os.waitpid(init_pid, 0)
    os._exit(0)


def _unshare_namespaces(libc) -> None:
    """New network, mount, PID and IPC namespaces. Root may create them directly; another user needs
    a user namespace with them, in which it maps its own uid and gid to themselves."""
    flags = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC
    if os.geteuid() == 0:
        _check(libc.unshare(flags), "unshare(CLONE_NEWNET|CLONE_NEWNS|CLONE_NEWPID|CLONE_NEWIPC) as root")
        return
    uid, gid = os.geteuid(), os.getegid()
    _check(libc.unshare(CLONE_NEWUSER | flags), f"unshare(CLONE_NEWUSER|CLONE_NEWNET|...) as uid {uid}",
           "; unprivileged user namespaces are off? (sysctl user.max_user_namespaces, "
           "kernel.unprivileged_userns_clone, kernel.apparmor_restrict_unprivileged_userns)")
    _map_ids(uid, gid)


def _init_main(libc, args: dict, code: bytes, alive_r: int) -> None:
    """PID 1 of the sandbox: build its root filesystem, run the tool, report how it ended."""
    status = args["status_fd"]
    try:
        _die_with_parent(libc, b"rc-sandbox-init")
        os.set_blocking(alive_r, False)
        try:
            if os.read(alive_r, 1) == b"":  # EOF: the wrapper died before PR_SET_PDEATHSIG
                os._exit(1)
        except BlockingIOError:
            pass
        os.close(alive_r)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the tool may signal PID 1; only a handled signal arrives
        exe = os.path.realpath(sys.executable)  # resolved on the host: /work/.venv/bin/python is not in the new root
        try:
            _build_root(libc, code, exe)
        except OSError as e:
            _report(status, setup=f"cannot isolate the filesystem: {_describe(e)}")
            os._exit(1)
        tool_pid = os.fork()
        if tool_pid == 0:
            _tool_main(libc, args, exe)
        _, wstatus, usage = os.wait4(tool_pid, 0)
        cpu = usage.ru_utime + usage.ru_stime
        if os.WIFSIGNALED(wstatus):
            _report(status, signal=os.WTERMSIG(wstatus), cpu_s=cpu, cpu_limit_s=args["cpu_s"])
        else:
            _report(status, exit=os.waitstatus_to_exitcode(wstatus), cpu_s=cpu, cpu_limit_s=args["cpu_s"])
    except BaseException as e:  # noqa: BLE001 -- a bug here must not pass for the tool's own failure
        _report(status, setup=f"sandbox init failed: {e!r}")
    finally:
        os._exit(0)  # never back into the wrapper's code; the kernel now kills the namespace


def _build_root(libc, code: bytes, exe: str) -> None:
    """A new root: a tmpfs holding read-only binds of /usr, /bin, /lib* and the interpreter's prefix,
    /dev/{null,zero,full,random,urandom}, a /proc of the new PID namespace and a writable tmpfs /tmp;
    the old root is detached, so nothing else of the host (/work, /root, /home, ...) is visible."""
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted below reaches the host
    new = "/tmp"  # any directory serves as the mount point; the host's /tmp is only hidden, here
    _mount(libc, "tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    bound: list[str] = []
    for path in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                 os.path.realpath(sys.base_prefix), os.path.dirname(exe)):
        if any(path == b or path.startswith(b + "/") for b in bound) or not os.path.lexists(path):
            continue
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(path), new + path)
            continue
        os.makedirs(new + path, mode=0o755, exist_ok=True)
        _bind_ro(libc, path, new + path, MS_NODEV)
        bound.append(path)
    os.mkdir(new + "/dev", 0o755)
    for name in ("null", "zero", "full", "random", "urandom"):
        os.close(os.open(f"{new}/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o644))
        _bind_ro(libc, f"/dev/{name}", f"{new}/dev/{name}", 0)
    os.mkdir(new + "/proc", 0o755)
    _mount(libc, "proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(new + "/tmp", 0o755)
    _mount(libc, "tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={_TMP_MB}m,mode=1777")
    fd = os.open(new + "/tmp/tool.py", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
    os.write(fd, code)
    os.close(fd)
    os.mkdir(new + "/.old", 0o700)
    nr = _SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise OSError(f"pivot_root: no syscall number known for {platform.machine()}")
    _check(libc.syscall(nr, new.encode(), (new + "/.old").encode()), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.old", MNT_DETACH), "umount2(old root)")  # gone, so no chroot-style escape
    os.rmdir("/.old")
    _mount(libc, None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _tool_main(libc, args: dict, exe: str) -> None:
    """The tool's process: drop privileges, take the limits, exec the interpreter on /tmp/tool.py."""
    try:
        if os.geteuid() == 0:
            os.setgroups([])
            os.setgid(_NOBODY)
            os.setuid(_NOBODY)
            # A uid change makes the process non-dumpable: its /proc/self files then belong to root
            # and it cannot write its own uid_map.
            libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        uid, gid = os.getuid(), os.getgid()
        # A user namespace of its own: RLIMIT_NPROC then counts this call's processes, not every
        # process of the user (kernel ucounts are per user namespace), and the tool holds no
        # capability over the namespaces init set up.
        _check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER) for the tool")
        _map_ids(uid, gid)
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        mem = args["mem_mb"] << 20
        for res, soft, hard in ((resource.RLIMIT_CPU, args["cpu_s"], args["cpu_s"] + 1),  # SIGXCPU, then SIGKILL
                                (resource.RLIMIT_AS, mem, mem),
                                (resource.RLIMIT_FSIZE, _FSIZE_BYTES, _FSIZE_BYTES),
                                (resource.RLIMIT_NPROC, args["max_procs"], args["max_procs"]),
                                (resource.RLIMIT_NOFILE, _NOFILE, _NOFILE),
                                (resource.RLIMIT_CORE, 0, 0)):
            _, cur_hard = resource.getrlimit(res)
            if cur_hard != resource.RLIM_INFINITY:  # a user cannot raise its hard limit; lower is stricter
                hard = min(hard, cur_hard)
            resource.setrlimit(res, (min(soft, hard), hard))
        os.chdir("/tmp")
        os.execve(exe, [exe, "-I", "-S", "tool.py"], {})
    except (OSError, ValueError) as e:
        _report(args["status_fd"], setup=f"cannot start the tool's interpreter: {_describe(e)}")
    os._exit(127)


def _bind_ro(libc, src: str, dst: str, extra: int) -> None:
    """Bind `src` on `dst` read-only and nosuid. A user namespace may not clear the flags its source
    mount has (nodev, noexec, the atime mode), so they are carried over."""
    _mount(libc, src, dst, None, MS_BIND)
    st = os.statvfs(src).f_flag
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | extra
    for st_flag, ms_flag in ((os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME),
                             (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
        if st & st_flag:
            flags |= ms_flag
    if not st & (os.ST_NOATIME | os.ST_RELATIME):
        flags |= MS_STRICTATIME  # else a remount defaults to relatime
    _mount(libc, None, dst, None, flags)


def _mount(libc, src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    rc = libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(rc, f"mount({src}, {dst}, {fstype})")


def _map_ids(uid: int, gid: int) -> None:
    """Map our own uid/gid into the user namespace just entered (what an unprivileged process may
    write); without a mapping, files cannot be created (EOVERFLOW)."""
    for path, text in (("/proc/self/uid_map", f"{uid} {uid} 1"), ("/proc/self/setgroups", "deny"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):
        with open(path, "w") as f:
            f.write(text)


def _die_with_parent(libc, name: bytes) -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


def _check(rc: int, what: str, hint: str = "") -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what} failed: {os.strerror(err)}{hint}")


def _describe(e: OSError) -> str:
    return str(e) if e.filename else e.strerror or str(e)  # "[Errno 2] ...: 'path'" keeps the path


def _report(fd: int, **record) -> None:
    os.write(fd, (json.dumps(record) + "\n").encode())  # one write under PIPE_BUF: lines never interleave


if __name__ == "__main__":
    _wrapper_main(json.loads(sys.argv[1]))
