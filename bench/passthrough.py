#!/usr/bin/env python3
"""A pass-through mutual-TLS proxy (one half of a pair) that does no ggml-rpc work at all.

Usage (a pair: ``connect`` next to the client, ``serve`` next to the server):

    python bench/passthrough.py DESIGN serve --listen 9001 --upstream 50052 --cert node1.pem \\
        --key node1.key --ca ca.pem
    python bench/passthrough.py DESIGN connect --listen 9000 --upstream 9001 --cert client1.pem \\
        --key client1.key --ca ca.pem [--server-name node1]

How this works: the ``serve`` role accepts TLS on ``--listen`` (TLS 1.3 minimum, client
certificate required and checked against ``--ca``) and relays plaintext to the loopback
``--upstream`` port; the ``connect`` role accepts plaintext on ``--listen`` and relays over TLS
to ``--upstream``, checking the server certificate's name (``--server-name``) with its own
client certificate. Bytes are copied as they come, in both directions, without being parsed.
TCP_NODELAY is set on every socket. When one side of a connection closes or fails, both are
closed. Four designs do the same thing with different I/O layers; a pair of each is an arm of
bench/arms.py (``aio``, ``bio``, ``thread``, ``sock``), which bench/floor.py and bench/paired.py
compare with HAProxy and rpcguard:

* ``aio``: uvloop transports with ``asyncio.BufferedProtocol``; the TLS side is uvloop's own
  TLS transport (``ssl=`` on the connection), as rpcguard's relay uses.
* ``bio``: uvloop plain TCP transports on both sides; TLS done by hand over two
  ``ssl.MemoryBIO`` objects (encrypted bytes in and out of the transport).
* ``thread``: one thread per connection, a blocking plain socket and a non-blocking
  ``ssl.SSLSocket`` waited on with ``poll()``.
* ``sock``: uvloop, the plain side as in ``aio``; the TLS side a non-blocking ``ssl.SSLSocket``
  (OpenSSL reads and writes the socket itself: no MemoryBIO copy) driven by the loop's
  ``add_reader`` / ``add_writer``.

The ready line (``READY_MESSAGE``) is printed once the listening socket is bound. This is a
benchmark tool, good for the few sessions a benchmark opens; it is not a product.
"""

from __future__ import annotations

import argparse
import asyncio
import select
import socket
import ssl
import sys
import threading

__all__ = ["DESIGNS", "ROLES", "READY_MESSAGE", "tls_context", "main"]

DESIGNS = ("aio", "bio", "thread", "sock")
ROLES = ("connect", "serve")
READY_MESSAGE = "passthrough ready"
HOST = "127.0.0.1"
BUF_BYTES = 256 * 1024  # largest plaintext chunk moved per read
RAW_BYTES = 64 * 1024  # largest encrypted chunk handed over by the transport (bio)
BACKLOG = 16


class Options(argparse.Namespace):
    design: str
    role: str
    listen: int
    upstream: int
    cert: str
    key: str
    ca: str
    server_name: str


def tls_context(opts: Options) -> ssl.SSLContext:
    """The role's TLS context: TLS 1.3 minimum, the peer verified against ``--ca`` both ways."""
    if opts.role == "serve":
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.verify_mode = ssl.CERT_REQUIRED
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED by default
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(opts.cert, opts.key)
    ctx.load_verify_locations(opts.ca)
    return ctx


def _nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _listener(port: int, blocking: bool) -> socket.socket:
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((HOST, port))
    ls.listen(BACKLOG)
    ls.setblocking(blocking)
    print(f"{READY_MESSAGE} on {HOST}:{port}", flush=True)
    return ls


# ------------------------------------------------------------------------- thread design
def _tls_sendall(tls: ssl.SSLSocket, data: memoryview) -> None:
    """Write all of ``data`` to a non-blocking TLS socket, waiting for room when it is full."""
    while data:
        try:
            data = data[tls.send(data):]
        except ssl.SSLWantWriteError:
            select.select([], [tls], [])
        except ssl.SSLWantReadError:
            select.select([tls], [], [])


def _thread_pump(tls: ssl.SSLSocket, plain: socket.socket) -> None:
    """Copy both ways until either side ends. The TLS socket is non-blocking: a readable
    socket may hold only a post-handshake message (a session ticket) and no application data."""
    tls.setblocking(False)
    view = memoryview(bytearray(BUF_BYTES))
    poller = select.poll()
    tfd, pfd = tls.fileno(), plain.fileno()
    poller.register(tfd, select.POLLIN)
    poller.register(pfd, select.POLLIN)
    while True:
        ready = [tfd] if tls.pending() else [fd for fd, _ in poller.poll()]
        if tfd in ready:
            try:
                n = tls.recv_into(view)
            except ssl.SSLWantReadError:
                n = -1
            if n == 0:
                return
            if n > 0:
                plain.sendall(view[:n])
        if pfd in ready:
            n = plain.recv_into(view)
            if not n:
                return
            _tls_sendall(tls, view[:n])


def _thread_session(ctx: ssl.SSLContext, opts: Options, accepted: socket.socket) -> None:
    socks = [accepted]
    try:
        upstream = socket.create_connection((HOST, opts.upstream))
        socks.append(upstream)
        _nodelay(accepted)
        _nodelay(upstream)
        if opts.role == "serve":
            tls, plain = ctx.wrap_socket(accepted, server_side=True), upstream
        else:
            tls, plain = ctx.wrap_socket(upstream, server_hostname=opts.server_name), accepted
        socks.append(tls)
        _thread_pump(tls, plain)
    except OSError:  # ssl.SSLError included: a refused handshake or a reset ends this session only
        pass
    finally:
        for s in socks:
            s.close()


def run_thread(ctx: ssl.SSLContext, opts: Options) -> None:
    ls = _listener(opts.listen, blocking=True)
    while True:
        accepted, _ = ls.accept()
        threading.Thread(target=_thread_session, args=(ctx, opts, accepted), daemon=True).start()


# --------------------------------------------------------------------------- uvloop designs
class Link:
    """The two endpoints of one relayed connection: what one receives, the other sends."""

    def __init__(self) -> None:
        self.ends: list[PlainEnd] = []

    def other(self, end: PlainEnd) -> PlainEnd:
        return self.ends[1] if self.ends[0] is end else self.ends[0]

    def close(self) -> None:
        for end in self.ends:
            if end.transport is not None:
                end.transport.close()


class PlainEnd(asyncio.BufferedProtocol):
    """One side whose transport carries the bytes as they are to be relayed (a plain socket,
    or uvloop's TLS transport in the ``aio`` design). Writing backpressure pauses the reader."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.transport: asyncio.Transport | None = None
        self.buf = memoryview(bytearray(BUF_BYTES))
        link.ends.append(self)

    def connection_made(self, transport) -> None:
        self.transport = transport
        _nodelay(transport.get_extra_info("socket"))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buf

    def buffer_updated(self, nbytes: int) -> None:
        self.link.other(self).send(bytes(self.buf[:nbytes]))

    def send(self, data: bytes) -> None:
        self.transport.write(data)

    def pause_writing(self) -> None:
        self.link.other(self).transport.pause_reading()

    def resume_writing(self) -> None:
        self.link.other(self).transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.close()


class BioTlsEnd(PlainEnd):
    """The TLS side of the ``bio`` design: a plain transport carries TLS records that an
    ``ssl`` object over two MemoryBIOs decrypts (received) and encrypts (sent)."""

    def __init__(self, link: Link, ctx: ssl.SSLContext, server_side: bool, server_name: str) -> None:
        super().__init__(link)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        wrapped = ctx.wrap_bio(self.incoming, self.outgoing, server_side=server_side,
                               server_hostname=None if server_side else server_name)
        # The C object under ssl.SSLObject, called directly as uvloop's own TLS code does
        # (the public wrapper adds a Python call per read and write).
        self.obj = getattr(wrapped, "_sslobj", wrapped)
        self.raw = memoryview(bytearray(RAW_BYTES))
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._handshake()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.raw

    def buffer_updated(self, nbytes: int) -> None:
        self.incoming.write(self.raw[:nbytes])
        try:
            if self.ready.done() or self._handshake():
                self._decrypt()
        except ssl.SSLError:  # close_notify, a bad record or a refused handshake: end the link
            self._flush()
            self.link.close()
            return
        self._flush()

    def _handshake(self) -> bool:
        try:
            self.obj.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return False
        except ssl.SSLError as exc:
            self._flush()  # the alert, so the peer learns why
            if not self.ready.done():
                self.ready.set_exception(exc)
            raise
        self._flush()
        if not self.ready.done():
            self.ready.set_result(None)
        return True

    def _decrypt(self) -> None:
        other, obj, buf = self.link.other(self), self.obj, self.buf
        while True:
            try:
                n = obj.read(BUF_BYTES, buf)
            except ssl.SSLWantReadError:
                return
            if not n:
                raise ssl.SSLZeroReturnError(ssl.SSL_ERROR_ZERO_RETURN, "TLS connection closed")
            other.send(bytes(buf[:n]))

    def _flush(self) -> None:
        data = self.outgoing.read()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def send(self, data: bytes) -> None:
        self.obj.write(data)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ready.done():
            self.ready.set_exception(ConnectionError("TLS connection lost during the handshake"))
        super().connection_lost(exc)


class SockTlsEnd:
    """The TLS side of the ``sock`` design: a non-blocking ``ssl.SSLSocket`` on the event loop.
    It stands in for a transport too (``close``, ``pause_reading``, ``resume_reading``)."""

    def __init__(self, link: Link, tls: ssl.SSLSocket) -> None:
        self.link, self.tls = link, tls
        self.obj = getattr(tls, "_sslobj", None) or tls  # the C object, as BioTlsEnd
        self.fd = tls.fileno()
        self.loop = asyncio.get_running_loop()
        self.buf = memoryview(bytearray(BUF_BYTES))
        self.out: list[bytes] = []  # what SSL_write could not send yet, retried whole and in order
        self.transport = self
        self.closed = False
        link.ends.append(self)  # type: ignore[arg-type]
        self.loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        other, obj, buf = self.link.other(self), self.obj, self.buf  # type: ignore[arg-type]
        while True:  # until OpenSSL has nothing buffered and the socket nothing to read
            try:
                n = obj.read(BUF_BYTES, buf)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError:  # ssl.SSLError included: a bad record or close_notify
                self.link.close()
                return
            if not n:
                self.link.close()
                return
            other.send(bytes(buf[:n]))

    def send(self, data: bytes) -> None:
        if self.out:
            self.out.append(data)
            return
        try:
            self.obj.write(data)
        except ssl.SSLWantWriteError:  # the socket is full: retry when it drains
            self.out.append(data)
            self.loop.add_writer(self.fd, self._writable)
            self.link.other(self).transport.pause_reading()  # type: ignore[arg-type,union-attr]
        except OSError:
            self.link.close()

    def _writable(self) -> None:
        while self.out:
            try:
                self.obj.write(self.out[0])
            except ssl.SSLWantWriteError:
                return
            except OSError:
                self.link.close()
                return
            self.out.pop(0)
        self.loop.remove_writer(self.fd)
        self.link.other(self).transport.resume_reading()  # type: ignore[arg-type,union-attr]

    def pause_reading(self) -> None:
        self.loop.remove_reader(self.fd)

    def resume_reading(self) -> None:
        self.loop.add_reader(self.fd, self._readable)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.fd)
            self.loop.remove_writer(self.fd)
            self.tls.close()


async def _wait_fd(fd: int, write: bool) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    (loop.add_writer if write else loop.add_reader)(fd, ready.set_result, None)
    try:
        await ready
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


async def _sock_handshake(tls: ssl.SSLSocket) -> None:
    while True:
        try:
            tls.do_handshake()
            return
        except ssl.SSLWantReadError:
            await _wait_fd(tls.fileno(), write=False)
        except ssl.SSLWantWriteError:
            await _wait_fd(tls.fileno(), write=True)


async def _sock_session(ctx: ssl.SSLContext, opts: Options, sock: socket.socket, link: Link) -> None:
    loop = asyncio.get_running_loop()
    if opts.role == "serve":
        upstream = PlainEnd(link)
        await loop.create_connection(lambda: upstream, HOST, opts.upstream)
        sock.setblocking(False)
        _nodelay(sock)
        tls = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        await _sock_handshake(tls)
        SockTlsEnd(link, tls)
    else:
        raw = socket.socket()
        try:
            raw.setblocking(False)
            await loop.sock_connect(raw, (HOST, opts.upstream))
            _nodelay(raw)
            tls = ctx.wrap_socket(raw, server_hostname=opts.server_name, do_handshake_on_connect=False)
            await _sock_handshake(tls)  # the client's bytes are read only once TLS is up
        except BaseException:
            raw.close()
            raise
        SockTlsEnd(link, tls)
        accepted = PlainEnd(link)
        await loop.connect_accepted_socket(lambda: accepted, sock)


async def _aio_session(ctx: ssl.SSLContext, opts: Options, sock: socket.socket, link: Link) -> None:
    loop = asyncio.get_running_loop()
    accepted, upstream = PlainEnd(link), PlainEnd(link)
    if opts.role == "serve":
        await loop.create_connection(lambda: upstream, HOST, opts.upstream)
        await loop.connect_accepted_socket(lambda: accepted, sock, ssl=ctx)
    else:
        await loop.create_connection(lambda: upstream, HOST, opts.upstream, ssl=ctx,
                                     server_hostname=opts.server_name)
        await loop.connect_accepted_socket(lambda: accepted, sock)


async def _bio_session(ctx: ssl.SSLContext, opts: Options, sock: socket.socket, link: Link) -> None:
    loop = asyncio.get_running_loop()
    if opts.role == "serve":
        upstream, accepted = PlainEnd(link), BioTlsEnd(link, ctx, True, opts.server_name)
        await loop.create_connection(lambda: upstream, HOST, opts.upstream)
        await loop.connect_accepted_socket(lambda: accepted, sock)
        await accepted.ready
    else:
        accepted, upstream = PlainEnd(link), BioTlsEnd(link, ctx, False, opts.server_name)
        await loop.create_connection(lambda: upstream, HOST, opts.upstream)
        await upstream.ready  # the client's bytes are read only once TLS is up
        await loop.connect_accepted_socket(lambda: accepted, sock)


_SESSIONS = {"aio": _aio_session, "bio": _bio_session, "sock": _sock_session}


async def _guarded(session, ctx: ssl.SSLContext, opts: Options, sock: socket.socket) -> None:
    """One session; a failure (refused handshake, upstream down) closes it and nothing else."""
    link = Link()
    try:
        await session(ctx, opts, sock, link)
    except (OSError, ConnectionError, asyncio.TimeoutError):
        link.close()
        sock.close()


async def run_uvloop(ctx: ssl.SSLContext, opts: Options) -> None:
    loop = asyncio.get_running_loop()
    ls = _listener(opts.listen, blocking=False)
    session, tasks = _SESSIONS[opts.design], set()
    while True:
        sock, _ = await loop.sock_accept(ls)
        task = loop.create_task(_guarded(session, ctx, opts, sock))
        tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(tasks.discard)


# ------------------------------------------------------------------------------------ CLI
def parse(argv: list[str] | None) -> Options:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("design", choices=DESIGNS)
    ap.add_argument("role", choices=ROLES)
    ap.add_argument("--listen", type=int, required=True, help="port to listen on (127.0.0.1)")
    ap.add_argument("--upstream", type=int, required=True, help="port to relay to (127.0.0.1)")
    ap.add_argument("--cert", required=True, help="this side's certificate (PEM)")
    ap.add_argument("--key", required=True, help="this side's private key (PEM)")
    ap.add_argument("--ca", required=True, help="CA that signed the peer's certificate (PEM)")
    ap.add_argument("--server-name", default="node1", help="name the server certificate must carry")
    return ap.parse_args(argv, namespace=Options())


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    try:
        ctx = tls_context(opts)
    except (OSError, ssl.SSLError) as exc:
        print(f"passthrough: cannot load the certificates: {exc}", file=sys.stderr)
        return 2
    try:
        if opts.design == "thread":
            run_thread(ctx, opts)
        else:
            import uvloop
            uvloop.run(run_uvloop(ctx, opts))
    except OSError as exc:
        print(f"passthrough: cannot listen on {HOST}:{opts.listen}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
