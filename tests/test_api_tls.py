"""--ssl-certfile / --ssl-keyfile checked as the command starts (tls.py): what is wrong, said plainly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mtpipe.coordinator.api.tls import api_tls


def _pair(directory: Path, passphrase: bytes | None = None) -> tuple[Path, Path]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    encryption = serialization.NoEncryption() if passphrase is None else \
        serialization.BestAvailableEncryption(passphrase)
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    return cert_path, key_path


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    """(OpenSSL's FileNotFoundError has no file name: the message said "no such file: None".)"""
    cert, key = _pair(tmp_path)
    for certfile, keyfile, missing in ((tmp_path / "nope.pem", key, "nope.pem"),
                                       (cert, tmp_path / "gone.pem", "gone.pem")):
        with pytest.raises(ValueError, match=f"no such file: .*{missing}$"):
            api_tls(str(certfile), str(keyfile))
    assert api_tls(str(cert), str(key)) is not None


def test_an_encrypted_key_is_refused_without_asking_for_its_passphrase(tmp_path: Path) -> None:
    """(OpenSSL asked for the passphrase on the terminal: the command waited there; without one it said only
    that the pair did not load.) A child with a terminal of its own would wait: its stdin is closed here, and
    what it prints is read for the prompt."""
    cert, key = _pair(tmp_path, b"secret")
    probe = ("from mtpipe.coordinator.api.tls import api_tls\ntry:\n    api_tls(%r, %r)\nexcept ValueError as e:\n"
             "    print(e)\n" % (str(cert), str(key)))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    assert "key is encrypted" in out.stdout and "pass phrase" not in out.stdout + out.stderr, out


def test_over_https_the_url_announced_names_the_host_asked(tmp_path: Path) -> None:
    """(`serve --host localhost` announced https://127.0.0.1:...: a certificate for localhost, or for the
    machine's name, failed the check of a client given that URL.) An address asked, or plain HTTP, is as bound."""
    from mtpipe.coordinator.api.front import base_url

    tls = api_tls(*map(str, _pair(tmp_path)))
    assert base_url("127.0.0.1", 8443, tls, "localhost") == "https://localhost:8443"
    assert base_url("::1", 8443, tls, "[::1]") == "https://[::1]:8443"
    assert base_url("0.0.0.0", 8443, tls, "0.0.0.0") == "https://0.0.0.0:8443"
    assert base_url("127.0.0.1", 8000, None, "localhost") == "http://127.0.0.1:8000"
