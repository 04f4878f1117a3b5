"""The router's HTTP client transport (orchestrator/router/transport.py) against real servers on
127.0.0.1: each way a connection can fail is the httpx error the router's retry strategy reads,
idle connections are reused (and not once the server closed them), and a reader that falls
behind stops the connection's reading instead of buffering the whole stream. On asyncio's own
event loop and on uvloop's (the loop of Ray's actors, where the router runs in a cluster)."""

from __future__ import annotations

import asyncio
import socket
import struct

import httpx
import pytest

from pdcluster.orchestrator.router import transport
from tests.unit.replica_stand_ins import closed_port

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def client(**timeouts) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=transport.AsyncioTransport(httpx.Limits()), timeout=httpx.Timeout(10, **timeouts)
    )


async def serving(handle) -> tuple[asyncio.Server, str]:
    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await handle(reader, writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def hang_up(reader, writer):
    writer.close()


async def half_a_body(reader, writer):
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
    await writer.drain()
    writer.close()


async def reset(reader, writer):
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart")
    await writer.drain()
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()  # RST: the connection is reset, not closed


async def silent(reader, writer):
    await reader.read()  # never answers; returns once the client gives up


@pytest.mark.parametrize(
    ("handle", "error"),
    [
        (None, httpx.ConnectError),
        (hang_up, httpx.RemoteProtocolError),
        (half_a_body, httpx.RemoteProtocolError),
        (reset, httpx.ReadError),
        (silent, httpx.ReadTimeout),
    ],
)
def test_each_failure_is_the_httpx_error_for_it(run, handle, error):
    async def scenario():
        server, url = (None, f"http://127.0.0.1:{closed_port()}") if handle is None else await serving(handle)
        try:
            async with client(read=0.5) as http:
                with pytest.raises(error):
                    await http.post(url + "/v1/completions", json={})
        finally:
            if server is not None:
                server.close()

    run(scenario, 30)


def test_idle_connections_are_reused_unless_the_server_closed_them(run):
    connections = []

    async def keep_alive(reader, writer):
        connections.append(writer)
        writer.write(OK)
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            writer.write(OK)

    async def scenario():
        server, url = await serving(keep_alive)
        try:
            async with client() as http:
                assert [(await http.get(url)).text for _ in range(3)] == ["ok"] * 3
                assert len(connections) == 1
                connections[0].close()  # the server ends the idle connection
                await connections[0].wait_closed()
                assert (await http.get(url)).text == "ok"  # a new connection, not an error
                assert len(connections) == 2
        finally:
            server.close()

    run(scenario, 30)


def test_a_reader_that_falls_behind_stops_the_connection_reading(run):
    size = 64 << 20  # far more than the kernel's socket buffers hold

    async def large(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()

    async def scenario():
        server, url = await serving(large)
        try:
            async with client() as http, http.stream("GET", url) as response:
                chunks = response.aiter_raw()
                received = len(await anext(chunks))
                protocol = response.extensions["network_stream"]._protocol
                while not protocol.reading_paused:  # the server keeps writing until the buffer is full
                    await asyncio.sleep(0.01)
                assert len(protocol.buffer) <= transport.READ_HIGH_WATER + (1 << 20)
                async for chunk in chunks:  # reading resumes as the reader catches up
                    received += len(chunk)
                assert received == size
        finally:
            server.close()

    run(scenario, 60)


def test_a_cancel_arriving_with_a_refused_connect_still_cancels():
    """The router's KV-event followers are cancelled at stop while they reconnect; a cancel that
    lands in the same loop turn as the connection's refusal must end the task. (asyncio.wait_for
    on Python 3.11 returned the refusal instead: the follower took it for a failed connect, kept
    reconnecting, and Router.stop() waited on it forever.)"""

    async def scenario():
        loop = asyncio.get_running_loop()
        backend = transport._Backend()
        connecting: asyncio.Task | None = None

        async def refused(*args, **kwargs):
            failed = loop.create_future()
            loop.call_soon(failed.set_exception, ConnectionRefusedError(111, "Connection refused"))
            loop.call_soon(connecting.cancel)  # both land in the same turn of the loop
            return await failed

        loop.create_connection = refused
        connecting = asyncio.ensure_future(backend.connect_tcp("127.0.0.1", closed_port(), timeout=5))
        with pytest.raises(asyncio.CancelledError):
            await connecting

    asyncio.run(scenario())
