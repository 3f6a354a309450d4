"""The checked-in gRPC stubs are exactly what protoc generates from proto/mtpipe.proto."""

from __future__ import annotations

import pytest

from mtpipe.proto import PROTO_DIR, generate_stubs


def test_stubs_match_the_proto() -> None:
    pytest.importorskip("grpc_tools")
    for name, text in generate_stubs().items():
        assert (PROTO_DIR / name).read_text() == text, (
            f"proto/{name} is stale; regenerate with: python -c \"from mtpipe.proto import write_stubs; write_stubs()\""
        )
