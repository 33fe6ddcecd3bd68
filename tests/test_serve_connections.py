"""Slow clients under ``python campaignapi.py serve`` (waitress), over raw sockets.

A client that sends half a request line and waits holds one of waitress's
connections until it times out.  waitress alone holds 100 for 120 s, so a
hundred such clients shut everyone else out; serve's ``--connection-limit``
and ``--channel-timeout`` set both, with defaults that keep the server
answering (README: Deployment)."""

import contextlib
import socket
import time

import pytest

from clihelpers import served

HALF_LINE = b"GET /v1/campaign/al"


@contextlib.contextmanager
def idle_clients(port, count):
    """``count`` connections that each sent half a request line; all closed
    at the end.  Yields the list, so that a test may close some earlier."""
    clients = []
    try:
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            clients.append(sock)
            sock.sendall(HALF_LINE)
        yield clients
    finally:
        for sock in clients:
            sock.close()


def request(port, secret):
    """A whole request on a new connection, sent at once: the socket, to read
    its answer with answer()."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"GET /v1/campaign/all HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 f"Authorization: Bearer {secret}\r\nConnection: close\r\n\r\n".encode())
    return sock


def answer(sock, timeout):
    """The status of the answer on ``sock``, or None when none came within
    ``timeout`` seconds.  Reads until the server closes the connection."""
    deadline, data = time.monotonic() + timeout, b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            part = sock.recv(65536)
        except socket.timeout:
            return None
        if not part:
            break
        data += part
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.") else data


def test_the_defaults_answer_with_110_idle_connections_open(tmp_path):
    with served("--db", "slow.db", cwd=tmp_path) as server, \
            idle_clients(server.port, 110) as clients:
        time.sleep(0.5)   # let waitress accept every one it will
        started = time.monotonic()
        with request(server.port, server.secret) as sock:
            assert answer(sock, timeout=10) == 200
        assert time.monotonic() - started < 10
        # The idle ones are still held, not dropped to make room.
        clients[0].settimeout(0.2)
        with pytest.raises(socket.timeout):
            clients[0].recv(1)


def test_connection_limit_counts_client_connections(tmp_path):
    with served("--db", "slow.db", "--connection-limit", "5", "--channel-timeout", "600",
                cwd=tmp_path) as server:
        with idle_clients(server.port, 4):
            # Four held: the fifth is a client too, and is answered.
            with request(server.port, server.secret) as sock:
                assert answer(sock, timeout=10) == 200
        with idle_clients(server.port, 5) as clients:
            time.sleep(0.5)
            with request(server.port, server.secret) as sock:
                # Five held: the sixth waits to be accepted ...
                assert answer(sock, timeout=2.5) is None
                # ... until one of them goes.
                clients.pop().close()
                assert answer(sock, timeout=10) == 200


def test_channel_timeout_closes_an_idle_connection(tmp_path):
    with served("--db", "slow.db", "--channel-timeout", "1", cwd=tmp_path) as server, \
            idle_clients(server.port, 1) as clients:
        started = time.monotonic()
        clients[0].settimeout(10)
        assert clients[0].recv(65536) == b""   # closed by the server, no answer
        assert 0.9 <= time.monotonic() - started <= 8   # the default would be 30 to 45
        # The server itself goes on answering.
        with request(server.port, server.secret) as sock:
            assert answer(sock, timeout=10) == 200
