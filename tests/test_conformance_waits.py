"""Every wait in the suite has a deadline (issue 53): a source walk of conformance/ that fails on a
call that can wait for ever, so a hang of a trainer, a library or the suite's own helper processes
ends in a message that names what was waited for, never in a pytest run that does not end.

What counts as a wait without a deadline:
- `q.get()` with no arguments (or `get(True)` / `get(block=True)` and no timeout): a queue;
- `x.wait()` and `x.join()` with no timeout: a process, an event, a condition, a thread;
- `x.communicate()` with no timeout, and `subprocess.run/call/check_call/check_output` with none;
- `os.waitpid(pid, 0)` and `os.wait()`: a child's exit, blocking;
- `lock.acquire()` with no timeout;
- `select.select(r, w, x)` with no timeout, a selector's `select()` with none, `signal.sigwaitinfo`.

A site bounded for another reason (a child already sent SIGKILL, a loop that the closing of its
client's pipe ends) is listed in BOUNDED with that reason; each entry must still name a site.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "conformance"


@dataclasses.dataclass(frozen=True)
class Site:
    path: str       # relative to the repository root
    function: str   # the enclosing function's qualified name ("<module>" at the top level)
    call: str       # the call, as ast.unparse writes it

    def key(self) -> tuple[str, str, str]:
        return self.path, self.function, self.call


# (path, enclosing function, call) -> why it cannot wait for ever.
BOUNDED: dict[tuple[str, str, str], str] = {
    ("conformance/run/forkserver.py", "serve", "sel.select()"):
        "the fork server's event loop: it waits for the next request or a child's exit for as long as its client "
        "lives, and the EOF of its request pipe (the client gone, however it ended) ends it",
    ("conformance/run/zygote.py", "_serve", "sel.select()"):
        "a job's rank zygote's event loop: it lives as long as the job, and dies with the job's process "
        "(PR_SET_PDEATHSIG), which the job's watchdog bounds",
    ("conformance/run/zygote.py", "proxy_rank", "signal.sigwaitinfo(awaited)"):
        "a rank's proxy waits for its rank's end as long as the rank trains: the job's watchdog bounds that, "
        "killing the job's whole tree, and the zygote's death closes the proxy's socket",
    ("conformance/cli/soak.py", "run_pytest", "subprocess.run(cmd, check=False, capture_output=True, text=True)"):
        "one soak run is a run of the suite itself, every wait of which has a deadline (this test)",
    # (each call names its command by a variable: ast.unparse writes an f-string's quotes differently by version)
    ("conformance/bench/measure.py", "ci_profile", "subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)"):
        "the benchmark of the suite's CI profile is a run of the suite itself, every wait of which has a deadline "
        "(this test)",
    ("conformance/cli/init.py", "first_run", "subprocess.run(cmd, cwd=directory)"):
        "the quick profile of the suite itself in the user's terminal, every wait of which has a deadline (this "
        "test), and which the user can interrupt",
}


def _name(call: ast.Call) -> tuple[str, str]:
    """(the called attribute or name, what it is called on as source text, '' for a bare name)."""
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr, ast.unparse(func.value)
    if isinstance(func, ast.Name):
        return func.id, ""
    return "", ""


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_none(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _no_timeout(call: ast.Call, position: int) -> bool:
    """Whether the call gives no timeout: neither as `timeout=` (other than None) nor as
    positional argument `position` (other than None)."""
    timeout = _keyword(call, "timeout")
    if timeout is not None:
        return _is_none(timeout)
    if len(call.args) > position:
        return _is_none(call.args[position])
    return not any(k.arg is None for k in call.keywords)   # **kwargs may carry one


def unbounded(call: ast.Call) -> bool:
    name, owner = _name(call)
    if name == "get" and owner:
        block = _keyword(call, "block") if _keyword(call, "block") is not None else (call.args[0] if call.args else None)
        if not call.args and not call.keywords:
            return True
        return isinstance(block, ast.Constant) and block.value is True and _no_timeout(call, 1)
    if name in ("wait", "join") and owner and owner not in ("os.path", "posixpath", "shlex"):
        if call.args and not _is_none(call.args[0]):   # str.join(items), a timeout given positionally
            return False
        return _no_timeout(call, 0)
    if name == "communicate":
        return _no_timeout(call, 1)
    if name in ("run", "call", "check_call", "check_output") and owner == "subprocess":
        return _keyword(call, "timeout") is None or _is_none(_keyword(call, "timeout"))
    if name == "waitpid" and owner == "os":
        options = call.args[1] if len(call.args) > 1 else _keyword(call, "options")
        return isinstance(options, ast.Constant) and options.value == 0
    if name in ("wait", "wait3", "wait4") and owner == "os":
        options = call.args[0] if call.args else None
        return name == "wait" or (isinstance(options, ast.Constant) and options.value == 0)
    if name == "acquire" and owner:
        blocking = _keyword(call, "blocking") if _keyword(call, "blocking") is not None \
            else (call.args[0] if call.args else None)
        if isinstance(blocking, ast.Constant) and blocking.value is False:
            return False
        timeout = _keyword(call, "timeout") if _keyword(call, "timeout") is not None \
            else (call.args[1] if len(call.args) > 1 else None)
        return timeout is None or (isinstance(timeout, ast.Constant) and timeout.value in (None, -1))
    if name == "select" and owner == "select":
        return len(call.args) < 4 and _no_timeout(call, 3)
    if name == "select" and owner:   # a selectors.BaseSelector
        return _no_timeout(call, 0)
    return name == "sigwaitinfo"


class _Walker(ast.NodeVisitor):
    def __init__(self, path: str):
        self.path, self.scope, self.sites = path, [], []

    def _enter(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_Call(self, node: ast.Call) -> None:
        if unbounded(node):
            self.sites.append((Site(self.path, ".".join(self.scope) or "<module>", ast.unparse(node)), node.lineno))
        self.generic_visit(node)


def unbounded_sites(root: Path = SOURCE) -> list[tuple[Site, int]]:
    """(site, line) of each call in `root`'s Python files that can wait for ever."""
    found = []
    for path in sorted(root.rglob("*.py")):
        walker = _Walker(path.relative_to(root.parent).as_posix())
        walker.visit(ast.parse(path.read_text(), filename=str(path)))
        found += walker.sites
    return found


def test_every_wait_in_the_suite_has_a_deadline():
    sites = [(site, line) for site, line in unbounded_sites() if site.key() not in BOUNDED]
    listing = "\n".join(f"  {site.path}:{line} in {site.function}: {site.call}" for site, line in sites)
    assert not sites, (f"{len(sites)} wait(s) without a deadline: give each one, and say what was waited for when it "
                       f"expires, or list it in BOUNDED with why it cannot wait for ever:\n{listing}")


def test_every_bounded_entry_still_names_a_wait():
    present = {site.key() for site, _ in unbounded_sites()}
    stale = [key for key in BOUNDED if key not in present]
    assert not stale, f"BOUNDED entries that name no wait any more (remove or update them): {stale}"


def _flags(source: str) -> list[str]:
    tree = ast.parse(source)
    return [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call) and unbounded(node)]


def test_the_walk_tells_waits_with_a_deadline_from_those_without():
    flagged = _flags("q.get()\nq.get(True)\nq.get(block=True)\np.wait()\np.wait(None)\nt.join()\n"
                     "p.communicate()\np.communicate(data)\nsubprocess.run(cmd)\nos.waitpid(pid, 0)\nos.wait()\n"
                     "lock.acquire()\nselect.select(r, w, x)\nsel.select()\nsignal.sigwaitinfo(s)\n")
    assert flagged == ["q.get()", "q.get(True)", "q.get(block=True)", "p.wait()", "p.wait(None)", "t.join()",
                       "p.communicate()", "p.communicate(data)", "subprocess.run(cmd)", "os.waitpid(pid, 0)", "os.wait()",
                       "lock.acquire()", "select.select(r, w, x)", "sel.select()", "signal.sigwaitinfo(s)"]
    assert _flags("q.get(timeout=1)\nq.get(True, 5)\nd.get('k')\nq.get(False)\np.wait(5)\np.wait(timeout=t)\n"
                  "t.join(1)\n', '.join(x)\nos.path.join(a, b)\np.communicate(timeout=5)\np.communicate(data, 5)\n"
                  "subprocess.run(cmd, timeout=60)\nos.waitpid(pid, os.WNOHANG)\nlock.acquire(timeout=5)\n"
                  "lock.acquire(False)\nselect.select(r, w, x, 1.0)\nsel.select(0.5)\nsel.select(timeout=t)\n"
                  "signal.sigtimedwait(s, 1)\nq.get(**kw)\n") == []
