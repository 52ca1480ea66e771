"""The warm runner's fork server: what it does once for its children (run/warmup.py), the child it
forks ahead of each request, the allocator setting it starts with, and the development harness's
root that forks fork servers (tests/forkroot.py)."""
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

from conformance.run.forkclient import ROOT_ENV, ForkServer
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
    while not server._dead and time.monotonic() < deadline:   # its reader sees the pipe close
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


def test_a_server_whose_trainer_starts_a_thread_at_import_refuses_to_fork(tmp_path):
    """Forking a process with another thread copies that thread's locks as they are: the server
    refuses, and the warm runner runs such a trainer fresh (saying why)."""
    from conformance.model.adapters import TrainerAdapter
    from conformance.model.process import RunSpec
    from conformance.run.forkclient import ServerRefused
    from conformance.run.warm import WarmRunner
    (tmp_path / "threaded_trainer.py").write_text(THREAD_AT_IMPORT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    srv = ForkServer(["threaded_trainer"], env=env)
    try:
        with pytest.raises(ServerRefused, match=r"\(Thread-1 \(sleep\) in Python\), 1 more than its fork-aware library pools"):
            srv.run("threaded_trainer", [], env, tmp_path / "stderr")
    finally:
        srv.close()
    runner = WarmRunner()
    adapter = TrainerAdapter(name="threaded", argv=(sys.executable, "-m", "threaded_trainer"),
                             pythonpath=(str(tmp_path),), spec="threaded_trainer")
    (tmp_path / "ckpt").mkdir()
    try:
        result = runner.run_process(adapter, RunSpec(1, 1, 0), (tmp_path / "ckpt").resolve(),
                                    (tmp_path / "loss.jsonl").resolve())
    finally:
        runner.close()
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
