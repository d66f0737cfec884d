"""Name resolution: workers publish their addresses under a key; peers look them up.

Keys are slash-separated paths, always scoped by experiment and trial (see scoped_key), and a
run clears its scope at start: cluster.md saw a key left over from an earlier run send workers
to a dead port and hang them.

The interface (NameResolver) is small on purpose. Backends: a shared filesystem (default; no
service needed), Redis and etcd (for clusters without a shared filesystem, or many workers).
"""

import abc
import os
import shutil
import time
import uuid

from realcore.api.config import NameResolveConfig


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
    """A small key -> str store shared by all processes of a run."""

    backend_name: str = "abstract"

    @abc.abstractmethod
    def put(self, key: str, value: str, *, replace: bool = False) -> None:
        """Store value; raise KeyExistsError if the key exists and not `replace`."""

    @abc.abstractmethod
    def get(self, key: str) -> str:
        """The value of key; KeyError (naming key and backend) if absent."""

    @abc.abstractmethod
    def find(self, prefix: str) -> dict[str, str]:
        """Every key equal to `prefix` or under `prefix/`, with its value."""

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


class FileNameResolver(NameResolver):
    """Keys on a (shared) filesystem: key 'a/b/c' is the file '<root>/a/b/c/.value'.

    The value lives in a file *inside* the key's directory so that 'a/b' and 'a/b/c' can both be
    keys. Writers never expose a partial file: they write a temporary file and then either
    os.replace it (replace=True) or os.link it (replace=False; link fails atomically with EEXIST,
    like O_EXCL, but the file appears with its full content). Both are atomic on local
    filesystems and on NFS.
    """

    backend_name = "fs"
    _VALUE = ".value"

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    def _dir(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def put(self, key: str, value: str, *, replace: bool = False) -> None:
        if not isinstance(value, str):
            raise ValueError(f"name_resolve: value for '{key}' must be str, got {type(value).__name__}")
        d = self._dir(key)
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".tmp.{os.getpid()}.{uuid.uuid4().hex}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(value)
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

    def get(self, key: str) -> str:
        try:
            with open(os.path.join(self._dir(key), self._VALUE), encoding="utf-8") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            raise self._missing(key) from None

    def find(self, prefix: str) -> dict[str, str]:
        out = {}
        for dirpath, _, filenames in os.walk(self._dir(prefix)):
            if self._VALUE not in filenames:
                continue
            key = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            try:
                out[key] = self.get(key)
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


class RedisNameResolver(NameResolver):
    """Keys in Redis under `<namespace>/`; put(replace=False) is SET NX (atomic)."""

    backend_name = "redis"

    def __init__(self, address: str, namespace: str, timeout_s: float):
        redis = _import("redis", "redis", "redis")
        host, port = _host_port(address, "redis")
        self.ns, self.address = namespace, address
        # No client retries (redis-py retries 3 times by default): a retried SET NX whose first
        # reply was lost would report our own key as taken, and retries stretch timeout_s.
        self.r = redis.Redis(host=host, port=port, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                             retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0), decode_responses=True)
        try:
            self.r.ping()
        except redis.exceptions.RedisError as e:
            raise ConnectionError(f"name_resolve(redis): cannot reach {address}: {e}") from None

    def _k(self, key: str) -> str:
        return f"{self.ns}/{check_key(key)}"

    def put(self, key: str, value: str, *, replace: bool = False) -> None:
        if not isinstance(value, str):
            raise ValueError(f"name_resolve: value for '{key}' must be str, got {type(value).__name__}")
        if not self.r.set(self._k(key), value, nx=not replace) and not replace:
            raise KeyExistsError(f"name_resolve({self.backend_name}): key '{key}' exists")

    def get(self, key: str) -> str:
        value = self.r.get(self._k(key))
        if value is None:
            raise self._missing(key)
        return value

    def _under(self, prefix: str) -> list[str]:
        """Stored names of `prefix` and every key under `prefix/` (glob characters escaped)."""
        full = self._k(prefix)
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in full) + "/*"
        return [full, *self.r.scan_iter(match=pattern, count=1000)]

    def find(self, prefix: str) -> dict[str, str]:
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

    def __init__(self, address: str, namespace: str, timeout_s: float):
        pyetcd = _import("pyetcd", "etcd", "etcd")
        host, port = _host_port(address, "etcd")
        self.ns, self.address = namespace, address
        self.c = pyetcd.client(host=host, port=port, timeout=timeout_s)
        try:
            self.c.status()
        except Exception as e:  # grpc raises many types; the user needs the address
            raise ConnectionError(f"name_resolve(etcd): cannot reach {address}: {type(e).__name__}") from None

    def _k(self, key: str) -> str:
        return f"{self.ns}/{check_key(key)}"

    def put(self, key: str, value: str, *, replace: bool = False) -> None:
        if not isinstance(value, str):
            raise ValueError(f"name_resolve: value for '{key}' must be str, got {type(value).__name__}")
        k = self._k(key)
        if replace:
            self.c.put(k, value)
            return
        t = self.c.transactions
        created, _ = self.c.transaction(compare=[t.create(k) == 0], success=[t.put(k, value)], failure=[])
        if not created:
            raise KeyExistsError(f"name_resolve({self.backend_name}): key '{key}' exists")

    def get(self, key: str) -> str:
        value, _ = self.c.get(self._k(key))
        if value is None:
            raise self._missing(key)
        return value.decode("utf-8")

    def find(self, prefix: str) -> dict[str, str]:
        out = {}
        value, _ = self.c.get(self._k(prefix))
        if value is not None:
            out[prefix] = value.decode("utf-8")
        for value, meta in self.c.get_prefix(self._k(prefix) + "/"):
            out[meta.key.decode("utf-8")[len(self.ns) + 1:]] = value.decode("utf-8")
        return out

    def delete(self, key: str) -> None:
        if not self.c.delete(self._k(key)):
            raise self._missing(key)

    def clear(self, prefix: str) -> None:
        self.c.delete(self._k(prefix))
        self.c.delete_prefix(self._k(prefix) + "/")


def make_name_resolver(cfg: NameResolveConfig) -> NameResolver:
    """The resolver the config names."""
    if cfg.type == "fs":
        return FileNameResolver(cfg.root)
    if cfg.type == "redis":
        return RedisNameResolver(cfg.address or "127.0.0.1:6379", cfg.namespace, cfg.timeout_s)
    if cfg.type == "etcd":
        return EtcdNameResolver(cfg.address or "127.0.0.1:2379", cfg.namespace, cfg.timeout_s)
    raise ValueError(f"name_resolve: unknown backend {cfg.type!r} (known: fs, redis, etcd)")
