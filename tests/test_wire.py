"""The wire format: round trips of every dtype, authentication failures, real sockets, secrets."""

import os
import stat

import msgpack
import pytest
import torch
import zmq

from realcore.system import wire

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
    frames = wire.encode({}, [torch.arange(4, dtype=torch.int64)], SECRET)
    frames = [bytearray(f) for f in frames]  # writable buffers, as zmq frames are
    _, (t,) = wire.decode(frames, SECRET)
    t[0] = 42
    assert int.from_bytes(frames[1][:8], "little") == 42


@pytest.mark.parametrize("case", ["tamper_header", "tamper_tensor", "tamper_mac", "wrong_secret",
                                  "drop_tensor", "only_one", "empty", "garbage", "swap_boundary"])
def test_bad_messages(case):
    frames = [bytes(f) for f in wire.encode({"op": "x"}, [torch.arange(8), torch.ones(2)], SECRET)]
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


def test_dealer_router_over_tcp(sock):
    router = sock(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = sock(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    x = torch.randn(1000, 300).to(torch.bfloat16)  # 600 KB: above pyzmq's copy threshold
    wire.send(dealer, {"op": "push", "step": 3}, [x, torch.tensor(True)], secret=SECRET)
    ident, header, (y, flag) = wire.recv(router, secret=SECRET, router=True, timeout_s=10)
    assert header == {"op": "push", "step": 3} and torch.equal(y, x) and bool(flag)
    wire.send(router, {"op": "ack"}, secret=SECRET, identity=ident)
    assert wire.recv(dealer, secret=SECRET, timeout_s=10) == (None, {"op": "ack"}, [])


def test_push_pull_wrong_secret_is_dropped_not_fatal(sock):
    pull = sock(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = sock(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    wire.send(push, {"n": 1}, secret=b"wrong" * 8)
    wire.send(push, {"n": 2}, [torch.arange(3)], secret=SECRET)
    with pytest.raises(wire.BadMessage):
        wire.recv(pull, secret=SECRET, timeout_s=10)
    _, header, (t,) = wire.recv(pull, secret=SECRET, timeout_s=10)  # the next one still arrives
    assert header == {"n": 2} and t.tolist() == [0, 1, 2]


def test_recv_timeout_names_purpose(sock):
    pull = sock(zmq.PULL)
    pull.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(TimeoutError, match="master control socket within 0.1 s"):
        wire.recv(pull, secret=SECRET, timeout_s=0.1, what="master control socket")


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
