"""The wire format: round trips of every dtype, authentication failures, replay protection, size
limits, drop counting, real sockets, secrets."""

import logging
import os
import random
import stat
import time

import msgpack
import pytest
import torch
import zmq

from realcore.transport import drops, wire

torch.set_num_threads(1)
SECRET = b"s" * 32


def _roundtrip(header, tensors, secret=SECRET):
    return wire.decode(wire.encode(header, tensors, secret), secret)


def test_roundtrip_every_dtype_and_shape():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    tensors = [
        base.to(torch.bfloat16),
        base > 0,  # bool
        (base * 10).to(torch.uint8),
        (base * 1e6).to(torch.int64),
        base,  # float32
        base.to(torch.float16),
        torch.tensor(3.5),  # 0-d
        torch.tensor(7, dtype=torch.int64),  # 0-d int
        torch.empty(0, dtype=torch.float32),  # empty
        torch.empty(3, 0, 2, dtype=torch.bfloat16),  # empty, multi-dim
        base.t(),  # non-contiguous
        base[:, ::2],  # non-contiguous slice
    ]
    header = {"type": "data", "ids": [1, 2, 3], "nested": {"a": [1.5, None, True], "b": {"c": b"\x00"}}, 4: "k"}
    out_header, out = _roundtrip(header, tensors)
    assert out_header == header
    assert len(out) == len(tensors)
    for t, o in zip(tensors, out):
        assert o.dtype == t.dtype and o.shape == t.shape
        assert torch.equal(o, t)


def test_no_tensors_and_reserved_key():
    assert _roundtrip({"x": 1}, []) == ({"x": 1}, [])
    with pytest.raises(ValueError, match="reserved"):
        wire.encode({"_t": 1}, [], SECRET)
    with pytest.raises(ValueError, match="msgpack"):
        wire.encode({"x": object()}, [], SECRET)


def test_tensor_is_zero_copy_view_of_frame():
    frames = wire.encode({}, [torch.arange(4, dtype=torch.int64)], SECRET, zero_copy=True)
    frames = [bytearray(f) for f in frames]  # writable buffers, as zmq frames are
    _, (t,) = wire.decode(frames, SECRET)
    t[0] = 42
    assert int.from_bytes(frames[1][:8], "little") == 42


@pytest.mark.parametrize("case", ["tamper_header", "tamper_tensor", "tamper_mac", "wrong_secret",
                                  "drop_tensor", "only_one", "empty", "garbage", "swap_boundary"])
def test_bad_messages(case):
    frames = [bytes(f) for f in wire.encode({"op": "x"}, [torch.arange(8), torch.ones(2)], SECRET, zero_copy=True)]
    secret = SECRET
    if case == "tamper_header":
        frames[0] = frames[0][:-1] + bytes([frames[0][-1] ^ 1])
    elif case == "tamper_tensor":
        frames[1] = b"\x01" + frames[1][1:]
    elif case == "tamper_mac":
        frames[-1] = bytes(32)
    elif case == "wrong_secret":
        secret = b"t" * 32
    elif case == "drop_tensor":
        del frames[2]
    elif case == "only_one":
        frames = frames[:1]
    elif case == "empty":
        frames = []
    elif case == "garbage":
        frames = [os.urandom(50), os.urandom(32)]
    elif case == "swap_boundary":  # same bytes, different frame split: the lengths are in the MAC
        frames = [frames[0], frames[1] + frames[2][:4], frames[2][4:], frames[3]]
    with pytest.raises(wire.BadMessage):
        wire.decode(frames, secret)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["one_frame", "zero_copy"])
def test_a_changed_byte_anywhere_is_rejected(zero_copy):
    """Every single-byte change in every frame (header, each tensor, the MAC itself) is refused."""
    frames = [bytes(f) for f in wire.encode({"op": "x", "n": 3}, [torch.arange(5), torch.ones(3, dtype=torch.bfloat16)],
                                            SECRET, zero_copy=zero_copy)]
    assert len(frames) == (4 if zero_copy else 1)
    wire.decode(frames, SECRET)  # the untouched message passes
    for i, frame in enumerate(frames):
        for j in range(len(frame)):
            changed = list(frames)
            changed[i] = frame[:j] + bytes([frame[j] ^ 0x40]) + frame[j + 1 :]
            with pytest.raises(wire.BadMessage, match="mac"):
                wire.decode(changed, SECRET)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["one_frame", "zero_copy"])
@pytest.mark.parametrize("tensors", [[], [torch.arange(3)]], ids=["control", "tensor"])
def test_a_changed_byte_anywhere_in_a_sealed_message_is_rejected(tensors, zero_copy):
    """Endpoint.open, both forms: every single-byte change of every frame is refused, whether
    frames come as bytes or as buffers."""
    a = wire.Endpoint(SECRET, "a", socket="t")
    frames = [bytes(f) for f in a.seal({"op": "x", "ids": [1, 2]}, tensors, to="B", zero_copy=zero_copy)]
    assert len(frames) == (2 + len(tensors) if zero_copy else 1)
    assert wire.decode(frames, SECRET)[0]["op"] == "x"  # the endpoint's frames are the codec's
    for kind in (bytes, bytearray):
        b = wire.Endpoint(SECRET, "b", socket="t", address="B")
        for i, frame in enumerate(frames):
            for j in range(len(frame)):
                changed = [kind(f) for f in frames]
                changed[i] = kind(frame[:j] + bytes([frame[j] ^ 0x40]) + frame[j + 1:])
                with pytest.raises(wire.BadMessage, match="mac"):
                    b.open(changed)
        _, header, got = b.open([kind(f) for f in frames])  # the untouched message passes, once
        assert header == {"op": "x", "ids": [1, 2]} and [t.tolist() for t in got] == [t.tolist() for t in tensors]


def _signed1(body: bytes) -> list:
    """A one-frame message with a valid MAC around any body."""
    import blake3

    return [body + blake3.blake3(body, key=wire._mac1_key(SECRET)).digest()]


def test_one_frame_roundtrip_and_malformed_bodies():
    """The one-frame form: tensors come back equal (aligned copies); a body whose lengths do not
    add up is refused even under a valid MAC; the two forms' MACs are not interchangeable."""
    ts = [torch.arange(3, dtype=torch.int8), torch.ones(2, 3, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.int64),
          torch.arange(5, dtype=torch.float64)]
    (frame,) = wire.encode({"op": "x"}, ts, SECRET)
    header, got = wire.decode([frame], SECRET)
    assert header == {"op": "x"} and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, ts))
    assert all(t.data_ptr() % 8 == 0 for t in got if t.numel())
    head = msgpack.packb({"_t": [["int64", [4]]]})
    pad = bytes(-(4 + len(head)) % 8)  # the tensor starts 8-byte aligned
    cases = {
        "header past the end": (10**6).to_bytes(4, "big") + head,
        "tensor past the end": len(head).to_bytes(4, "big") + head + pad + bytes(16),
        "bytes after": len(head).to_bytes(4, "big") + head + pad + bytes(32) + b"x",
        "not msgpack": (3).to_bytes(4, "big") + b"\xc1\xc1\xc1",
    }
    for what, body in cases.items():
        with pytest.raises(wire.BadMessage, match="malformed"):
            wire.decode(_signed1(body), SECRET)
    wire.decode(_signed1(len(head).to_bytes(4, "big") + head + pad + bytes(32)), SECRET)  # lengths add up: passes
    with pytest.raises(wire.BadMessage, match="malformed"):
        wire.decode([b"short"], SECRET)
    multi = wire.encode({"op": "x"}, [torch.arange(3)], SECRET, zero_copy=True)
    with pytest.raises(wire.BadMessage, match="mac"):
        wire.decode([b"".join(bytes(f) for f in multi)], SECRET)  # zero-copy frames joined into one
    with pytest.raises(wire.BadMessage, match="mac"):
        wire.decode([frame[:40], frame[40:-32], frame[-32:]], SECRET)  # one frame cut into three


def _signed(frames):
    return [*frames, wire.mac(frames, SECRET)]


@pytest.mark.parametrize(
    "frames, match",
    [
        ([b"\xc1not msgpack"], "msgpack"),
        ([msgpack.packb([1, 2])], "not a map"),
        ([msgpack.packb({"_t": [["float32", [2]]]})], "1 tensors but 0"),
        ([msgpack.packb({"_t": [["float32", [2]]]}), b"\x00" * 7], "7 bytes"),
        ([msgpack.packb({"_t": [["object", [1]]]}), b"\x00"], "bad metadata"),
        ([msgpack.packb({"_t": [["float32", [-1]]]}), b""], "bad metadata"),
        ([msgpack.packb({"x": 1}), b"\x00"], "missing"),
    ],
)
def test_authenticated_but_malformed(frames, match):
    with pytest.raises(wire.BadMessage, match=match):
        wire.decode(_signed(frames), SECRET)


@pytest.fixture
def sock():
    """sock(type) -> a new socket; all are closed (linger 0) at teardown."""
    c, made = zmq.Context(), []

    def make(kind):
        made.append(c.socket(kind))
        return made[-1]

    yield make
    for s in made:
        s.close(linger=0)
    c.term()


def _ep(name, address=None, secret=SECRET, **limits):
    lim = wire.Limits(**{"max_message_bytes": 2**20, "max_control_message_bytes": 2**16, "clock_skew_s": 5.0, **limits})
    return wire.Endpoint(secret, name, socket=f"test-{name}", address=address, limits=lim)


def test_dealer_router_over_tcp(sock):
    router = sock(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    server, client = _ep("server", address), _ep("client")
    dealer = sock(zmq.DEALER)
    dealer.connect(address)
    x = torch.randn(1000, 300).to(torch.bfloat16)  # 600 KB: above pyzmq's copy threshold
    wire.send(dealer, {"op": "push", "step": 3}, [x, torch.tensor(True)], endpoint=client, to=address)
    peer, header, (y, flag) = wire.recv(router, endpoint=server, router=True, timeout_s=10)
    assert header == {"op": "push", "step": 3} and torch.equal(y, x) and bool(flag)
    assert peer.sender == client.id and peer.routing_id
    wire.send(router, {"op": "ack"}, endpoint=server, to=peer)
    assert wire.recv(dealer, endpoint=client, timeout_s=10) == (wire.Peer(server.id), {"op": "ack"}, [])


def test_push_pull_wrong_secret_is_dropped_not_fatal(sock):
    pull = sock(zmq.PULL)
    address = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    push = sock(zmq.PUSH)
    push.connect(address)
    wire.send(push, {"n": 1}, endpoint=_ep("forger", secret=b"wrong" * 8), to=address)
    wire.send(push, {"n": 2}, [torch.arange(3)], endpoint=_ep("pusher"), to=address)
    receiver = _ep("puller", address)
    with pytest.raises(wire.BadMessage) as e:
        wire.recv(pull, endpoint=receiver, timeout_s=10)
    assert e.value.reason == "mac"
    _, header, (t,) = wire.recv(pull, endpoint=receiver, timeout_s=10)  # the next one still arrives
    assert header == {"n": 2} and t.tolist() == [0, 1, 2]


def test_recv_timeout_names_purpose(sock):
    pull = sock(zmq.PULL)
    pull.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(TimeoutError, match="master control socket within 0.1 s"):
        wire.recv(pull, endpoint=_ep("idle"), timeout_s=0.1, what="master control socket")


# --- replay protection ------------------------------------------------------------------------------


def _reason(endpoint, frames, router=False):
    with pytest.raises(wire.BadMessage) as e:
        endpoint.open(frames, router=router)
    return e.value.reason


def test_a_message_is_accepted_once():
    server, client = _ep("srv", "tcp://127.0.0.1:1"), _ep("cli")
    frames = client.seal({"cmd": 6, "rid": 1}, [torch.arange(3)], to=server.address)
    peer, header, (t,) = server.open(frames)
    assert peer == wire.Peer(client.id) and header == {"cmd": 6, "rid": 1} and t.tolist() == [0, 1, 2]
    assert _reason(server, frames) == "replay"
    assert server.open(client.seal({"cmd": 6, "rid": 2}, to=server.address))[1]["rid"] == 2  # new ones still pass
    assert _reason(server, frames) == "replay"


def test_a_message_for_one_receiver_is_refused_by_another():
    a, b, client = _ep("a", "tcp://127.0.0.1:1"), _ep("b", "tcp://127.0.0.1:2"), _ep("cli")
    frames = client.seal({"x": 1}, to=a.address)
    assert _reason(b, frames) == "misaddressed"
    a.open(frames)
    # A reply is addressed to the endpoint that asked: another client does not take it.
    other = _ep("cli2")
    reply = a.seal({"ok": True}, to=wire.Peer(client.id, b"route"))
    assert reply[0] == b"route"  # a ROUTER reply starts with the peer's routing identity
    assert _reason(other, reply[1:]) == "misaddressed"
    assert client.open(reply[1:])[1] == {"ok": True}


def test_a_restarted_receiver_refuses_what_was_sent_before_it_started():
    """Its per-sender state is gone, so the timestamp decides: older than its start minus the
    clock-skew allowance is refused; within the allowance it is accepted (once)."""
    address = "tcp://127.0.0.1:1"
    client = _ep("cli")
    old = client.seal({"rid": 1}, to=address)
    _ep("before", address).open(old)  # the first incarnation took it
    time.sleep(0.05)
    strict = _ep("after", address, clock_skew_s=0.0)  # restarted at the same address, no allowance
    assert _reason(strict, old) == "stale"
    lenient = _ep("after2", address, clock_skew_s=5.0)
    lenient.open(old)
    assert _reason(lenient, old) == "replay"
    # A new message from the same sender is fine for the restarted receiver.
    assert strict.open(client.seal({"rid": 2}, to=address))[1] == {"rid": 2}


def test_reordering_within_the_window_is_accepted_once():
    server, client = _ep("srv", "tcp://127.0.0.1:1"), _ep("cli")
    sealed = [client.seal({"i": i}, to=server.address) for i in range(wire.REPLAY_WINDOW + 30)]
    order = list(range(20))
    random.Random(0).shuffle(order)
    assert [server.open(sealed[i])[1]["i"] for i in order] == order  # out of order: each accepted
    assert {_reason(server, sealed[i]) for i in order} == {"replay"}  # and only once
    server.open(sealed[-1])  # the sender's latest is now seq REPLAY_WINDOW + 30
    assert _reason(server, sealed[25]) == "replay"  # seq 26, unseen but outside the window: could be a replay
    server.open(sealed[-2])  # unseen and inside the window
    assert _reason(server, sealed[-2]) == "replay"


def test_forgotten_senders_cannot_be_replayed():
    guard = wire.ReplayGuard(not_before=0.0, window=8, max_senders=2)
    guard.accept("a", 1, 10.0)
    guard.accept("b", 1, 11.0)
    guard.accept("c", 1, 12.0)  # "a" (least recently heard) is forgotten
    with pytest.raises(wire.BadMessage, match="forgot"):
        guard.accept("a", 1, 10.0)  # its old message again: refused, though "a" is unknown now
    guard.accept("a", 2, 13.0)  # a newer one is fine
    guard.accept("d", 1, 14.0)


def test_unsealed_or_bad_envelopes_are_malformed():
    server = _ep("srv", "tcp://127.0.0.1:1")
    assert _reason(server, wire.encode({"x": 1}, [], SECRET)) == "malformed"  # the codec alone: no envelope
    for env in ([1, 1, server.address, 0.0], ["s", 0, server.address, 0.0], ["s", 1, server.address], "x",
                ["s", True, server.address, time.time()], ["s", 1, server.address, float("nan")]):
        frames = [msgpack.packb({"_e": env, "_t": []})]
        assert _reason(server, _signed(frames)) == "malformed", env
    with pytest.raises(ValueError, match="reserved"):
        server.seal({"_e": 1}, to="x")
    assert _reason(server, [b"only"], router=True) == "malformed"


def test_drops_are_counted_by_socket_and_reason():
    server, client = _ep("counted", "tcp://127.0.0.1:1"), _ep("cli")
    before = drops.snapshot()
    frames = client.seal({}, to=server.address)
    server.open(frames)
    for _ in range(3):
        _reason(server, frames)
    _reason(server, client.seal({}, to="tcp://elsewhere:1"))
    _reason(server, [b"x", b"y"])
    after = drops.snapshot()
    new = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert new == {"test-counted/replay": 3, "test-counted/misaddressed": 1, "test-counted/mac": 1}


def test_drop_log_is_rate_limited(caplog):
    drops.set_log_interval(3600)
    try:
        with caplog.at_level(logging.WARNING, logger="realcore.drops"):
            for _ in range(1000):
                drops.count("flood", "mac", "a forged message")
            assert len(caplog.records) == 1 and "flood: mac (a forged message)" in caplog.text
            drops.set_log_interval(0.0)  # a summary is due: the next count (or snapshot) writes one line
            drops.snapshot()
            assert len(caplog.records) == 2 and "flood/mac 999" in caplog.records[-1].getMessage()
    finally:
        drops.set_log_interval(60.0)


def test_tally_turns_totals_into_increments():
    t = drops.Tally()
    assert t.update(("w", 1), {"control/mac": 2}) == {"control/mac": 2}
    assert t.update(("w", 1), {"control/mac": 5, "data/replay": 1}) == {"control/mac": 3, "data/replay": 1}
    assert t.update(("w", 1), {"control/mac": 5, "data/replay": 1}) == {}
    assert t.update(("w", 2), {"control/mac": 1}) == {"control/mac": 1}  # restarted (new pid): from zero


# --- size limits ------------------------------------------------------------------------------------


def test_limits_default_to_the_config():
    from realcore.api.config import SystemConfig

    s = SystemConfig()
    assert wire.Limits.of() == wire.Limits(s.max_message_bytes, s.max_control_message_bytes, s.clock_skew_s)
    assert s.max_message_bytes == 2**31
    assert wire.Limits.of(SystemConfig(max_message_bytes=100)).max_control_message_bytes == 100  # capped


def test_sender_refuses_frames_over_the_limits():
    client = _ep("big", max_message_bytes=1000, max_control_message_bytes=500)
    client.seal({}, [torch.zeros(250)], to="x", zero_copy=True)  # a frame of 1000 bytes: at the limit
    with pytest.raises(ValueError, match=r"tensor 1 \(float32 \[251\]\) is 1004 bytes, over system.max_message_bytes = 1000"):
        client.seal({}, [torch.zeros(2), torch.zeros(251)], to="x", zero_copy=True)
    (frame,) = client.seal({}, [torch.zeros(200)], to="x")  # one frame: tensors, header and MAC together
    with pytest.raises(ValueError, match=rf"a message of {len(frame) + 200} bytes is over system.max_message_bytes = 1000"):
        client.seal({}, [torch.zeros(250)], to="x")
    with pytest.raises(ValueError, match="over system.max_control_message_bytes = 500"):
        client.seal({"ids": list(range(1000))}, to="x")


def test_a_frame_over_the_socket_limit_is_dropped_and_the_socket_keeps_working(sock):
    router = sock(zmq.ROUTER)
    wire.set_max_size(router, 4096)
    address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    server, client = _ep("limited", address), _ep("cli")
    big = sock(zmq.DEALER)
    big.connect(address)
    big.send_multipart([b"h", b"\0" * 10_000, b"m"])  # ZeroMQ cuts this connection, allocating nothing
    assert not router.poll(500)
    for dealer in (sock(zmq.DEALER), big):  # a new peer, and the offender (it reconnects)
        dealer.connect(address)
        wire.send(dealer, {"ok": 1}, [torch.zeros(100)], endpoint=client, to=address)
        _, header, (t,) = wire.recv(router, endpoint=server, router=True, timeout_s=10)
        assert header == {"ok": 1} and t.numel() == 100


def test_secret_file(tmp_path):
    path = tmp_path / "sub" / "secret"
    s = wire.write_secret(str(path))
    assert len(s) == 32 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert wire.load_secret(str(path)) == s
    with pytest.raises(FileExistsError):
        wire.write_secret(str(path))
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="0o644.*chmod 600"):
        wire.load_secret(str(path))
    bad = tmp_path / "bad"
    bad.write_text("zz\n")
    os.chmod(bad, 0o600)
    with pytest.raises(ValueError, match="hex"):
        wire.load_secret(str(bad))


def test_a_large_message_is_maced_on_several_threads_with_the_same_digest():
    """From MAC_THREADS_FROM bytes the MAC runs on all cores; the digest is BLAKE3's, the same as
    one thread's (a receiver of either kind accepts it)."""
    import blake3

    big = torch.arange(wire.MAC_THREADS_FROM // 8 + 1, dtype=torch.int64)
    frames = wire.encode({"op": "x"}, [big], SECRET, zero_copy=True)
    one = blake3.blake3(key=wire._mac_key(SECRET), max_threads=1)
    for f in frames[:-1]:
        buf = memoryview(f)
        one.update(buf.nbytes.to_bytes(8, "big"))
        one.update(buf)
    assert bytes(frames[-1]) == one.digest()
    _, (t,) = wire.decode(frames, SECRET)
    assert torch.equal(t, big)


# --- unauthenticated input: nothing parsed before the MAC, frames capped, CURVE ---------------------


def _curve_pair(sock, limits=None):
    """A CURVE server ROUTER (bound) and its address, and the limits used."""
    lim = limits or wire.Limits(2**24, 2**16, 5.0, 16, True)
    router = sock(zmq.ROUTER)
    router.setsockopt(zmq.RCVTIMEO, 5000)
    wire.secure(router, SECRET, server=True, limits=lim, socket="test-curve")
    return router, f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}", lim


def test_a_header_of_msgpack_bombs_is_hashed_not_parsed(sock):
    """8 MiB of 0x80 (each an empty map: ~73x larger as Python objects if unpacked) as the
    header of a zero-copy message: refused by its MAC, having cost about its own bytes."""
    import tracemalloc

    lim = wire.Limits(2**24, 2**24, 5.0, 16, False)
    router = sock(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    dealer = sock(zmq.DEALER)
    dealer.connect(address)
    dealer.send_multipart([b"\x80" * (8 << 20), b"t" * 100, b"m" * 32])
    assert wire.readable(router, 5000)
    before = drops.snapshot().get("test-bomb/mac", 0)
    tracemalloc.start()
    try:
        with pytest.raises(wire.BadMessage, match="mac"):
            wire.recv(router, endpoint=wire.Endpoint(SECRET, "r", socket="test-bomb", address=address, limits=lim),
                      router=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, peak  # the frame's 8 MiB copy, not 600 MB of empty dicts
    assert drops.snapshot()["test-bomb/mac"] == before + 1


def test_a_message_of_too_many_frames_is_drained_and_counted(sock):
    """100,000 empty frames to a socket that takes 16: read to the end without being kept, counted
    as malformed; the next message on the socket is served."""
    lim = wire.Limits(2**20, 2**16, 5.0, 16, False)
    router = sock(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    dealer = sock(zmq.DEALER)
    dealer.connect(address)
    dealer.send_multipart([b""] * 100_000)
    client, server = _ep("client"), wire.Endpoint(SECRET, "r", socket="test-frames", address=address, limits=lim)
    wire.send(dealer, {"n": 1}, [torch.arange(3)], endpoint=client, to=address, zero_copy=True)
    with pytest.raises(wire.BadMessage, match="100001 frames"):  # + the routing id
        wire.recv(router, endpoint=server, router=True, timeout_s=10)
    assert drops.snapshot()["test-frames/malformed"] >= 1
    _, header, (t,) = wire.recv(router, endpoint=server, router=True, timeout_s=10)
    assert header == {"n": 1} and t.tolist() == [0, 1, 2]
    # A control socket reads at most CONTROL_MAX_FRAMES per message, and goes on to the next.
    dealer.send_multipart([b""] * 1000)
    wire.send(dealer, {"n": 2}, endpoint=client, to=address)
    assert wire.readable(router, 5000)
    before = drops.snapshot().get("test-ctl/malformed", 0)
    deadline = time.time() + 5
    while (frames := wire.recv_waiting(router, "test-ctl")) is None and time.time() < deadline:
        time.sleep(0.01)
    assert server.open(frames, router=True)[1] == {"n": 2}
    assert drops.snapshot()["test-ctl/malformed"] == before + 1


def test_curve_round_trip_and_keys_from_the_secret(sock):
    router, address, lim = _curve_pair(sock)
    dealer = sock(zmq.DEALER)
    wire.secure(dealer, SECRET, server=False, limits=lim)
    dealer.connect(address)
    client, server = _ep("client"), wire.Endpoint(SECRET, "r", socket="test-curve", address=address, limits=lim)
    wire.send(dealer, {"x": 1}, [torch.ones(4)], endpoint=client, to=address, zero_copy=True)
    peer, header, (t,) = wire.recv(router, endpoint=server, router=True, timeout_s=10)
    assert header == {"x": 1} and t.tolist() == [1.0] * 4
    wire.send(router, {"ok": True}, endpoint=server, to=peer)
    assert wire.recv(dealer, endpoint=client, timeout_s=10)[1] == {"ok": True}
    assert wire.curve_keys(SECRET, "server") == wire.curve_keys(SECRET, "server")
    assert wire.curve_keys(SECRET, "server") != wire.curve_keys(b"t" * 32, "server")
    assert wire.curve_keys(SECRET, "server") != wire.curve_keys(SECRET, "client")


def test_curve_keeps_out_peers_without_the_secret(sock):
    """A plain peer and a CURVE peer with another secret's keys cannot complete a handshake: what
    they send is never delivered (8 MiB of 0x80 included), and the server counts each failure."""
    router, address, lim = _curve_pair(sock)
    before = drops.snapshot().get("test-curve/handshake", 0)
    plain = sock(zmq.DEALER)
    plain.connect(address)
    wrong = sock(zmq.DEALER)
    wire.secure(wrong, b"w" * 32, server=False, limits=lim)
    wrong.connect(address)
    for s in (plain, wrong):
        # NOBLOCK: once a handshake has failed the DEALER has no pipe, and a blocking send would wait forever.
        for frames in ([b"\x80" * (8 << 20), b"m" * 32], [b""] * 1000):
            try:
                s.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
    assert _wait_for(lambda: drops.snapshot().get("test-curve/handshake", 0) >= before + 2, 10)
    assert not wire.readable(router, 500)  # nothing delivered


def _wait_for(cond, timeout_s):
    deadline = time.time() + timeout_s
    while not cond() and time.time() < deadline:
        time.sleep(0.02)
    return cond()


def test_curve_off_is_a_plain_socket(sock):
    lim = wire.Limits(2**20, 2**16, 5.0, 16, False)
    s = sock(zmq.ROUTER)
    wire.secure(s, SECRET, server=True, limits=lim, socket="x")
    assert s.getsockopt(zmq.MECHANISM) == zmq.NULL
    wire.secure(s, SECRET, server=True, limits=wire.Limits.of(), socket=None)
    assert s.getsockopt(zmq.MECHANISM) == zmq.CURVE
