"""Warm ranks are forked by a zygote with one thread, never by torchrun's agent (zygote.py): a
fork copies the locks other threads hold, and the agent's TCPStore thread holds glibc's resolver
lock while it accepts a rank's connection. The proxy the agent manages must end as its rank
ended, pass the agent's signals on, and take its rank with it when it dies."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import time

from conformance.model.adapters import TrainerAdapter
from conformance.model.process import RunSpec
from conformance.run.attach import RankAttacher, announce_pid, attach_strace
from conformance.run.runners import Limits
from conformance.run.warm import WarmRunner

# Each rank records the thread count and name of the process that forked it.
RECORDS_ITS_PARENT = textwrap.dedent("""\
    import json, os
    import torch.distributed as dist
    ppid = os.getppid()
    status = dict(line.split(":", 1) for line in open(f"/proc/{ppid}/status").read().splitlines() if ":" in line)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.environ["CONFORMANCE_LOSS_LOG"] + f".parent{rank}", "w") as out:
        json.dump({"threads": int(status["Threads"]), "name": status["Name"].strip()}, out)
    with open(os.environ["CONFORMANCE_LOSS_LOG"] + f".rank{rank}", "a") as log:
        log.write(json.dumps({"step": 1, "loss": 1.0}) + "\\n")
    dist.barrier()
    dist.destroy_process_group()
""")


def test_a_warm_rank_is_forked_by_a_process_with_one_thread(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(RECORDS_ITS_PARENT)
    adapter = TrainerAdapter(name="parent", argv=(sys.executable, str(script)), world_size=2)
    runner = WarmRunner(limits=dataclasses.replace(Limits(), total_s=120))
    (tmp_path / "ckpt").mkdir()
    log = tmp_path / "loss.jsonl"
    try:
        result = runner.run_process(adapter, RunSpec(total_steps=1, save_every=0, seed=0, world_size=2),
                                    tmp_path / "ckpt", log)
    finally:
        runner.close()
    assert result.returncode == 0, result
    for rank in (0, 1):
        parent = json.loads((tmp_path / f"loss.jsonl.parent{rank}").read_text())
        assert parent == {"threads": 1, "name": "rank-zygote"}, (rank, parent)


# A zygote and proxies without torchrun: each case forks a proxy (as the agent does), reads how it
# ended, and prints one JSON line per case.
PROXY_CASES = textwrap.dedent("""\
    import json, os, signal, sys, time
    from conformance.run.zygote import RankZygote, proxy_rank

    def run_rank(env):
        mode = env["MODE"]
        with open(env["PIDFILE"], "w") as f:
            f.write(str(os.getpid()))
        if mode == "exit3":
            return 3
        if mode == "done_then_term":
            return 0
        if mode == "env":
            return 0 if env.get("FROM_PROXY") == "yes" else 9
        if mode == "self_kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "count_term":   # ends 1 s after the last SIGTERM: 10 + how many arrived
            got = []
            signal.signal(signal.SIGTERM, lambda *_: got.append(time.monotonic()))
            while not got or time.monotonic() - got[-1] < 1:
                time.sleep(0.02)
            return 10 + len(got)
        time.sleep(60)        # "sleep": waits for a signal
        return 0

    zygote = RankZygote.start(run_rank)
    out = {}
    for mode in ("exit3", "env", "self_kill", "term", "count_term", "done_then_term", "proxy_killed"):
        pidfile = f"{sys.argv[1]}/{mode}.pid"
        pid = os.fork()
        if pid == 0:
            os.environ.update(MODE=mode, PIDFILE=pidfile, FROM_PROXY="yes")
            proxy_rank(zygote.address)
            if mode == "done_then_term":   # as torch's _wrap keeps a finished worker waiting
                time.sleep(30)
            os._exit(0)
        if mode in ("term", "count_term", "proxy_killed"):
            while not os.path.exists(pidfile) or not open(pidfile).read():
                time.sleep(0.01)
            time.sleep(0.2)
        if mode == "count_term":       # a stranger's SIGTERM is not passed on; the agent's is
            stranger = os.fork()
            if stranger == 0:
                os.kill(pid, signal.SIGTERM)
                os._exit(0)
            os.waitpid(stranger, 0)
            time.sleep(0.2)
            os.kill(pid, signal.SIGTERM)
        elif mode == "done_then_term":     # the agent ends a finished worker when another failed
            while not os.path.exists(pidfile) or not open(pidfile).read():
                time.sleep(0.01)
            time.sleep(0.5)
            os.kill(pid, signal.SIGTERM)
        elif mode in ("term", "proxy_killed"):
            os.kill(pid, signal.SIGTERM if mode == "term" else signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        out[mode] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if mode == "proxy_killed":
            rank = int(open(pidfile).read())
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and os.path.exists(f"/proc/{rank}"):
                time.sleep(0.01)
            out["rank_outlived_proxy"] = os.path.exists(f"/proc/{rank}")
    zygote.close()
    print(json.dumps(out))
""")


def test_a_proxy_ends_as_its_rank_ended_and_takes_it_along(tmp_path):
    done = subprocess.run([sys.executable, "-c", PROXY_CASES, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "exit3": 3,                  # the rank's exit status
        "env": 0,                    # the rank runs with the proxy's environment
        "self_kill": -9,             # a rank killed by a signal: its proxy dies by the same signal
        "term": -15,                 # the agent's SIGTERM reaches the rank
        "count_term": 11,            # once: a SIGTERM from another process is not passed on
        "done_then_term": -15,       # a proxy whose rank has finished still dies on SIGTERM
        "proxy_killed": -9,
        "rank_outlived_proxy": False,
    }, done.stderr


def _attached(attacher, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while attacher._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_rank_that_ended_before_its_strace_attached_is_the_runs_outcome_not_the_suites_failure(tmp_path):
    """Soak seed 39: rank 0 was killed early, the agent stopped rank 1 while it waited for its
    strace, and the suite reported "could not attach strace" as the trainer's failure."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    attacher = RankAttacher(tmp_path, {0: ["strace", "-qq", "-o", str(tmp_path / "t0"), "--"]}).start()
    announce_pid(tmp_path, 0, gone.pid)
    _attached(attacher)
    assert (attacher.problem(), attacher.gone) == (None, [0])
    attacher.close()


def test_a_live_rank_strace_cannot_attach_to_stops_the_job(tmp_path):
    """A rank that is still there but cannot be traced waits for ever: that must end the job."""
    rank = subprocess.Popen(["sleep", "60"])
    first = attach_strace(["strace", "-o", "/dev/null"], rank.pid)   # a second tracer is refused
    try:
        attacher = RankAttacher(tmp_path, {0: ["strace", "-qq", "-o", str(tmp_path / "t0"), "--"]}).start()
        announce_pid(tmp_path, 0, rank.pid)
        _attached(attacher)
        assert attacher.gone == []
        assert "could not attach strace to a rank" in (attacher.problem() or ""), attacher.problem()
        attacher.kill()
        attacher.close()
    finally:
        first.kill()
        rank.kill()
        rank.wait()


def test_a_seeding_call_in_a_child_reads_no_source_the_fork_server_has_read(monkeypatch):
    """torch.manual_seed formats the stack for each lazy device; the fork server reads those files
    once (warmup.read_seeding_sources), so its children do not read them again."""
    import linecache

    import torch

    from conformance.run.warmup import SEEDING_MODULES, read_seeding_sources
    linecache.clearcache()
    read_seeding_sources(["conformance.run.forkserver"])
    read = []
    real = linecache.updatecache
    monkeypatch.setattr(linecache, "updatecache", lambda filename, *a: read.append(filename) or real(filename, *a))
    with torch.random.fork_rng():
        torch.manual_seed(1234)
    ours = {path for m in SEEDING_MODULES if (path := getattr(sys.modules.get(m), "__file__", None))}
    assert torch.random.__file__ in ours and not ours & set(read), sorted(ours & set(read))
    linecache.clearcache()
    read.clear()
    with torch.random.fork_rng():
        torch.manual_seed(1234)
    assert torch.random.__file__ in read      # what the test would see without the fork server's reading
