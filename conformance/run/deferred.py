"""Modules a fork server loads ahead of its trainer that a fresh interpreter of the trainer imports
later, lazily (torch._dynamo from the first optimizer or DDP constructor, DCP, torchrun's
launcher): loaded once in the server, then kept out of sight, out of `sys.modules` and off their
parent package, until the trainer imports one. Then that module, and every module its import
loaded in the server, come back at once, as a fresh interpreter's import would load them at that
moment.

Why not simply leave them imported: a module's top-level code reads the state of the process it
runs in, and a module imported lazily runs in the trainer's state, not the server's.
`torch.distributed.nn.functional` binds `group=group.WORLD` as a default argument; a fresh DDP
rank imports it (through dynamo) after `init_process_group`, so its defaults hold the rank's
default group until the interpreter exits. Imported in the server it holds None, and the group
is freed with the DDP reducer when the trainer's `main()` returns, with the GIL held: that is
where torch's gloo backend can deadlock (a worker thread dropping the last reference to a work
whose captured thread-local state holds a Python object waits for the GIL that the main thread,
joining that worker, holds), and the warm rank hung at exit where torchrun's never did. And code
that asks `"torch._dynamo" in sys.modules` (init_process_group does) sees what a fresh interpreter
sees.

What comes back are the server's module objects: their code ran in the server's state. The
imports known to capture the trainer's state are evaluated again as they come back (CAPTURES);
anything else shows as a difference between a warm and a fresh run, which determinism_precondition
looks for.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import inspect
import sys
from collections.abc import Callable, Iterable
from types import ModuleType


def _rebind_world_group(module: ModuleType) -> None:
    """torch.distributed.nn.functional: `group=group.WORLD` defaults, evaluated as its import does."""
    world = getattr(getattr(sys.modules.get("torch.distributed"), "group", None), "WORLD", None)
    for fn in vars(module).values():
        if not inspect.isfunction(fn) or fn.__module__ != module.__name__ or not fn.__defaults__:
            continue
        names = [p.name for p in inspect.signature(fn).parameters.values() if p.default is not p.empty]
        tail = names[-len(fn.__defaults__):]
        fn.__defaults__ = tuple(world if name == "group" else value for name, value in zip(tail, fn.__defaults__))


# Module -> what re-evaluates its import-time reads of the process state when it comes back.
CAPTURES: dict[str, Callable[[ModuleType], None]] = {"torch.distributed.nn.functional": _rebind_world_group}


class Deferred(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads modules (`load`), hides them, and brings them back when imported. One per process: the
    fork server's, inherited by every child it forks."""

    def __init__(self) -> None:
        self.hidden: dict[str, tuple[ModuleType, object]] = {}   # name -> (module, its own __spec__)
        self.loads: dict[str, dict[str, None]] = {}   # module -> the modules its import loaded (itself first), in order
        self._stack: list[str] | None = None    # while loading: the modules being imported, outermost first
        self._specs: dict[str, object] = {}     # a module being brought back by an import -> its own __spec__

    # -- in the server ----------------------------------------------------------------------------
    def load(self, names: Iterable[str], report: Callable[[str], None]) -> None:
        """Import each of `names` (one that fails is reported and skipped), learning which modules
        each import loads, then hide every module that is loaded now and was not before."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)
        before = set(sys.modules)
        self._stack = []
        try:
            for name in names:
                try:
                    importlib.import_module(name)
                except Exception as exc:
                    report(f"cannot preload {name}: {exc!r}")
        finally:
            self._stack = None
        for name in [name for name in sys.modules if name not in before]:
            self.loads.setdefault(name, {name: None})
            self._hide(name)

    def _hide(self, name: str) -> None:
        module = sys.modules.pop(name)
        self.hidden[name] = (module, getattr(module, "__spec__", None))
        parent, _, child = name.rpartition(".")
        owner = sys.modules.get(parent) or self.hidden.get(parent, (None,))[0]
        if parent and getattr(owner, child, None) is module:
            delattr(owner, child)

    def _note(self, names: list[str]) -> None:
        """The modules being imported around this moment loaded `names` too."""
        for outer in self._stack or ():
            self.loads[outer].update(dict.fromkeys(names))

    def _enter(self, name: str) -> None:
        self.loads.setdefault(name, {name: None})
        self._note([name])
        self._stack.append(name)

    # -- the import protocol ------------------------------------------------------------------------
    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.hidden:
            module, _ = self.hidden[fullname]
            return importlib.machinery.ModuleSpec(fullname, self, is_package=hasattr(module, "__path__"))
        if self._stack is None:
            return None
        for finder in sys.meta_path:   # learning what an import loads: find it as usual, then watch it load
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Watched(self, spec.loader)
                return spec
        return None

    def create_module(self, spec):
        """A hidden module is imported: it comes back with what its import loaded in the server."""
        module, self._specs[spec.name] = self.hidden[spec.name]
        self._note(self.reveal(spec.name))
        return module

    def exec_module(self, module) -> None:
        """Nothing to run: the module ran in the server. The import system gave it this finder's
        spec; it gets its own back."""
        vars(module)["__spec__"] = self._specs.pop(module.__name__, module.__spec__)

    def reveal(self, name: str) -> list[str]:
        """Bring `name` back, with every hidden module its import loaded, in the order they loaded;
        returns their names."""
        back = []
        for each in self.loads.get(name, (name,)):
            if each not in self.hidden:
                continue
            module, _ = self.hidden.pop(each)
            sys.modules[each] = module
            parent, _, child = each.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, module)
            back.append(each)
        for each in back:
            capture = CAPTURES.get(each)
            if capture is not None:
                capture(sys.modules[each])
        return back


class _Watched(importlib.abc.Loader):
    """Wraps a module's loader while the server learns what imports load: the module runs as usual,
    noted as loaded by every module being imported around it. Afterwards the module has its own
    loader again."""

    def __init__(self, deferred: Deferred, loader):
        self.deferred, self.loader = deferred, loader

    def __getattr__(self, name):   # get_resource_reader, get_data, is_package, ...: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        self.deferred._enter(spec.name)
        try:
            return self.loader.create_module(spec)
        finally:
            self.deferred._stack.pop()

    def exec_module(self, module) -> None:
        self.deferred._enter(module.__name__)
        try:
            self.loader.exec_module(module)
        finally:
            self.deferred._stack.pop()
            vars(module)["__loader__"] = self.loader   # not setattr: torch's config modules refuse unknown names
            spec = vars(module).get("__spec__")
            if spec is not None and spec.loader is self:
                spec.loader = self.loader
