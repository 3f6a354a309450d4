"""What the subcommands share: flags, exit codes, the progress bar and the console."""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from ...node.cli import add_draft_options, number_arg
from ...node.links import bind_problem, format_host_port, split_host_port
from ...node.protocol import MAX_MTP_DEPTH
from ..api.defaults import DEFAULT_MAX_TOKENS, check_origins

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
EXIT_SIGPIPE = 141  # what a shell reports for a filter its reader left (128 + SIGPIPE)


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within it, SIGTERM (`timeout`, systemd, `kill`) unwinds through the command's clean-up as Ctrl-C
    does, ending it with 128 + 15; the handler before is back after it."""
    def unwind(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():  # (signals reach the main thread only)
        yield
        return
    before = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def exit_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM ends a serving command through its `finally` (engine, node and peers released), not by the
    signal's default action; uvicorn raises the signal again once it has shut down."""
    raise SystemExit(0)


def add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)


def depth_arg(value: str) -> int | str:
    """--mtp-depth: a number of drafts or 'auto'."""
    if value == "auto":
        return value
    try:
        depth = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of drafts or 'auto', got {value!r}") from None
    if not 0 <= depth <= MAX_MTP_DEPTH:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_MTP_DEPTH}] or 'auto', got {depth}")
    return depth


positive_int = number_arg(int, "a positive integer", lambda n: n >= 1)
positive_seconds = number_arg(float, "a positive number of seconds", lambda x: 0 < x < math.inf)


def nodes_arg(value: str) -> list[str]:
    """--nodes: comma-separated host:port of nodes, each once, in pipeline order."""
    nodes: list[str] = []
    for part in filter(None, (p.strip() for p in value.split(","))):
        try:
            node = format_host_port(*split_host_port(part))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if node in nodes:
            raise argparse.ArgumentTypeError(f"{part} is listed twice: list each node once")
        nodes.append(node)
    if not nodes:
        raise argparse.ArgumentTypeError(f"expected comma-separated host:port of nodes, got {value!r}")
    return nodes


def check_default_depth(depth: int | str | None, has_mtp: bool, option: str = "--mtp-depth") -> None:
    """A served default depth the model can run (requests that name none get it)."""
    if isinstance(depth, int) and depth > 0 and not has_mtp:
        raise ValueError(f"{option} needs a model with an MTP head")


def check_port_free(host: str, port: int, what: str) -> None:
    """Refuse a port something else listens on (this node's own server too) before serving on it, so
    that nothing reads the other listener as this server up."""
    if (problem := bind_problem(host, port)) is not None:
        raise ValueError(f"{what} {format_host_port(host, port)} cannot be used: {problem}")


def add_model(p: argparse.ArgumentParser, default: str = "the bundled demo model") -> None:
    p.add_argument("--model", help=f"model directory or Hugging Face repo id (default: {default})")
    p.add_argument("--revision", help="with a hub repo id: the branch, tag or commit to use (default: main)")


def generation_config_arg(value: str) -> str:
    from ..api.model_defaults import generation_config_source

    try:
        return generation_config_source(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_generation_config(p: argparse.ArgumentParser, checked: bool = True) -> None:
    """`checked`: the value is checked as the options are read (where the API surely runs here)."""
    p.add_argument("--generation-config", metavar="auto|none|DIR", type=generation_config_arg if checked else str,
                   help="where a request that leaves out its sampling or max_tokens gets them: auto, the model's "
                        "generation_config.json (default, as vLLM); none (or vllm), OpenAI's defaults; or a "
                        "directory holding a generation_config.json")


def template_args_arg(value: str) -> dict[str, Any]:
    from ..api.templates import template_args

    try:
        return template_args(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--chat-template-args ")) from None


def add_chat_template(p: argparse.ArgumentParser, served: bool = True) -> None:
    """The options of the server's chat template; not `served`: `generate --chat`'s, one prompt's."""
    applies = "" if served else "with --chat: "
    p.add_argument("--chat-template", metavar="TEMPLATE",
                   help=f"{applies}a chat template (a file, or the template itself) to render prompts with instead "
                        "of the model's")
    example = "'{\"enable_thinking\": false}'"
    p.add_argument("--chat-template-args", "--default-chat-template-kwargs", metavar="JSON", dest="chat_template_args",
                   type=template_args_arg,
                   help=f"template variables every prompt gets unless its request's chat_template_kwargs set them, as "
                        f"a JSON object: {example} serves a Qwen thinking model without thought by default" if served
                   else f"{applies}template variables to render the prompt with, as a JSON object: {example} asks a "
                        "Qwen thinking model to answer without thought")


def add_api_tls(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ssl-certfile", metavar="PEM", help="serve the API over HTTPS with this certificate (chain)")
    p.add_argument("--ssl-keyfile", metavar="PEM", help="the private key of --ssl-certfile")


def add_default_max_tokens(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=positive_int, metavar="N", dest="default_max_tokens",
                   help="the max_tokens of a request that leaves it out (default: the generation config's "
                        f"max_new_tokens, else {DEFAULT_MAX_TOKENS}); never past what is left of the context")


def origins_arg(value: str) -> list[str]:
    """Comma-separated origins (`*`: any; `none`: only the API's own)."""
    try:
        return check_origins(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_allowed_origins(p: argparse.ArgumentParser, default: str = "*") -> None:
    p.add_argument("--allowed-origins", type=origins_arg, metavar="ORIGINS",
                   help="comma-separated origins of web pages that may call the API from a browser (CORS), "
                        f"e.g. http://localhost:3000; '*': any; 'none': only the API's own (default {default})")


def add_scheduling_policy(p: argparse.ArgumentParser, default: str | None = "fcfs") -> None:
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=default,
                   help="how waiting requests are ordered: first come, first served, or by each request's `priority` "
                        "(vLLM's: lower first), which then also decides whose rows leave first for room "
                        f"(default {default or 'cluster.yaml api.scheduling_policy, else fcfs'})")


def json_usage_errors(p: argparse.ArgumentParser, exit_code: int, **shape: str) -> None:
    """Usage errors of `p` (an option's bad value, one it does not know) for a command whose --json
    output a script reads: exit `exit_code`, and with --json one JSON object (`shape` and the error)
    on stdout too."""
    def error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
        if "--json" in sys.argv[1:]:
            print(json.dumps({**shape, "error": message}), flush=True)
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        sys.exit(exit_code)

    p.error = types.MethodType(error, p)  # type: ignore[method-assign]
    p.set_defaults(usage_parser=p)  # (`main` reports unknown options through it)


def unrecognized(extra: list[str]) -> str:
    """argparse's message for options nobody knows, without the value of one that looks secret."""
    def secret(option: str) -> bool:
        name = option.split("=", 1)[0].lower().replace("_", "-")
        return name.startswith("-") and any(w in name for w in ("key", "secret", "password", "token"))

    shown = ["***" if i and secret(extra[i - 1]) and "=" not in extra[i - 1] and not a.startswith("-")
             else a.split("=", 1)[0] + "=***" if secret(a) and "=" in a else a for i, a in enumerate(extra)]
    return "unrecognized arguments: " + " ".join(shown)


def add_take_over(p: argparse.ArgumentParser) -> None:
    p.add_argument("--take-over", action="store_true",
                   help="load nodes that another coordinator holds, ending its requests there for good (by default "
                        "such a node refuses)")


def add_mtp(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--mtp-depth", type=depth_arg, default=None,
                   help="drafts per round, or 'auto' to pick each round's depth (default: auto if the model has MTP)")
    g.add_argument("--no-mtp", action="store_true", help="decode without speculation (and without loading the MTP head)")
    p.add_argument("--mtp-pre-norm", action="store_true", help="feed the MTP head the hidden before the final norm")
    add_draft_options(p)


def drafting_options(args: argparse.Namespace) -> dict[str, Any]:
    """How the last stage drafts (--draft-vocab, --mtp-window), where given: a node takes them too."""
    return {name: getattr(args, name) for name in ("draft_vocab", "mtp_window") if getattr(args, name, None) is not None}


def stage_options(args: argparse.Namespace, *, remote: bool = False,
                  drafting: dict[str, Any] | None = None) -> dict[str, Any]:
    """Options of local stages given on the command line (`drafting`: the drafting options, where they
    come from elsewhere, such as a cluster file under the flags); an error when the stages are
    `remote` nodes, which take their own."""
    options = dict(drafting_options(args) if drafting is None else drafting)
    if getattr(args, "mtp_pre_norm", False):
        options["mtp_pre_norm"] = True
    if remote and options:
        raise ValueError("--mtp-pre-norm, --draft-vocab and --mtp-window apply to local stages; nodes take their own")
    return options


def progress_loader(label: str) -> Callable[..., Any]:
    """A context that shows a rich progress bar while tensors are materialized."""
    from rich.progress import Progress

    class _Bar:
        def __enter__(self) -> Callable[[int, int], None]:
            self.progress = Progress(transient=True, console=stderr_console())
            self.progress.start()
            self.task = self.progress.add_task(label, total=None)
            return lambda done, total: self.progress.update(self.task, completed=done, total=total)

        def __exit__(self, *exc: object) -> None:
            self.progress.stop()

    return _Bar


def stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)
