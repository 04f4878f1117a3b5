"""The router's HTTP client transport: httpcore's HTTP/1.1 connection pool over a plain asyncio
protocol, for httpx (`httpx.AsyncClient(transport=AsyncioTransport(...))`).

httpx's default transport reaches the socket through anyio, which per read enters a cancel scope
for the timeout and resumes, then pauses, the transport's reading (two epoll_ctl calls); a relayed
stream reads once per token. Here the protocol keeps reading while its buffer is below
`READ_HIGH_WATER` (above it, reading pauses until the router catches up, so a slow client still
slows its replica down), and a read that has to wait arms one timer. Behaviour is httpx's:
httpcore does the HTTP, its errors become httpx's (ConnectError, ReadError, RemoteProtocolError,
ReadTimeout, ...). Plain TCP only: the router talks HTTP to replicas inside the cluster.
"""

from __future__ import annotations

import asyncio
import select
from collections.abc import AsyncIterator, Iterable

import httpcore
import httpx

READ_HIGH_WATER = 256 << 10  # bytes buffered from one connection before it stops reading

# httpcore's errors -> httpx's, the most specific first (httpx's own transport maps the same).
_ERRORS: tuple[tuple[type[Exception], type[httpx.HTTPError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.ProxyError, httpx.ProxyError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


_CORE_ERRORS = tuple(core for core, _ in _ERRORS)


def _as_httpx(exc: Exception) -> httpx.HTTPError:
    return next(mapped for core, mapped in _ERRORS if isinstance(exc, core))(str(exc))


class _Protocol(asyncio.Protocol):
    """One connection's bytes as they arrive, and the one reader waiting for them."""

    def __init__(self, on_lost=None) -> None:
        self._on_lost = on_lost  # the backend forgets the connection
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False
        self.error: Exception | None = None
        self.reader: asyncio.Future | None = None
        self.reading_paused = False
        self.writing_paused = False
        self.drained: asyncio.Future | None = None

    def connection_made(self, transport) -> None:  # asyncio's or uvloop's (Ray's loop) transport
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > READ_HIGH_WATER and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake_reader()
        return False  # close the transport: an HTTP/1.1 response never follows the peer's EOF

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof, self.error = True, self.error or exc
        self._wake_reader()
        self.resume_writing()
        if self._on_lost is not None:
            self._on_lost(self)

    def cut(self, reason: str) -> None:
        """End the connection now: its reader gets a ReadError naming `reason`."""
        self.error = ConnectionAbortedError(reason)
        if self.transport is not None:
            self.transport.abort()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def _wake_reader(self) -> None:
        if self.reader is not None and not self.reader.done():
            self.reader.set_result(None)


async def _wait(waiter: asyncio.Future, timeout: float | None, error: type[Exception]) -> None:
    """Until the protocol resolves `waiter`; `error` if that takes longer than `timeout`."""
    timer = None if timeout is None else waiter.get_loop().call_later(timeout, _time_out, waiter, error)
    try:
        await waiter
    finally:
        if timer is not None:
            timer.cancel()


def _time_out(waiter: asyncio.Future, error: type[Exception]) -> None:
    if not waiter.done():
        waiter.set_exception(error("timed out"))


def _readable(sock) -> bool:
    """Data or an EOF in the kernel that the event loop has not delivered yet (the server may
    have just closed an idle connection)."""
    fd = -1 if sock is None else sock.fileno()
    if fd < 0:
        return True
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(0))


class _Stream(httpcore.AsyncNetworkStream):
    """One connection, as httpcore uses it: one read or write at a time."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol):
        self._transport, self._protocol = transport, protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        p = self._protocol
        if not p.buffer and not p.eof:
            p.reader = asyncio.get_running_loop().create_future()
            try:
                await _wait(p.reader, timeout, httpcore.ReadTimeout)
            finally:
                p.reader = None
        if p.buffer:
            if len(p.buffer) <= max_bytes:
                data = bytes(p.buffer)
                p.buffer.clear()
            else:
                data = bytes(p.buffer[:max_bytes])
                del p.buffer[:max_bytes]
            if p.reading_paused and len(p.buffer) <= READ_HIGH_WATER:
                p.reading_paused = False
                self._transport.resume_reading()
            return data
        if p.error is not None:
            raise httpcore.ReadError(str(p.error) or type(p.error).__name__)
        return b""  # end of stream (h11 tells a response cut short from a complete one)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        if self._transport.is_closing():
            raise httpcore.WriteError("connection closed")
        self._transport.write(buffer)
        p = self._protocol
        if p.writing_paused:  # above the transport's high-water mark: wait until it drained
            p.drained = asyncio.get_running_loop().create_future()
            try:
                await _wait(p.drained, timeout, httpcore.WriteTimeout)
            finally:
                p.drained = None

    async def aclose(self) -> None:
        self._transport.close()

    async def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.AsyncNetworkStream:
        raise httpcore.UnsupportedProtocol("the router's transport speaks plain HTTP to replicas")

    def get_extra_info(self, info: str):
        if info == "is_readable":  # an idle connection the server closed (or wrote to) is not reused
            return (
                bool(self._protocol.buffer) or self._protocol.eof or _readable(self._transport.get_extra_info("socket"))
            )
        if info == "socket":
            return self._transport.get_extra_info("socket")
        if info == "client_addr":
            return self._transport.get_extra_info("sockname")
        if info == "server_addr":
            return self._transport.get_extra_info("peername")
        return None


class _Backend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self.open: dict[tuple[str, int], set[_Protocol]] = {}  # live connections per replica

    def _lost(self, origin: tuple[str, int], protocol: _Protocol) -> None:
        connections = self.open.get(origin)
        if connections is not None:
            connections.discard(protocol)
            if not connections:
                del self.open[origin]

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        local = (local_address, 0) if local_address else None
        origin = (host, port)
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the connect's failure
            # when a cancel lands in the same turn of the loop, and the cancel is lost.
            async with asyncio.timeout(timeout):
                transport, protocol = await loop.create_connection(
                    lambda: _Protocol(lambda p: self._lost(origin, p)), host, port, local_addr=local
                )
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
            raise httpcore.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        for option in socket_options or ():
            transport.get_extra_info("socket").setsockopt(*option)
        self.open.setdefault(origin, set()).add(protocol)
        return _Stream(transport, protocol)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, stream: AsyncIterator[bytes]):
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for part in self._stream:
                yield part
        except _CORE_ERRORS as exc:
            raise _as_httpx(exc) from exc

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        except _CORE_ERRORS as exc:
            raise _as_httpx(exc) from exc


class AsyncioTransport(httpx.AsyncBaseTransport):
    def __init__(self, limits: httpx.Limits):
        self._backend = _Backend()
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=self._backend,
        )

    def cut(self, url: str, reason: str) -> int:
        """End every connection to the replica at `url` now (it was found dead: a request on it
        must not wait for a read timeout); returns how many there were."""
        parsed = httpx.URL(url)
        connections = list(self._backend.open.get((parsed.host, parsed.port or 80), ()))
        for protocol in connections:
            protocol.cut(reason)
        return len(connections)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        core = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        try:
            response = await self._pool.handle_async_request(core)
        except _CORE_ERRORS as exc:
            raise _as_httpx(exc) from exc
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ResponseStream(response.stream),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._pool.aclose()
