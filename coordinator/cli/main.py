"""`mtpipe`: the command line. Each subcommand parses its flags and calls one function."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from ... import __version__
from ...models import blas
from ...node.secrets import add_secret_args
from .common import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_SIGPIPE,
    EXIT_USAGE,
    add_chat_template,
    add_draft_options,
    add_model,
    add_mtp,
    add_sampling,
    add_take_over,
    check_default_depth,
    depth_arg,
    json_usage_errors,
    nodes_arg,
    positive_int,
    positive_seconds,
    progress_loader,
    sigterm_unwinds,
    stage_options,
    stderr_console,
    unrecognized,
)
from .held import after_thought, held_to

GENERATE_MAX_TOKENS = 256  # `mtpipe generate`'s length when --max-tokens is left out (mlx-lm's too)


def cmd_generate(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from ...models.registry import resolve_model
    from ...node.protocol import SamplingParams
    from ..api.templates import chat_template_of, checked_for
    from ..engine.build import local_engine
    from ..engine.request import GenerationRequest, RequestError, check_request, fit_to_context, resolve_depth

    if args.weights_from and not args.nodes:
        raise ValueError("--weights-from applies with --nodes")
    fmt = held_to(args)
    params = SamplingParams(args.temp, args.top_p, args.top_k, args.min_p, args.seed,
                            grammar=fmt.plain if fmt is not None else None)
    params.validate()  # (before any node is loaded, or taken over)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    try:
        prompt.encode("utf-8")  # (bytes that are not UTF-8 arrive as lone surrogates: no tokenizer takes them)
    except UnicodeEncodeError as e:
        raise ValueError(f"the prompt is not UTF-8 text (byte 0x{ord(e.object[e.start]) & 0xFF:02x} at character "
                         f"{e.start})") from None
    if not prompt and not args.chat:  # (a chat template makes tokens of an empty message)
        raise ValueError("the prompt is empty")
    template = chat_template_of(args.chat_template, args.chat_template_args)
    if template is not None and not args.chat:
        raise ValueError("--chat-template and --chat-template-args apply with --chat")
    if args.system is not None and not args.chat:
        raise ValueError("--system applies with --chat")
    model = resolve_model(args.model, args.revision)
    checked_for(template, model)  # (before any node is loaded, or taken over)
    options = stage_options(args, remote=bool(args.nodes))
    if args.nodes:
        from ...node.secrets import read_secret
        from ..engine.build import remote_engine

        engine = remote_engine(model, args.nodes, mtp=not args.no_mtp, secret=read_secret(args.secret_file),
                               dtype=args.dtype, sources=args.weights_from or [], take_over=args.take_over)
    else:
        with progress_loader("loading model")() as progress:
            engine = local_engine(
                model,
                mtp=not args.no_mtp,
                dtype=getattr(mx, args.dtype) if args.dtype else None,
                progress=progress,
                **options,
            )
    try:
        asked = 0 if args.no_mtp else args.mtp_depth
        check_default_depth(asked, engine.has_mtp)  # (its error names this command's option)
        depth, auto = resolve_depth(asked, engine.has_mtp)
        chat = [*([{"role": "system", "content": args.system}] if args.system is not None else []),
                {"role": "user", "content": prompt}]
        if template is not None:
            template.apply(engine.tokenizer)
        tokens = list(engine.tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, **(template.variables if template else {}))) \
            if args.chat else engine.tokenizer.encode(prompt)
        if fmt is not None and args.chat:  # (a thought the template opened stays free, as the API leaves it)
            params = after_thought(fmt, engine, tokens, params)
        depth, auto, max_tokens = fit_to_context(len(tokens), depth, auto, args.max_tokens, GENERATE_MAX_TOKENS,
                                                 engine.max_context)
        req = GenerationRequest(prompt_tokens=tokens, max_tokens=max_tokens, params=params, mtp_depth=depth,
                                mtp_auto=auto, stop=args.stop or [])
        try:  # (as the engine checks it, its fields named as this command's options)
            check_request(req, max_context=engine.max_context, has_mtp=engine.has_mtp, constrains=engine.constrains)
        except RequestError as e:
            raise ValueError(re.sub(r"\b(mtp_depth|max_tokens)\b", lambda m: "--" + m[1].replace("_", "-"),
                                    str(e))) from None
        if args.json:
            result = engine.complete(req)
            print(json.dumps({"text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason,
                              "mtp_depth": req.depth_label, "stats": result.stats.to_dict()}))
        else:
            stats = None
            for chunk in engine.generate(req):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                stats = chunk.stats or stats
            sys.stdout.write("\n")
            _print_stats(stats.to_dict(), req.depth_label)
    finally:
        engine.close()
    return EXIT_OK


def _print_stats(stats: dict[str, Any], depth: int | str) -> None:
    console = stderr_console()
    console.print(
        f"[dim]prompt {stats['prompt_tokens']} tok @ {stats['prefill_tps']:.1f} tok/s · "
        f"generated {stats['generation_tokens']} tok @ {stats['decode_tps']:.1f} tok/s · "
        f"MTP depth {depth}: accepted {stats['accepted']}/{stats['drafted']} ({100 * stats['acceptance']:.1f}%), "
        f"per position {stats['acceptance_per_position']}, rounds by depth {stats['depths']}[/dim]"
    )


def cmd_convert(args: argparse.Namespace) -> int:
    from ...models.convert import DEFAULT_BITS, DEFAULT_GROUP_SIZE, convert

    if not args.quantize:
        given = [o for o, v in (("--q-bits", args.q_bits), ("--q-group-size", args.q_group_size),
                                ("--mtp-unquantized", args.mtp_unquantized or None)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with -q/--quantize")
    bits = args.q_bits or DEFAULT_BITS
    with sigterm_unwinds():  # (the conversion's clean-up then leaves nothing, as after Ctrl-C)
        out = convert(Path(args.hf_path), Path(args.mlx_path), quantize=args.quantize, bits=bits,
                      group_size=args.q_group_size or DEFAULT_GROUP_SIZE, quantize_mtp=not args.mtp_unquantized,
                      dtype=args.dtype, mtp=not args.no_mtp)
    from rich.markup import escape

    held = json.loads((out / "config.json").read_text()).get("quantization")  # (-q, or a quantized source)
    stderr_console().print(f"converted {escape(args.hf_path)} -> [cyan]{escape(str(out))}[/cyan]"
                           + (f" ({held['bits']}-bit)" if held else f" ({args.dtype})"))
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from ...models import cpu_jit
    from ...models.registry import resolve_model
    from ..bench import engine as bench

    model = resolve_model(args.model, args.revision)
    if args.temperature and (args.target != "serve" or args.nodes):
        raise ValueError("--temperature applies to the single-node serve bench (bench serve without --nodes)")
    if args.target == "serve" and args.nodes:
        from ..bench import serve as bench_serve
        from ..bench import serve_nodes

        result = serve_nodes.bench_serve_nodes(
            model, nodes=bench_serve.parse_levels(args.nodes, "--nodes"),
            concurrency=bench_serve.parse_levels(args.concurrency), max_tokens=args.max_tokens, reps=args.reps,
            mlx_ring=not args.skip_mlx_lm, gap=not args.skip_gap,
        )
        serve_nodes.print_nodes_report(result, stderr_console())
    elif args.target == "serve":
        from ..bench import serve as bench_serve
        from ..bench.serve_report import print_serve_report

        result = bench_serve.bench_serve(
            model, concurrency=bench_serve.parse_levels(args.concurrency), max_tokens=args.max_tokens,
            api=not args.skip_api, gap=not args.skip_gap, mlx_lm=not args.skip_mlx_lm, reps=args.reps,
            temperature=args.temperature, closed=not args.skip_closed_loop, api_process=not args.api_in_process,
            **({"closed_requests": args.closed_requests} if args.closed_requests is not None else {}),
        )
        print_serve_report(result, stderr_console())
    elif args.target == "engine":
        result = bench.bench_engine(
            model, max_tokens=args.max_tokens, prompts=args.prompts, depths=args.depths, mtp_pre_norm=args.mtp_pre_norm,
            contexts=args.context, context_reps=args.context_reps or bench.CONTEXT_REPS, draft_vocab=args.draft_vocab,
            mtp_window=args.mtp_window,
        )
        bench.print_engine_report(result, stderr_console())
    elif args.target == "transfer":
        from ..bench import transfer as bench_transfer

        problem = bench_transfer.netns_problem()
        if problem:
            print(f"mtpipe: {problem}", file=sys.stderr)
            return EXIT_ERROR
        result = bench_transfer.bench_transfer(model, repeat=args.repeat)
        bench_transfer.print_report(result, stderr_console())
    elif args.target == "prefill":
        from ..bench import prefill as bench_prefill

        result = bench_prefill.bench_prefill(model, lengths=args.context or bench_prefill.DEFAULT_LENGTHS,
                                             reps=args.context_reps or bench_prefill.REPS)
        bench_prefill.print_report(result, stderr_console())
    elif args.target == "chat":
        from ..bench import chat as bench_chat

        nodes = bench_chat_nodes(args.nodes)
        result = bench_chat.bench_chat(model, turns=args.turns, reply_tokens=args.max_tokens,
                                       mlx_lm=not args.skip_mlx_lm and not nodes, nodes=nodes)
        bench_chat.print_report(result, stderr_console())
    elif args.target == "sampled":
        from ..bench import sampled as bench_sampled

        result = bench_sampled.bench_sampled(model, max_tokens=args.max_tokens, prompts=args.prompts, depths=args.depths)
        bench_sampled.print_report(result, stderr_console())
    elif args.target == "faults":
        from ..bench import faults as bench_faults
        from ..bench.serve import parse_levels

        result = bench_faults.bench_faults(model, nodes=parse_levels(args.nodes or "2,3", "--nodes"),
                                           max_tokens=args.max_tokens, fault_s=args.fault_seconds)
        bench_faults.print_report(result, stderr_console())
    else:
        from ..bench import pipeline as bench_pipeline

        result = bench_pipeline.bench_pipeline(model, max_tokens=args.max_tokens, prompts=args.prompts)
        bench_pipeline.print_report(result, stderr_console())
    if args.json:  # (every bench says which BLAS and JIT it measured with)
        print(json.dumps({"blas": blas.info().to_dict(), "cpu_jit": cpu_jit.info(), **result}))
    return EXIT_OK


def _lengths(value: str) -> list[int]:
    try:
        lengths = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {value!r}") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts, got {value!r}")
    return lengths


def bench_chat_nodes(value: str | None) -> int:
    """The chat bench's one ring size (0: one machine)."""
    if value and not value.strip().isdigit():
        raise ValueError(f"--nodes: the chat bench takes one number of nodes, got {value!r}")
    return int(value) if value else 0


def drafts_arg(value: str) -> int:
    """A fixed depth to bench: 1 to the most drafts a stage takes."""
    depth = depth_arg(value)
    if depth == "auto" or depth == 0:
        raise argparse.ArgumentTypeError(f"expected a number of drafts from 1, got {value!r}")
    return int(depth)


COMPUTES = ("generate", "serve", "launch", "bench")  # commands that run MLX here (node: its servicer says)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtpipe",
        description="Serve Qwen3.5/3.6 across a pipeline of machines with native MTP speculative decoding.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("--version", action="version", version=f"mtpipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text from a prompt")
    json_usage_errors(p, EXIT_USAGE)  # (with --json, a bad command line is a JSON error on stdout too)
    add_model(p)
    p.add_argument("--prompt", help="prompt text (default: read standard input)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", "--system-prompt", dest="system", metavar="TEXT",
                   help="with --chat: a system message before the prompt")
    add_chat_template(p, served=False)
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help=f"tokens to generate at most (default {GENERATE_MAX_TOKENS}, or what the context leaves)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    held = p.add_mutually_exclusive_group()
    held.add_argument("--json-schema", metavar="FILE|JSON",
                      help="hold the output to JSON that fits this JSON Schema (a file, or the schema; '{}': any JSON)")
    held.add_argument("--regex", help="hold the output to this regular expression")
    held.add_argument("--grammar", metavar="FILE|TEXT",
                      help="hold the output to this grammar (a file, or the grammar): EBNF (root ::= ...) or Lark")
    p.add_argument("--nodes", type=nodes_arg, help="comma-separated host:port of running nodes, in pipeline order")
    add_secret_args(p, "the nodes' shared secret, with --nodes")
    p.add_argument("--weights-from", type=nodes_arg,
                   help="with --nodes: comma-separated host:port of nodes that hold the model; "
                        "the others fetch their shards from them")
    add_take_over(p)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="cast weights on load")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_mtp(p)
    add_sampling(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("convert", help="convert an HF checkpoint to mlx, keeping the MTP head")
    p.add_argument("--hf-path", required=True, help="the Hugging Face-layout checkpoint directory to convert")
    p.add_argument("--mlx-path", required=True, help="where to write the converted model (a new or empty directory)")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize the weights (affine, as mlx-lm's)")
    p.add_argument("--q-bits", type=int, choices=[2, 3, 4, 5, 6, 8],
                   help="bits per weight with -q (default 4)")
    p.add_argument("--q-group-size", type=int, choices=[32, 64, 128],
                   help="weights per quantization group with -q (default 64)")
    p.add_argument("--mtp-unquantized", action="store_true", help="with -q: keep the MTP head's weights unquantized")
    p.add_argument("--no-mtp", action="store_true", help="drop the MTP head")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"],
                   help="dtype of the weights not quantized (default bfloat16)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("bench", help="side-by-side benchmarks")
    json_usage_errors(p, EXIT_USAGE)
    p.add_argument("target",
                   choices=["engine", "pipeline", "serve", "transfer", "faults", "sampled", "prefill", "chat"])
    add_model(p)
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--prompts", type=positive_int, default=8, help="number of prompts")
    p.add_argument("--depths", type=drafts_arg, nargs="+", default=[1, 2, 3])
    p.add_argument("--mtp-pre-norm", action="store_true", help="engine bench: feed the MTP head the pre-norm hidden")
    add_draft_options(p)  # engine bench
    p.add_argument("--context", type=_lengths, default=None, metavar="L1,L2,...",
                   help="engine bench: also decode after prompts of these lengths (e.g. 256,2048,8192); "
                        "prefill bench: the prompt lengths (default 512,2048)")
    p.add_argument("--context-reps", type=positive_int, default=None, metavar="N",
                   help="engine bench: repetitions at each --context length, ratios their median (default 4); "
                        "prefill bench: alternated pairs at each length (default 5)")
    p.add_argument("--concurrency", default="1,2,4,8,16", metavar="C1,C2,...",
                   help="serve bench: numbers of concurrent streams")
    p.add_argument("--nodes", default=None, metavar="N1,N2,...",
                   help="serve bench: ring batches over this many node processes each (e.g. 2,3), against one node; "
                        "faults bench: pipelines of these sizes (default 2,3); chat bench: one ring of this many")
    p.add_argument("--fault-seconds", type=positive_seconds, default=4.0,
                   help="faults bench: how long a node is frozen, or gone before it starts again")
    p.add_argument("--repeat", type=positive_int, default=3, help="transfer bench: transfers, each into a fresh cache")
    p.add_argument("--turns", type=positive_int, default=8, help="chat bench: turns of the conversation")
    p.add_argument("--reps", type=positive_int, default=1, help="serve bench: runs per cell (the median is reported)")
    p.add_argument("--skip-api", action="store_true", help="serve bench: skip the HTTP API level")
    p.add_argument("--api-in-process", action="store_true",
                   help="serve bench: the API level in the engine's process (default: a process of its own, as served)")
    p.add_argument("--skip-gap", action="store_true", help="serve bench: skip the prefill-gap measurement")
    p.add_argument("--skip-mlx-lm", action="store_true", help="serve and chat benches: leave mlx-lm out")
    p.add_argument("--skip-closed-loop", action="store_true",
                   help="serve bench: skip the closed loop (c clients each sending again as their request ends)")
    p.add_argument("--closed-requests", type=positive_int,
                   help="serve bench: requests per client in the closed loop (default 4; more: a longer steady window)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="serve bench: sample at this temperature, each prompt with a seed of its own (default 0: greedy)")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.set_defaults(func=cmd_bench)

    from .cluster import add_cluster_commands

    add_cluster_commands(sub)
    for command in {id(p): p for p in sub.choices.values()}.values():  # `mtpipe generate -v` as `mtpipe -v generate`
        if command.get_default("usage_parser") is None:  # (an unknown option is reported with its command's usage)
            command.set_defaults(usage_parser=command)
        if "-v" not in command._option_string_actions:
            command.add_argument("-v", "--verbose", dest="verbose_after", action="count", default=0,
                                 help="more logging (-vv for debug)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        getattr(args, "usage_parser", parser).error(unrecognized(extra))
    args.verbose += getattr(args, "verbose_after", 0)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.command in COMPUTES:
        blas.warn_if_reference()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader of our output went away (`| head`): stop quietly, as a filter does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit's flush cannot fail again)
        return EXIT_SIGPIPE
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        return _failed(args, str(e), EXIT_USAGE)
    except Exception as e:  # a failure the user should see as one line, with -v for the trace
        if args.verbose:
            raise
        return _failed(args, f"{type(e).__name__}: {e}", EXIT_ERROR)


def _failed(args: argparse.Namespace, message: str, code: int) -> int:
    """The error on stderr; with `generate --json` or `bench --json`, whose stdout a script reads, as JSON
    there too."""
    if args.command in ("generate", "bench") and getattr(args, "json", False):
        print(json.dumps({"error": message}), flush=True)
    print(f"mtpipe: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
