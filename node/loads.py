"""A node's Load RPC and its single-node counterpart (`adopt`): which shard it serves, for whom.

A Load is checked first (the coordinator admitted, the weights found, the layers fitting the model)
and refused with nothing changed; only then does it take the node over from other coordinators and
replace the shard it serves (coordinators.py decides who may).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc

from ..proto import mtpipe_pb2 as pb
from .conditions import Conditions
from .constraints import grammars_in
from .coordinators import Claim, Coordinators, superseded, taken_over
from .loader import LoadKey, check_load, load_stage, same_shard
from .weights import WeightStore

if TYPE_CHECKING:
    from .dataplane import NextStage
    from .stage import StageWorker

log = logging.getLogger(__name__)

ADOPT_TIMEOUT_S = 30.0  # a stage handed over from another thread (single-node launch)


class ShardLoads:
    """NodeService's loading (a mixin, on its loop)."""

    name: str
    node_id: str
    worker: StageWorker | None
    key: LoadKey | None
    coordinators: Coordinators
    conditions: Conditions
    weights: WeightStore
    draft_vocab: int | None
    mtp_window: int | None
    orphan_grace: float
    loop: asyncio.AbstractEventLoop | None
    _load_lock: asyncio.Lock | None
    next: NextStage | None
    ring: NextStage | None
    _subs: dict[str, asyncio.Queue]
    _owners: dict[str, str]

    if TYPE_CHECKING:  # what NodeService and its other mixins provide (never defined here: a stub would win the MRO)
        def _expire(self, client_id: str) -> None: ...
        def forget_client(self, client_id: str, alone: bool = True) -> int: ...
        def drop_groups(self) -> None: ...
        def _dtype_name(self) -> str: ...

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReply:
        key = LoadKey(request.model_path, request.start, request.end, request.num_layers, request.mtp, request.dtype,
                      request.fingerprint, request.ring_groups)
        self._load_lock = self._load_lock or asyncio.Lock()
        claim = Claim(request.term, request.term_holder)
        async with self._load_lock:
            if self.coordinators.stale(claim):  # (it steps down: coordinators.py)
                await context.abort(grpc.StatusCode.ABORTED, superseded(self.name, self.coordinators.claim, claim))
            # A coordinator of a newer term takes the node over from those of a term (coordinators.py: `of_terms`).
            newer = self.coordinators.supersedes(claim)
            take_over = request.take_over

            def others() -> tuple[list[str], list[str]]:  # (the subscribed that stay parties, those of older terms)
                older = self.coordinators.of_terms(request.client_id, self._subs) if newer else []
                return [c for c in self._subs if c not in older], older

            reused = self.worker is not None and self.key is not None and same_shard(self.key, key)
            loaded = self.worker is not None
            if self.coordinators.refuses(request.client_id, others()[0], reused, take_over, loaded):
                await self._refuse(request.client_id, context)
            found = None
            if not reused:
                try:
                    # A local copy, the shard cache or a peer; the old shard serves meanwhile, and
                    # stays if the request is refused.
                    found = await self.weights.resolve(request)
                    load = check_load(replace(key, model_path=str(found.path)))
                except (ValueError, OSError, KeyError) as e:
                    if found is not None:
                        found.release()
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.name}: {e}")
            # (asked again: the subscriptions may have changed while the weights were found)
            subscribed, older = others()
            ended = self.coordinators.admit_load(request.client_id, subscribed, reused, take_over, loaded)
            if ended is None:
                if found is not None:
                    found.release()
                await self._refuse(request.client_id, context)
            self.coordinators.supersede(older, request.client_id, claim.term)
            if request.node_name:
                self.name = request.node_name
            before = self.coordinators.claim
            self.coordinators.see(claim)
            ended = [*ended, *(c for c in older if c in self._subs and c not in ended)]
            self._end_taken_over(ended, request.client_id, superseded(self.name, claim, before) if newer else "")
            if found is None:
                # The pipeline is formed again: its groups' rounds were lost with it, and its engine starts
                # their rows afresh (as it forgets the kept prefixes). A sequence alone may be a request
                # that started meanwhile: it stays (its lease frees one nobody wants any more).
                if gone := self.forget_client(request.client_id, alone=False):
                    log.info("released %d grouped sequence(s) of client %s: its pipeline is formed again", gone,
                             request.client_id)
            else:
                try:
                    self.worker, self.key = None, None  # free the old shard before reading the new one
                    self.drop_groups()
                    self._owners.clear()
                    # On this thread (arrays belong to it), yielding to the loop between pieces.
                    worker = await load_stage(load, draft_vocab=self.draft_vocab, mtp_window=self.mtp_window)
                    if worker.head is not None:  # the last stage: grammars where the tokenizer is
                        config = worker.shard.config
                        worker.head.grammars = await asyncio.to_thread(grammars_in, load.model_path,
                                                                       config.args.vocab_size, config.eos_token_ids)
                    self.worker, self.key = worker, key
                    self.conditions.clear("load")
                except (ValueError, OSError, KeyError) as e:
                    self.conditions.set("load", f"load failed: {e}")
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.name}: {e}")
                finally:
                    found.release()  # in memory now: the cache entry may go
            shard = self.worker.shard
            log.info("%s shard [%d, %d) of %s (%s)", "kept" if reused else "loaded", key.start, key.end,
                     self.weights.loaded.path if self.weights.loaded else key.model_path, self._dtype_name())
            return pb.LoadReply(
                node_id=self.node_id,
                parameter_bytes=shard.model.parameter_bytes(),
                has_mtp=shard.has_mtp,
                hidden_size=shard.config.args.hidden_size,
                max_context=shard.config.args.max_position_embeddings,
                reused=reused,
                weights_source=self.weights.loaded.source if self.weights.loaded else "path",
                weights_path=str(self.weights.loaded.path) if self.weights.loaded else key.model_path,
                fetched_bytes=found.fetched if found is not None else 0,
                ring_groups=not self.worker.overlap,
                constrains=self.worker.head is not None and self.worker.head.grammars is not None,
            )

    async def Unload(self, request: pb.UnloadRequest, context: grpc.aio.ServicerContext) -> pb.UnloadReply:
        self._load_lock = self._load_lock or asyncio.Lock()
        async with self._load_lock:
            if self.worker is None:
                return pb.UnloadReply(unloaded=False)
            if request.client_id not in self.coordinators.clients or self.coordinators.refuses(
                    request.client_id, list(self._subs), reused=False, take_over=False):
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"{self.name} serves another coordinator: its shard stays")
            freed = self.worker.shard.model.parameter_bytes()
            for client in {*self._owners.values(), *self.coordinators.clients}:
                self.forget_client(client)
            self.worker, self.key = None, None
            self.drop_groups()
            self._owners.clear()
            self.weights.loaded = None
            links, self.next, self.ring = (self.next, self.ring), None, None  # (gone before anything awaits)
            self.conditions.clear("link:next stage")
            self.conditions.clear("link:first stage")
            for link in links:
                if link is not None:
                    await link.close()
            import mlx.core as mx

            gc.collect()  # (the shard's arrays have no other holder now)
            mx.clear_cache()  # (MLX work: this is the node's MLX thread)
            log.info("unloaded its shard (%.2f GiB): coordinator %s placed nothing here any more", freed / 2**30,
                     request.client_id or "?")
            return pb.UnloadReply(unloaded=True, freed_bytes=freed)

    async def _refuse(self, client_id: str, context: grpc.aio.ServicerContext) -> None:
        if (by := self.coordinators.displaced.get(client_id)) is not None:
            await context.abort(grpc.StatusCode.ABORTED, taken_over(self.name, by))
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"{self.name} serves another coordinator (connected now) with another shard: "
                            "stop that one, or take the node over (--take-over)")

    def _end_taken_over(self, ended: list[str], by: str, why: str = "") -> None:
        """The coordinators taken over hear it (`why`, else that `by` took the node over) as their
        subscriptions' last event."""
        for client in ended:
            log.warning("%s: taken over from coordinator %s by %s", self.name, client, by)
            q = self._subs.pop(client)
            message = why or taken_over(self.name, by)
            q.put_nowait(pb.Event(error=pb.Error(code="ABORTED", node=self.name, message=message)))
            q.put_nowait(None)
            asyncio.get_running_loop().call_later(self.orphan_grace, self._expire, client)

    def adopt(self, worker: StageWorker | None, key: LoadKey | None) -> None:
        """Serve a stage built in this process (single-node `mtpipe launch`): Health reports it. (None:
        none any more, its coordinator stepped down.)

        Only Python objects change hands, and on the loop thread, so no call on the loop sees half
        an adoption. Nothing of MLX is done here: the stage's arrays belong to the thread that built
        them, which must have materialized them (load_shard evaluates every parameter)."""
        loop = self.loop
        if loop is None or not loop.is_running() or _on_loop(loop):
            self._adopt(worker, key)
            return
        done = threading.Event()

        def adopt_on_loop() -> None:
            try:
                self._adopt(worker, key)
            finally:
                done.set()

        loop.call_soon_threadsafe(adopt_on_loop)
        if not done.wait(ADOPT_TIMEOUT_S):
            raise TimeoutError(f"the node loop did not take the stage within {ADOPT_TIMEOUT_S:.0f} s")

    def _adopt(self, worker: StageWorker | None, key: LoadKey | None) -> None:
        self.worker, self.key = worker, key
        self.drop_groups()
        self._owners.clear()


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False

