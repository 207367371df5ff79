"""The layout's rules, kept in force: layering, no reach-through into the engine's parts from
outside the engine, the web stack only in serving, no unpickler in the engine, and every source
folder a package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src" / "tandem"
ENGINE_DIRS = ("rollout", "sync", "kernels")
PACKAGE_DIRS = (*ENGINE_DIRS, "trainers", "cli")
WEB_STACK = ("fastapi", "uvicorn", "pydantic", "starlette")
# Callers of the engine (LLMEngine's public methods), and the parts of it they must not read.
ENGINE_CALLERS = ("trainers", "cli", "rollout/serving", "sync")
ENGINE_PARTS = ("runner", "scheduler", "input_processor")
UNPICKLERS = ("pickle", "_pickle", "cPickle", "cloudpickle", "dill", "shelve")


def modules(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (SOURCE / d).rglob("*.py"))


def imported_names(path: Path) -> list[str]:
    """Every module ``path`` imports, anywhere in it (inside functions too), as absolute
    names (relative imports resolved against the package mapping)."""
    package = _package_of(path)
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.append(base)
    return names


def _package_of(path: Path) -> str:
    return ".".join(path.parent.relative_to(SOURCE.parent).parts)


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_repository_root_holds_no_package_but_the_tests():
    # Python started from the root (python -m pytest) imports from it first: a package there
    # shadows the distribution of its name (a root kernels/ folder hid the one transformers
    # imports), so the sources live under src/.
    assert {p.parent.name for p in ROOT.glob("*/__init__.py")} <= {"tests"}


@pytest.mark.parametrize("path", modules(*ENGINE_DIRS), ids=relative)
def test_engine_packages_never_import_the_trainers_or_the_cli(path):
    upward = [n for n in imported_names(path) if n.startswith(("tandem.trainers", "tandem.cli"))]
    assert not upward, f"{path} imports {upward}: the engine must not depend on the layer above"


def test_nothing_imports_the_cli():
    importers = [p for p in modules(*PACKAGE_DIRS) if "cli" not in p.parts
                 and any(n.startswith("tandem.cli") for n in imported_names(p))]
    assert not importers


def test_the_web_stack_is_imported_only_in_serving():
    outside = [p for p in modules(*PACKAGE_DIRS) if "serving" not in p.parts
               and any(n.split(".")[0] in WEB_STACK for n in imported_names(p))]
    assert not outside, f"{outside} import {WEB_STACK}: serving owns the HTTP server"


def test_the_client_and_server_config_import_without_the_web_stack():
    for name in ("client.py", "config.py", "__init__.py"):
        path = SOURCE / "rollout" / "serving" / name
        assert not any(n.split(".")[0] in WEB_STACK for n in imported_names(path)), path


@pytest.mark.parametrize("path", modules("sync", "rollout"), ids=relative)
def test_no_engine_or_sync_module_imports_pickle(path):
    # What arrives over a connection (the weight-transfer store, HTTP bodies) is JSON: an
    # unpickler there would run whatever code a hostile peer sent.
    unpicklers = [n for n in imported_names(path) if n.split(".")[0] in UNPICKLERS]
    assert not unpicklers, f"{path} imports {unpicklers}: decode JSON instead"


def engine_part_reads(path: Path) -> list[str]:
    """Each ``engine.runner``, ``x.engine.scheduler``, ... in ``path`` (an attribute of
    ``ENGINE_PARTS`` taken from a name ``engine`` or an attribute ``engine``), with its line."""
    reads = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_PARTS:
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "engine"
                    or isinstance(owner, ast.Attribute) and owner.attr == "engine"):
                reads.append(f"line {node.lineno}: {ast.unparse(node)}")
    return reads


@pytest.mark.parametrize("path", modules(*ENGINE_CALLERS), ids=relative)
def test_callers_use_the_engine_methods_not_its_parts(path):
    # The runner, scheduler and input processor are the engine's to change; a caller that
    # reads them breaks when they do (LLMEngine.tensor_parallel, compile_grammar,
    # waiting_request_ids and stats() say what callers need).
    reads = engine_part_reads(path)
    assert not reads, f"{path} reaches into the engine: {reads}; add an LLMEngine method"


def test_every_source_folder_is_a_package():
    # pyproject finds the packages under src/ (packages.find): a folder of modules without
    # an __init__.py would not install.
    folders = {p.parent for p in SOURCE.rglob("*.py")}
    assert all((folder / "__init__.py").exists() for folder in folders), folders
