"""Each command reads its ``argparse.Namespace`` once, at its edge, into one frozen settings value
(``XSettings.from_args``); the helpers below the edge take the settings, never the namespace."""

from __future__ import annotations

import argparse
import ast
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import attrs
import pytest
from attrs import AttrsInstance

from dgr_engine import cli
from dgr_engine.cli import _route, _speculate, baseline, chat, demo, generate, serve, worker
from dgr_engine.cli._speculate import SpeculateSource
from dgr_engine.options import EngineOptions
from dgr_session import EvidenceClass

CLI = Path(cli.__file__).parent
SETTLED: dict[ModuleType, set[str]] = {
    _route: set(),
    _speculate: set(),
    generate: set(),
    chat: set(),
    serve: set(),
    demo: set(),
    worker: {"certify_command"},  # a public edge of its own: a parsed command line, one string
    baseline: set(),
}
"""The modules whose namespace stops at the edge, and the functions besides ``run`` and the
settings' ``from_args`` that may take one."""
EDGES = {"run", "from_args"}


def parse(*argv: str) -> argparse.Namespace:
    return cli.parser().parse_args(list(argv))


def functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def namespace_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    every = [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]
    every += [a for a in (function.args.vararg, function.args.kwarg) if a is not None]
    return [
        a.arg
        for a in every
        if a.annotation is not None and "Namespace" in ast.unparse(a.annotation)
    ]


def handed_on(function: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> list[str]:
    """The calls ``function`` passes its parameter ``name`` to whole, but ``X.from_args``."""
    calls = []
    for node in ast.walk(function):
        if not isinstance(node, ast.Call):
            continue
        passed = [*node.args, *(k.value for k in node.keywords)]
        if any(isinstance(a, ast.Name) and a.id == name for a in passed):
            if not (isinstance(node.func, ast.Attribute) and node.func.attr == "from_args"):
                calls.append(ast.unparse(node))
    return calls


@pytest.mark.parametrize("module", SETTLED, ids=lambda m: m.__name__)
def test_no_function_below_the_edge_takes_a_namespace(module: ModuleType) -> None:
    tree = ast.parse(inspect.getsource(module))
    takers = {f.name for f in functions(tree) if namespace_parameters(f)}
    assert takers <= EDGES | SETTLED[module], takers - EDGES
    assert "from_args" in takers and (module in (_route, _speculate) or "run" in takers)


@pytest.mark.parametrize("module", SETTLED, ids=lambda m: m.__name__)
def test_the_edge_hands_the_namespace_to_from_args_only(module: ModuleType) -> None:
    tree = ast.parse(inspect.getsource(module))
    for function in functions(tree):
        for name in namespace_parameters(function):
            assert handed_on(function, name) == [], f"{function.name} hands on {name}"


@pytest.mark.parametrize("path", sorted(CLI.glob("*.py")), ids=lambda p: p.name)
def test_no_command_threads_a_namespace_through_helpers(path: Path) -> None:
    """Every command: only ``run`` hands its namespace on (to ``from_args``, or to the handler
    of a subcommand, like ``dgr lock new``'s, which reads it and hands it on no further); no
    namespace is made or copied."""
    tree = ast.parse(path.read_text())
    for function in functions(tree):
        if function.name == "run":
            continue
        for name in namespace_parameters(function):
            assert handed_on(function, name) == [], f"{path.name}: {function.name} hands on {name}"
    made = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Namespace")
    ]
    assert made == [], f"{path.name} makes a namespace: {made}"


SETTINGS: dict[str, Callable[[], AttrsInstance]] = {
    "route": lambda: _route.RouteSettings.from_args(parse("chat", "--spawn", "1")),
    "sampling": lambda: _route.SamplingSettings.from_args(parse("chat", "--spawn", "1")),
    "speculation": lambda: _speculate.SpeculationSettings.from_args(parse("chat", "--spawn", "1")),
    "generate": lambda: generate.GenerateSettings.from_args(parse("generate", "--spawn", "1")),
    "chat": lambda: chat.ChatSettings.from_args(parse("chat", "--spawn", "1")),
    "serve": lambda: serve.ServeSettings.from_args(parse("serve", "--spawn", "1")),
    "demo": lambda: demo.DemoSettings.from_args(parse("demo")),
    "worker": lambda: worker.WorkerSettings.from_args(
        parse("worker", "--model", "m.gguf", "--layers", "0:1")
    ),
    "baseline": lambda: baseline.BaselineSettings.from_args(parse("baseline", "--model", "m")),
}
"""Each settings value, made from a parsed command line."""


@pytest.mark.parametrize("name", SETTINGS)
def test_settings_are_frozen_and_say_what_each_field_is(name: str) -> None:
    settings = SETTINGS[name]()
    kind = type(settings)
    first = attrs.fields(kind)[0].name
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(settings, first, None)
    sources = [inspect.getsource(c) for c in kind.__mro__ if attrs.has(c)]  # inherited too
    for field in attrs.fields(kind):
        source = next(s for s in sources if f"\n    {field.name}: " in s)
        declared = source.split(f"\n    {field.name}: ", 1)[1]
        assert declared.splitlines()[1].strip().startswith('"""'), f"{field.name}: no docstring"


def test_generate_settings_are_the_command_line() -> None:
    args = parse(
        "generate", "--spawn", "2", "--fixture", "tiny-llama", "--ctx", "128",
        "--temperature", "0.5", "--top-k", "4", "--seed", "9", "--stop", "END", "-n", "7",
        "--speculate", "ngram", "--draft-max", "3", "--prompt", "hi", "--chat", "--no-stop",
        "--json", "--transport", "chain", "--data-path", "grpc", "--require", "fixture",
    )  # fmt: skip
    settings = generate.GenerateSettings.from_args(args)
    route = settings.route
    assert (route.spawn, route.endpoints, route.fixture, route.model) == (
        2,
        None,
        "tiny-llama",
        None,
    )
    assert route.options == EngineOptions(n_ctx_per_session=128)
    assert (route.transport, route.data_path) == ("chain", "grpc")
    assert route.require is EvidenceClass.FIXTURE and route.step_deadline == 10.0
    sampling = settings.sampling
    assert (sampling.temperature, sampling.top_k, sampling.seed) == (0.5, 4, 9)
    assert (sampling.stop, sampling.max_tokens) == (("END",), 7)
    assert settings.speculation == _speculate.SpeculationSettings(SpeculateSource("ngram"), 3)
    assert (settings.prompt, settings.ids, settings.chat) == ("hi", False, True)
    assert (settings.stop_at_eog, settings.check, settings.json) == (False, False, True)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        settings.json = False  # type: ignore[misc]


def test_chat_settings_are_the_command_line() -> None:
    args = parse("chat", "--endpoints", "h:1,h:2", "--system", "Be brief.", "--top-p", "0.9")
    settings = chat.ChatSettings.from_args(args)
    assert (settings.route.endpoints, settings.route.spawn) == ("h:1,h:2", None)
    assert settings.system == "Be brief." and settings.sampling.top_p == 0.9
    assert settings.sampling.greedy and settings.speculation.source is None
    assert settings.route.require is EvidenceClass.REAL_HARDWARE


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["--name", "mine"], "mine"),
        (["--model", "/m/x.gguf"], "x"),
        (["--fixture", "tiny-llama"], "tiny-llama"),
        ([], "dgr"),
    ],
)
def test_serve_settings_name_the_model(argv: list[str], name: str) -> None:
    args = parse("serve", "--endpoints", "h:1", "--port", "0", "--admission-wait", "2", *argv)
    settings = serve.ServeSettings.from_args(args)
    assert (settings.host, settings.port, settings.admission_wait) == ("127.0.0.1", 0, 2.0)
    assert settings.model_name == name


def test_worker_settings_are_the_command_line() -> None:
    args = parse(
        "worker", "--fixture", "tiny-llama", "--layers", "1:", "--no-frame-link",
        "--native-link-port", "7001", "--grant-key", "a=k.pem", "--session-lease", "0",
        "--batching", "co-batch",
    )  # fmt: skip
    settings = worker.WorkerSettings.from_args(args)
    assert (settings.fixture, settings.layers) == ("tiny-llama", (1, -1))
    assert (settings.frame_link_port, settings.native_link_port) == (None, 7001)
    assert settings.grant_key_specs == ("a=k.pem",) and settings.session_lease == 0.0
    assert settings.options.batching == "co-batch" and settings.log_level == "INFO"


def test_demo_settings_fill_in_what_depends_on_the_model(tmp_path: Path) -> None:
    args = parse("demo", "--steps", "10", "--no-spare", "--operator-dir", str(tmp_path))
    settings = demo.DemoSettings.from_args(args)
    assert (settings.model, settings.fixture, settings.spare) == (demo.DEFAULT_MODEL, None, False)
    assert settings.operator_dir == tmp_path and settings.steps == 10 and settings.sessions is None
    chat_run = settings.sessions_for(chat=True)
    assert chat_run == demo.DemoSessions(demo.QUESTION, 1, 10, demo.CHAT_LOSE_AT)
    fixture_run = settings.sessions_for(chat=False)
    assert fixture_run == demo.DemoSessions(None, demo.FIXTURE_SESSIONS, 10, demo.FIXTURE_LOSE_AT)
    assert list(fixture_run.names) == [f"demo-{i}" for i in range(demo.FIXTURE_SESSIONS)]


def test_baseline_settings_are_the_command_line() -> None:
    args = parse("baseline", "--model", "m.gguf", "--no-record", "--threads", "3")
    settings = baseline.BaselineSettings.from_args(args)
    assert (settings.model, settings.hf_dir, settings.record, settings.threads) == (
        "m.gguf",
        None,
        False,
        3,
    )
