"""Capture the TCP traffic of a live run on the loopback interface and cut it into ZeroMQ
messages, as an attacker with root on the same host could (tests/test_fuzz.py replays them).

Needs root (an AF_PACKET socket). Only what ZMTP 3 needs is parsed: the 64-byte greeting, then
frames (flags byte: 1 = more, 2 = long size, 4 = command; size 1 or 8 bytes big-endian; body).
Commands (the READY handshake) are skipped; a message is the frames up to one without `more`.
"""

from __future__ import annotations

import socket
import struct
import threading

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # on lo every packet shows twice: as sent and as received; keep the received one


class LoopbackCapture:
    """Collects TCP payloads on lo (to `ports`, or to any port), on a thread, until stop(); at most
    `max_bytes` in all. Start it before the run: a connection is parsed from its first byte."""

    def __init__(self, ports: set[int] | None = None, max_bytes: int = 512 * 2**20):
        self.ports, self.max_bytes, self.nbytes = ports, max_bytes, 0
        self.segments: dict[tuple[int, int], dict[int, bytes]] = {}  # (src port, dst port) -> seq -> payload
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 64 * 2**20)  # SO_RCVBUFFORCE (root): no drops in bursts
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.2)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                packet, addr = self.sock.recvfrom(262144)
            except socket.timeout:
                continue
            if addr[2] == PACKET_OUTGOING or len(packet) < 34 or packet[12:14] != b"\x08\x00":
                continue  # not a received IPv4 packet
            ip = packet[14:]
            ihl = (ip[0] & 0x0F) * 4
            if ip[9] != 6:  # not TCP
                continue
            total = struct.unpack("!H", ip[2:4])[0]
            tcp = ip[ihl:total]
            sport, dport, seq = struct.unpack("!HHI", tcp[:8])
            payload = tcp[(tcp[12] >> 4) * 4:]
            if payload and (self.ports is None or dport in self.ports) and self.nbytes < self.max_bytes:
                self.segments.setdefault((sport, dport), {})[seq] = bytes(payload)
                self.nbytes += len(payload)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.sock.close()

    def streams(self) -> dict[tuple[int, int], bytes]:
        """Each connection's client-to-server byte stream, reassembled by sequence number."""
        out = {}
        for conn, segs in self.segments.items():
            data, end = bytearray(), None
            for seq in sorted(segs):
                payload = segs[seq]
                if end is not None and seq + len(payload) <= end:
                    continue  # a retransmission of what we have
                if end is not None and seq < end:
                    payload = payload[end - seq:]
                data += payload
                end = seq + len(segs[seq])
            out[conn] = bytes(data)
        return out


def zmtp_messages(stream: bytes) -> list[list[bytes]]:
    """The complete multipart messages in a ZMTP 3 byte stream (a connection's start is needed)."""
    if len(stream) < 64 or stream[0] != 0xFF or stream[9] != 0x7F:
        return []  # the capture began mid-connection: no frame boundary to start from
    pos, frames, messages = 64, [], []
    while pos < len(stream):
        flags = stream[pos]
        if flags & 2:
            if pos + 9 > len(stream):
                break
            size, head = struct.unpack("!Q", stream[pos + 1:pos + 9])[0], 9
        else:
            if pos + 2 > len(stream):
                break
            size, head = stream[pos + 1], 2
        if pos + head + size > len(stream):
            break  # cut off at the end of the capture
        body = stream[pos + head:pos + head + size]
        pos += head + size
        if flags & 4:  # a command (READY, PING...), not a message frame
            continue
        frames.append(body)
        if not flags & 1:
            messages.append(frames)
            frames = []
    return messages
