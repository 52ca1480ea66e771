"""How an adapter's module is imported, and what a user is told when it is not: the bundled trainers'
old top-level spelling (`fixtures.x`, before they moved under `resume_conformance.`), and for a
module that cannot be imported, which part of its dotted name failed and the nearest existing name."""
from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

NAMESPACE = "resume_conformance"
OLD_TOP_LEVEL = ("fixtures", "reference")   # installed top-level until 0.1.0; PyPI has both names


def _bundled_dir(top: str) -> Path | None:
    spec = importlib.util.find_spec(f"{NAMESPACE}.{top}")
    return Path(spec.submodule_search_locations[0]).resolve() if spec and spec.submodule_search_locations else None


def _find(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):   # a parent that is not a package, or fails to import
        return None


def current_spelling(module_name: str) -> str | None:
    """The new name of a bundled module given by its old top-level spelling (`fixtures.broken.x` ->
    `resume_conformance.fixtures.broken.x`); None when the name is not an old spelling, or when
    another package answers to it (a project's own `fixtures/` stays theirs; testing-cabal's
    `fixtures` has no `fixtures.broken`)."""
    top = module_name.split(".")[0]
    if top not in OLD_TOP_LEVEL:
        return None
    new = f"{NAMESPACE}.{module_name}"
    if _find(new) is None:
        return None
    theirs = _find(top)
    bundled = _bundled_dir(top)
    if theirs is not None and theirs.submodule_search_locations and bundled is not None:
        # Another `fixtures` (a project's own, or testing-cabal's) keeps every name it has.
        if Path(theirs.submodule_search_locations[0]).resolve() != bundled and _find(module_name) is not None:
            return None
    return new


def _children(package: str | None, search: tuple[str, ...]) -> list[str]:
    """The module names directly inside `package` (None: the top level of `search` and sys.path)."""
    if package is None:
        return sorted({m.name for m in pkgutil.iter_modules([*search, *[p for p in sys.path if p]])})
    spec = _find(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return sorted({m.name for m in pkgutil.iter_modules(locations)})


def why_not_importable(module_name: str, exc: ImportError, search: tuple[str, ...]) -> tuple[str, str]:
    """(cause, fix) for a module that raised ImportError: the part of the dotted name that is
    missing, with the nearest existing name; or, when the module exists but something it imports
    does not, that import."""
    missing = getattr(exc, "name", None) or ""
    parts = module_name.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    if not missing and not isinstance(exc, ModuleNotFoundError):   # the module raised it: it names what it needs
        return (f"cannot import {module_name!r}: it exists, but importing it failed: {exc}",
                f"install what it names in this environment, or fix that import in {module_name}")
    if missing and missing not in prefixes:
        return (f"cannot import {module_name!r}: it exists, but importing it failed: {exc}",
                f"install {missing.split('.')[0]!r} in this environment, or fix that import in {module_name}")
    depth = prefixes.index(missing) if missing in prefixes else len(parts) - 1
    parent = prefixes[depth - 1] if depth else None
    near = difflib.get_close_matches(parts[depth], _children(parent, search), n=1, cutoff=0.6)
    suggestion = f" (did you mean {'.'.join([*parts[:depth], near[0]])!r}?)" if near else ""
    if parent is None:
        where = ", ".join(search) or os.getcwd()
        return (f"cannot import {module_name!r}: no module {parts[0]!r} on sys.path or in {where}{suggestion}",
                f"run pytest from the directory that holds {parts[0]!r}, or install that package"
                + (f"; or spell it {near[0]!r}" if near else ""))
    return (f"cannot import {module_name!r}: {parent!r} has no module {parts[depth]!r}{suggestion}",
            f"check the spelling of {parts[depth]!r}" + (f": {'.'.join([*parts[:depth], near[0]])}" if near else ""))


_FIND = ("import importlib.util, sys\n"
         "try:\n    found = importlib.util.find_spec(sys.argv[1])\nexcept Exception as exc:\n"
         "    print(f'{type(exc).__name__}: {exc}'); sys.exit(3)\n"
         "sys.exit(0 if found is not None else 3)\n")


def python_target(argv) -> tuple[str, str, tuple[str, ...]] | None:
    """How a trainer command names its Python target: ("module", name, rest) for `python -m name
    ...`, ("script", path, rest) for `python path.py ...` (whether or not the file exists), None for
    any other command. The one reading, which the warm runner's fork target asks too."""
    if not argv or not Path(argv[0]).name.startswith("python") or len(argv) < 2:
        return None
    if argv[1] == "-m" and len(argv) > 2:
        return "module", argv[2], tuple(argv[3:])
    if not argv[1].startswith("-") and argv[1].endswith(".py"):
        return "script", argv[1], tuple(argv[2:])
    return None


def python_target_problem(argv: tuple[str, ...], interpreter: str, search: tuple[str, ...]) -> tuple[str, str] | None:
    """(cause, fix) when a trainer command is a Python interpreter given a module (`-m mod`) or a
    script that it cannot find, asked of that interpreter (it may be another environment's) with
    the trainer's own search path; None otherwise, or for anything else."""
    target = python_target(argv)
    if target is None:
        return None
    kind, module, _ = target
    if kind == "module":
        found, said = _interpreter_finds(interpreter, module,
                                         os.pathsep.join([*search, *filter(None, [os.environ.get("PYTHONPATH")])]))
        if found:
            return None
        added = [d for d in search if d not in sys.path]
        sys.path[:0] = added
        try:
            here = _find(module)
            if here is None:   # a misspelling or the wrong directory: the nearest names are the same files
                cause, fix = why_not_importable(module, ModuleNotFoundError(module, name=_missing(module)), search)
                return f"{cause} ({interpreter})", fix
        finally:
            for d in added:
                sys.path.remove(d)
        return (f"{interpreter} cannot import {module!r}, although the suite's own environment can "
                f"({said or 'no such module'})", f"install it for {interpreter} as well")
    if not os.path.isfile(module):
        return (f"the script {module!r} does not exist (in {os.getcwd()})",
                "run pytest from the directory the command's paths are relative to, or give the script's full path")
    return None


@functools.cache
def _interpreter_finds(interpreter: str, module: str, pythonpath: str) -> tuple[bool, str]:
    """(whether `interpreter` finds `module` with `pythonpath`, what it said): asked once per process,
    since finding a package's module imports its parents (a trainer's package may import torch),
    and the options are resolved more than once (at configure, then by the session)."""
    proc = subprocess.run([interpreter, "-c", _FIND, module], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": pythonpath}, timeout=120)
    return proc.returncode == 0, proc.stdout.strip()


def _missing(module: str) -> str:
    """The first prefix of a dotted module name that cannot be found."""
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        if _find(".".join(parts[:i])) is None:
            return ".".join(parts[:i])
    return module
