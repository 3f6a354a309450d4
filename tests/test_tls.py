"""What a rogue on the network gets from mtpipe with a cluster secret: nothing that authenticates.

A rogue listener that records every byte sent to it learns neither the secret nor anything derived
from it (a client stops after its TLS hello when the server cannot prove the key), and replaying the
recording to a real node gets nowhere. Data-plane frames altered on the way are refused, the link is
closed and nothing reaches the node."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from rogue_node import replay_all

from mtpipe.coordinator.cluster.health import first_reachable, probe_node
from mtpipe.node.bulk import close
from mtpipe.node.dataplane import HELLO, LENGTH, FrameListener, TcpFrameLink
from mtpipe.node.server import NodeServer
from mtpipe.node.tls import NAME, identity, ssl_context
from mtpipe.proto import mtpipe_pb2 as pb

SECRET = "correct horse battery staple"


class Recorder:
    """Accepts connections and records every byte they send; answers nothing."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self.accepted = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._record, args=(conn,), daemon=True).start()

    def _record(self, conn: socket.socket) -> None:
        data = b""
        conn.settimeout(3)
        try:
            while chunk := conn.recv(65536):
                data += chunk
        except OSError:
            pass
        self.received.append(data)
        conn.close()

    def settled(self) -> bool:
        """Every connection it took has ended (its client gave up) and is recorded."""
        return self.accepted > 0 and len(self.received) == self.accepted

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def node() -> Iterator[NodeServer]:
    server = NodeServer("127.0.0.1", 0, node_id="real", secret=SECRET).start()
    yield server
    server.stop(0)


def test_a_rogue_listener_records_nothing_that_authenticates(node: NodeServer) -> None:
    rogue = Recorder()
    try:
        target = f"127.0.0.1:{rogue.port}"

        async def data_plane() -> None:
            with pytest.raises((OSError, asyncio.TimeoutError, ConnectionError)):
                await TcpFrameLink.connect("127.0.0.1", rogue.port, SECRET, timeout=1.5)

        with ThreadPoolExecutor(3) as pool:  # (each waits out its timeout: all at once)
            found = pool.submit(first_reachable, [target], SECRET, timeout=1.5)
            probed = pool.submit(probe_node, target, SECRET, timeout=1.5)
            pool.submit(asyncio.run, data_plane()).result()
            assert found.result() is None and probed.result()["reachable"] is False
        assert _wait(rogue.settled)
        recorded = b"".join(rogue.received)
        assert recorded  # it did receive connections
        key, cert = identity(SECRET)
        for secret_thing in (SECRET.encode(), key, cert, key.split(b"\n")[1], cert.split(b"\n")[1]):
            assert secret_thing not in recorded
        # Replayed to a real node, the recorded bytes authenticate nothing: no reply is application data.
        ports = (node.port, node.service.data_port)
        for reply in replay_all([("127.0.0.1", port, blob) for blob in rogue.received for port in ports]):
            assert b"node_id" not in reply and b"real" not in reply
        assert not node.service._subs and not node.service._owners  # no client got through
    finally:
        rogue.close()


class Proxy:
    """Forwards one TCP connection to `port`, counting the client's bytes (`seen`) and flipping one
    bit of byte number `flip_at` of them, if given."""

    def __init__(self, port: int, flip_at: int | None = None) -> None:
        self.target, self.flip_at = port, flip_at
        self.seen = 0
        self.recorded = bytearray()  # what the client sent, as sent
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        conn, _ = self.sock.accept()
        up = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._back, args=(up, conn), daemon=True).start()
        try:
            while chunk := conn.recv(65536):
                self.recorded += chunk
                if self.flip_at is not None and self.seen <= self.flip_at < self.seen + len(chunk):
                    i = self.flip_at - self.seen
                    chunk = chunk[:i] + bytes([chunk[i] ^ 0x01]) + chunk[i + 1 :]
                self.seen += len(chunk)
                up.sendall(chunk)
        except OSError:
            pass
        finally:
            close(up)

    @staticmethod
    def _back(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            close(dst)


def test_an_altered_frame_is_refused_and_nothing_reaches_the_node() -> None:
    loop = asyncio.new_event_loop()
    got: list[pb.Frame] = []

    async def on_frame(frame: pb.Frame) -> None:
        got.append(frame)

    threading.Thread(target=loop.run_forever, daemon=True).start()
    listener = FrameListener(on_frame, SECRET, max_bytes=1 << 20)
    port = asyncio.run_coroutine_threadsafe(listener.start("127.0.0.1"), loop).result(10)
    try:
        frame = pb.Frame(client_id="c", seq_id="s", step=1, kind=pb.DECODE, tokens=[1, 2, 3])
        data = LENGTH.pack(frame.ByteSize()) + frame.SerializeToString()

        def send(via: int, payload: bytes) -> bool:
            """Through the data plane at `via`; True if the listener kept the connection open."""
            s = socket.create_connection(("127.0.0.1", via), timeout=5)
            s.sendall(HELLO)
            assert s.recv(2) == b"OK"
            tls = ssl_context(SECRET, server=False).wrap_socket(s, server_hostname=NAME)
            tls.sendall(payload)
            tls.settimeout(2)
            try:
                return tls.recv(1) != b""  # the listener never writes: a timeout means still open
            except TimeoutError:
                return True
            except (ssl.SSLError, OSError):
                return False
            finally:
                tls.close()

        counted = Proxy(port)
        assert send(counted.port, data) and _wait(lambda: len(got) == 1) and got[0] == frame
        # The same again, one bit flipped inside the frame's TLS record (TLS 1.3: a 5-byte header,
        # then the data, its content type and a 16-byte tag), past the hello and the handshake.
        record = len(data) + 22
        flipped = Proxy(port, flip_at=counted.seen - record + 10)
        assert not send(flipped.port, data)  # the record fails its check: the listener closed the link
        assert len(got) == 1  # and nothing more reached the node
        # The good connection's bytes replayed as they were, on a new connection: the handshake
        # cannot complete (fresh server randoms), the listener hangs up, and no frame reaches the node.
        recorded = bytes(counted.recorded)
        assert recorded.startswith(HELLO)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(HELLO)
            assert s.recv(2) == b"OK"
            s.sendall(recorded[len(HELLO):])
            s.settimeout(5)
            closed = False
            try:
                while s.recv(65536):
                    pass
                closed = True
            except ConnectionResetError:
                closed = True
            assert closed
        assert len(got) == 1
    finally:
        asyncio.run_coroutine_threadsafe(listener.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def _wait(cond, timeout: float = 5.0) -> bool:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return True
        threading.Event().wait(0.02)
    return cond()


def test_plaintext_slipped_in_before_tls_is_refused_on_both_sides() -> None:
    """Someone on the path without the secret appends a plaintext frame to a node's hello (or bytes to
    the listener's OK): the stream is refused before TLS, and nothing it carried reaches the node."""
    from mtpipe.node.dataplane import DataPlaneError, _encode

    async def run() -> list[str]:
        got: list[str] = []
        real = asyncio.Event()

        async def on_frame(frame: pb.Frame) -> None:
            got.append(frame.seq_id)
            if frame.seq_id == "real":
                real.set()

        listener = FrameListener(on_frame, SECRET, 64 << 20)
        port = await listener.start("127.0.0.1")
        injected = _encode(pb.Frame(client_id="rogue", seq_id="injected", step=1))

        async def relay(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        async def on_path(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
            sr, sw = await asyncio.open_connection("127.0.0.1", port)
            sw.write(await cr.readexactly(len(HELLO)) + injected)
            await asyncio.gather(relay(cr, sw), relay(sr, cw))

        async def answers_ok_and_more(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.readexactly(len(HELLO))
            w.write(b"OK" + injected)
            await w.drain()
            await asyncio.sleep(1)
            w.close()

        for fake in (on_path, answers_ok_and_more):
            server = await asyncio.start_server(fake, "127.0.0.1", 0)
            with pytest.raises(DataPlaneError):
                await TcpFrameLink.connect("127.0.0.1", server.sockets[0].getsockname()[1], SECRET, timeout=3)
            server.close()
        link = await TcpFrameLink.connect("127.0.0.1", port, SECRET)  # (the listener serves on)
        await link.write(pb.Frame(client_id="node-a", seq_id="real", step=1))
        await asyncio.wait_for(real.wait(), 10)
        await link.close()
        await listener.close()
        return got

    assert asyncio.run(run()) == ["real"]


def test_a_client_without_the_secret_is_told_the_node_asks_for_one() -> None:
    """A channel without TLS to a node with a secret fails as a closed socket, which reads like a network
    fault: the error says the node asks for the secret. A node without one is not said to."""
    from mtpipe.coordinator.pipeline.nodes import NodeFailure, wait_for_nodes
    from mtpipe.node.tls import is_secured_node

    secured = NodeServer("127.0.0.1", 0, node_id="secured", secret=SECRET).start()
    plain = NodeServer("127.0.0.1", 0, node_id="plain").start()
    try:
        target, open_target = f"127.0.0.1:{secured.port}", f"127.0.0.1:{plain.port}"
        assert is_secured_node(target) and not is_secured_node(open_target)
        row = probe_node(target, None, timeout=3.0)
        assert row["status"] == "unreachable" and "asks for the cluster secret" in row["problems"][0], row
        with pytest.raises(NodeFailure, match="asks for the cluster secret"):
            wait_for_nodes([target], timeout=2.0)
        assert probe_node(open_target, None, timeout=3.0)["reachable"]
    finally:
        secured.stop(0)
        plain.stop(0)
    assert not is_secured_node(target)  # (nothing listens there now)


def test_another_tls_server_is_not_taken_for_a_node_asking_for_the_secret(tmp_path: Path) -> None:
    """An HTTPS service on the port (another certificate's name) is not a node that asks for the secret."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from mtpipe.node.tls import is_secured_node

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "example.org")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(datetime.datetime(2020, 1, 1))
            .not_valid_after(datetime.datetime(2120, 1, 1)).sign(key, hashes.SHA256()))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    listener = socket.create_server(("127.0.0.1", 0))

    def serve_one() -> None:
        conn, _ = listener.accept()
        try:
            with context.wrap_socket(conn, server_side=True):
                pass
        except (ssl.SSLError, OSError):
            pass

    server = threading.Thread(target=serve_one, daemon=True)
    server.start()
    try:
        assert not is_secured_node(f"127.0.0.1:{listener.getsockname()[1]}")
    finally:
        server.join(5)
        listener.close()


def test_the_identity_is_derived_once_however_many_threads_ask_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probing many nodes at once (a launch proving members, `mtpipe health`) asks for the identity from
    many threads before any has it: one scrypt, not one per thread."""
    import hashlib

    from mtpipe.node import tls

    calls = []
    real = hashlib.scrypt

    def counted(password: bytes, **kwargs):
        if password == secret.encode():  # (not another test's thread deriving its own)
            calls.append(threading.get_ident())
        return real(password, **kwargs)

    monkeypatch.setattr(tls.hashlib, "scrypt", counted)
    secret = f"asked for at once {id(calls)}"  # (not in the cache yet)
    start = threading.Barrier(8)

    def ask(_: int) -> tuple[bytes, bytes]:
        start.wait()
        return identity(secret)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert len(calls) == 1 and len(set(got)) == 1 and got[0][1].startswith(b"-----BEGIN CERTIFICATE-----")
