"""The wire format of every ZeroMQ message in realcore (no pickle anywhere).

A message is a list of frames:

    [header, tensor_0, ..., tensor_{n-1}, mac]

- header: a msgpack map. Any msgpack-able dict, plus the reserved key ``_t`` = a list of
  ``[dtype name, shape]``, one per tensor frame.
- tensor_i: the raw bytes of a contiguous CPU tensor, sent zero-copy and received zero-copy
  (the received tensor is a view of the ZeroMQ frame's memory).
- mac: HMAC-SHA256, keyed by the run's secret, over every preceding frame, each fed as its
  8-byte length then its bytes, so frame boundaries are authenticated too.

Zero-copy send means ZeroMQ reads the tensor's memory *after* ``send`` returns: do not modify a
sent tensor until the peer has acknowledged it (acknowledge at the application level anyway:
cluster.md saw messages lost when a sender exited right after a burst).
"""

import hashlib
import hmac
import math
import os
import secrets

import msgpack
import torch
import zmq

MAC_SIZE = 32  # bytes of HMAC-SHA256
_META_KEY = "_t"
# Dtypes allowed on the wire, by name. A name is data, so decode() looks it up here rather than
# calling getattr(torch, name) on whatever a peer sent.
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
    )
}


class BadMessage(ValueError):
    """A message that fails authentication or does not parse; the receiver drops and counts it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _buffer(frame) -> memoryview:
    """The bytes of a frame as a memoryview: zmq.Frame (copy=False), bytes or any buffer."""
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)


def mac(frames, secret: bytes) -> bytes:
    """HMAC-SHA256 over frames, each preceded by its 8-byte big-endian length."""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for f in frames:
        buf = _buffer(f)
        h.update(buf.nbytes.to_bytes(8, "big"))
        h.update(buf)
    return h.digest()


def _tensor_buffer(t: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU tensor's memory (copies only if it is non-contiguous)."""
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


def encode(header: dict, tensors, secret: bytes) -> list:
    """Frames for one message: [msgpack header, raw tensor buffers..., HMAC]."""
    if not isinstance(header, dict):
        raise ValueError(f"wire: header must be a dict, got {type(header).__name__}")
    if _META_KEY in header:
        raise ValueError(f"wire: header key {_META_KEY!r} is reserved for tensor metadata")
    tensors = list(tensors)
    meta = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    bufs = [_tensor_buffer(t) for t in tensors]
    try:
        head = msgpack.packb({**header, _META_KEY: meta}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"wire: header is not msgpack-able: {e}") from e
    frames = [head, *bufs]
    frames.append(mac(frames, secret))
    return frames


def _parse_meta(meta, n_frames: int) -> list[tuple[torch.dtype, list[int]]]:
    if not isinstance(meta, list):
        raise BadMessage(f"tensor metadata {_META_KEY!r} is missing or not a list")
    if len(meta) != n_frames:
        raise BadMessage(f"metadata lists {len(meta)} tensors but {n_frames} tensor frames came")
    out = []
    for i, m in enumerate(meta):
        ok = isinstance(m, list) and len(m) == 2 and isinstance(m[1], list)
        if not ok or m[0] not in _DTYPES or not all(isinstance(s, int) and s >= 0 for s in m[1]):
            raise BadMessage(f"tensor {i}: bad metadata {m!r}")
        out.append((_DTYPES[m[0]], m[1]))
    return out


def decode(frames, secret: bytes) -> tuple[dict, list[torch.Tensor]]:
    """Authenticate and parse frames from encode(); tensors are views of the frames' memory."""
    frames = list(frames)
    if len(frames) < 2:
        raise BadMessage(f"truncated: {len(frames)} frame(s), need at least header and mac")
    *body, tag = frames
    if not hmac.compare_digest(mac(body, secret), bytes(_buffer(tag))):
        raise BadMessage("HMAC mismatch (wrong secret, tampered or truncated message)")
    try:
        # strict_map_key=False: int keys are allowed; the message is already authenticated.
        header = msgpack.unpackb(_buffer(body[0]), raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise BadMessage(f"header is not valid msgpack: {e!r}") from e
    if not isinstance(header, dict):
        raise BadMessage(f"header is a {type(header).__name__}, not a map")
    specs = _parse_meta(header.pop(_META_KEY, None), len(body) - 1)
    tensors = []
    for i, ((dtype, shape), f) in enumerate(zip(specs, body[1:])):
        buf = _buffer(f)
        nbytes = math.prod(shape) * dtype.itemsize
        if buf.nbytes != nbytes:
            raise BadMessage(f"tensor {i}: {buf.nbytes} bytes for {dtype} {shape} ({nbytes} expected)")
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dtype))  # frombuffer rejects empty buffers
            continue
        # frombuffer as uint8 then view: no copy, and it works for every dtype incl. bfloat16.
        tensors.append(torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape))
    return header, tensors


def send(sock: zmq.Socket, header: dict, tensors=(), *, secret: bytes, identity: bytes | None = None) -> None:
    """Send one message; `identity` is the peer's routing id when `sock` is a ROUTER."""
    frames = encode(header, tensors, secret)
    if identity is not None:
        frames.insert(0, identity)
    sock.send_multipart(frames, copy=False)


def recv(
    sock: zmq.Socket,
    *,
    secret: bytes,
    router: bool = False,
    timeout_s: float | None = None,
    what: str | None = None,
) -> tuple[bytes | None, dict, list[torch.Tensor]]:
    """Receive one message -> (sender identity if `router` else None, header, tensors).

    Raises TimeoutError after `timeout_s` (None waits forever; `what` names the socket's purpose
    in the message) and BadMessage for a message that fails decode (it is consumed either way).
    """
    if timeout_s is not None:
        ms = max(0, math.ceil(timeout_s * 1000))
        if not sock.poll(ms, zmq.POLLIN):
            raise TimeoutError(f"wire.recv: no message on {what or 'socket'} within {timeout_s:g} s")
    frames = sock.recv_multipart(copy=False)
    identity = None
    if router:
        if len(frames) < 1:
            raise BadMessage("ROUTER message without an identity frame")
        identity, frames = frames[0].bytes, frames[1:]
    header, tensors = decode(frames, secret)
    return identity, header, tensors


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
