"""Kept prompt prefixes on a node, each client's under its own keys.

The stage keeps and hands them out (stage.py, prefixes.py); the client's engine decides which are kept
and which go (coordinator/engine/kept.py). A key is the client's, so no client can start from what
another one's prompts left. A client gone, or loading the pipeline afresh (after it was lost, when
its engine forgets what it kept), loses its prefixes here.
"""

from __future__ import annotations

from dataclasses import replace

from ..proto import mtpipe_pb2 as pb
from .protocol import StepRequest
from .stage import StageWorker


def scoped(client_id: str, key: str) -> str:
    return f"{client_id}/{key}" if key else ""


class KeptFrames:
    """The node service's side (a mixin of NodeService, on its loop)."""

    worker: StageWorker | None

    def _forward(self, frame: pb.Frame) -> None: ...  # NodeService's

    @staticmethod
    def scope(req: StepRequest, client_id: str) -> StepRequest:
        if not req.prefix and not req.keep:
            return req
        return replace(req, prefix=scoped(client_id, req.prefix), keep=scoped(client_id, req.keep))

    def drop_kept(self, frame: pb.Frame) -> None:
        """A RELEASE naming a kept prefix: it goes here, then on the nodes after this one (in order
        behind the steps that started from it)."""
        if self.worker is None:
            return
        self.worker.drop_prefixes([scoped(frame.client_id, frame.prefix)])
        if not self.worker.spec.is_last:
            self._forward(frame)

    def forget_kept(self, client_id: str) -> None:
        if self.worker is not None:
            self.worker.drop_prefixes([k for k in self.worker.prefixes if k.startswith(f"{client_id}/")])
