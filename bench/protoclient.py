"""A synthetic ggml-rpc (v7.0.0) client for protocol-level benchmarks.

How this works: one TCP connection does HELLO (24 zero caps bytes), ALLOC_BUFFER on device 0,
BUFFER_GET_BASE, then either

* ``bulk``: SET_TENSOR frames of ``frame_bytes`` each into one F32 tensor that spans the whole
  buffer (``ne = [size/4, 1, 1, 1]``, ``data = base``), cycling the offset through the buffer.
  SET_TENSOR has no response, so the clock stops after a GET_ALIGNMENT round trip that follows
  the last frame (the server has consumed everything by then). A GET_TENSOR of the last frame's
  first 64 KiB then checks that the bytes arrived intact. Every frame is a valid tensor write,
  so rpcguard's firewall in enforce mode forwards it.
* ``ping``: GET_ALIGNMENT request/response round trips, timed one by one.
* ``burst``: the shape of one decode step (small SET_TENSORs sent piecewise, then a GET_TENSOR
  round trip), timed per step.

Frames are built with ``rpcguard.protocol.encode`` (no hand-written byte strings). The payload
is sent from one preallocated buffer, header and body as two ``sendall`` calls, as the real
client does, so Python copies nothing per frame.

Run standalone: ``python bench/protoclient.py bulk 127.0.0.1:50052`` (prints one JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rpcguard.protocol.encode import TensorSpec, pack_tensor, request  # noqa: E402

__all__ = ["RpcClient", "bulk", "ping", "burst"]

MIB = 1024 * 1024
F32 = 0  # GGML_TYPE_F32
# v7 SET_TENSOR: rpc_tensor | u8 cache_flag | u64 offset | data (docs/protocol-verification.md §4)
_SET_TAIL = struct.Struct("<BQ")
_GET_TAIL = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")
CHECK_BYTES = 64 * 1024  # read back this much of the last frame to check integrity


class RpcClient:
    """A blocking ggml-rpc client socket with just enough commands for the benchmarks."""

    def __init__(self, endpoint: str, timeout: float = 60.0) -> None:
        host, _, port = endpoint.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._hdr = bytearray(8)

    def close(self) -> None:
        self.sock.close()

    def _recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if not k:
                raise ConnectionError(f"connection closed after {got} of {n} response bytes")
            got += k
        return buf

    def call(self, cmd: str, payload: bytes) -> bytearray:
        """Send one request and read its response payload."""
        self.sock.sendall(request(cmd, payload))
        (size,) = _U64.unpack(self._recv_exact(8))
        return self._recv_exact(size)

    def hello(self) -> tuple[int, int, int]:
        rsp = self.call("HELLO", bytes(24))
        return rsp[0], rsp[1], rsp[2]

    def alloc(self, size: int) -> tuple[int, int]:
        ptr, got = struct.unpack("<QQ", self.call("ALLOC_BUFFER", struct.pack("<IQ", 0, size)))
        if not ptr:
            raise RuntimeError(f"ALLOC_BUFFER of {size} bytes failed")
        return ptr, got

    def base(self, ptr: int) -> int:
        return _U64.unpack(self.call("BUFFER_GET_BASE", _U64.pack(ptr)))[0]

    def alignment(self) -> int:
        return _U64.unpack(self.call("GET_ALIGNMENT", struct.pack("<I", 0)))[0]

    def set_tensor_head(self, tensor: bytes, offset: int, nbytes: int) -> bytes:
        payload_len = len(tensor) + _SET_TAIL.size + nbytes
        return request("SET_TENSOR", b"", length=payload_len) + tensor + _SET_TAIL.pack(0, offset)

    def get_tensor(self, tensor: bytes, offset: int, size: int) -> bytearray:
        return self.call("GET_TENSOR", tensor + _GET_TAIL.pack(offset, size))

    def free(self, ptr: int) -> None:
        self.sock.sendall(request("FREE_BUFFER", _U64.pack(ptr)))


def _open(endpoint: str, buffer_bytes: int) -> tuple[RpcClient, bytes]:
    c = RpcClient(endpoint)
    major, minor, patch = c.hello()
    if major != 7:
        raise RuntimeError(f"server speaks {major}.{minor}.{patch}, this client speaks 7.0.0")
    ptr, _ = c.alloc(buffer_bytes)
    base = c.base(ptr)
    tensor = pack_tensor(TensorSpec(id=0xB0, type=F32, buffer=ptr, ne=(buffer_bytes // 4, 1, 1, 1),
                                    data=base, name=b"bench"))
    c.ptr = ptr  # type: ignore[attr-defined]
    return c, tensor


def bulk(endpoint: str, *, total_bytes: int = 512 * MIB, frame_bytes: int = 8 * MIB,
         buffer_bytes: int = 64 * MIB) -> dict:
    """Upload ``total_bytes`` as SET_TENSOR frames; returns MB/s (1 MB = 1e6 bytes)."""
    buffer_bytes = max(buffer_bytes, frame_bytes)
    data = bytearray(os.urandom(frame_bytes))
    view = memoryview(data)
    c, tensor = _open(endpoint, buffer_bytes)
    try:
        n_frames = max(1, total_bytes // frame_bytes)
        slots = buffer_bytes // frame_bytes
        t0 = time.perf_counter()
        offset = 0
        for i in range(n_frames):
            offset = (i % slots) * frame_bytes
            c.sock.sendall(c.set_tensor_head(tensor, offset, frame_bytes))
            c.sock.sendall(view)
        c.alignment()  # the server handles requests in order: all frames are in once this answers
        elapsed = time.perf_counter() - t0
        back = c.get_tensor(tensor, offset, min(CHECK_BYTES, frame_bytes))
        intact = bytes(back) == bytes(view[:len(back)])
        c.free(c.ptr)  # type: ignore[attr-defined]
    finally:
        c.close()
    sent = n_frames * frame_bytes
    return {"bytes": sent, "frames": n_frames, "frame_bytes": frame_bytes, "seconds": elapsed,
            "mb_s": sent / elapsed / 1e6, "intact": intact}


def ping(endpoint: str, *, count: int = 2000, warmup: int = 50) -> dict:
    """GET_ALIGNMENT round trips; returns median and p99 in microseconds."""
    c, _ = _open(endpoint, 4096)
    try:
        payload = request("GET_ALIGNMENT", struct.pack("<I", 0))
        sock, rtts = c.sock, []
        want = 16  # u64 size + u64 alignment
        buf = bytearray(want)
        view = memoryview(buf)
        for i in range(warmup + count):
            t0 = time.perf_counter_ns()
            sock.sendall(payload)
            got = 0
            while got < want:
                k = sock.recv_into(view[got:])
                if not k:
                    raise ConnectionError("connection closed during GET_ALIGNMENT")
                got += k
            if i >= warmup:
                rtts.append(time.perf_counter_ns() - t0)
        alignment = _U64.unpack_from(buf, 8)[0]
    finally:
        c.close()
    rtts.sort()
    return {"count": count, "alignment": alignment, "median_us": rtts[len(rtts) // 2] / 1e3,
            "p99_us": rtts[min(len(rtts) - 1, int(len(rtts) * 0.99))] / 1e3,
            "min_us": rtts[0] / 1e3, "max_us": rtts[-1] / 1e3}


def burst(endpoint: str, *, count: int = 1000, frames: int = 5, frame_bytes: int = 512,
          get_bytes: int = 2048, warmup: int = 20) -> dict:
    """A decode step's traffic shape: ``frames`` small SET_TENSORs, then a GET_TENSOR round trip.

    The real client (7.0.0) sends the command byte, the size and the payload of every frame with
    separate ``send`` calls and TCP_NODELAY, so one token is ~20 small segments and one response
    (tests/realpeer capture of the tiny model). This mode does the same, to time what a proxy
    adds per token independently of the model's compute time.
    """
    c, tensor = _open(endpoint, 1 << 20)
    try:
        sock = c.sock
        data = os.urandom(frame_bytes)
        set_tail = _SET_TAIL.pack(0, 0)
        set_size = struct.pack("<Q", len(tensor) + len(set_tail) + frame_bytes)
        get_payload = tensor + _GET_TAIL.pack(0, get_bytes)
        get_size = struct.pack("<Q", len(get_payload))
        set_cmd, get_cmd = bytes([6]), bytes([8])
        want = 8 + get_bytes
        buf = bytearray(want)
        view = memoryview(buf)
        times = []
        for i in range(warmup + count):
            t0 = time.perf_counter_ns()
            for _ in range(frames):
                sock.sendall(set_cmd)
                sock.sendall(set_size)
                sock.sendall(tensor + set_tail + data)
            sock.sendall(get_cmd)
            sock.sendall(get_size)
            sock.sendall(get_payload)
            got = 0
            while got < want:
                k = sock.recv_into(view[got:])
                if not k:
                    raise ConnectionError("connection closed during GET_TENSOR")
                got += k
            if i >= warmup:
                times.append(time.perf_counter_ns() - t0)
        intact = bytes(buf[8:8 + min(frame_bytes, get_bytes)]) == data[:min(frame_bytes, get_bytes)]
    finally:
        c.close()
    times.sort()
    return {"count": count, "frames": frames, "median_us": times[len(times) // 2] / 1e3,
            "p99_us": times[min(len(times) - 1, int(len(times) * 0.99))] / 1e3, "intact": intact}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["bulk", "ping", "burst"])
    ap.add_argument("endpoint", help="HOST:PORT of the server or of a proxy in front of it")
    ap.add_argument("--total-mib", type=int, default=512)
    ap.add_argument("--frame-mib", type=int, default=8)
    ap.add_argument("--buffer-mib", type=int, default=64)
    ap.add_argument("--count", type=int, default=2000)
    a = ap.parse_args(argv)
    if a.mode == "bulk":
        out = bulk(a.endpoint, total_bytes=a.total_mib * MIB, frame_bytes=a.frame_mib * MIB,
                   buffer_bytes=a.buffer_mib * MIB)
    elif a.mode == "burst":
        out = burst(a.endpoint, count=a.count)
    else:
        out = ping(a.endpoint, count=a.count)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
