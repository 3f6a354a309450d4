"""HTTPS for the API (vLLM's `--ssl-certfile` / `--ssl-keyfile`): a certificate chain and its key in PEM.

An API served beyond this machine with an API key sends that key with every request: over plain HTTP
anyone on the path reads it. The files are checked when the command starts (they load as a pair), not
when the first client connects.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ApiTLS:
    certfile: str
    keyfile: str


def uvicorn_options(tls: ApiTLS | None) -> dict[str, Any]:
    """uvicorn.Config's options for `tls` (none: plain HTTP)."""
    return {} if tls is None else {"ssl_certfile": tls.certfile, "ssl_keyfile": tls.keyfile}


def api_tls(certfile: str | None, keyfile: str | None, option: str = "--ssl-certfile/--ssl-keyfile") -> ApiTLS | None:
    """The API's certificate and key (None: plain HTTP); ValueError naming `option` where one is given
    without the other, or they do not load as a pair."""
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        raise ValueError(f"{option}: give both a certificate and its key")
    cert, key = Path(certfile).expanduser().resolve(), Path(keyfile).expanduser().resolve()
    for path in (cert, key):  # (OpenSSL's own error names neither)
        if not path.is_file():
            raise ValueError(f"{option}: no such file: {path}")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key, password=_no_passphrase)
    except _Encrypted:
        raise ValueError(f"{option}: the key is encrypted; give it unencrypted (the server cannot be asked for "
                         "its passphrase)") from None
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"{option}: the certificate and key do not load as a pair ({e})") from None
    return ApiTLS(str(cert), str(key))


class _Encrypted(Exception):
    pass


def _no_passphrase() -> bytes:
    """Called for an encrypted key only: without it OpenSSL asks for the passphrase on the terminal, and
    the command waits there (or, with no terminal, says only that the pair does not load)."""
    raise _Encrypted


def scheme(tls: ApiTLS | None) -> str:
    return "https" if tls is not None else "http"
