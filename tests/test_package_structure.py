"""The package's structure, checked: no import cycle, layout knowledge behind the adapter, one
version, and every public name that moved still importable with a ``DeprecationWarning``.

These read the source tree (``ast``), not a running megatron: they fail on the change that
breaks the rule, whichever test happens to run the code.
"""

from __future__ import annotations

import ast
import configparser
import importlib
import pathlib
import re
import subprocess
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "norm_optim"


def _module_name(path: pathlib.Path, top: pathlib.Path) -> str:
    parts = list(path.relative_to(top).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(path: pathlib.Path) -> bool:
    return path.name == "__init__.py"


def import_graph(root: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports, deferred (function-level) imports
    included: a cycle through a deferred import is still a cycle of the design.

    ``from pkg import sub`` counts as importing ``pkg.sub`` when ``sub`` is a module, and as
    importing ``pkg`` (its ``__init__``) otherwise.
    """
    files = {_module_name(p, root.parent): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if _is_package(path) else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = {f"{target}.{a.name}" for a in node.names} & files.keys()
                deps.update(subs)
                if len(subs) < len(node.names) and target in files:
                    deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / "norm_optim"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from norm_optim.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert cycles(import_graph(pkg)) == [["norm_optim.a", "norm_optim.sub.b"]]


def test_no_import_cycle_in_the_package() -> None:
    graph = import_graph()
    assert len(graph) > 40  # the package was read
    assert cycles(graph) == []


def test_the_registry_names_no_layout_and_no_release() -> None:
    """Layout knowledge lives in the Megatron adapter (``norm_optim._megatron``); the registry
    joins what it reads with the counting rule."""
    source = (PACKAGE / "_norms" / "registry.py").read_text(encoding="utf-8")
    layouts = (
        r"fsdp|dtensor|gtp|mimo|mesh|padding|pipeline|precision|muon|layer-wise|megatron-core\b"
    )
    assert re.findall(layouts, source, re.I) == []
    assert re.findall(r"\b0\.\d+(\.\d+)?\b", source) == []  # no release numbers


def test_the_counting_table_has_one_text() -> None:
    """docs/counting.md is the rule's one text: the module points to it, holds no copy."""
    source = (PACKAGE / "_counting" / "ownership.py").read_text(encoding="utf-8")
    assert "docs/counting.md" in source
    assert "=========" not in source and "| replicated over" not in source


def test_the_library_says_what_it_says_through_logging() -> None:
    """No ``print`` in the library: users route, filter and silence its messages with
    ``logging`` (the ``norm_optim`` loggers). Only ``python -m norm_optim.plot``'s command line
    and the test kit print."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "testing" in path.relative_to(PACKAGE).parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        allowed: set[int] = set()
        if path.name == "plot.py":
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and node.name == "main":
                    allowed |= {n.lineno for n in ast.walk(node) if hasattr(n, "lineno")}
        found += [
            f"{path.relative_to(ROOT)}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "print"
            and node.lineno not in allowed
        ]
    assert found == []


def test_no_merge_conflict_marker_in_any_tracked_file() -> None:
    """The same check as ``make lint`` (.ci/no-conflict-markers), here too."""
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "no-conflict-markers")], cwd=ROOT, capture_output=True
    )
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()


def test_the_version_is_written_once() -> None:
    import norm_optim

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config["metadata"]["version"] == "attr: norm_optim.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+", norm_optim.__version__)
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## [{norm_optim.__version__}]" in changelog or "## [Unreleased]" in changelog


def test_the_top_level_holds_what_a_training_script_names() -> None:
    """``norm_optim.__all__`` stays small (what a script names); the types for looking inside
    are ``norm_optim.inspection``'s, exported once."""
    import norm_optim
    import norm_optim.inspection

    assert len(norm_optim.__all__) <= 16
    assert set(norm_optim.__all__).isdisjoint(norm_optim.inspection.__all__)
    assert {"NormAwareOptimizer", "verify_resume", "StateFingerprint", "Communicator"} <= set(
        norm_optim.__all__
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current names do not warn
        for module in (norm_optim, norm_optim.inspection):
            for name in module.__all__:
                getattr(module, name)


@pytest.mark.parametrize(
    "name",
    ["ParamRecord", "CountedRecord", "ParamRegistry", "RankCoords", "NotCounted", "Source"],
)
def test_an_inspection_type_at_the_top_level_warns_and_works(name: str) -> None:
    import norm_optim
    import norm_optim.inspection

    with pytest.warns(DeprecationWarning, match=f"use norm_optim.inspection.{name}") as caught:
        old = getattr(norm_optim, name)
    assert old is getattr(norm_optim.inspection, name)
    assert caught[0].filename == __file__  # the warning names the line that reads the name
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        norm_optim.NoSuchName  # noqa: B018


@pytest.mark.parametrize("loop", ["megatron_lm", "megatron_bridge"])
def test_a_name_removed_in_0_5_is_gone(loop: str) -> None:
    """``ParamsNormWithBreakdown`` (renamed ``LoggedParamsNorm`` in 0.3.0) went in 0.5.0, as
    its warning said; an unknown name is an ``AttributeError`` that names it."""
    module = importlib.import_module(f"norm_optim.integrations.{loop}")
    with pytest.raises(AttributeError, match="no attribute 'ParamsNormWithBreakdown'"):
        module.ParamsNormWithBreakdown  # noqa: B018
    assert f"{module.LoggedParamsNorm(5.0, 3.0, 4.0):.1f}" == (
        "5.0 | params norm dense: 3.0 | params norm expert: 4.0"
    )


def test_both_integrations_export_the_same_shared_names() -> None:
    from norm_optim.integrations import megatron_bridge, megatron_lm

    def shared(module: object) -> set[str]:
        loop_specific = re.compile(
            r"^(MegatronLM|MegatronBridge|NormAwareOptimizerConfig|norm_aware)"
        )
        return {n for n in module.__all__ if not loop_specific.match(n)}  # type: ignore[attr-defined]

    assert (
        shared(megatron_lm)
        == shared(megatron_bridge)
        == {
            "InstallOptions",
            "LoggedParamsNorm",
            "install",
            "log_reads_params_norm",
        }
    )
    for module in (megatron_lm, megatron_bridge):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the current names do not warn
            for name in module.__all__:
                if name != "NormAwareOptimizerConfig":  # resolves through Bridge
                    getattr(module, name)


def test_the_testing_docstring_lists_every_public_module() -> None:
    import norm_optim.testing

    doc = norm_optim.testing.__doc__ or ""
    modules = {p.stem for p in (PACKAGE / "testing").glob("*.py") if not p.stem.startswith("_")}
    assert modules, "no module found"
    missing = [m for m in sorted(modules) if f":mod:`~norm_optim.testing.{m}`" not in doc]
    assert missing == []


def test_every_module_is_on_the_map() -> None:
    """docs/architecture.md's module map names every module of the package, and names none
    that is gone."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    map_section = text[text.index("## Every module") :]
    modules = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")}
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", map_section, flags=re.M))
    assert modules - listed == set(), "modules missing from docs/architecture.md's map"
    assert listed - modules == set(), "docs/architecture.md's map lists modules that are gone"


def test_every_adapter_module_is_in_its_list() -> None:
    """The adapter's docstring lists every module and subfolder of ``norm_optim/_megatron``;
    a subfolder's own docstring lists its modules (``FEATURE_FOLDERS``, below)."""
    import norm_optim._megatron as adapter

    listed = set(re.findall(r":mod:`\.(\w+)`", adapter.__doc__ or ""))
    folder = PACKAGE / "_megatron"
    modules = {_module_name(p, folder) for p in folder.glob("*/__init__.py")}
    modules |= {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    assert "optimizers" in modules and "model" in modules  # both kinds were read
    assert modules - listed == set()
    assert "_megatron/optimizers" in FEATURE_FOLDERS


FEATURE_FOLDERS = ("_counting", "_norms", "_step", "_audit", "_resume", "_megatron/optimizers")


@pytest.mark.parametrize("folder", FEATURE_FOLDERS)
def test_every_feature_folder_lists_its_modules(folder: str) -> None:
    """Each folder's docstring says what the feature is and lists its modules."""
    package = importlib.import_module("norm_optim." + folder.replace("/", "."))
    listed = set(re.findall(r":mod:`\.(\w+)`", package.__doc__ or ""))
    modules = {p.stem for p in (PACKAGE / folder).glob("*.py") if p.stem != "__init__"}
    assert modules, "no module found"
    assert modules - listed == set()


# The layers, lowest first, by the first name under norm_optim/ ("__init__" is the package
# itself): a module imports from its own layer and the layers below it, never from one above
# (docs/architecture.md, "Layers"). The test kit (testing/) is on top: it may import anything.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ground", ("_errors", "_comm", "_patching", "_versions", "_kernels", "_counting")),
    ("adapter", ("_megatron",)),
    ("norms", ("_norms",)),
    ("features", ("_step", "_audit", "_resume")),
    ("wrapper", ("__init__", "_wrapper", "_moved", "inspection")),
    ("loops", ("integrations", "plot")),
    ("kit", ("testing",)),
)
# The features (the step, the audit, the resume proof) share a layer and do not import each
# other; the imports between them the code has (none).
FEATURES = "features"
FEATURE_EDGES: frozenset[tuple[str, str]] = frozenset()
# Imports of a higher layer the code has (none).
UPWARD_EDGES: frozenset[tuple[str, str]] = frozenset()


def _layer_part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layers() -> dict[str, int]:
    return {part: i for i, (_, parts) in enumerate(LAYERS) for part in parts}


def test_every_module_is_on_a_layer() -> None:
    missing = sorted({_layer_part(m) for m in import_graph()} - _layers().keys())
    assert missing == [], "put these on a layer of LAYERS"


def layer_violations(
    graph: dict[str, set[str]],
    upward_allowed: frozenset[tuple[str, str]] = UPWARD_EDGES,
    across_allowed: frozenset[tuple[str, str]] = FEATURE_EDGES,
) -> tuple[list[str], list[str]]:
    """The imports of a higher layer, and those from one feature into another."""
    layer = _layers()
    features = next(i for i, (name, _) in enumerate(LAYERS) if name == FEATURES)
    upward, across = [], []
    for module, deps in sorted(graph.items()):
        a = _layer_part(module)
        for dep in sorted(deps):
            b = _layer_part(dep)
            if layer[b] > layer[a] and (module, dep) not in upward_allowed:
                upward.append(f"{module} -> {dep}")
            elif layer[a] == layer[b] == features and a != b and (a, b) not in across_allowed:
                across.append(f"{module} -> {dep}")
    return upward, across


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {
        "norm_optim._megatron.model": {"norm_optim._norms.registry", "norm_optim._errors"},
        "norm_optim._resume.report": {"norm_optim._step.watch"},
        "norm_optim._wrapper": {"norm_optim._step.watch", "norm_optim._counting.ownership"},
        "norm_optim.testing.cpu": {"norm_optim._wrapper"},
    }
    assert layer_violations(graph, frozenset(), frozenset()) == (
        ["norm_optim._megatron.model -> norm_optim._norms.registry"],
        ["norm_optim._resume.report -> norm_optim._step.watch"],
    )


def test_no_module_imports_a_higher_layer() -> None:
    upward, across = layer_violations(import_graph())
    assert upward == [], "imports of a higher layer"
    assert across == [], "the features import each other"
