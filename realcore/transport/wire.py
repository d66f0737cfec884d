"""The wire format of every ZeroMQ message in realcore (no pickle anywhere).

A message is one frame by default:

    [u32 header length | header | tensor_0 | ... | tensor_{n-1} | mac]   (each tensor 8-byte aligned)

or, when its sender asks for `zero_copy` (bulk tensors to a socket that hears from one peer):

    [header] [tensor_0] ... [tensor_{n-1}] [mac]   (one frame each)

- header: a msgpack map. Any msgpack-able dict, plus two reserved keys: ``_t`` = a list of
  ``[dtype name, shape]``, one per tensor, and ``_e`` = the envelope ``[sender, seq, to, ts]``
  (below).
- tensor_i: the raw bytes of a contiguous CPU tensor. In the zero-copy form they are sent and
  received without a copy (the received tensor is a view of the ZeroMQ frame's memory); in the
  one-frame form they are copied in and out (fine for the small tensors it carries).
- mac: BLAKE3 in keyed mode (a MAC; the key is derived from the run's secret). One frame: over
  everything before it. Zero-copy: over every preceding frame, each fed as its 8-byte length then
  its bytes, so frame boundaries are authenticated too; the two forms use different keys. BLAKE3
  rather than HMAC-SHA256: it hashes at ~3.8 GB/s on one core here against 1.6 for HMAC-SHA256 and
  ~1.5-2 for a memcpy, and a payload is hashed on both sides.

Why one frame by default: libzmq (4.3.5 and master) can abort the process
(``Assertion failed: !_more (src/fq.cpp:80)``) or hand over a frame of another peer's message
when a socket that fair-queues several peers (a ROUTER, or a DEALER connected to several) sees one
peer's connection end while it is between the frames of another peer's message: its pipe list is
reordered under the message being read. A message of one frame is never read "between frames".
So a multi-frame message may only go to a socket that hears from one peer (a DEALER per peer).

The MAC proves a message came from the run, not that it is new: every socket owner therefore sends
and receives through an `Endpoint`, which seals each message with an envelope inside the MAC:
the sender's id (its name + random bytes, fresh per process start), a per-sender sequence number
(strictly increasing), the receiver it is meant for (a bound socket's address, or the id of the
endpoint a reply answers) and the wall-clock time. A receiving Endpoint accepts each (sender, seq)
once, only when addressed to it, and nothing stamped before its own start minus
`system.clock_skew_s`: a captured message replayed to the same, another or a restarted receiver is
dropped (`BadMessage`, counted in realcore.transport.drops). docs/wire.md has the details.

Sizes are bounded: receiving sockets set ZMQ_MAXMSGSIZE (per frame) from `Limits`, and a sender
refuses a frame its receiver would drop, naming the config key. Nothing is parsed before the MAC:
a receiver reads the frames of a message as they are (up to a number of frames: the rest is read
and let go), hashes them, and only then unpacks the header.

Connections: with `system.wire_curve` (the default) every socket is a ZeroMQ CURVE server (bound)
or client (connecting), keys derived from the run's secret (`secure`): a peer without the secret
cannot complete a handshake, so it cannot make a listener read a frame at all, and the traffic is
encrypted. The MAC and envelope stay: they also hold between the run's own processes (replays).

Zero-copy send means ZeroMQ reads the tensor's memory *after* ``send`` returns: do not modify a
sent tensor until the peer has acknowledged it (acknowledge at the application level anyway:
cluster.md saw messages lost when a sender exited right after a burst).
"""

from __future__ import annotations

import functools
import hmac
import itertools
import math
import os
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import blake3
import msgpack
import zmq
import zmq.utils.z85
from zmq.backend import Socket as _RawSocket
from zmq.backend import zmq_poll

from realcore.api.config import SystemConfig
from realcore.transport import drops, handshakes
from realcore.transport.drops import BadMessage
from realcore.transport.replay import ReplayGuard

if TYPE_CHECKING:
    import torch

MAC_SIZE = 32  # bytes of a BLAKE3 digest
_MAC_CONTEXT = "realcore 2026-11 wire frames MAC"  # BLAKE3 key derivation: a key for this use only
_MAC1_CONTEXT = "realcore 2026-11 wire one-frame MAC"  # the one-frame form's key (never the other's)
_ALIGN = 8  # tensors in a one frame message start at multiples of this (their dtype's alignment)
_META_KEY = "_t"
_ENVELOPE_KEY = "_e"
# The replay window (as IPsec's, RFC 4303 section 3.4.3): a sequence number up to this far below
# the highest one seen from its sender is still accepted once, so messages of one sender that
# reach a receiver out of order (over two connections, from two threads) are not lost.
REPLAY_WINDOW = 1024
# Senders remembered per receiver; the least recently heard one is forgotten first, and anything
# it (or any sender not heard of) stamped before its last message is then refused as stale.
MAX_SENDERS = 4096
# Frames one message may have on a control socket (one frame, plus a ROUTER's routing id; a few
# more for a zero-copy message without tensors): a message with more is drained and dropped.
CONTROL_MAX_FRAMES = 8
_CURVE_SERVER_CONTEXT = "realcore 2026-11 wire CURVE server key"
_CURVE_CLIENT_CONTEXT = "realcore 2026-11 wire CURVE client key"
# Dtypes allowed on the wire, by name. A name is data, so decode() checks it against this list
# before it looks it up in torch. torch itself is imported on the first tensor: the processes that
# only pass control messages (launcher, master, manager) start ~2 s of CPU sooner without it.
_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")


def _buffer(frame) -> memoryview:
    """The bytes of a frame as a memoryview: zmq.Frame (copy=False), bytes or any buffer."""
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)


@functools.lru_cache(maxsize=8)
def _mac_key(secret: bytes) -> bytes:
    return blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest()


@functools.lru_cache(maxsize=8)
def _mac1_key(secret: bytes) -> bytes:
    return blake3.blake3(secret, derive_key_context=_MAC1_CONTEXT).digest()


# From this many bytes a MAC is computed on all cores (BLAKE3 splits its input over threads; same
# digest): the other side of a transfer waits meanwhile, and 64 MB hash in 8-10 ms on 2 cores here
# against 16 on one. Below it, starting the threads costs more than they save.
MAC_THREADS_FROM = 4 << 20


def mac(frames, secret: bytes) -> bytes:
    """Keyed BLAKE3 over frames, each preceded by its 8-byte big-endian length."""
    bufs = [_buffer(f) for f in frames]
    big = sum(b.nbytes for b in bufs) >= MAC_THREADS_FROM
    h = blake3.blake3(key=_mac_key(secret), max_threads=blake3.blake3.AUTO if big else 1)
    for buf in bufs:
        h.update(buf.nbytes.to_bytes(8, "big"))
        h.update(buf)
    return h.digest()


def _tensor_buffer(t: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU tensor's memory (copies only if it is non-contiguous)."""
    import torch  # why: control-only processes start without torch (_DTYPES)

    if not isinstance(t, torch.Tensor):
        raise ValueError(f"wire: tensors must be torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"wire: tensors must be on CPU, got one on {t.device}")
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"wire: dtype {name} is not supported (supported: {sorted(_DTYPES)})")
    # reshape(-1) makes a 1-d view (0-d -> 1 element); view(uint8) reinterprets any dtype,
    # including bfloat16 which numpy cannot hold, as bytes.
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())  # the numpy array keeps the tensor alive while zmq sends


def _pack(header: dict) -> bytes:
    try:
        return msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"wire: header is not msgpack-able: {e}") from e


def _encode(header: dict, tensors, secret: bytes, zero_copy: bool = False) -> list:
    tensors = list(tensors)
    meta = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    bufs = [_tensor_buffer(t) for t in tensors]
    head = _pack({**header, _META_KEY: meta})
    if not bufs and not zero_copy:  # a control message: the fewest calls (its per-message cost)
        body = len(head).to_bytes(4, "big") + head
        return [body + blake3.blake3(body, key=_mac1_key(secret)).digest()]
    if zero_copy:
        frames = [head, *bufs]
        frames.append(mac(frames, secret))
        return frames
    parts = [len(head).to_bytes(4, "big"), head]
    pos = 4 + len(head)
    for b in bufs:
        if pad := -pos % _ALIGN:
            parts.append(bytes(pad))
        parts.append(b)
        pos += pad + b.nbytes
    h = blake3.blake3(key=_mac1_key(secret), max_threads=blake3.blake3.AUTO if pos >= MAC_THREADS_FROM else 1)
    for p in parts:
        h.update(p)
    parts.append(h.digest())
    return [b"".join(parts)]  # the one copy of the tensors


def _check_header(header: dict) -> None:
    if not isinstance(header, dict):
        raise ValueError(f"wire: header must be a dict, got {type(header).__name__}")
    if _META_KEY in header or _ENVELOPE_KEY in header:
        raise ValueError(f"wire: header key {_META_KEY if _META_KEY in header else _ENVELOPE_KEY!r} is reserved")


def encode(header: dict, tensors, secret: bytes, *, zero_copy: bool = False) -> list:
    """Frames for one message without an envelope: one frame, or with `zero_copy` [msgpack header,
    raw tensor buffers..., MAC] (see the module docstring for when that is safe). The codec only;
    processes send through an Endpoint (replay protection)."""
    _check_header(header)
    return _encode(header, tensors, secret, zero_copy)


def _parse_meta(meta, n_frames: int | None) -> list[tuple[torch.dtype, list[int]]]:
    if not isinstance(meta, list):
        raise BadMessage("malformed", f"tensor metadata {_META_KEY!r} is missing or not a list")
    if n_frames is not None and len(meta) != n_frames:
        raise BadMessage("malformed", f"metadata lists {len(meta)} tensors but {n_frames} tensor frames came")
    out = []
    for i, m in enumerate(meta):
        ok = isinstance(m, list) and len(m) == 2 and isinstance(m[1], list)
        if not ok or m[0] not in _DTYPES or not all(isinstance(s, int) and s >= 0 for s in m[1]):
            raise BadMessage("malformed", f"tensor {i}: bad metadata {m!r}")
        out.append((m[0], m[1]))
    if out:
        import torch  # why: control-only processes start without torch (_DTYPES)

        out = [(getattr(torch, name), shape) for name, shape in out]  # names from _DTYPES only
    return out


def decode(frames, secret: bytes) -> tuple[dict, list[torch.Tensor]]:
    """Authenticate and parse frames from encode(); the tensors of a zero-copy message are views
    of its frames' memory, those of a one-frame message copies.
    A sealed message's envelope stays in the header under ``_e`` (Endpoint.open checks it)."""
    if type(frames) is not list:
        frames = list(frames)
    if len(frames) == 1:
        f = frames[0]
        return _decode_one(f if type(f) is bytes else _buffer(f), secret)
    if len(frames) < 2:
        raise BadMessage("malformed", "no frames")
    head = _buffer(frames[0])
    ok = hmac.compare_digest(mac(frames[:-1], secret), bytes(_buffer(frames[-1])))
    if not ok:
        raise BadMessage("mac", "HMAC mismatch (wrong secret, tampered or truncated message)")
    try:
        # strict_map_key=False: int keys are allowed; the message is already authenticated.
        header = msgpack.unpackb(head, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise BadMessage("malformed", f"header is not valid msgpack: {e!r}") from e
    if not isinstance(header, dict):
        raise BadMessage("malformed", f"header is a {type(header).__name__}, not a map")
    specs = _parse_meta(header.pop(_META_KEY, None), len(frames) - 2)
    if not specs:
        return header, []
    import torch  # why: control-only processes start without torch (_DTYPES)

    tensors = []
    for i, ((dtype, shape), f) in enumerate(zip(specs, frames[1:-1])):
        buf = _buffer(f)
        nbytes = math.prod(shape) * dtype.itemsize
        if buf.nbytes != nbytes:
            raise BadMessage("malformed", f"tensor {i}: {buf.nbytes} bytes for {dtype} {shape} ({nbytes} expected)")
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dtype))  # frombuffer rejects empty buffers
            continue
        # frombuffer as uint8 then view: no copy, and it works for every dtype incl. bfloat16.
        tensors.append(torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape))
    return header, tensors


def _decode_one(f, secret: bytes) -> tuple[dict, list[torch.Tensor]]:
    """decode() of the one-frame form: [u32 header length | header | aligned tensors | mac].
    `f`: bytes (a control message, sliced as bytes: cheaper at its size) or a memoryview."""
    if len(f) < 4 + MAC_SIZE:
        raise BadMessage("malformed", f"truncated: a frame of {len(f)} bytes")
    end = len(f) - MAC_SIZE
    if end < MAC_THREADS_FROM:
        h = blake3.blake3(f[:end], key=_mac1_key(secret))
    else:
        h = blake3.blake3(f[:end], key=_mac1_key(secret), max_threads=blake3.blake3.AUTO)
    if not hmac.compare_digest(h.digest(), f[end:]):
        raise BadMessage("mac", "MAC mismatch (wrong secret, tampered or truncated message)")
    pos = 4 + int.from_bytes(f[:4], "big")
    if pos > end:
        raise BadMessage("malformed", f"header length {pos - 4} runs past the frame ({end - 4} bytes)")
    try:
        header = msgpack.unpackb(f[4:pos], raw=False, strict_map_key=False)  # authenticated already
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise BadMessage("malformed", f"header is not valid msgpack: {e!r}") from e
    if not isinstance(header, dict):
        raise BadMessage("malformed", f"header is a {type(header).__name__}, not a map")
    specs = _parse_meta(header.pop(_META_KEY, None), None)
    tensors = []
    if specs:
        import torch  # why: control-only processes start without torch (_DTYPES)

        for i, (dtype, shape) in enumerate(specs):
            pos += -pos % _ALIGN
            nbytes = math.prod(shape) * dtype.itemsize
            if pos + nbytes > end:
                raise BadMessage("malformed", f"tensor {i} ({dtype} {shape}) runs past the frame")
            # A copy: writable, aligned, and it does not keep the whole frame alive.
            t = torch.frombuffer(bytearray(f[pos:pos + nbytes]), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            tensors.append(t.view(dtype).reshape(shape))
            pos += nbytes
    if pos != end:
        raise BadMessage("malformed", f"{end - pos} bytes after the header and tensors")
    return header, tensors


# --- sockets: size limits, CURVE, endpoints (replay protection: replay.py) --------------------------


@dataclass(frozen=True)
class Limits:
    """Size and clock settings of one process's sockets (SystemConfig's keys of the same names)."""

    max_message_bytes: int  # a tensor frame (ZMQ_MAXMSGSIZE of tensor-carrying sockets)
    max_control_message_bytes: int  # a header (ZMQ_MAXMSGSIZE of control sockets)
    clock_skew_s: float
    max_message_frames: int = 65536  # frames of one message on a tensor-carrying socket
    curve: bool = True  # CURVE on every connection (secure)

    @classmethod
    def of(cls, system: SystemConfig | None = None) -> Limits:
        s = system if system is not None else SystemConfig()
        control = min(s.max_control_message_bytes, s.max_message_bytes)  # lowering one lowers both
        return cls(s.max_message_bytes, control, s.clock_skew_s, s.max_message_frames, s.wire_curve)


def set_max_size(sock: zmq.Socket, nbytes: int) -> None:
    """ZMQ_MAXMSGSIZE: a peer that sends a larger frame is disconnected before ZeroMQ allocates
    it (the socket goes on serving the others). Set it before bind/connect."""
    sock.setsockopt(zmq.MAXMSGSIZE, int(nbytes))


@functools.lru_cache(maxsize=16)
def curve_keys(secret: bytes, role: str) -> tuple[bytes, bytes]:
    """(public, secret) CURVE keys, Z85, of `role` ("server" or "client") for the run's secret. The
    server's public key is a secret too: a client must know it to say HELLO, and it never travels
    in clear (CurveZMQ sends only short-term keys, boxed), so it is what keeps outsiders out."""
    context = {"server": _CURVE_SERVER_CONTEXT, "client": _CURVE_CLIENT_CONTEXT}[role]
    sk = zmq.utils.z85.encode(blake3.blake3(secret, derive_key_context=context).digest())
    return zmq.curve_public(sk), sk


def secure(sock: zmq.Socket, secret: bytes, *, server: bool, limits: Limits, socket: str | None = None) -> None:
    """Make `sock` a CURVE server (`server`: it binds) or client (it connects) with the run's keys,
    unless `limits.curve` is off. Call it before bind/connect. A server's failed handshakes are
    counted as drops under `socket` (its name in drop counts), reason "handshake"."""
    if not limits.curve:
        return
    server_public, server_secret = curve_keys(secret, "server")
    if server:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, server_secret)
        if socket is not None:
            handshakes.watch(sock, socket)
    else:
        public, key = curve_keys(secret, "client")
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, key)




class Peer(NamedTuple):
    """Where a received message came from; send a reply `to` it. (A NamedTuple: one is made per
    received message, and a frozen dataclass costs several times as much to construct.)"""

    sender: str  # the sender's endpoint id (authenticated)
    routing_id: bytes | None = None  # its ROUTER routing identity; None on a DEALER


class Endpoint:
    """One socket owner's identity: seals what it sends (envelope + MAC) and opens what it
    receives (MAC, envelope addressed to it, each (sender, seq) once, not stale). Drops are
    counted under `socket` in realcore.transport.drops.

    `address`: the bound address of a listening socket (requests are addressed to it); a
    connecting socket has none and receives only replies, addressed to its `id`. Thread-safe."""

    def __init__(self, secret: bytes, name: str, *, socket: str, address: str | None = None,
                 limits: Limits | None = None):
        self.secret, self.socket, self.address = secret, socket, address
        self.limits = limits or Limits.of()
        self.id = f"{name}#{secrets.token_hex(8)}"
        self._seq = itertools.count(1)  # next() is atomic under the GIL
        self.guard = ReplayGuard(time.time() - self.limits.clock_skew_s, REPLAY_WINDOW, MAX_SENDERS)

    def seal(self, header: dict, tensors=(), *, to: str | Peer, zero_copy: bool = False) -> list:
        """Frames for `header` + `tensors` to `to` (a bound address, or the Peer a reply answers;
        on a ROUTER the frames start with its routing identity). One frame unless `zero_copy`:
        then the tensors go in frames of their own, uncopied, which only a socket that hears
        from one peer may receive (the module docstring says why)."""
        _check_header(header)
        tensors = list(tensors)
        lim = self.limits
        envelope = [self.id, next(self._seq), to.sender if isinstance(to, Peer) else to, time.time()]
        for i, t in enumerate(tensors):
            nbytes = t.numel() * t.element_size()
            if nbytes > lim.max_message_bytes:
                raise ValueError(f"wire: tensor {i} ({str(t.dtype).removeprefix('torch.')} {list(t.shape)}) is "
                                 f"{nbytes} bytes, over system.max_message_bytes = {lim.max_message_bytes}: raise that key")
        frames = _encode({**header, _ENVELOPE_KEY: envelope}, tensors, self.secret, zero_copy)
        size = len(frames[0])
        # The header's bytes (without tensors: the whole frame) count against the control limit.
        control = size if zero_copy or not tensors else int.from_bytes(frames[0][:4], "big")
        if control > lim.max_control_message_bytes:
            raise ValueError(f"wire: a message header of {control} bytes is over "
                             f"system.max_control_message_bytes = {lim.max_control_message_bytes}: raise that key")
        if not zero_copy and size > lim.max_message_bytes:
            raise ValueError(f"wire: a message of {size} bytes is over system.max_message_bytes = "
                             f"{lim.max_message_bytes}: raise that key")
        if isinstance(to, Peer) and to.routing_id is not None:
            frames.insert(0, to.routing_id)
        return frames

    def open(self, frames, *, router: bool = False) -> tuple[Peer, dict, list[torch.Tensor]]:
        """(sender, header, tensors) of received frames; BadMessage (counted) if it is not for us."""
        try:
            return self._open(list(frames), router)
        except BadMessage as e:
            drops.count(self.socket, e.reason, e.detail)
            raise

    def _open(self, frames: list, router: bool) -> tuple[Peer, dict, list[torch.Tensor]]:
        routing_id = None
        if router:
            if not frames:
                raise BadMessage("malformed", "ROUTER message without an identity frame")
            routing_id, frames = bytes(_buffer(frames[0])), frames[1:]
        header, tensors = decode(frames, self.secret)
        env = header.pop(_ENVELOPE_KEY, None)
        ok = (isinstance(env, list) and len(env) == 4 and isinstance(env[0], str) and len(env[0]) <= 256
              and type(env[1]) is int and env[1] > 0 and isinstance(env[2], str)
              and type(env[3]) in (int, float) and math.isfinite(env[3]))
        if not ok:
            raise BadMessage("malformed", f"no valid envelope [sender, seq, to, ts] (got {env!r:.200})")
        sender, seq, to, ts = env
        if to != self.id and (self.address is None or to != self.address):
            raise BadMessage("misaddressed", f"{sender} #{seq} is addressed to {to!r:.200}, not to this {self.socket} socket")
        self.guard.accept(sender, seq, float(ts))
        return Peer(sender, routing_id), header, tensors


# Frames go through pyzmq's Cython socket methods with int flags: its Python layer (send_multipart,
# recv_multipart, Socket.poll) costs ~10-15 us per call in flag enums and copy-threshold logic,
# more than the message itself on loopback (bench/wire.py). Same semantics otherwise.
_SEND, _RECV, _GET = _RawSocket.send, _RawSocket.recv, _RawSocket.get
_NOBLOCK, _SNDMORE, _RCVMORE, _POLLIN, _EVENTS = (int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.RCVMORE), int(zmq.POLLIN),
                                                  int(zmq.EVENTS))
COPY_BELOW = 65536  # pyzmq's copy_threshold: smaller frames are copied (cheaper), larger sent zero-copy


def send_frames(sock: zmq.Socket, frames: list, *, noblock: bool = False) -> None:
    """Send `frames` as one multipart message (zmq.Again when `noblock` and it cannot be queued)."""
    flags = _NOBLOCK if noblock else 0
    last = len(frames) - 1
    for i, f in enumerate(frames):
        small = isinstance(f, bytes) or _buffer(f).nbytes < COPY_BELOW
        _SEND(sock, f, (flags | _SNDMORE) if i < last else flags, small)


def _drain(sock: zmq.Socket, kept: int) -> BadMessage:
    """Read the rest of a message over the frame cap without keeping it (libzmq hands over a
    message only whole, so the rest is already here): the error to drop it with."""
    n = kept
    while _GET(sock, _RCVMORE):
        _RECV(sock, 0, True)
        n += 1
    return BadMessage("malformed", f"a message of {n} frames, over the {kept} a message may have here")


def recv_frames(sock: zmq.Socket, *, noblock: bool = False, copy: bool = False,
                max_frames: int = CONTROL_MAX_FRAMES) -> list:
    """One multipart message: zmq.Frames (zero-copy) or bytes (`copy`, cheaper for small
    messages). zmq.Again when `noblock` and none is waiting; BadMessage (malformed) for a message
    of more than `max_frames` frames, read to its end and let go."""
    frames = [_RECV(sock, _NOBLOCK if noblock else 0, copy)]
    while _GET(sock, _RCVMORE):  # the rest of a multipart message has arrived with its first frame
        if len(frames) >= max_frames:
            raise _drain(sock, len(frames))
        frames.append(_RECV(sock, 0, copy))
    return frames


def recv_waiting(sock: zmq.Socket, socket: str = "control") -> list[bytes] | None:
    """The next message waiting on `sock` as bytes frames, or None when there is none: asking
    ZMQ_EVENTS first, since a NOBLOCK recv on an empty socket raises zmq.Again (~10 us to build the
    exception, at the end of every drain of a busy socket). A message of more than
    CONTROL_MAX_FRAMES frames is dropped and counted under `socket` (its name in drop counts)."""
    while _GET(sock, _EVENTS) & _POLLIN:
        try:
            return recv_frames(sock, noblock=True, copy=True)
        except zmq.Again:
            return None
        except BadMessage as e:
            drops.count(socket, e.reason, e.detail)
    return None


def recv_message(sock: zmq.Socket, *, router: bool = False, max_frames: int = 65536) -> list:
    """One multipart message (blocking), nothing in it parsed (the MAC comes first): the routing
    identity (`router`) and the first frame (a header, or a whole one-frame message) as bytes, the
    others (tensors, the MAC) as zmq.Frames, zero-copy. A zmq.Frame costs far more than a copy of
    a small frame (bench/wire.py), so control messages, one frame, never make one. BadMessage
    (malformed) for more than `max_frames` frames: the rest is read and let go."""
    frames = [_RECV(sock, 0, True)]
    if router and _GET(sock, _RCVMORE):
        frames.append(_RECV(sock, 0, True))
    while _GET(sock, _RCVMORE):
        if len(frames) >= max_frames:
            raise _drain(sock, len(frames))
        frames.append(_RECV(sock, 0, False))
    return frames


def readable(sock: zmq.Socket, timeout_ms: int) -> bool:
    """Whether a message is waiting on `sock` within `timeout_ms` (-1: forever)."""
    return bool(zmq_poll([(sock, _POLLIN)], timeout_ms))


def send(sock: zmq.Socket, header: dict, tensors=(), *, endpoint: Endpoint, to: str | Peer,
         zero_copy: bool = False) -> None:
    """Send one message sealed by `endpoint` to `to` (a bound address, or the Peer to answer);
    `zero_copy` as in Endpoint.seal."""
    send_frames(sock, endpoint.seal(header, tensors, to=to, zero_copy=zero_copy))


def recv(
    sock: zmq.Socket,
    *,
    endpoint: Endpoint,
    router: bool = False,
    timeout_s: float | None = None,
    what: str | None = None,
) -> tuple[Peer, dict, list[torch.Tensor]]:
    """Receive one message -> (its sender, header, tensors); `router`: `sock` is a ROUTER.

    Raises TimeoutError after `timeout_s` (None waits forever; `what` names the socket's purpose
    in the message) and BadMessage for a message the endpoint refuses (consumed and counted).
    """
    if timeout_s is not None:
        ms = max(0, math.ceil(timeout_s * 1000))
        if not readable(sock, ms):
            raise TimeoutError(f"wire.recv: no message on {what or 'socket'} within {timeout_s:g} s")
    try:
        frames = recv_message(sock, router=router, max_frames=endpoint.limits.max_message_frames + int(router))
    except BadMessage as e:
        drops.count(endpoint.socket, e.reason, e.detail)
        raise
    return endpoint.open(frames, router=router)


def count_dropped(socket: str, reason: str, detail: str = "") -> None:
    """Count a message refused above the wire (e.g. an HTTP request), like the wire's own drops."""
    drops.count(socket, reason, detail)


def dropped() -> dict[str, int]:
    """This process's dropped-message counts {"socket/reason": n} (realcore.transport.drops; here so
    that backends, which import no other realcore.system module, can report them)."""
    return drops.snapshot()


def write_secret(path: str) -> bytes:
    """Create `path` (mode 0600, must not exist) holding 32 random bytes as hex; return them."""
    secret = secrets.token_bytes(32)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return secret


def load_secret(path: str) -> bytes:
    """Read a secret written by write_secret; refuse a file that group or others can access."""
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"secret file {path} has mode {mode:#o}: group/others can access it; chmod 600 it")
    with open(path) as f:
        text = f.read().strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"secret file {path} does not hold a hex string") from None
    if len(secret) < 16:
        raise ValueError(f"secret file {path} holds {len(secret)} bytes; need at least 16")
    return secret
