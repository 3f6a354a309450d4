"""Mutual TLS keyed by the cluster secret: every connection between members is authenticated both
ways and encrypted, and the secret itself never travels.

Each process derives the same P-256 key from the secret (scrypt, so guessing a secret from a public
key is slow) and the same self-signed certificate (deterministic ECDSA: byte for byte the same
everywhere), which is both its identity and the only root it trusts. A peer without the secret
cannot complete a handshake in either direction; a client stops at a server that cannot prove the
key before sending anything of its own. TLS 1.3 then protects every message from being read,
altered or replayed. gRPC uses it through its credentials, the data plane and bulk transfers
through `ssl` contexts.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import socket
import ssl
import tempfile
import threading

import grpc

NAME = "mtpipe-cluster"  # the certificate's name: what every client checks, whatever address it dialled
TARGET_NAME_OPTION = ("grpc.ssl_target_name_override", NAME)
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_SALT = b"mtpipe cluster key v1"
_DERIVING = threading.Lock()


def identity(secret: str) -> tuple[bytes, bytes]:
    """(private key PEM, certificate PEM), the same in every process that knows `secret`. Derived once
    per process: the probes of a launch or of `mtpipe health` ask for it from many threads at once, and
    each would otherwise pay the scrypt (a cache alone lets every thread that misses at once derive it)."""
    with _DERIVING:
        return _derive(secret)


@functools.lru_cache(maxsize=16)
def _derive(secret: str) -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    seed = hashlib.scrypt(secret.encode(), salt=_SALT, n=2**15, r=8, p=1, maxmem=64 * 2**20, dklen=32)
    key = ec.derive_private_key(int.from_bytes(seed, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, NAME)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1)
            .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC))
            .not_valid_after(datetime.datetime(2120, 1, 1, tzinfo=datetime.UTC))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256(), ecdsa_deterministic=True))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def server_credentials(secret: str) -> grpc.ServerCredentials:
    key, cert = identity(secret)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=cert, require_client_auth=True)


def channel_credentials(secret: str) -> grpc.ChannelCredentials:
    key, cert = identity(secret)
    return grpc.ssl_channel_credentials(root_certificates=cert, private_key=key, certificate_chain=cert)


@functools.lru_cache(maxsize=8)
def ssl_context(secret: str, server: bool) -> ssl.SSLContext:
    """For raw TCP (the data plane, bulk transfers): TLS 1.3, the peer must show the cluster's certificate."""
    key, cert = identity(secret)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=cert.decode())
    with tempfile.TemporaryDirectory() as d:  # ssl loads a key only from a file: a private one, gone at once
        path = os.path.join(d, "identity.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key + cert)
        ctx.load_cert_chain(path)
    return ctx


def is_secured_node(target: str, timeout: float = 2.0) -> bool:
    """Whether `target` answers a TLS hello with a cluster certificate: a node started with a cluster
    secret does, and a channel without one then fails as a closed socket, which reads like a network
    fault. (Any other TLS server, an HTTPS service on the port, is not one.)"""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    from .links import split_host_port

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        host, port = split_host_port(target)
        with socket.create_connection((host, port), timeout) as sock, context.wrap_socket(sock) as tls:
            der = tls.getpeercert(binary_form=True)
    except (OSError, ValueError):  # (ssl.SSLError is an OSError: plaintext, or a refusal)
        return False
    if not der:
        return False
    names = x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return [n.value for n in names] == [NAME]
