"""The warm runner's fork server: what it does once for its children (run/warmup.py), the child it
forks ahead of each request, the allocator setting it starts with, the development harness's root
that forks fork servers (tests/forkroot.py), and its channel: what a trainer's import does to
stdin and stdout never reaches it, a module that exits at import ends its children as it ends a
fresh interpreter, and every wait on the server ends by a deadline that says what it waited for."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.run.forkclient import ROOT_ENV, ForkServer, ServerDied
from conformance.run.forkserver import server_env
from conformance.run.warmup import huge_page_tunables
from conformance.trace.strace import strace_problem

PROBE = '''\
import json, os, sys
import torch


def main():
    torch.manual_seed(1)
    torch.zeros(2) + 1
    os.access(os.environ["PROBE_MARK"], os.F_OK)   # where the trace stops counting
    with open(os.environ["PROBE_OUT"], "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    if os.environ.get("PROBE_PATH"):
        with open(os.environ["PROBE_PATH"], "w") as f:
            json.dump([sys.path, os.getcwd()], f)


if __name__ == "__main__":
    main()
'''


@pytest.fixture
def server(tmp_path):
    (tmp_path / "warm_probe.py").write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    srv = ForkServer(["warm_probe"], env=env)
    yield srv
    srv.close()


def _run(srv: ForkServer, tmp_path: Path, attach=None) -> tuple[int, str]:
    out = tmp_path / "out"
    env = dict(os.environ, PROBE_OUT=str(out), PROBE_MARK=str(tmp_path / "MARK"))
    rc, _ = srv.run("warm_probe", [], env, tmp_path / "stderr", attach=attach)
    return rc, out.read_text() if out.exists() else (tmp_path / "stderr").read_text()


def _server_children(srv: ForkServer) -> set[int]:
    tasks = Path(f"/proc/{srv.proc.pid}/task")
    return {int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split()}


def test_huge_page_tunables_keep_the_callers_settings_and_choice():
    assert huge_page_tunables(None) == "glibc.malloc.hugetlb=1"
    assert huge_page_tunables("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert huge_page_tunables("glibc.malloc.hugetlb=0") == "glibc.malloc.hugetlb=0"


def test_each_request_gets_a_child_forked_ahead_and_a_dead_spare_is_replaced(server, tmp_path):
    rc, out = _run(server, tmp_path)
    assert rc == 0, out
    pid, ppid = map(int, out.split())
    assert ppid == server.proc.pid
    deadline = time.monotonic() + 30
    while not (spares := _server_children(server)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(spares) == 1 and pid not in spares, spares   # the next child waits, forked already
    os.kill(spares.pop(), signal.SIGKILL)                  # killed from outside before its request
    time.sleep(0.2)
    rc, out = _run(server, tmp_path)
    assert rc == 0, out
    assert int(out.split()[1]) == server.proc.pid


@pytest.mark.skipif(strace_problem() is not None, reason=f"needs strace: {strace_problem()}")
def test_a_child_starts_without_the_syscalls_its_server_made_for_it(server, tmp_path):
    """Between its release and the trainer's own work, a child reads no Python source or bytecode
    and does not detect the CPU again: each of those syscalls costs every traced trial process."""
    from conformance.run.attach import attach_strace
    trace = tmp_path / "trace"
    rc, out = _run(server, tmp_path, attach=lambda pid: attach_strace(["strace", "-f", "-o", str(trace)], pid))
    assert rc == 0, out
    lines = trace.read_text().splitlines()
    mark = next(i for i, line in enumerate(lines) if "MARK" in line)
    before = "\n".join(lines[:mark])
    assert not re.findall(r'"[^"]*\.py[c]?"', before), before
    assert "cpuinfo" not in before and "/sys/devices/system/cpu" not in before, before
    assert len(lines[:mark]) < 40, before
    assert sys.modules.get("warm_probe") is None   # the probe ran in the child only


@pytest.fixture
def root(tmp_path):
    address = f"@conformance-test-root-{os.getpid()}-{tmp_path.name}"
    proc = subprocess.Popen([sys.executable, "-m", "tests.forkroot", address], env=server_env(os.environ),
                            cwd=Path(__file__).resolve().parents[1], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield address, proc
    proc.stdin.close()
    proc.wait(timeout=60)


def _probe_path(tmp_path: Path, env: dict[str, str]) -> list:
    """sys.path and directory of `python -m warm_probe` started fresh in tmp_path with `env`."""
    out = tmp_path / "fresh-path.json"
    subprocess.run([sys.executable, "-c", "import json, sys, os; json.dump([sys.path, os.getcwd()], "
                    f"open({str(out)!r}, 'w'))"], cwd=tmp_path, env=env, check=True)
    path, cwd = json.loads(out.read_text())
    return [[cwd, *path[1:]], cwd]   # -m puts the directory first, -c an empty string


def test_a_root_forks_a_server_that_looks_started_fresh_and_its_children_run(root, tmp_path, monkeypatch):
    address, proc = root
    (tmp_path / "warm_probe.py").write_text(PROBE)
    (tmp_path / "lib").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ROOT_ENV, address)
    env = {k: v for k, v in os.environ.items() if k != ROOT_ENV}
    env["PYTHONPATH"] = os.pathsep.join(["lib", str(tmp_path)])
    srv = ForkServer(["warm_probe"], env=env)
    try:
        assert not isinstance(srv.proc, subprocess.Popen)
        assert int(Path(f"/proc/{srv.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == proc.pid
        out = tmp_path / "out"
        child_env = dict(env, PROBE_OUT=str(out), PROBE_MARK=str(tmp_path / "MARK"),
                         PROBE_PATH=str(tmp_path / "path.json"))
        rc, _ = srv.run("warm_probe", [], child_env, tmp_path / "stderr")
        assert rc == 0, (tmp_path / "stderr").read_text()
        assert int(out.read_text().split()[1]) == srv.proc.pid
        assert json.loads((tmp_path / "path.json").read_text()) == _probe_path(tmp_path, env)
    finally:
        srv.close()
    assert srv.proc.poll() == 0   # its exit is seen, though it is the root's child


def test_a_root_that_cannot_stand_in_for_a_fresh_interpreter_is_not_used(root, tmp_path, monkeypatch):
    address, _ = root
    monkeypatch.setenv(ROOT_ENV, address)
    other = tmp_path / "python3"
    other.symlink_to(sys.executable)   # the same binary by another path: another environment (a venv)
    srv = ForkServer([], interpreter=str(other))
    try:
        assert isinstance(srv.proc, subprocess.Popen)
    finally:
        srv.close()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # read by the OpenMP runtime as torch loads
    srv = ForkServer([])
    try:
        assert isinstance(srv.proc, subprocess.Popen)
    finally:
        srv.close()
    monkeypatch.delenv("OMP_NUM_THREADS")
    # Read by torch.cuda at each call, not as torch loads; importing lightning sets it.
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    srv = ForkServer([])
    try:
        assert not isinstance(srv.proc, subprocess.Popen)   # the root is still there, and used
    finally:
        srv.close()
    monkeypatch.setenv(ROOT_ENV, "@conformance-no-root-here")
    srv = ForkServer([])
    try:
        assert isinstance(srv.proc, subprocess.Popen)
    finally:
        srv.close()


def test_a_server_that_died_is_started_again_for_the_next_request(server, tmp_path):
    rc, _ = _run(server, tmp_path)
    assert rc == 0
    first = server.proc.pid
    os.kill(first, signal.SIGKILL)
    server.proc.wait()
    deadline = time.monotonic() + 10
    while server.ended is None and time.monotonic() < deadline:   # its reader sees the pipe close
        time.sleep(0.01)
    rc, out = _run(server, tmp_path)
    assert rc == 0, out
    assert server.proc.pid != first and server.restarts == 1
    assert int(out.split()[1]) == server.proc.pid


THREAD_AT_IMPORT = '''\
import threading, time
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()   # a thread from the trainer's import


def main():
    pass


if __name__ == "__main__":
    main()
'''


def _run_warm(tmp_path: Path, module: str):
    """(the warm runner, its result) for one process of tmp_path's `module` (`python -m module`),
    the runner closed: what it refused is in its `refused`."""
    from conformance.model.adapters import TrainerAdapter
    from conformance.model.process import RunSpec
    from conformance.run.warm import WarmRunner
    runner = WarmRunner()
    adapter = TrainerAdapter(name=module, argv=(sys.executable, "-m", module), pythonpath=(str(tmp_path),), spec=module)
    (tmp_path / "ckpt").mkdir()
    try:
        result = runner.run_process(adapter, RunSpec(1, 1, 0), (tmp_path / "ckpt").resolve(),
                                    (tmp_path / "loss.jsonl").resolve())
    finally:
        runner.close()
    return runner, result


def test_a_server_whose_trainer_starts_a_thread_at_import_refuses_to_fork(tmp_path):
    """Forking a process with another thread copies that thread's locks as they are: the server
    refuses, and the warm runner runs such a trainer fresh (saying why)."""
    from conformance.run.forkclient import ServerRefused
    (tmp_path / "threaded_trainer.py").write_text(THREAD_AT_IMPORT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    srv = ForkServer(["threaded_trainer"], env=env)
    try:
        with pytest.raises(ServerRefused, match=r"\(Thread-1 \(sleep\) in Python\), 1 more than its fork-aware library pools"):
            srv.run("threaded_trainer", [], env, tmp_path / "stderr")
    finally:
        srv.close()
    runner, result = _run_warm(tmp_path, "threaded_trainer")
    assert result.returncode == 0, result.stderr   # run fresh instead
    assert "more than its fork-aware library pools" in runner.refused["threaded_trainer"]


NATIVE_THREAD_AT_IMPORT = '''\
import ctypes
libc = ctypes.CDLL(None)
thread = ctypes.c_ulong()
# A native thread that no BLAS or OpenMP runtime started (pause() as its start routine).
assert libc.pthread_create(ctypes.byref(thread), None, ctypes.cast(libc.pause, ctypes.c_void_p), None) == 0
'''
POOL_AT_IMPORT = "import scipy.linalg   # loads scipy's own OpenBLAS, whose pool starts a worker per extra core\n"


@pytest.mark.parametrize("module,refused", [("native_thread_trainer", True), ("pool_trainer", False)])
def test_a_server_forks_beside_a_blas_pool_the_trainers_imports_start_and_not_beside_another_native_thread(
        tmp_path, module, refused):
    """lightning and transformers import scipy, whose OpenBLAS starts its workers at import: such
    pools make themselves fork-safe (pthread_atfork), so the server forks beside them; a native
    thread whose import loaded no such runtime is refused, naming the import that started it."""
    if module == "pool_trainer":
        pytest.importorskip("scipy.linalg")
        if (os.cpu_count() or 1) < 2:
            pytest.skip("OpenBLAS starts no worker on one core")
    from conformance.run.forkclient import ServerRefused
    (tmp_path / "native_thread_trainer.py").write_text(NATIVE_THREAD_AT_IMPORT)
    (tmp_path / "pool_trainer.py").write_text(POOL_AT_IMPORT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    srv = ForkServer([module], env=env)
    try:
        if refused:
            with pytest.raises(ServerRefused, match=f"importing {module} started 1 that no thread-pool runtime"):
                srv.run(module, [], env, tmp_path / "stderr")
        else:
            assert srv.run(module, [], env, tmp_path / "stderr") == (0, None), (tmp_path / "stderr").read_text()
    finally:
        srv.close()


SAVES_AT_EXIT = '''\
import os
from concurrent.futures import ThreadPoolExecutor

SAVER = ThreadPoolExecutor(max_workers=1)


def save(path):
    import time
    time.sleep(0.3)   # still writing when main() returns
    with open(path, "w") as f:
        f.write("saved")


def main():
    SAVER.submit(save, os.environ["SAVE_TO"])   # queued, never waited for: the interpreter's exit waits


if __name__ == "__main__":
    main()
'''


def test_a_child_ends_as_an_interpreter_ends_and_finishes_a_queued_save(tmp_path):
    (tmp_path / "saves_at_exit.py").write_text(SAVES_AT_EXIT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    fresh = subprocess.run([sys.executable, "-m", "saves_at_exit"], env=dict(env, SAVE_TO=str(tmp_path / "fresh")))
    assert fresh.returncode == 0 and (tmp_path / "fresh").read_text() == "saved"
    srv = ForkServer(["saves_at_exit"], env=env)
    try:
        rc, _ = srv.run("saves_at_exit", [], dict(env, SAVE_TO=str(tmp_path / "warm")), tmp_path / "stderr")
    finally:
        srv.close()
    assert rc == 0 and (tmp_path / "warm").read_text() == "saved"


SHARED_AT_IMPORT = '''\
import tempfile

# Made when a library is imported, so in a warm run by the fork server: one directory for all its children.
SHARED = tempfile.TemporaryDirectory(prefix="shared-at-import-")
'''
FINALIZERS = '''\
import os, pathlib, weakref

import shared_at_import


class Own:
    pass


def main():
    mine = Own()
    weakref.finalize(mine, pathlib.Path(os.environ["MARK"]).write_text, "child's own finalizer ran")
    pathlib.Path(os.environ["SHARED_NAME"]).write_text(shared_at_import.SHARED.name)
    globals()["KEEP"] = mine   # alive until exit: the finalizer runs then


if __name__ == "__main__":
    main()
'''


def test_a_child_runs_its_own_finalizers_at_exit_and_not_the_servers(tmp_path):
    """A temporary directory a library makes at import is the server's in a warm run: a child
    running the server's finalizers at exit would delete it under the server and its later
    children. The child's own finalizers run, as a fresh interpreter's do."""
    (tmp_path / "finalizers_trainer.py").write_text(FINALIZERS)
    (tmp_path / "shared_at_import.py").write_text(SHARED_AT_IMPORT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    srv = ForkServer(["finalizers_trainer"], env=env)
    try:
        for k in range(2):
            mark, name = tmp_path / f"mark{k}", tmp_path / f"shared{k}"
            rc, _ = srv.run("finalizers_trainer", [], dict(env, MARK=str(mark), SHARED_NAME=str(name)),
                            tmp_path / "stderr")
            assert rc == 0, (tmp_path / "stderr").read_text()
            assert mark.read_text() == "child's own finalizer ran"
            assert os.path.isdir(name.read_text()), f"child {k} found the server's directory deleted"
    finally:
        srv.close()


# -- the channel is the suite's own: what a trainer's import does to stdio, exits, junk, deadlines --
def _env(tmp_path: Path) -> dict[str, str]:
    """The environment of a server of tmp_path's modules: forked by a root of this test process,
    which has torch imported, where one runs (a root forks only servers with its hash secret)."""
    from conformance.run.forkclient import roots
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    seeds = [seed for _, seed in roots() if seed]
    if seeds:
        env["PYTHONHASHSEED"] = seeds[0]
    return env


STDIO_PROBE = '''\
import os, sys
STDIO = [os.readlink(f"/proc/self/fd/{{fd}}") for fd in (0, 1)]   # as the process started, before the import's doing
{at_import}


def main():
    pipes = sorted(link for fd in os.listdir("/proc/self/fd")
                   if (link := os.readlink(f"/proc/self/fd/{{fd}}") if os.path.exists(f"/proc/self/fd/{{fd}}") else "")
                   .startswith("pipe:"))
    with open(os.environ["PROBE_OUT"], "w") as f:
        f.write(" ".join([*STDIO, *pipes]))


if __name__ == "__main__":
    main()
'''
JUNK = bytes(range(256)) * 3
AT_IMPORT = {
    "banner": 'print("banner printed at import", flush=True)',
    "binary": f"os.write(1, {JUNK!r})",
    "closed": "os.close(1)",
    # Where the server imports it (pytest is not imported there): what the read returned, and when.
    "stdin": 'if "pytest" not in sys.modules:\n'
             '    import time; start = time.monotonic(); data = sys.stdin.read()\n'
             '    seen = os.path.join(os.path.dirname(__file__), "stdin_seen")\n'
             '    open(seen, "w").write(repr((data, time.monotonic() - start < 5)))',
}


def _within(seconds: float, fn):
    """fn()'s result, or a failure if it has not returned within `seconds` (on a thread of its own,
    so that a wait without a deadline fails the test instead of hanging it)."""
    import threading
    box: dict = {}

    def call():
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["result"]


def _own_pipes() -> set[str]:
    return {link for fd in os.listdir("/proc/self/fd")
            if (link := os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else "")
            .startswith("pipe:")}


@pytest.mark.parametrize("what", sorted(AT_IMPORT))
def test_what_a_trainers_import_does_to_stdout_or_stdin_never_reaches_the_channel(tmp_path, capfdbinary, what):
    """A banner printed (flushed) at import, binary junk on fd 1, fd 1 closed, a read of stdin: the
    server imports the trainer's module with stdin on /dev/null and stdout on its log (stderr), so
    it still answers, the read ends at once with nothing, and its children run with stdin and
    stdout on /dev/null, as the fresh runner starts a trainer, holding none of the channel."""
    module = f"stdio_{what}"
    (tmp_path / f"{module}.py").write_text(STDIO_PROBE.format(at_import=AT_IMPORT[what]))
    env = _env(tmp_path)
    srv = ForkServer([module], env=env)
    try:
        for k in range(2):
            out = tmp_path / f"out{k}"
            rc = _within(120, lambda out=out: srv.run(module, [], dict(env, PROBE_OUT=str(out)), tmp_path / "stderr"))
            assert rc == (0, None), (tmp_path / "stderr").read_text()
            stdin, stdout, *pipes = out.read_text().split()
            assert (stdin, stdout) == (os.devnull, os.devnull)
            assert not set(pipes) & _own_pipes(), "the child holds the server's channel"
        assert srv.restarts == 0
    finally:
        srv.close()
    logged = capfdbinary.readouterr().err
    if what == "banner":
        assert b"banner printed at import" in logged
    elif what == "binary":
        assert JUNK in logged
    elif what == "stdin":
        assert (tmp_path / "stdin_seen").read_text() == repr(("", True))


EXITS_AT_IMPORT = '''\
import sys
if "pytest" not in sys.modules:
    {how}


def main():
    pass


if __name__ == "__main__":
    main()
'''


@pytest.mark.parametrize("how, status", [("sys.exit(3)", 3), ('raise RuntimeError("no config file")', 1)])
def test_a_module_that_exits_or_raises_as_the_server_imports_it_ends_each_child_as_a_fresh_interpreter(
        tmp_path, capfd, how, status):
    """The server lives on (no ServerDied): each child imports the module again and ends as a fresh
    interpreter of it does, with the same status and stderr, so both runners give one verdict."""
    (tmp_path / "gives_up.py").write_text(EXITS_AT_IMPORT.format(how=how))
    env = _env(tmp_path)
    fresh = subprocess.run([sys.executable, "-m", "gives_up"], env=env, capture_output=True, text=True, timeout=120)
    assert fresh.returncode == status
    srv = ForkServer(["gives_up"], env=env)
    try:
        first = srv.proc.pid
        for _ in range(2):
            assert _within(120, lambda: srv.run("gives_up", [], env, tmp_path / "stderr")) == (status, None)
            assert (tmp_path / "stderr").read_text().splitlines()[-1:] == fresh.stderr.splitlines()[-1:]
        assert srv.proc.pid == first and srv.restarts == 0
    finally:
        srv.close()
    if status == 3:
        assert capfd.readouterr().err.count("forkserver: importing gives_up exited with status 3") == 1


def test_a_server_that_dies_while_it_imports_is_refused_naming_the_module_and_status(tmp_path, monkeypatch):
    """os._exit at import ends the server itself: the request fails at once with one message, a
    refusal, and the server is not started again; the warm runner then runs the trainer fresh, and
    its verdict is the fresh runner's."""
    from conformance.run.forkclient import WarmUpFailed
    monkeypatch.delenv(ROOT_ENV, raising=False)   # a server of its own: a root's child's status is the root's
    (tmp_path / "dies_at_import.py").write_text('import os\nif "pytest" not in __import__("sys").modules:\n'
                                                '    os._exit(3)\n')
    env = _env(tmp_path)
    srv = ForkServer(["dies_at_import"], env=env)
    try:
        for _ in range(2):
            with pytest.raises(WarmUpFailed, match=r"^the fork server exited with status 3, while importing "
                                                   r"dies_at_import, before it forked any trainer process$"):
                _within(300, lambda: srv.run("dies_at_import", [], env, tmp_path / "stderr"))
        assert srv.restarts == 0
    finally:
        srv.close()
    runner, result = _run_warm(tmp_path, "dies_at_import")
    assert result.returncode == 3
    assert runner.refused["dies_at_import"] == ("the fork server exited with status 3, while importing dies_at_import, "
                                                "before it forked any trainer process")


WAITS = '''\
import os, time


def main():
    open(os.environ["STARTED"], "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["GO_ON"]) and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
'''


def _reply_pipe(srv: ForkServer) -> str:
    """/proc path of the server's end of the pipe it writes and this process reads: its reply channel."""
    def ends(pid: int, access: int) -> dict[str, str]:
        found = {}
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                flags = next(line for line in open(f"/proc/{pid}/fdinfo/{fd}") if line.startswith("flags:"))
            except OSError:
                continue
            if link.startswith("pipe:") and int(flags.split()[1], 8) & 3 == access:
                found[link] = f"/proc/{pid}/fd/{fd}"
        return found
    theirs, mine = ends(srv.proc.pid, os.O_WRONLY), ends(os.getpid(), os.O_RDONLY)
    (shared,) = set(theirs) & set(mine)
    return theirs[shared]


def _start_waiting_child(srv: ForkServer, tmp_path: Path, env: dict, **kw):
    """Run the WAITS module on a thread; returns (thread's result box, thread) once the child runs."""
    import threading
    box: dict = {}
    child_env = dict(env, STARTED=str(tmp_path / "started"), GO_ON=str(tmp_path / "go_on"))

    def call():
        try:
            box["result"] = srv.run("waits", [], child_env, tmp_path / "stderr", **kw)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (tmp_path / "started").exists(), box
    return box, thread


def test_the_reader_survives_a_line_that_is_no_reply_and_ends_every_waiting_request_quoting_it(tmp_path):
    (tmp_path / "waits.py").write_text(WAITS)
    env = _env(tmp_path)
    srv = ForkServer(["waits"], env=env)
    try:
        box, thread = _start_waiting_child(srv, tmp_path, env)
        with open(_reply_pipe(srv), "wb") as channel:
            channel.write(b"\xffnot a reply at all\n")
        thread.join(30)
        assert not thread.is_alive(), "the request still waits"
        assert isinstance(box.get("error"), ServerDied), box
        assert "carried a line that is no reply, '\ufffdnot a reply at all'" in str(box["error"])
        assert "the suite was waiting for the exit status of waits process" in str(box["error"])
        (tmp_path / "started").unlink()
        (tmp_path / "go_on").touch()
        box, thread = _start_waiting_child(srv, tmp_path, env)   # a new server answers the next request
        thread.join(60)
        assert box.get("result") == (0, None) and srv.restarts == 1, box
    finally:
        srv.close()


def test_a_server_that_stops_answering_ends_the_request_saying_what_it_waited_for(tmp_path, monkeypatch):
    from conformance.run import forkclient
    monkeypatch.setattr(forkclient, "REPLY_S", 3.0, raising=False)
    (tmp_path / "waits.py").write_text(WAITS)
    env = _env(tmp_path)
    srv = ForkServer(["waits"], env=env)
    try:
        def watch():   # once the child runs, the suite stops it, and its server is frozen meanwhile: no status comes
            if not (tmp_path / "started").exists():   # a loaded machine may not have run it yet
                return None
            os.kill(srv.proc.pid, signal.SIGSTOP)
            return "stopped by the test"
        box, thread = _start_waiting_child(srv, tmp_path, env, watch=watch)
        thread.join(60)
        assert not thread.is_alive(), "the request still waits"
        assert isinstance(box.get("error"), ServerDied), box
        assert re.search(r"^the fork server was ended: it reported no exit 3 s after the suite stopped waits process "
                         r"\d+; the suite was waiting for the exit status of waits process \d+$", str(box["error"]))
    finally:
        srv.close()


# Slow where the server imports it (not in pytest, nor as a child's __main__).
SLOW_IMPORT = 'import time\nif __name__ != "__main__" and "pytest" not in __import__("sys").modules:\n    time.sleep({seconds})\n'


@pytest.mark.parametrize("ok", [True, False])
def test_a_slow_import_is_waited_for_until_the_warm_up_deadline(tmp_path, monkeypatch, ok):
    """The reply to a request sent while the server still imports is due REPLY_S after its warm-up,
    not after the request; a warm-up past WARM_UP_S is refused, naming what it imported."""
    from conformance.run import forkclient
    monkeypatch.setattr(forkclient, "REPLY_S", 2.0, raising=False)
    (tmp_path / "slow_import.py").write_text(SLOW_IMPORT.format(seconds=4 if ok else 120))
    env = _env(tmp_path)
    srv = ForkServer(["slow_import"], env=env)
    try:
        if ok:
            assert _within(120, lambda: srv.run("slow_import", [], env, tmp_path / "stderr")) == (0, None)
        else:
            deadline = time.monotonic() + 120   # torch first (a loaded machine's seconds), then the module
            while srv._link.warming != "importing slow_import" and time.monotonic() < deadline:
                time.sleep(0.05)
            monkeypatch.setattr(forkclient, "WARM_UP_S", round(time.monotonic() - srv._link.started) + 3, raising=False)
            with pytest.raises(forkclient.WarmUpFailed, match=r"^the fork server was ended: it had not finished its "
                               r"warm-up \d+ s after it started, while importing slow_import, before it forked any "
                               r"trainer process$"):
                _within(60, lambda: srv.run("slow_import", [], env, tmp_path / "stderr"))
    finally:
        srv.close()


# FileBaton's wait (torch/utils/file_baton.py), where the server imports it: poll until the lock is gone.
STALE_LOCK_IMPORT = '''import os, time
if __name__ != "__main__" and "pytest" not in __import__("sys").modules:
    while os.path.exists({lock!r}):
        time.sleep(0.1)
'''


def test_a_warm_up_that_waits_on_a_stale_lock_file_is_ended_naming_it_long_before_the_warm_up_deadline(
        tmp_path, monkeypatch):
    """A process killed while it held a lock file taken at import leaves it, and every later import
    waits on it for ever: the server is asked what it waits on while it warms up, and ended naming
    the file (the warm runner then runs the trainer fresh, whose watchdog names it too), instead of
    being waited for until WARM_UP_S."""
    from conformance.run import forkclient
    monkeypatch.setattr(forkclient, "WARM_UP_PROBE_S", 1.0, raising=False)
    lock = tmp_path / "torch_extensions" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    (tmp_path / "stale_lock_import.py").write_text(STALE_LOCK_IMPORT.format(lock=str(lock)))
    env = _env(tmp_path)
    srv = ForkServer(["stale_lock_import"], env=env)
    try:
        with pytest.raises(forkclient.WarmUpFailed, match=r"^the fork server was ended during its warm-up \(importing "
                           r"stale_lock_import, \d+ s after it started\): it waits on " + re.escape(str(lock))
                           + r" \(in 1 s it checked \d+ times whether that file exists"):
            _within(forkclient.WARM_UP_S / 2, lambda: srv.run("stale_lock_import", [], env, tmp_path / "stderr"))
    finally:
        srv.close()


def test_a_warm_up_that_is_only_slow_is_asked_what_it_waits_on_and_goes_on(tmp_path, monkeypatch):
    """The probe claims a lock only where the calls show one: a sleeping import (a download, a
    build) goes on to serve requests."""
    from conformance.run import forkclient
    monkeypatch.setattr(forkclient, "WARM_UP_PROBE_S", 1.0, raising=False)
    (tmp_path / "slow_import.py").write_text(SLOW_IMPORT.format(seconds=5))
    env = _env(tmp_path)
    srv = ForkServer(["slow_import"], env=env)
    try:
        assert _within(120, lambda: srv.run("slow_import", [], env, tmp_path / "stderr")) == (0, None)
        assert srv._link.probed_at > srv._link.started   # it was asked, and went on
    finally:
        srv.close()
