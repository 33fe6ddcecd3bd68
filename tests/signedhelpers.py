"""Real HTTP(S) servers on loopback and test certificates, for the signed-HTTP tests."""

import datetime
import http.server
import ssl
import threading

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID


def self_signed(name, key=None):
    """(key, certificate PEM bytes) of a self-signed certificate for DNS ``name``."""
    key = key or rsa.generate_private_key(public_exponent=65537, key_size=2048)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert.public_bytes(serialization.Encoding.PEM)


def client_context(cert_pem):
    """A client TLS context that trusts only ``cert_pem``."""
    return ssl.create_default_context(cadata=cert_pem.decode("ascii"))


class Receiver:
    """A threaded HTTP server on 127.0.0.1 whose answers come from
    ``respond(handler)``; it records every connection and request.  Use as a
    context manager: the server is stopped (and hanging handlers released) on exit.

    ``tls``: a (key, certificate PEM) pair, to serve https; the names the
    clients asked for by SNI are kept in ``sni``.
    """

    def __init__(self, respond, tls=None, tmp_path=None):
        self.respond, self.requests, self.connections, self.sni = respond, [], 0, []
        self.release = threading.Event()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _record(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.body = body = self.rfile.read(length) if length else b""
                receiver.requests.append({"method": self.command, "path": self.path,
                                          "headers": dict(self.headers), "body": body})
                try:
                    receiver.respond(self)
                except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                    pass   # the client hung up, as some tests expect

            do_GET = do_POST = _record

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def verify_request(self, request, client_address):
                receiver.connections += 1
                return True

        self.server = Server(("127.0.0.1", 0), Handler)
        if tls:
            key, cert_pem = tls
            cert_file, key_file = tmp_path / "server.pem", tmp_path / "server.key"
            cert_file.write_bytes(cert_pem)
            key_file.write_bytes(key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption()))
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cert_file, key_file)
            context.sni_callback = lambda sock, name, ctx: self.sni.append(name)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)

    def url(self, path="/hook", host="127.0.0.1", scheme="http"):
        return f"{scheme}://{host}:{self.port}{path}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.release.is_set():
            return
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def answer(handler, status, body=b"", headers=()):
    """Write a complete answer with a Content-Length."""
    handler.send_response(status)
    for name, value in headers:
        handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
