"""The API in a process of its own, over the engine in this one (link.py says why).

`FrontProcess` spawns the front: it loads the tokenizer (never the weights, and it does no MLX work),
builds the same app as the in-process API over an `EngineClient`, and serves it with uvicorn. The
engine's process keeps its MLX thread and an `EngineHost`. Either process going away ends the other's
part: a front that dies cancels its requests in the engine; an engine that dies fails the front's
open requests and stops it.

This module imports nothing heavy at its top: the spawned process imports it to unpickle its spec, then
prepares itself (`prepare_process`) before the app and the tokenizer come in.
(No `from __future__ import annotations` here: the spec crosses to a spawned process by pickling.)
"""

import asyncio
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

from ...models.deferred import defer_package_init
from ..stacks import dump_stacks_on_sigusr1
from .defaults import (
    DEFAULT_CORS_ORIGINS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MODEL_NAME,
    STALL_TIMEOUT_S,
)
from .templates import ChatTemplate
from .tls import ApiTLS, scheme, uvicorn_options

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # spawning, importing the app and loading the tokenizer
STOP_TIMEOUT_S = 10.0
WAKE_S = 0.25  # the longest a waiting main thread sleeps before it runs the handlers of signals that came
ABORT_BEFORE_GRACE_END_S = 1.0  # on a stop, generations still open this long before uvicorn cuts them end


@dataclass(frozen=True)
class FrontSpec:
    """What the front process serves and how (the API key crosses by pipe, never on a command line)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, reported back
    model_name: str = DEFAULT_MODEL_NAME
    api_key: str | None = None
    default_mtp_depth: int | str | None = None
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES
    access_log: bool = True
    log_level: int = logging.INFO
    stall_timeout: float | None = STALL_TIMEOUT_S  # an engine stuck this long fails its requests (None: never)
    generation_config: str | None = None  # the directory of the request defaults (model_defaults.py); None: OpenAI's
    cors_origins: tuple[str, ...] = DEFAULT_CORS_ORIGINS  # web pages that may call it from a browser (create_app)
    default_max_tokens: int | None = None  # the max_tokens of a request that leaves it out (create_app)
    scheduling_policy: str = "fcfs"  # "priority": requests may set theirs (create_app)
    chat_template: ChatTemplate | None = None  # the server's template and variables (create_app)
    tls: ApiTLS | None = None  # HTTPS (tls.py); None: plain HTTP


def front_spec(model_path: Path, host: str, port: int, api_key: str | None, model_name: str, *,
               default_mtp_depth: int | None, max_concurrency: int, max_body_bytes: int | None,
               stall_timeout: float | None = STALL_TIMEOUT_S, generation_config: Path | None = None,
               cors_origins: Sequence[str] = DEFAULT_CORS_ORIGINS, default_max_tokens: int | None = None,
               scheduling_policy: str = "fcfs", chat_template: ChatTemplate | None = None,
               tls: ApiTLS | None = None) -> FrontSpec:
    """What `serve` runs an API process with: `mtpipe serve` spawns one with it before the model loads."""
    return FrontSpec(str(model_path), host=host, port=port, model_name=model_name, api_key=api_key,
                     default_mtp_depth=default_mtp_depth, max_concurrency=max_concurrency,
                     max_body_bytes=max_body_bytes, log_level=logging.getLogger().getEffectiveLevel(),
                     stall_timeout=stall_timeout, cors_origins=tuple(cors_origins),
                     generation_config=None if generation_config is None else str(generation_config),
                     default_max_tokens=default_max_tokens, scheduling_policy=scheduling_policy,
                     chat_template=chat_template, tls=tls)


def prepare_process() -> None:
    """The front's process before it imports the app: signals, and a tokenizer without a model's code.

    Until uvicorn serves, Ctrl-C is ignored here: a terminal sends it to both processes, and the
    engine's stops this one with SIGTERM. While it serves, uvicorn handles both signals (a graceful
    shutdown) and raises them again once done, and the handlers set here end the process cleanly.
    Torch is marked absent and mlx-lm's package init deferred, as the `mtpipe` command does
    (coordinator/cli/entry.py): that init imports the generation code, which evaluates arrays as it
    loads, and the front only tokenizes.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # (SIGINT blocked from the spawn, `FrontProcess.spawn`; both as a parent's thread blocked them)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGTERM, _exit_cleanly)
    dump_stacks_on_sigusr1()
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    defer_package_init("mlx_lm")


def front_main(conn: Any, spec: FrontSpec) -> None:
    """The front process: serve the API over the engine at the other end of `conn` until told to stop."""
    prepare_process()
    import uvicorn

    from ..engine.tokenizer import load_tokenizer
    from .app import create_app
    from .link import EngineClient

    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    tokenizer = _early_tokenizer(spec.model_path)  # (while the engine loads)
    try:
        (op, info), = conn.recv()
    except (EOFError, OSError):
        return
    assert op == "hello", op
    if tokenizer is None or set(tokenizer.eos_token_ids) != set(info["eos"]):  # the engine's word decides
        tokenizer = load_tokenizer(spec.model_path, info["eos"])
    client = EngineClient(conn, info, tokenizer)
    app = create_app(client, spec.model_name, api_key=spec.api_key,
                     cluster_info=client.cluster_info if info["cluster"] else None,
                     default_mtp_depth=spec.default_mtp_depth, max_concurrency=spec.max_concurrency,
                     max_body_bytes=spec.max_body_bytes, generation_config=spec.generation_config,
                     cors_origins=spec.cors_origins, default_max_tokens=spec.default_max_tokens,
                     scheduling_policy=spec.scheduling_policy, chat_template=spec.chat_template)
    config = uvicorn.Config(app, host=spec.host, port=spec.port, log_config=None, access_log=spec.access_log,
                            timeout_graceful_shutdown=5, **uvicorn_options(spec.tls))
    server = api_server(config)

    def stop() -> None:
        server.should_exit = True

    client.on_lost = stop
    if client.lost is not None:  # the engine's process went away before `on_lost` was set
        return
    if spec.stall_timeout:
        client.watch(spec.stall_timeout)

    threading.Thread(target=when_serving, args=(server, client.announce), name="api-announce", daemon=True).start()
    try:
        server.run()
    finally:
        client.close()
    if client.lost is not None:
        log.error("the API stops: %s", client.lost)
        sys.exit(1)


def api_server(config: Any) -> Any:
    """A uvicorn server that drains on a stop (Ctrl-C, SIGTERM): new generations are refused (503) at
    once, open ones may finish during most of the grace period, and those still open a second before
    its end end with a 503 error (an event, in a stream), where uvicorn would cut them without a word."""
    import uvicorn

    class Server(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None

        async def startup(self, sockets: Any = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:  # (a signal handler: hands the work to the loop)
            self._drain()
            super().handle_exit(sig, frame)

        def stop(self) -> None:
            """Stop as on SIGTERM, but with no signal: uvicorn raises again the signals it handled once it
            has stopped, and a SIGTERM raised then would end `launch` (a tenure's end, tenure.py)."""
            self._drain()
            self.should_exit = True

        def _drain(self) -> None:
            if not self.should_exit and self.loop is not None:
                self.loop.call_soon_threadsafe(_drain, self.loop, self.config.timeout_graceful_shutdown)

    return Server(config)


def _drain(loop: asyncio.AbstractEventLoop, grace: float | None) -> None:
    from .generation import stop_admitting

    stop_admitting()
    if grace is not None:  # (None: uvicorn waits for them as long as they take)
        loop.call_later(max(0.0, grace - ABORT_BEFORE_GRACE_END_S), _abort_all)


def _abort_all() -> None:
    from .generation import abort_all

    if n := abort_all():
        log.info("the server stops: %d open generation(s) ended with an error", n)


def when_serving(server: Any, tell: Callable[[str, int], None]) -> None:
    """`tell(host, port)` once a uvicorn server listens (the port it bound, if 0 was asked); nothing if
    it stops first. Blocks: run it on a thread of its own."""
    while not server.started and not server.should_exit:
        time.sleep(0.01)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        tell(host, port)


def base_url(host: str, port: int, tls: ApiTLS | None = None, asked: str | None = None) -> str:
    """The URL of an API bound to `host` (an address) and `port`. Over HTTPS, the host `asked` where it is
    a name: the certificate names that, and a client checks it against the URL's host, not the address."""
    if tls is not None and asked and not _is_address(asked):
        host = asked
    return f"{scheme(tls)}://[{host}]:{port}" if ":" in host else f"{scheme(tls)}://{host}:{port}"


def _is_address(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _early_tokenizer(model_path: str) -> Any:
    """The tokenizer with the end tokens its config names, as the engine loads it; None if that fails
    (then it is loaded once the engine says hello, and fails there if it must)."""
    import json

    from ...models.config import eos_token_ids
    from ..engine.tokenizer import load_tokenizer

    try:
        return load_tokenizer(model_path, eos_token_ids(json.loads((Path(model_path) / "config.json").read_text())))
    except Exception as e:  # noqa: BLE001 - any failure here is met again, and reported, after the hello
        log.debug("tokenizer not loaded ahead of the engine: %s", e)
        return None


def _exit_cleanly(signum: int, frame: Any) -> None:
    """SIGTERM outside uvicorn's own handling: nothing of the front's is left to save (a signal may also
    land while the interpreter exits, where raising would only print a traceback)."""
    logging.shutdown()
    os._exit(0)


class FrontProcess:
    """The API front, spawned and linked to an engine; `start()` returns its base URL once it serves.

    Spawned before there is an engine (`spawn`, then `attach` once it is loaded), it imports the app
    and loads the tokenizer while the engine loads, and serves once the engine says hello.
    """

    def __init__(self, engine: Any | None, spec: FrontSpec, cluster_info: Callable[[], dict] | None = None):
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs MLX
        self.spec = spec
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=front_main, args=(child, spec), name="mtpipe-api", daemon=True)
        self._child_conn = child
        self.host: Any = None  # the EngineHost, once attached
        self.url = ""
        if engine is not None:
            self.attach(engine, cluster_info)

    @staticmethod
    def serves(engine: Any) -> bool:
        """Whether a front can serve `engine`: one that batches (the local or the ring engine)."""
        return hasattr(engine, "open")

    def spawn(self) -> "FrontProcess":
        if self.process.pid is None:
            # The child starts with Ctrl-C blocked: a terminal's SIGINT to the whole group while its
            # interpreter starts would kill it there ("Fatal Python error"), before it can ignore it.
            # Multiprocessing's resource tracker is started first: starting it within `start` unblocks
            # SIGINT (its own launch blocks and then unblocks it), and the child would start unblocked.
            resource_tracker.ensure_running()
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                self.process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                self._child_conn.close()  # the child's end is the child's alone
            log.info("API process %d started", self.process.pid)
        return self

    def attach(self, engine: Any, cluster_info: Callable[[], dict] | None = None) -> "FrontProcess":
        from .link import EngineHost

        if not self.serves(engine):
            raise ValueError("the API front needs an engine that batches (the local or the ring engine)")
        self.host = EngineHost(engine, self._conn, cluster_info=cluster_info)
        return self

    def start(self, timeout: float = START_TIMEOUT_S) -> str:
        if self.host is None:
            raise RuntimeError("the API front has no engine to serve (attach one)")
        try:
            self.spawn()
            self.host.start()
            host, port = self.host.listening.result(timeout)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"the API process did not serve within {timeout:.0f} s") from None
        except OSError as e:  # the pipe broke at once: the front died as it started
            self.stop()
            raise RuntimeError(f"the API process ended before it served ({e}; its log says why)") from None
        except BaseException:
            self.stop()
            raise
        self.url = base_url(host, port, self.spec.tls, self.spec.host)
        return self.url

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def serve(self, announce: Callable[[str], None] | None = None, until: threading.Event | None = None) -> int:
        """Start the front and wait for it to end; the command's exit code. Ctrl-C (a terminal signals
        both processes), SIGTERM to this process and `until` set stop the front as uvicorn stops, and end
        in 0; a front that ends without being told to is an error, logged, and ends in 1. `announce(url)`
        once it serves."""
        stopping = threading.Event()

        def on_term(signum: int, frame: Any) -> None:
            stopping.set()
            if self.process.pid is not None:
                self.process.terminate()

        on_main = threading.current_thread() is threading.main_thread()
        # Ctrl-C too (the front, whose uvicorn handles it, may end first): and a SIGINT this process
        # inherited as ignored still stops it
        previous = {sig: signal.signal(sig, on_term) for sig in (signal.SIGTERM, signal.SIGINT)} if on_main else {}
        try:
            self.start()
            log.info("the API serves at %s/v1 from process %d", self.url, self.process.pid)
            if announce is not None:
                announce(self.url)
            # Timed: a signal the kernel gives another of this process's threads runs its handler here
            # only once this thread wakes (and SIGTERM before the front had a pid found nothing to stop)
            while not stopping.is_set() and self.process.is_alive():
                self.process.join(WAKE_S)
                if until is not None and until.is_set():
                    stopping.set()  # (`finally` stops the front)
        except KeyboardInterrupt:  # SIGINT to this process alone reaches the front this way
            stopping.set()
            if self.process.pid is not None:
                self.process.terminate()
            self.process.join(STOP_TIMEOUT_S)
        except RuntimeError:
            if not stopping.is_set():  # (else it ended because it was told to)
                raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.stop()
        if stopping.is_set():
            return 0
        code = self.process.exitcode
        log.error("the API process ended by itself (%s): stopping", f"signal {-code}" if code and code < 0
                  else f"exit code {code}")
        return 1

    def stop(self) -> None:
        """Stop the front (as uvicorn stops on SIGTERM: open streams get their grace), then the link."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(STOP_TIMEOUT_S)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(STOP_TIMEOUT_S)
        if self.host is not None:
            self.host.close()
        else:
            self._conn.close()
