"""The name store is the run's own: a root folder others own or can write to is refused before
anything starts (the real launcher: exit 2, one line, nothing created); the folders and files the
fs backend makes are private; a forged address written by hand is refused and counted by a reader
in another process; Redis logs in with the configured credentials (a real redis-server that
requires them)."""

import json
import multiprocessing as mp
import os
import shutil
import socket
import stat
import subprocess
import sys
import time

import pytest
from conftest import skip_unless_ci, stop_daemon

from realcore.api.config import NameResolveConfig
from realcore.transport.name_resolve import FileNameResolver, UnsafeStoreError, make_name_resolver

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = b"k" * 32


def _launch_refused(tmp_path, root: str) -> str:
    """The real launcher with name_resolve.root=`root`: exit 2 and one line, before any model,
    secret or worker (output_dir holds the run's lock only); `root` is left as it was. Returns the line."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    before = sorted(os.listdir(root))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "realcore.launch", "experiment=ppo-math", "model=tiny",
                        f"output_dir={out}", f"model.cache_dir={cache}", f"system.name_resolve.root={root}"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"realcore: config error: name_resolve.root {root} "), r.stderr
    assert os.listdir(out) == [".lock"], os.listdir(out)  # the run's lock only: no secret, no logs, no worker
    assert not cache.exists()  # no model built
    assert sorted(os.listdir(root)) == before
    assert time.monotonic() - t0 < 60
    return lines[0]


def test_launch_refuses_a_world_writable_root(tmp_path):
    root = tmp_path / "shared-nr"
    root.mkdir()
    os.chmod(root, 0o777)  # what another user who made the folder first would leave
    assert "writable by group or others (mode 0777)" in _launch_refused(tmp_path, str(root))


def test_launch_refuses_a_foreign_root(tmp_path):
    if os.geteuid() == 0:  # as root: give a private-looking folder to nobody
        root = tmp_path / "foreign-nr"
        root.mkdir(mode=0o700)
        os.chown(root, 65534, 65534)
        owner = 65534
    else:  # elsewhere a folder that root owns is foreign
        root, owner = "/", 0
    assert f"is owned by uid {owner}, not by you" in _launch_refused(tmp_path, str(root))


def test_private_root_folders_and_files(tmp_path):
    """Created 0700 (parents too), whatever the umask; key folders 0700, values 0600; a symbolic
    link as root is refused (its target could change)."""
    old = os.umask(0)
    try:
        nr = FileNameResolver(str(tmp_path / "a" / "nr"), SECRET)
        nr.put("exp/t/w/0", "tcp://127.0.0.1:1")
    finally:
        os.umask(old)
    for path in (tmp_path / "a", tmp_path / "a" / "nr", tmp_path / "a/nr/exp", tmp_path / "a/nr/exp/t/w/0"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700, path
    assert stat.S_IMODE(os.stat(tmp_path / "a/nr/exp/t/w/0/.value").st_mode) == 0o600
    os.symlink(tmp_path / "a" / "nr", tmp_path / "link")
    with pytest.raises(UnsafeStoreError, match="is a symbolic link"):
        FileNameResolver(str(tmp_path / "link"), SECRET)
    os.chmod(tmp_path / "a" / "nr", 0o720)
    with pytest.raises(UnsafeStoreError, match="writable by group or others"):
        FileNameResolver(str(tmp_path / "a" / "nr"), SECRET)


def _reader(root: str, key: str, ready, out) -> None:
    """A run process waiting for a peer's address, as the master waits for its model workers."""
    from realcore.transport import drops, name_resolve

    name_resolve.use_secret(SECRET)
    nr = make_name_resolver(NameResolveConfig(root=root))
    ready.set()
    address = nr.wait(key, timeout_s=20, poll_s=0.01)
    out.put((address, drops.snapshot()))


def test_forged_address_written_by_hand_is_refused_and_counted(tmp_path):
    root, key = str(tmp_path / "nr"), "exp/t/run-x/model_worker/0"
    FileNameResolver(root, SECRET)
    ctx = mp.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=_reader, args=(root, key, ready, out))
    reader.start()
    try:
        assert ready.wait(timeout=60)
        folder = os.path.join(root, *key.split("/"))
        os.makedirs(folder)
        with open(os.path.join(folder, ".value"), "w") as f:  # no MAC: what an intruder can write
            f.write(json.dumps({"control": "tcp://10.9.9.9:5555", "pid": 1}))
        time.sleep(0.5)  # the reader polls it many times meanwhile
        assert out.empty()  # still waiting: the forged address was not taken
        FileNameResolver(root, SECRET).put(key, json.dumps({"control": "tcp://127.0.0.1:4000", "pid": 2}), replace=True)
        address, dropped = out.get(timeout=20)
    finally:
        reader.join(timeout=20)
        if reader.is_alive():
            reader.kill()
    assert json.loads(address)["control"] == "tcp://127.0.0.1:4000"
    assert dropped == {"name_resolve/malformed": 1}  # counted once, however often it was polled


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_with_auth(tmp_path_factory):
    """A redis-server on loopback whose default user needs a password and with an ACL user."""
    if shutil.which("redis-server") is None:
        skip_unless_ci("redis-server is not installed (apt-get install redis-server)")
    pytest.importorskip("redis", reason="pip install -e '.[redis]'")
    import redis

    d, port = tmp_path_factory.mktemp("redis-auth"), _free_port()
    with open(d / "log", "wb") as log:
        proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                 "--appendonly", "no", "--dir", str(d), "--requirepass", "default-pw",
                                 "--user", "alice", "on", ">alice-pw", "~*", "+@all"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                redis.Redis(host="127.0.0.1", port=port, password="default-pw", socket_timeout=1).ping()
                break
            except redis.exceptions.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, open(d / "log").read()[-2000:]
                time.sleep(0.1)
        yield f"127.0.0.1:{port}", d
    finally:
        stop_daemon(proc)


def test_redis_credentials(redis_with_auth, monkeypatch):
    address, d = redis_with_auth
    cfg = NameResolveConfig(type="redis", address=address, timeout_s=2, namespace="auth-test")
    with pytest.raises(ConnectionError, match=f"name_resolve\\(redis\\): {address} refused the credentials"):
        make_name_resolver(cfg, SECRET)
    pw = d / "alice.pw"
    pw.write_text("alice-pw\n")
    os.chmod(pw, 0o644)
    with pytest.raises(ValueError, match="group or others can read it; chmod 600 it"):
        make_name_resolver(cfg.model_copy(update={"username": "alice", "password_file": str(pw)}), SECRET)
    os.chmod(pw, 0o600)
    alice = make_name_resolver(cfg.model_copy(update={"username": "alice", "password_file": str(pw)}), SECRET)
    alice.put("exp/t/k", "v")
    monkeypatch.setenv("RC_TEST_REDIS_PW", "default-pw")
    default = make_name_resolver(cfg.model_copy(update={"password_env": "RC_TEST_REDIS_PW"}), SECRET)
    assert default.get("exp/t/k") == "v"
    monkeypatch.setenv("RC_TEST_REDIS_PW", "wrong")
    with pytest.raises(ConnectionError, match="refused the credentials"):
        make_name_resolver(cfg.model_copy(update={"password_env": "RC_TEST_REDIS_PW"}), SECRET)
    with pytest.raises(ValueError, match="RC_TEST_UNSET is unset"):
        make_name_resolver(cfg.model_copy(update={"password_env": "RC_TEST_UNSET"}), SECRET)


def _mesh_cfg(tmp_path, **system):
    from realcore.api.config import ExperimentConfig, MFCConfig, SystemConfig

    return ExperimentConfig(experiment_name="rdv", trial_name=tmp_path.name, output_dir=str(tmp_path),
                            mfcs=[MFCConfig(name="n", type="sft_update")],
                            system=SystemConfig(request_timeout_s=30, startup_timeout_s=10, **system))


def test_a_rank_refuses_a_store_without_the_runs_proof(tmp_path):
    """A store at the published address that rank 0 did not make (no proof, or another run's) is
    refused at once by a joining rank, before it trusts a single key."""
    from datetime import timedelta

    from realcore.transport import keys
    from realcore.transport.rendezvous import LOOPBACK, init_mesh, serve_store, store_address

    cfg = _mesh_cfg(tmp_path)
    nr = make_name_resolver(cfg.system.name_resolve, SECRET)
    for secret, why in ((None, "holds no run proof"), (b"o" * 32, "holds a wrong run proof")):
        stranger = serve_store(LOOPBACK, 2, timedelta(seconds=10), secret)
        nr.put(keys.dist_init(cfg), store_address(LOOPBACK, stranger.port), replace=True)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=f"rendezvous: the store at tcp://127.0.0.1:{stranger.port} {why}"):
            init_mesh(cfg, nr, 1, 2)
        assert time.monotonic() - t0 < 5
        del stranger


def test_each_training_mesh_has_its_own_rendezvous(tmp_path):
    """A role on a mesh of its own (allocation_mode actor:d1,ref:d2) is a torch.distributed world of
    its own: its ranks join the store published under that mesh's key, not the actor mesh's."""
    from datetime import timedelta

    from realcore.transport import keys
    from realcore.transport.rendezvous import LOOPBACK, init_mesh, serve_store, store_address

    cfg = _mesh_cfg(tmp_path)
    nr = make_name_resolver(cfg.system.name_resolve, SECRET)
    first = serve_store(LOOPBACK, 2, timedelta(seconds=10), None)
    second = serve_store(LOOPBACK, 2, timedelta(seconds=10), None)
    nr.put(keys.dist_init(cfg), store_address(LOOPBACK, first.port), replace=True)
    nr.put(keys.dist_init(cfg) + "/mesh1", store_address(LOOPBACK, second.port), replace=True)
    with pytest.raises(RuntimeError, match=f"the store at tcp://127.0.0.1:{second.port} holds no run proof"):
        init_mesh(cfg, nr, 1, 2, mesh=1)
    del first, second


def test_a_local_mesh_listens_on_loopback_whatever_system_host(tmp_path, monkeypatch):
    """scheduler=local: every rank is on this machine, so the store binds loopback even when
    system.host is the wildcard (servers reachable from elsewhere); the rank's own proof passes."""
    from datetime import timedelta

    import psutil
    import torch.distributed as dist

    from realcore.transport import keys
    from realcore.transport.rendezvous import check_proof, init_mesh, parse_address

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # process-wide: kept from bind_gloo_to, undone after
    cfg = _mesh_cfg(tmp_path, host="0.0.0.0")
    nr = make_name_resolver(cfg.system.name_resolve, SECRET)
    init_mesh(cfg, nr, 0, 1)
    try:
        address = nr.get(keys.dist_init(cfg))
        host, port = parse_address(address)
        assert host == "127.0.0.1"
        listening = {c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        assert ("127.0.0.1", port) in listening and ("0.0.0.0", port) not in listening
        check_proof(dist.TCPStore(host, port, 2, False, timedelta(seconds=5)), SECRET, address)  # as rank 1 would
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def etcd_with_auth(tmp_path_factory):
    """etcd over TLS (a self-signed certificate for 127.0.0.1) with auth enabled: user root."""
    for tool in ("etcd", "openssl"):
        if shutil.which(tool) is None:
            skip_unless_ci(f"{tool} is not installed")
    pytest.importorskip("pyetcd", reason="pip install -e '.[etcd]'")
    import pyetcd
    from pyetcd import etcdrpc

    d = tmp_path_factory.mktemp("etcd-auth")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", d / "key.pem", "-out",
                    d / "cert.pem", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    client, peer = f"https://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    port = int(client.rsplit(":", 1)[1])
    with open(d / "log", "wb") as log:
        proc = subprocess.Popen(["etcd", "--data-dir", d / "data", "--listen-client-urls", client,
                                 "--advertise-client-urls", client, "--cert-file", d / "cert.pem", "--key-file",
                                 d / "key.pem", "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                 "--initial-cluster", f"default={peer}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                admin = pyetcd.client(host="127.0.0.1", port=port, timeout=2, ca_cert=str(d / "cert.pem"))
                admin.status()
                break
            except Exception:
                assert proc.poll() is None and time.monotonic() < deadline, open(d / "log").read()[-2000:]
                time.sleep(0.2)
        admin.authstub.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password="root-pw"), 5)
        admin.authstub.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), 5)
        admin.authstub.AuthEnable(etcdrpc.AuthEnableRequest(), 5)
        yield f"127.0.0.1:{port}", d
    finally:
        stop_daemon(proc)


def test_etcd_credentials(etcd_with_auth, monkeypatch):
    address, d = etcd_with_auth
    cfg = NameResolveConfig(type="etcd", address=address, timeout_s=3, namespace="auth-test",
                            tls_ca_file=str(d / "cert.pem"))
    with pytest.raises(ConnectionError, match=f"name_resolve\\(etcd\\): cannot reach {address}: .*user name is empty"):
        make_name_resolver(cfg, SECRET)
    monkeypatch.setenv("RC_TEST_ETCD_PW", "wrong")
    with pytest.raises(ConnectionError, match="authentication failed"):
        make_name_resolver(cfg.model_copy(update={"username": "root", "password_env": "RC_TEST_ETCD_PW"}), SECRET)
    monkeypatch.setenv("RC_TEST_ETCD_PW", "root-pw")
    root = make_name_resolver(cfg.model_copy(update={"username": "root", "password_env": "RC_TEST_ETCD_PW"}), SECRET)
    root.put("exp/t/k", "v")
    assert root.get("exp/t/k") == "v"
    with pytest.raises(ValueError, match="a login \\(username\\) needs TLS"):
        make_name_resolver(cfg.model_copy(update={"username": "root", "password_env": "RC_TEST_ETCD_PW",
                                                  "tls_ca_file": None}), SECRET)
