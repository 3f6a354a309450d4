"""The command line refuses bad input at once, naming the option, before it touches a node; no test here
loads a model."""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
from pathlib import Path

import pytest

from mtpipe.coordinator.bench.nodes import free_port
from mtpipe.coordinator.cli.common import check_default_depth, check_port_free
from mtpipe.coordinator.cli.main import build_parser, main
from mtpipe.coordinator.engine.tokenizer import load_tokenizer
from mtpipe.models.config import load_config


@pytest.mark.parametrize("argv, message", [
    (["serve", "--mtp-depth", "100"], r"--mtp-depth: must be in \[0, 8\] or 'auto', got 100"),
    (["generate", "--mtp-depth", "-1"], r"--mtp-depth: must be in \[0, 8\]"),
    (["serve", "--port", "70000"], r"--port: expected a TCP port \(0-65535; 0: any free one\), got '70000'"),
    (["node", "--port", "-1"], r"--port: expected a TCP port"),
    (["generate", "--nodes", "127.0.0.1:99999"], r"--nodes: '127.0.0.1:99999': '99999' is not a TCP port"),
    (["generate", "--nodes", "10.0.0.1:5,10.0.0.2:5,10.0.0.1:5"], r"--nodes: 10.0.0.1:5 is listed twice"),
    (["serve", "--stall-timeout", "-1"], r"--stall-timeout: expected a number of seconds \(0: never\), got '-1'"),
    (["serve", "--resume-window", "nan"], r"--resume-window: expected a number of seconds"),
    (["serve", "--nodes", "h:1", "--heal-after", "-1"], r"--heal-after: expected a number of seconds"),
    (["serve", "--nodes", " , "], r"--nodes: expected comma-separated host:port of nodes"),
    (["serve", "--nodes", "h:1", "--weights-from", "h"], r"--weights-from: 'h' has no port"),
    (["generate", "--max-tokens", "0"], r"--max-tokens: expected a positive integer"),
    (["bench", "engine", "--prompts", "0"], r"--prompts: expected a positive integer"),
    (["bench", "engine", "--max-tokens", "-5"], r"--max-tokens: expected a positive integer"),
    (["bench", "engine", "--depths", "1", "0"], r"--depths: expected a number of drafts from 1"),
    (["bench", "serve", "--reps", "0"], r"--reps: expected a positive integer"),
    (["serve", "--generation-config", "/nowhere"], r"--generation-config: '/nowhere' is neither auto, none"),
    (["bench", "faults", "--fault-seconds", "-1"], r"--fault-seconds: expected a positive number of seconds"),
    (["bench", "faults", "--fault-seconds", "nan"], r"--fault-seconds: expected a positive number of seconds"),
    (["serve", "--chat-template-args", "[1]"], r"--chat-template-args/--default-chat-template-kwargs: must be a JSON "
                                               r"object"),
    (["launch", "--chat-template-args", "{x"], r"--chat-template-args/--default-chat-template-kwargs: is not JSON"),
    (["generate", "--chat-template-args", '{"tools": []}'], r"may not set 'tools': it is an argument"),
])
def test_bad_options_are_usage_errors_naming_the_option(argv: list[str], message: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as ended:
        build_parser().parse_args(argv)
    assert ended.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("argv", [["--timeout", "abc"], ["--timeout", "-1", "127.0.0.1:1"], ["--wait", "0"],
                                  ["--timeout", "nan"], ["--secret", "x"], ["--bogus", "127.0.0.1:1"]])
def test_a_mistyped_health_check_could_not_check(argv: list[str], capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 3 (could not check), never argparse's 2, which `health` means as unreachable; with --json
    the status "error" on stdout."""
    monkeypatch.setattr(sys, "argv", ["mtpipe", "health", "--json", *argv])
    with pytest.raises(SystemExit) as ended:
        main()
    assert ended.value.code == 3
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "error" and argv[0] in report["error"]


def test_generate_checks_its_request_before_it_loads_any_node(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    """Nodes are loaded (and, with --take-over, taken over) only for a request that can run."""
    from mtpipe.coordinator.engine import build

    def no_nodes(*args: object, **kwargs: object) -> None:
        raise AssertionError("a node was loaded for a request refused afterwards")

    monkeypatch.setattr(build, "remote_engine", no_nodes)
    for argv in (["--temp", "-1"], ["--temp", "nan"], ["--top-p", "0"], ["--weights-from", "127.0.0.1:2"]):
        nodes = [] if argv[0] == "--weights-from" else ["--nodes", "127.0.0.1:1", "--take-over"]
        assert main(["generate", "--prompt", "hi", *nodes, *argv]) == 2, argv
        assert capsys.readouterr().err.startswith("mtpipe: error: ")


@pytest.mark.parametrize("option", [["--heal-after", "5"], ["--resume-window", "5"], ["--weights-from", "h:1"]])
def test_options_of_serve_over_nodes_are_refused_without_nodes(option: list[str],
                                                                capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--model", "/nowhere", "--port", "0", *option]) == 2
    assert f"{option[0]} applies with --nodes" in capsys.readouterr().err


def test_a_port_in_use_and_a_depth_the_model_cannot_run_are_refused() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"the API port 127.0.0.1:{port} cannot be used"):
            check_port_free("127.0.0.1", port, "the API port")
    check_port_free("127.0.0.1", port, "the API port")  # free again
    with pytest.raises(ValueError, match="mtp_depth needs a model with an MTP head"):
        check_default_depth(2, False, "mtp_depth")
    for depth, has_mtp in ((0, False), ("auto", False), (None, False), (3, True)):
        check_default_depth(depth, has_mtp)


def test_a_model_directory_without_a_tokenizer_or_a_readable_config_says_so(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer in"):
        load_tokenizer(tmp_path, [])


@pytest.mark.parametrize("size", ["inf", "nan", "-1"])
def test_cache_prune_refuses_a_size_that_is_not_one(size: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["cache", "prune", "--shard-cache", str(tmp_path), "--max-gib", size]) == 2
    assert "--max-gib must be a number of GiB" in capsys.readouterr().err


def test_a_launch_checks_where_request_defaults_come_from_once_it_coordinates(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """api.generation_config names a directory on the coordinator: machines that only run nodes, and
    `mtpipe health`, read the same cluster.yaml without it; the coordinator refuses a bad one before it
    loads the model."""
    from mtpipe.coordinator.cli.cluster import resolve_config
    from mtpipe.models import registry

    monkeypatch.setenv("MTPIPE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(registry, "resolve_model", lambda *a: pytest.fail("the model was looked up"))
    config = tmp_path / "cluster.yaml"
    ports = [free_port(), free_port()]
    config.write_text(f"discovery: {{enabled: false}}\nnode: {{host: 127.0.0.1, port: {ports[0]}}}\n"
                      f"api: {{host: 127.0.0.1, port: {ports[1]}, generation_config: /only-on-another-machine}}\n")
    assert resolve_config(build_parser().parse_args(["health", "--config", str(config)])).api.generation_config == (
        "/only-on-another-machine")
    assert main(["launch", "--json", "--config", str(config)]) == 2
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert events[-1]["event"] == "error" and events[-1]["error"].startswith(
        "api.generation_config (--generation-config): '/only-on-another-machine' is neither auto, none")
    args = build_parser().parse_args(["launch", "--generation-config", "vllm"])
    assert resolve_config(args).api.generation_config == "vllm"


def test_generates_chat_template_options_speak_of_its_prompt_not_of_requests() -> None:
    """(Its help said "unless its request's chat_template_kwargs set them", and "serves", of one prompt.)"""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c: next(a.help for a in sub.choices[c]._actions if a.dest == "chat_template_args")
             for c in ("generate", "serve", "launch")}
    assert "request" not in helps["generate"] and "serves" not in helps["generate"], helps["generate"]
    assert all("request's chat_template_kwargs" in helps[c] for c in ("serve", "launch"))


def test_a_launch_names_cluster_yamls_keys_for_its_chat_template(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """(Its errors named serve's options, --chat-template and --chat-template-args, whatever set them.) A
    variable the file alone refuses is refused as the file is read, before a node starts."""
    monkeypatch.setenv("MTPIPE_STATE_DIR", str(tmp_path / "state"))
    config = tmp_path / "cluster.yaml"
    ports = [free_port(), free_port()]
    base = f"discovery: {{enabled: false}}\nnode: {{host: 127.0.0.1, port: {ports[0]}}}\n"
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if not allowed %}{{ raise_exception('not allowed') }}{% endif %}")
    for api, said in ((f"chat_template: {tmp_path / 'none.jinja'}", "api.chat_template (--chat-template): no such"),
                      (f"chat_template: {strict}, chat_template_args: {{allowed: false}}",
                       "api.chat_template (--chat-template) does not render a message with api.chat_template_args "
                       "(--chat-template-args) {\"allowed\": false}: not allowed"),
                      ("chat_template_args: {tools: []}", "cluster.yaml: api.chat_template_args: may not set 'tools'")):
        config.write_text(base + f"api: {{host: 127.0.0.1, port: {ports[1]}, {api}}}\n")
        assert main(["launch", "--json", "--config", str(config), "--insecure"]) == 2
        events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert events[-1]["event"] == "error" and said in events[-1]["error"], events[-1]
        assert len(events) == (1 if "tools" in api else 2)  # (the node's event first, where it started)


def test_a_launch_that_fails_says_so_in_its_events(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "no-secret"
    assert main(["launch", "--json", "--secret-file", str(missing)]) != 0
    (event,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert event["event"] == "error" and str(missing) in event["error"]


def test_a_launch_with_its_node_port_taken_or_a_file_for_its_state_says_which_option(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Usage errors (exit 2) naming the option, as a busy API port is, not an errno."""
    monkeypatch.delenv("MTPIPE_STATE_DIR", raising=False)
    config = tmp_path / "cluster.yaml"
    config.write_text("discovery: {enabled: false}\n")
    (tmp_path / "afile").write_text("")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv, said in ((["--host", "127.0.0.1", "--port", str(port), "--state-dir", str(tmp_path / "state")],
                            f"the node port (node.host/node.port, --host/--port) 127.0.0.1:{port} cannot be used"),
                           (["--host", "127.0.0.1", "--state-dir", str(tmp_path / "afile")],
                            f"the state directory {tmp_path / 'afile'} (--state-dir, node.state_dir) is a file")):
            assert main(["launch", "--json", "--config", str(config), "--insecure", *argv]) == 2
            (event,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
            assert event["event"] == "error" and event["error"].startswith(said), event


@pytest.mark.parametrize("argv", [["--port", "abc"], ["--zzz"]])
def test_a_launch_with_a_bad_command_line_says_so_in_its_events(argv: list[str], capsys: pytest.CaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["mtpipe", "launch", "--json", *argv])
    with pytest.raises(SystemExit) as ended:
        main()
    assert ended.value.code == 2
    (event,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert event["event"] == "error" and argv[0] in event["error"]


def test_an_unknown_option_with_a_secret_is_not_echoed(capsys: pytest.CaptureFixture) -> None:
    for argv in (["generate", "--api-key", "sk-hush"], ["generate", "--token=sk-hush"],
                 ["generate", "--hf_token", "sk-hush"]):
        with pytest.raises(SystemExit) as ended:
            main(argv)
        assert ended.value.code == 2
        err = capsys.readouterr().err
        assert "unrecognized arguments: --" in err and "sk-hush" not in err
        assert err.startswith("usage: mtpipe generate")  # (the command's usage, not the top level's)


@pytest.mark.parametrize("command, option", [("serve", "--api-key-file"), ("node", "--secret-file")])
def test_an_empty_secret_path_is_an_error_not_no_secret(command: str, option: str, capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a script's unset variable gives (`--api-key-file "$KEYFILE"`): never a server without a key."""
    monkeypatch.setenv("MTPIPE_API_KEY", "from-env")
    assert main([command, "--model", "/nonexistent/model", "--port", str(free_port()), option, ""]) == 2
    assert f"{option}: the path is empty" in capsys.readouterr().err


def test_a_cluster_config_that_cannot_be_read_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe")
    (tmp_path / "dir.yaml").mkdir()
    (tmp_path / "nodisc.yaml").write_text("discovery:\n  enabled: false\n")
    for name, message in (("binary.yaml", "not UTF-8 text"), ("dir.yaml", "Is a directory"),
                          ("nodisc.yaml", "nothing to check")):
        assert main(["health", "--json", "--config", str(tmp_path / name)]) == 3
        out = capsys.readouterr().out
        assert json.loads(out)["status"] == "error" and message in out and (name == "nodisc.yaml" or name in out)


def test_serve_refuses_a_port_it_cannot_listen_on_before_loading(capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", "/nonexistent/model", "--port", str(port)]) == 2
        assert f"--host/--port 127.0.0.1:{port} cannot be used: Address already in use" in capsys.readouterr().err
        assert main(["node", "--host", "127.0.0.1", "--port", str(port)]) == 2  # (as `serve` says it)
    assert f"--host/--port 127.0.0.1:{port} cannot be used: Address already in use" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "/nonexistent/model", "--prompt", ""], "the prompt is empty"),
    (["generate", "--model", "/nonexistent/model", "--prompt", b"abc\xff".decode("utf-8", "surrogateescape")],
     "the prompt is not UTF-8 text (byte 0xff at character 3)"),  # (as a shell hands over bytes that are not)
    (["generate", "--model", "/nonexistent/model", "--prompt", "x", "--regex", "("],
     "--regex: the output cannot be held to it"),
    (["generate", "--model", "/nonexistent/model", "--prompt", "x", "--json-schema", '{"type": "nonsense"}'],
     "--json-schema: the output cannot be held to it: Invalid type: nonsense"),
    (["generate", "--model", "/nonexistent/model", "--prompt", "x", "--json-schema", "/nowhere.json"],
     "--json-schema is neither a JSON Schema nor a file holding one"),
    (["bench", "faults", "--nodes", "x"], "--nodes: expected comma-separated counts"),
    (["node", "--port", "0", "--shard-cache", sys.executable], "is a file, not a directory"),
    (["serve", "--model", "/nonexistent/model", "--memory-budget", "0"], "--memory-budget must be a number of GB"),
    (["serve", "--model", "/nonexistent/model", "--api-in-process", "--stall-timeout", "10"],
     "--stall-timeout applies without --api-in-process"),
    (["generate", "--model", "/nonexistent/model", "--prompt", "x", "--grammar", "/nowhere.ebnf"],
     "--grammar is neither a grammar nor a file holding one: '/nowhere.ebnf'"),
    (["convert", "--hf-path", "/nonexistent", "--mlx-path", "/nonexistent2", "--q-bits", "4"],
     "--q-bits applies only with -q/--quantize"),
])
def test_bad_input_found_before_any_model_is_read(argv: list[str], message: str,
                                                  capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture) -> None:
    from mtpipe import __version__

    with pytest.raises(SystemExit) as ended:
        build_parser().parse_args(["--version"])
    assert ended.value.code == 0 and capsys.readouterr().out.strip() == f"mtpipe {__version__}"


def test_health_and_cache_load_no_node_server() -> None:
    """`mtpipe health` (run by monitors, often) and `mtpipe cache` read nodes and files: they start
    without the node's server, its batching and numpy."""
    import subprocess

    probe = ("import runpy, sys\n"
             "try:\n"
             "    runpy.run_module('mtpipe', run_name='__main__', alter_sys=True)\n"
             "except SystemExit:\n"
             "    pass\n"
             "print([m for m in ('mtpipe.node.server', 'mtpipe.node.service', 'numpy') if m in sys.modules])\n")
    port = free_port()
    for argv in (["health", "--json", "--timeout", "1", f"127.0.0.1:{port}"], ["cache", "--help"]):
        r = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60)
        assert r.stdout.strip() and r.stdout.strip().splitlines()[-1] == "[]", (argv, r.stdout, r.stderr)


def test_verbose_before_or_after_the_command() -> None:
    def verbose(argv: list[str]) -> int:
        args = build_parser().parse_args(argv)
        return args.verbose + args.verbose_after

    assert verbose(["generate"]) == 0
    assert verbose(["-v", "generate"]) == verbose(["generate", "-v"]) == 1
    assert verbose(["health", "-vv", "127.0.0.1:1"]) == verbose(["-v", "cache", "list", "-v"]) == 2


def test_auto_depth_fits_the_context_where_plain_decoding_would(capsys: pytest.CaptureFixture) -> None:
    """`auto` (generate's default, as the API's) drafts only where the context leaves room: a request plain
    decoding serves is never refused for its drafts; a fixed depth that does not fit is refused, named as
    this command's option."""
    from mtpipe.coordinator.engine.request import fit_to_context

    assert fit_to_context(1, 3, True, 32767, 256, 32768) == (0, False, 32767)  # (no room for drafts: none)
    assert fit_to_context(1, 3, True, 32765, 256, 32768) == (2, True, 32765)
    assert fit_to_context(32765, 3, True, None, 256, 32768) == (0, False, 1)  # (a default within the room)
    assert fit_to_context(100, 3, True, None, 256, 32768) == (3, True, 256)
    assert fit_to_context(100, 2, False, 1, 256, 32768) == (0, False, 1)  # (one token: no round carries drafts)
    assert fit_to_context(100, 2, False, 32668, 256, 32768) == (2, False, 32668)  # (a fixed depth: as asked)
    assert main(["generate", "--prompt", "hi", "--max-tokens", "32767", "--mtp-depth", "3"]) == 2
    assert "use --mtp-depth 0 or auto" in capsys.readouterr().err


def test_generate_with_json_says_its_errors_as_json_on_stdout(capsys: pytest.CaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A script reading `generate --json` gets one JSON object on stdout whatever went wrong (a bad value,
    a bad command line), and the usual line on stderr; the exit code says which."""
    assert main(["generate", "--prompt", "hi", "--temp", "-1", "--json"]) == 2
    out, err = capsys.readouterr()
    assert "temperature" in json.loads(out)["error"] and err.startswith("mtpipe: error: ")
    monkeypatch.setattr(sys, "argv", ["mtpipe", "generate", "--max-tokens", "abc", "--json"])
    with pytest.raises(SystemExit) as ended:
        main(["generate", "--max-tokens", "abc", "--json"])
    assert ended.value.code == 2 and "--max-tokens" in json.loads(capsys.readouterr().out)["error"]


@pytest.mark.parametrize("argv", [["bench", "faults", "--nodes", "x", "--json"],  # (refused by the command)
                                  ["bench", "serve", "--reps", "0", "--json"]])  # (by argparse)
def test_bench_json_errors_are_json_on_stdout(argv: list[str], capsys: pytest.CaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A script reads a bench's --json output: its usage errors come there too, as generate's do."""
    monkeypatch.setattr(sys, "argv", ["mtpipe", *argv])  # (what argparse's errors look at)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and json.loads(out[0])["error"]


def test_a_chat_template_that_does_not_render_is_refused_before_the_model_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """--chat-template is a file or the template itself, checked against the model's tokenizer (with the
    variables of --chat-template-args) before the model loads; its options apply with --chat."""
    from mtpipe.coordinator.engine import build

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded for a template refused afterwards")

    monkeypatch.setattr(build, "local_engine", no_model)
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if not allowed %}{{ raise_exception('not allowed') }}{% endif %}{{ messages[0]['content'] }}")
    for argv, says in (([], "apply with --chat"),
                       (["--chat", "--chat-template", "no such file"], "no such file, nor a template"),
                       (["--chat", "--chat-template", str(strict)], "does not render a message: not allowed"),
                       (["--chat", "--chat-template", "{{ x.y.z }}"], "does not render")):
        assert main(["generate", "--prompt", "hi", "--chat-template-args", "{}", *argv]) == 2, argv
        assert says in capsys.readouterr().err, argv


def test_generate_chat_takes_a_system_message(capsys: pytest.CaptureFixture) -> None:
    """--system (mlx-lm's --system-prompt): a system message before the prompt, as the template renders it."""
    from mtpipe.models.registry import DEMO_MODEL

    counts = []
    for extra in ([], ["--system", "Be brief."]):
        assert main(["generate", "--model", str(DEMO_MODEL), "--chat", "--prompt", "hi", "--max-tokens", "1",
                     "--no-mtp", "--json", *extra]) == 0
        counts.append(json.loads(capsys.readouterr().out)["stats"]["prompt_tokens"])
    tok = load_tokenizer(DEMO_MODEL, [])
    assert counts == [len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)) for messages in (
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])]
    assert main(["generate", "--prompt", "hi", "--system", "x"]) == 2
    assert "--system applies with --chat" in capsys.readouterr().err
