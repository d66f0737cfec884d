"""Name resolution: workers publish their addresses under a key; peers look them up.

Keys are slash-separated paths, always scoped by experiment and trial (see scoped_key), and a
run clears its scope at start: cluster.md saw a key left over from an earlier run send workers
to a dead port and hang them.

The interface (NameResolver) is small on purpose. Backends: a shared filesystem (default; no
service needed), Redis and etcd (for clusters without a shared filesystem, or many workers).

Nobody but the run may steer it (docs/security.md, "The name store"): the fs root is a private
folder (ours, 0700, checked), and every value is stored with a MAC of key and value under the run's
secret, checked on every read. An entry that fails the check (written by someone without the
secret, or by an earlier run) reads as absent and is counted as a drop on socket `name_resolve`.
"""

import abc
import hmac
import logging
import os
import shutil
import stat
import threading
import time
import uuid

import blake3

from realcore.api.config import NameResolveConfig
from realcore.transport import drops
from realcore.transport.wire import mac

log = logging.getLogger("realcore.name_resolve")

DROP_SOCKET = "name_resolve"  # drops.count socket name of refused entries
_MAC_CONTEXT = "realcore 2026-11 name_resolve entry MAC"  # its own key: an entry's MAC is never a wire MAC
_MAC_HEX = 64  # hex digits of the MAC stored before the value


class UnsafeStoreError(ValueError):
    """The fs root is a folder others could write to: the run refuses to use it."""


class NoSecretError(RuntimeError):
    """put/get on a resolver made without the run's secret."""


_process_secret: bytes | None = None


def use_secret(secret: bytes) -> None:
    """The run's secret for every resolver this process makes without one (run_worker sets it once,
    before any resolver is made): consumers (manager, weight pushes, stream, rendezvous) need not
    carry it."""
    global _process_secret
    _process_secret = secret


def _entry_key(secret: bytes) -> bytes:
    return blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest()


def sign(secret: bytes, key: str, value: str) -> str:
    """The stored form of `value` under `key`: hex MAC of (key, value), a newline, the value."""
    return mac([key.encode(), value.encode()], _entry_key(secret)).hex() + "\n" + value


_refused_lock = threading.Lock()
_refused: set[tuple[str, str]] = set()  # (key, stored text) already counted: a poll loop counts a forgery once


def verify(secret: bytes, key: str, stored: str) -> str | None:
    """The value if `stored` carries a valid MAC for `key`, else None (counted once per entry, logged once)."""
    tag, sep, value = stored.partition("\n")
    ok = False
    if sep and len(tag) == _MAC_HEX:
        try:
            ok = hmac.compare_digest(bytes.fromhex(tag), mac([key.encode(), value.encode()], _entry_key(secret)))
        except ValueError:
            pass
    if ok:
        return value
    with _refused_lock:
        if (key, stored) in _refused:
            return None
        if len(_refused) >= 4096:  # bounded: a flood of forgeries is counted, never stored without end
            _refused.clear()
        _refused.add((key, stored))
    drops.count(DROP_SOCKET, "mac" if sep and len(tag) == _MAC_HEX else "malformed",
                f"key '{key}' holds an entry without the run's MAC; read as absent")
    return None


class KeyExistsError(Exception):
    """put(replace=False) found the key already present."""


def check_key(key: str) -> str:
    """Validate a key: non-empty slash-separated parts, none empty, none starting with '.'."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"name_resolve: key must be a non-empty string, got {key!r}")
    if "\0" in key:
        raise ValueError(f"name_resolve: key {key!r} contains a NUL byte")
    for part in key.split("/"):
        # Parts starting with '.' are reserved: they would allow '..' escapes, and the fs
        # backend keeps its value and temporary files under such names.
        if not part or part.startswith("."):
            raise ValueError(f"name_resolve: bad key {key!r}: empty part or part starting with '.'")
    return key


def scoped_key(experiment: str, trial: str, *parts: str) -> str:
    """'experiment/trial/part/...': the only way keys should be built, so runs never collide."""
    for what, name in (("experiment", experiment), ("trial", trial)):
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise ValueError(f"name_resolve: bad {what} name {name!r} (no '/', no leading '.', non-empty)")
    return check_key("/".join((experiment, trial, *parts)))


class NameResolver(abc.ABC):
    """A small key -> str store shared by all processes of a run.

    Backends store and return raw text (_put, _get, _find); put/get/find sign and verify it with
    `secret`. A resolver without a secret can only delete and clear (the launcher, before the run's
    secret exists)."""

    backend_name: str = "abstract"
    secret: bytes | None = None

    def _secret(self) -> bytes:
        if self.secret is None:
            raise NoSecretError(f"name_resolve({self.backend_name}): this resolver has no run secret "
                                "(make_name_resolver(cfg, secret), or name_resolve.use_secret first)")
        return self.secret

    def put(self, key: str, value: str, *, replace: bool = False) -> None:
        """Store value; raise KeyExistsError if the key exists and not `replace`."""
        if not isinstance(value, str):
            raise ValueError(f"name_resolve: value for '{key}' must be str, got {type(value).__name__}")
        self._put(check_key(key), sign(self._secret(), key, value), replace=replace)

    def get(self, key: str) -> str:
        """The value of key; KeyError (naming key and backend) if absent or not signed by the run."""
        secret = self._secret()
        value = verify(secret, key, self._get(check_key(key)))
        if value is None:
            raise self._missing(key)
        return value

    def find(self, prefix: str) -> dict[str, str]:
        """Every key equal to `prefix` or under `prefix/`, with its value (unsigned entries left out)."""
        secret = self._secret()
        out = {}
        for key, stored in self._find(check_key(prefix)).items():
            value = verify(secret, key, stored)
            if value is not None:
                out[key] = value
        return out

    @abc.abstractmethod
    def _put(self, key: str, stored: str, *, replace: bool) -> None:
        """Store the signed text; KeyExistsError if the key exists and not `replace`."""

    @abc.abstractmethod
    def _get(self, key: str) -> str:
        """The stored text of key; KeyError if absent."""

    @abc.abstractmethod
    def _find(self, prefix: str) -> dict[str, str]:
        """Every key equal to `prefix` or under `prefix/`, with its stored text."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove key; KeyError if absent."""

    @abc.abstractmethod
    def clear(self, prefix: str) -> None:
        """Remove every key equal to `prefix` or under `prefix/` (no error if there is none)."""

    def _missing(self, key: str) -> KeyError:
        return KeyError(f"name_resolve({self.backend_name}): no key '{key}'")

    def wait(self, key: str, *, timeout_s: float, poll_s: float = 0.05) -> str:
        """Poll get(key) until it exists; TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        self._secret()  # no secret: fail now, not after timeout_s
        while True:
            try:
                return self.get(key)
            except KeyError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"name_resolve({self.backend_name}): gave up waiting for key '{key}' after {timeout_s:g} s"
                )
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))


def makedirs_private(path: str) -> None:
    """os.makedirs, every folder it creates mode 0700 (os.makedirs gives `mode` to the last only)."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:  # a concurrent put made it
            pass


def private_root(root: str) -> str:
    """`root` as an absolute path, created mode 0700 if absent (its missing parents too); refuse
    (UnsafeStoreError, one line naming the folder and what is wrong) a root that is a symbolic
    link, not a folder, owned by another user, or writable by group or others: whoever can write
    there can swap a key's folder (the MAC stops forged values, not a deleted or withheld one)."""
    root = os.path.abspath(root)
    try:
        makedirs_private(root)
    except OSError as e:
        raise UnsafeStoreError(f"name_resolve.root {root}: cannot create it: {e.strerror}") from None
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeStoreError(f"name_resolve.root {root} is a symbolic link; give the folder itself")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeStoreError(f"name_resolve.root {root} is not a folder")
    if st.st_uid != os.geteuid():
        raise UnsafeStoreError(f"name_resolve.root {root} is owned by uid {st.st_uid}, not by you (uid "
                               f"{os.geteuid()}): its owner could redirect the run; remove it or choose another folder")
    if st.st_mode & 0o022:
        raise UnsafeStoreError(f"name_resolve.root {root} is writable by group or others (mode "
                               f"{stat.S_IMODE(st.st_mode):04o}); chmod 700 it or choose another folder")
    return root


class FileNameResolver(NameResolver):
    """Keys on a (shared) filesystem: key 'a/b/c' is the file '<root>/a/b/c/.value'.

    The value lives in a file *inside* the key's directory so that 'a/b' and 'a/b/c' can both be
    keys. Writers never expose a partial file: they write a temporary file and then either
    os.replace it (replace=True) or os.link it (replace=False; link fails atomically with EEXIST,
    like O_EXCL, but the file appears with its full content). Both are atomic on local
    filesystems and on NFS. The root is private (private_root); key folders are made 0700 and
    values 0600.
    """

    backend_name = "fs"
    _VALUE = ".value"

    def __init__(self, root: str, secret: bytes | None = None):
        self.root = private_root(root)
        self.secret = secret

    def _dir(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _put(self, key: str, stored: str, *, replace: bool) -> None:
        d = self._dir(key)
        makedirs_private(d)
        tmp = os.path.join(d, f".tmp.{os.getpid()}.{uuid.uuid4().hex}")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
            f.write(stored)
        try:
            if replace:
                os.replace(tmp, os.path.join(d, self._VALUE))
                return
            try:
                os.link(tmp, os.path.join(d, self._VALUE))
            except FileExistsError:
                raise KeyExistsError(f"name_resolve({self.backend_name}): key '{key}' exists") from None
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)

    def _get(self, key: str) -> str:
        try:
            with open(os.path.join(self._dir(key), self._VALUE), encoding="utf-8") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            raise self._missing(key) from None
        except UnicodeDecodeError:
            return ""  # not text: verify() refuses and counts it

    def _find(self, prefix: str) -> dict[str, str]:
        out = {}
        for dirpath, _, filenames in os.walk(self._dir(prefix)):
            if self._VALUE not in filenames:
                continue
            key = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            try:
                out[key] = self._get(key)
            except KeyError:  # deleted between walk and read
                pass
        return out

    def delete(self, key: str) -> None:
        # Empty directories are left behind: removing them would race with a concurrent put
        # that has just created them; clear() removes whole subtrees.
        try:
            os.unlink(os.path.join(self._dir(key), self._VALUE))
        except (FileNotFoundError, NotADirectoryError):
            raise self._missing(key) from None

    def clear(self, prefix: str) -> None:
        def onerror(func, path, exc_info):
            if not issubclass(exc_info[0], FileNotFoundError):  # another process cleared it first
                raise exc_info[1]

        shutil.rmtree(self._dir(prefix), onerror=onerror)


def _host_port(address: str, backend: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"name_resolve({backend}): address must be host:port, got {address!r}")
    return host, int(port)


def _import(module: str, backend: str, extra: str):
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(f"name_resolve({backend}) needs the {module!r} package: pip install -e '.[{extra}]'") from None


def read_password(cfg: NameResolveConfig) -> str | None:
    """redis/etcd: the password from `password_file` (0600: refused if group or others can read
    it) or the environment variable `password_env`; None when neither is set. Never from the
    command line: it would show in `ps`."""
    if cfg.password_file and cfg.password_env:
        raise ValueError("name_resolve: set password_file or password_env, not both")
    if cfg.password_env:
        password = os.environ.get(cfg.password_env)
        if not password:
            raise ValueError(f"name_resolve.password_env: environment variable {cfg.password_env} is unset or empty")
        return password
    if cfg.password_file:
        try:
            mode = stat.S_IMODE(os.stat(cfg.password_file).st_mode)
            if mode & 0o077:
                raise ValueError(f"name_resolve.password_file {cfg.password_file} has mode {mode:04o}: group or "
                                 "others can read it; chmod 600 it")
            with open(cfg.password_file, encoding="utf-8") as f:
                password = f.read().rstrip("\r\n")
        except OSError as e:
            raise ValueError(f"name_resolve.password_file {cfg.password_file}: {e.strerror}") from None
        if not password:
            raise ValueError(f"name_resolve.password_file {cfg.password_file} is empty")
        return password
    return None


class RedisNameResolver(NameResolver):
    """Keys in Redis under `<namespace>/`; put(replace=False) is SET NX (atomic)."""

    backend_name = "redis"

    def __init__(self, address: str, namespace: str, timeout_s: float, secret: bytes | None = None, *,
                 username: str | None = None, password: str | None = None, tls_ca_file: str | None = None):
        redis = _import("redis", "redis", "redis")
        host, port = _host_port(address, "redis")
        self.ns, self.address, self.secret = namespace, address, secret
        tls = {"ssl": True, "ssl_ca_certs": tls_ca_file} if tls_ca_file else {}
        # No client retries (redis-py retries 3 times by default): a retried SET NX whose first
        # reply was lost would report our own key as taken, and retries stretch timeout_s.
        self.r = redis.Redis(host=host, port=port, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                             retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0), decode_responses=True,
                             username=username, password=password, **tls)
        try:
            self.r.ping()
        except redis.exceptions.AuthenticationError as e:
            raise ConnectionError(f"name_resolve(redis): {address} refused the credentials: {e}") from None
        except redis.exceptions.RedisError as e:
            raise ConnectionError(f"name_resolve(redis): cannot reach {address}: {e}") from None

    def _k(self, key: str) -> str:
        return f"{self.ns}/{check_key(key)}"

    def _put(self, key: str, stored: str, *, replace: bool) -> None:
        if not self.r.set(self._k(key), stored, nx=not replace) and not replace:
            raise KeyExistsError(f"name_resolve({self.backend_name}): key '{key}' exists")

    def _get(self, key: str) -> str:
        value = self.r.get(self._k(key))
        if value is None:
            raise self._missing(key)
        return value

    def _under(self, prefix: str) -> list[str]:
        """Stored names of `prefix` and every key under `prefix/` (glob characters escaped)."""
        full = self._k(prefix)
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in full) + "/*"
        return [full, *self.r.scan_iter(match=pattern, count=1000)]

    def _find(self, prefix: str) -> dict[str, str]:
        names = self._under(prefix)
        values = self.r.mget(names)
        return {n[len(self.ns) + 1:]: v for n, v in zip(names, values) if v is not None}

    def delete(self, key: str) -> None:
        if not self.r.delete(self._k(key)):
            raise self._missing(key)

    def clear(self, prefix: str) -> None:
        names = self._under(prefix)
        for i in range(0, len(names), 1000):
            self.r.delete(*names[i:i + 1000])


class EtcdNameResolver(NameResolver):
    """Keys in etcd v3 under `<namespace>/` (client: etcd-sdk-python, imported as `pyetcd`; the
    old `etcd3` package breaks on protobuf >= 4); put(replace=False) is a create-revision txn."""

    backend_name = "etcd"

    def __init__(self, address: str, namespace: str, timeout_s: float, secret: bytes | None = None, *,
                 username: str | None = None, password: str | None = None, tls_ca_file: str | None = None):
        pyetcd = _import("pyetcd", "etcd", "etcd")
        host, port = _host_port(address, "etcd")
        self.ns, self.address, self.secret = namespace, address, secret
        if (username is None) != (password is None):
            raise ValueError("name_resolve(etcd): username and a password (password_file or password_env) go together")
        if username is not None and tls_ca_file is None:  # grpc sends no call credentials over plain TCP
            raise ValueError("name_resolve(etcd): a login (username) needs TLS: set name_resolve.tls_ca_file")
        try:
            self.c = pyetcd.client(host=host, port=port, timeout=timeout_s, user=username, password=password,
                                   ca_cert=tls_ca_file)
            self.c.get(self.ns)  # a read, not status(): a server with auth enabled refuses it without a login
        except Exception as e:  # grpc raises many types; the user needs the address
            detail = e.details() if callable(getattr(e, "details", None)) else None  # grpc's reason
            raise ConnectionError(f"name_resolve(etcd): cannot reach {address}: {type(e).__name__}"
                                  + (f" ({detail})" if detail else "")) from None

    def _k(self, key: str) -> str:
        return f"{self.ns}/{check_key(key)}"

    def _put(self, key: str, stored: str, *, replace: bool) -> None:
        k = self._k(key)
        if replace:
            self.c.put(k, stored)
            return
        t = self.c.transactions
        created, _ = self.c.transaction(compare=[t.create(k) == 0], success=[t.put(k, stored)], failure=[])
        if not created:
            raise KeyExistsError(f"name_resolve({self.backend_name}): key '{key}' exists")

    def _get(self, key: str) -> str:
        value, _ = self.c.get(self._k(key))
        if value is None:
            raise self._missing(key)
        return value.decode("utf-8", errors="replace")

    def _find(self, prefix: str) -> dict[str, str]:
        out = {}
        value, _ = self.c.get(self._k(prefix))
        if value is not None:
            out[prefix] = value.decode("utf-8", errors="replace")
        for value, meta in self.c.get_prefix(self._k(prefix) + "/"):
            out[meta.key.decode("utf-8")[len(self.ns) + 1:]] = value.decode("utf-8", errors="replace")
        return out

    def delete(self, key: str) -> None:
        if not self.c.delete(self._k(key)):
            raise self._missing(key)

    def clear(self, prefix: str) -> None:
        self.c.delete(self._k(prefix))
        self.c.delete_prefix(self._k(prefix) + "/")


def make_name_resolver(cfg: NameResolveConfig, secret: bytes | None = None) -> NameResolver:
    """The resolver the config names, signing and checking entries with `secret` (None: the one
    this process set with use_secret, if any; without one it can only delete and clear)."""
    secret = secret if secret is not None else _process_secret
    if cfg.type == "fs":
        if cfg.root is None:
            raise ValueError("name_resolve.root is unset (ExperimentConfig sets it to OUTPUT_DIR/.name_resolve)")
        return FileNameResolver(cfg.root, secret)
    creds = {"username": cfg.username, "password": read_password(cfg), "tls_ca_file": cfg.tls_ca_file}
    if cfg.type == "redis":
        return RedisNameResolver(cfg.address or "127.0.0.1:6379", cfg.namespace, cfg.timeout_s, secret, **creds)
    if cfg.type == "etcd":
        return EtcdNameResolver(cfg.address or "127.0.0.1:2379", cfg.namespace, cfg.timeout_s, secret, **creds)
    raise ValueError(f"name_resolve: unknown backend {cfg.type!r} (known: fs, redis, etcd)")
