"""`mtpipe bench chat`: time to the first token, turn after turn of one conversation, with kept prompt
prefixes and without, and against mlx-lm reusing its prompt cache as its server does.

Every side sees the same conversation: each user turn is a piece of held-out library source, each
assistant turn the reply mtpipe gave without kept prefixes (greedy). A turn's prompt is the chat
template over the whole conversation so far. mtpipe keeps each prompt's state before its last token
and each request's state as it ends, so a turn prefills the new user message (or, where the template
renders the reply as other tokens than were generated, the last reply too); mlx-lm's cache holds the
last prompt and its reply (a hybrid model's cache cannot be cut back, so it is reused only when it is
a prefix of the new prompt, else rebuilt). The three sides take each turn in rotated order, so the
machine's noise of a moment hits them alike.

With `nodes`, the same over a ring of that many `mtpipe node` processes: the nodes keep the prefixes
and ends (node/kept.py, node/groups.py). Both sides run on one ring engine, the `whole` side with the engine's kept prefixes
set aside for its turn, so the nodes, processes and links are the same; mlx-lm has no such side.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx

from ...models import blas, cpu_jit
from ..engine.build import batch_engine
from ..engine.request import AUTO, GenerationRequest, resolve_depth
from .engine import long_prompt

DEFAULT_TURNS = 8
TURN_TOKENS = 384  # tokens of library source per user turn
REPLY_TOKENS = 32


def time_engine(engine: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """Seconds to the first token, the reply's tokens, and how many prompt tokens came from a kept prefix."""
    depth, auto = resolve_depth(AUTO, engine.has_mtp)
    start = time.perf_counter()
    first = None
    tokens: list[int] = []
    cached = 0
    for chunk in engine.generate(GenerationRequest(prompt, max_tokens=max_tokens, mtp_depth=depth, mtp_auto=auto)):
        first = first or time.perf_counter() - start
        tokens += chunk.shown
        if chunk.stats is not None:
            cached = chunk.stats.cached_tokens
    return first or 0.0, tokens, cached


class MlxLmChat:
    """mlx-lm's side: one prompt cache, reused when what it holds starts the new prompt."""

    def __init__(self, model: Any, tokenizer: Any):
        self.model, self.tokenizer = model, tokenizer
        self.cache: list | None = None
        self.held: list[int] = []  # the tokens the cache holds

    def turn(self, prompt: list[int], max_tokens: int) -> tuple[float, int]:
        """Seconds to the first token, and the prompt tokens taken from the cache (runs on the engine's
        MLX thread: mlx-lm's arrays belong to it)."""
        from mlx_lm import stream_generate
        from mlx_lm.models.cache import make_prompt_cache

        reused = len(self.held) if self.cache is not None and prompt[: len(self.held)] == self.held else 0
        if not reused or reused >= len(prompt):
            self.cache, self.held, reused = make_prompt_cache(self.model), [], 0
        start = time.perf_counter()
        first = None
        generated: list[int] = []
        for response in stream_generate(self.model, self.tokenizer, prompt[reused:], max_tokens=max_tokens,
                                        prompt_cache=self.cache):
            first = first or time.perf_counter() - start
            generated.append(response.token)
        mx.synchronize()
        # What its cache holds: mlx-lm feeds each token as it hands it out (the last one too), and maybe
        # an end token it did not hand out; a cache that holds tokens not known here is not reused.
        offsets = {c.offset for c in self.cache if hasattr(c, "offset")}
        fed = prompt + generated
        held = offsets.pop() if len(offsets) == 1 else -1
        if held in (len(fed), len(fed) - 1):
            self.held = fed[:held]
        else:
            self.cache, self.held = None, []
        return first or 0.0, reused


def conversation_texts(tokenizer: Any, turns: int, turn_tokens: int) -> list[str]:
    source = long_prompt(tokenizer, turns * turn_tokens)
    return [tokenizer.decode(source[i * turn_tokens : (i + 1) * turn_tokens]) for i in range(turns)]


@contextmanager
def prefixes_aside(engine: Any) -> Iterator[None]:
    """A ring engine's turn without its kept prefixes (none reused, none kept), then with them again."""
    kept, engine.kept = engine.kept, None
    try:
        yield
    finally:
        engine.kept = kept


def bench_chat(model_path: Path | str, *, turns: int = DEFAULT_TURNS, turn_tokens: int = TURN_TOKENS,
               reply_tokens: int = REPLY_TOKENS, mlx_lm: bool = True, nodes: int = 0) -> dict[str, Any]:
    if turns < 2 or turn_tokens < 1 or reply_tokens < 1:
        raise ValueError("the chat bench needs at least 2 turns and positive token counts")
    if nodes == 1 or nodes < 0:
        raise ValueError(f"--nodes: a ring needs 2 nodes or more, got {nodes}")
    with ExitStack() as stack:
        sides: dict[str, Callable[[list[int]], tuple]]
        if nodes:
            from ..engine.build import ring_engine
            from .nodes import spawn_nodes

            ring = ring_engine(model_path, stack.enter_context(spawn_nodes(nodes, model_path)), mtp=True)
            stack.callback(ring.close)
            if getattr(ring, "kept", None) is None:
                raise RuntimeError(f"no ring over {nodes} nodes, or it keeps no prefixes")

            def whole_turn(prompt: list[int]) -> tuple:
                with prefixes_aside(ring):
                    return time_engine(ring, prompt, reply_tokens)

            sides = {"whole": whole_turn, "cached": lambda prompt: time_engine(ring, prompt, reply_tokens)}
            tokenizer, encode = ring.tokenizer, ring.encode_chat
        else:
            cached = batch_engine(model_path)
            stack.callback(cached.close)
            whole = batch_engine(model_path, prefix_cache=0)
            stack.callback(whole.close)
            sides = {"whole": lambda prompt: time_engine(whole, prompt, reply_tokens),
                     "cached": lambda prompt: time_engine(cached, prompt, reply_tokens)}
            if mlx_lm:
                from mlx_lm import load as mlx_load

                theirs = MlxLmChat(*whole.thread.call(lambda: mlx_load(str(model_path))))  # (on the thread it runs on)
                sides["mlx_lm"] = lambda prompt: whole.thread.call(lambda: theirs.turn(prompt, reply_tokens))
            tokenizer, encode = cached.tokenizer, cached.encode_chat
        rows = converse(sides, tokenizer, encode, turns, turn_tokens)
    later = rows[1:]  # the first turn has nothing to reuse

    def ratio(a: str, b: str) -> float:
        return round(statistics.median(r["ttft_ms"][b] / r["ttft_ms"][a] for r in later), 3)

    ratios = {"cached_vs_whole_ttft": ratio("cached", "whole")}
    if "mlx_lm" in rows[0]["ttft_ms"]:
        ratios["cached_vs_mlx_lm_ttft"] = ratio("cached", "mlx_lm")
        ratios["mlx_lm_vs_whole_ttft"] = ratio("mlx_lm", "whole")
    shown = [{**r, "ttft_ms": {k: round(v, 2) for k, v in r["ttft_ms"].items()}} for r in rows]
    return {"model": str(model_path), "blas": blas.info().to_dict(), "cpu_jit": cpu_jit.info(), "nodes": nodes,
            "turns": turns, "turn_tokens": turn_tokens, "reply_tokens": reply_tokens, "rows": shown, "ratios": ratios,
            "measure": "speedups: the median over turns 2.. of the other side's time to the first token over this side's",
            "identical": all(r["same_reply"] for r in rows)}


def converse(sides: dict[str, Callable[[list[int]], tuple]], tokenizer: Any, encode: Callable[[list], list[int]],
             turns: int, turn_tokens: int) -> list[dict[str, Any]]:
    """One conversation, each turn timed on every side in rotated order; the replies are the `whole` side's."""
    messages: list[dict[str, str]] = []
    rows: list[dict[str, Any]] = []
    names = list(sides)
    for i, user in enumerate(conversation_texts(tokenizer, turns, turn_tokens)):
        messages.append({"role": "user", "content": user})
        prompt = encode(messages)
        got = {name: sides[name](prompt) for name in names[i % len(names):] + names[: i % len(names)]}
        reply = got["whole"][1]
        row = {"turn": i + 1, "prompt_tokens": len(prompt),
               "ttft_ms": {name: 1000 * got[name][0] for name in names},
               "cached_tokens": {"whole": got["whole"][2], "cached": got["cached"][2]},
               "same_reply": got["cached"][1] == reply}
        if "mlx_lm" in got:
            row["cached_tokens"]["mlx_lm"] = got["mlx_lm"][1]
        rows.append(row)
        messages.append({"role": "assistant", "content": tokenizer.decode(reply)})
    return rows


def print_report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    names = list(result["rows"][0]["ttft_ms"])
    table = Table(title=f"time to first token per turn (ms), {result['turn_tokens']}-token user turns")
    table.add_column("turn")
    table.add_column("prompt tokens")
    for name in names:
        table.add_column(name)
    table.add_column("reused (mtpipe / mlx-lm)" if "mlx_lm" in names else "reused")
    for r in result["rows"]:
        reused = " / ".join(str(v) for k, v in r["cached_tokens"].items() if k != "whole")
        table.add_row(str(r["turn"]), str(r["prompt_tokens"]), *(f"{r['ttft_ms'][n]:.1f}" for n in names), reused)
    console.print(table)
    speedups = " ".join(f"{k} {v}x" for k, v in result["ratios"].items())
    console.print(f"{speedups}; identical replies {result['identical']}")
