"""gRPC service definitions. `mtpipe.proto` is the source; mtpipe_pb2*.py are generated from it.

Regenerate after editing the .proto (tests/test_proto_sync.py fails while they differ):

    python -c "from mtpipe.proto import write_stubs; write_stubs()"
"""

from __future__ import annotations

import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).parent
PROTO_FILE = PROTO_DIR / "mtpipe.proto"
STUBS = ("mtpipe_pb2.py", "mtpipe_pb2_grpc.py")


def generate_stubs() -> dict[str, str]:
    """Run protoc (grpcio-tools) on mtpipe.proto; returns {file name: source} with package-relative imports."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as out:
        args = [f"-I{PROTO_DIR}", f"--python_out={out}", f"--grpc_python_out={out}", str(PROTO_FILE)]
        rc = protoc.main(["protoc", *args])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        stubs = {name: (Path(out) / name).read_text() for name in STUBS}
    # protoc writes a top-level import; the stubs live inside this package.
    stubs["mtpipe_pb2_grpc.py"] = stubs["mtpipe_pb2_grpc.py"].replace(
        "import mtpipe_pb2 as mtpipe__pb2", "from . import mtpipe_pb2 as mtpipe__pb2"
    )
    return stubs


def write_stubs() -> None:
    for name, text in generate_stubs().items():
        (PROTO_DIR / name).write_text(text)
