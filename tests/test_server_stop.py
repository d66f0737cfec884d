"""realcore.rollout.server_stop: the gserver manager stops a generation server that fails every request
(so the launcher restarts it), and only the process that serves the server's address."""

import json
import socket
import subprocess
import sys
import time

import psutil
import pytest

from realcore.rollout.server_stop import stop_server, take_reason

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(pid: int, port: int) -> bool:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for p in procs for c in p.net_connections("tcp"))


def test_stop_server_kills_the_group_serving_the_url_and_nothing_else(tmp_path):
    port = free_port()
    listen = f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(60)"
    # As the launcher starts a server: its own session; the listener is a child (as vLLM's engine core is).
    server = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "{listen}" & wait'], start_new_session=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        (tmp_path / "pids.json").write_text(json.dumps({"gen_server/0": server.pid, "gen_server/1": bystander.pid}))
        deadline = time.monotonic() + 20
        while not listening(server.pid, port):
            assert time.monotonic() < deadline, "the stand-in server never listened"
            time.sleep(0.05)
        child = psutil.Process(server.pid).children()[0]
        url = f"http://127.0.0.1:{port}"
        assert not stop_server(str(tmp_path), "gen_server/1", url, "x")  # listed, but serves another address
        assert not stop_server(str(tmp_path), "gen_server/2", url, "x")  # not listed
        assert take_reason(str(tmp_path), "gen_server/1") is None and bystander.poll() is None

        assert stop_server(str(tmp_path), "gen_server/0", url, "stopped: failed 8 requests\n(HTTP 500)")
        assert server.wait(10) == -9
        psutil.wait_procs([child], timeout=10)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE  # the whole group went
        assert take_reason(str(tmp_path), "gen_server/0") == "stopped: failed 8 requests (HTTP 500)"  # one line
        assert take_reason(str(tmp_path), "gen_server/0") is None  # read once
        assert bystander.poll() is None
    finally:
        for p in (server, bystander):
            if p.poll() is None:
                p.kill()
            p.wait()
