"""A warm run is a real restart: the fork server's preloads do not change what a trainer does
(run/deferred.py), a resumed process has another process identity than the one that saved
(run/identity.py), a 2-rank DDP trainer that ends with destroy_process_group exits as under
torchrun, a failure the warm runner finds is confirmed in a fresh interpreter before it is
reported, and nothing the suite starts outlives it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conformance.model.adapters import TrainerAdapter, load_object
from conformance.model.process import RunSpec
from conformance.run.identity import Identities, hash_seeds
from conformance.run.runners import Limits, ProcessOverran
from conformance.run.warm import WarmRunner

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")


def _python(code: str, timeout: float = 300, env: dict | None = None) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


# -- deferred imports: loaded in the server, out of sight until the trainer imports them -------------
def test_a_deferred_module_is_out_of_sight_until_imported_then_back_with_what_it_loaded():
    out = _python("""
        import importlib.util, json, sys
        import torch
        from conformance.run.deferred import Deferred
        deferred = Deferred()
        deferred.load(["torch._dynamo"], print)
        seen = {"hidden": "torch._dynamo" in sys.modules or "_dynamo" in vars(torch),
                "functional hidden": "torch.distributed.nn.functional" in sys.modules,
                "found": importlib.util.find_spec("torch._dynamo") is not None}
        seen["still hidden after find_spec"] = "torch._dynamo" not in sys.modules
        import torch._dynamo.utils
        seen["back"] = "torch._dynamo" in sys.modules and torch._dynamo.utils is sys.modules["torch._dynamo.utils"]
        seen["what it loaded"] = "torch.distributed.nn.functional" in sys.modules
        seen["own spec"] = sys.modules["torch._dynamo"].__spec__.loader is not deferred
        print(json.dumps(seen))
    """)
    assert json.loads(out.splitlines()[-1]) == {"hidden": False, "functional hidden": False, "found": True,
                                                "still hidden after find_spec": True, "back": True,
                                                "what it loaded": True, "own spec": True}


def test_a_module_that_reads_the_process_state_reads_it_when_it_comes_back():
    """torch.distributed.nn.functional binds `group=group.WORLD` when it runs: back after the
    trainer's init_process_group, it holds the trainer's group, as a fresh import then would."""
    out = _python("""
        import torch, torch.distributed as dist
        from conformance.run.deferred import Deferred
        Deferred().load(["torch._dynamo"], print)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        import torch._dynamo
        import torch.distributed.nn.functional as fn
        print(fn.all_reduce.__defaults__[-1] is dist.group.WORLD, dist.group.WORLD is not None)
        dist.destroy_process_group()
    """)
    assert out.split()[-2:] == ["True", "True"], out


FORKED_DDP = """
    import os, sys, torch, torch.distributed as dist
    from conformance.run.deferred import Deferred
    from conformance.run.warmup import LAZY_IMPORTS
    if sys.argv[1] == "fork":
        Deferred().load([*LAZY_IMPORTS, "torch.distributed.checkpoint"], print)

    def train():   # as a DDP trainer: the group first, then DDP (which imports dynamo), then return
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        ddp(torch.randn(3, 4)).sum().backward()
        dist.barrier()
        dist.destroy_process_group()

    def gloo_threads():
        return sum("gloo" in open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task"))

    if sys.argv[1] == "fork":
        pid = os.fork()
        if pid == 0:
            train()
            print("threads", gloo_threads(), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
    else:
        train()
        print("threads", gloo_threads(), flush=True)
"""


def test_a_forked_ddp_trainer_keeps_its_process_group_as_long_as_a_fresh_one_does():
    """The exit deadlock's cause: a fresh DDP process imports dynamo after init_process_group, so
    torch.distributed.nn.functional's defaults keep its group alive until the interpreter exits;
    with dynamo visible in the server, a forked rank's group died with the DDP reducer, under the
    GIL, where gloo's worker can deadlock (docs/running.md, "How the warm runner stays a real
    restart"). A fork of a deferring server keeps the group as long as a fresh interpreter."""
    script = textwrap.dedent(FORKED_DDP)
    counts = {mode: _python(script.replace("sys.argv[1]", repr(mode))).split()[-1] for mode in ("fresh", "fork")}
    assert counts["fork"] == counts["fresh"] != "0", counts


# -- the exit deadlock, end to end -------------------------------------------------------------------
@pytest.mark.slow
def test_fifty_warm_ddp_jobs_that_destroy_their_group_all_exit(tmp_path):
    """A correct 2-rank DDP trainer whose main() ends with barrier and destroy_process_group and
    returns with its model a local: under the warm runner before the fix, about one job in ten hung
    at exit (3 of 30 measured); under torchrun none."""
    adapter = load_object("resume_conformance.fixtures.plain_ddp_trainer:ADAPTER")
    runner = WarmRunner(limits=Limits(total_s=60, stall_s=30, job_stall_s=30))
    spec = RunSpec(total_steps=4, save_every=3, seed=0, world_size=2)
    outcomes = []
    try:
        for i in range(50):
            (tmp_path / f"c{i}").mkdir()
            try:
                result = runner.run_process(adapter, spec, (tmp_path / f"c{i}").resolve(),
                                            (tmp_path / f"l{i}.jsonl").resolve())
                outcomes.append(result.returncode if result.returncode else 0)
            except ProcessOverran as exc:
                outcomes.append(exc.problem)
    finally:
        runner.close()
    assert outcomes == [0] * 50, [o for o in outcomes if o != 0]


def test_a_crash_after_the_last_step_counts_as_a_finished_run_and_is_noted(tmp_path):
    """torch's gloo teardown can abort a correct DDP rank at interpreter exit (1 of 40 bare torchrun
    runs of resume_conformance.fixtures.plain_ddp_trainer): the run finished; its exit is a note, not a verdict."""
    from conformance.model import evidence
    from conformance.model.process import ProcessResult
    from conformance.run.runners import crash_at_exit
    single = RunSpec(3, 1, 0)
    assert crash_at_exit(ProcessResult(-6, {1: 1.0, 2: 1.0, 3: 1.0}, ""), single) == "SIGABRT"
    assert crash_at_exit(ProcessResult(-6, {1: 1.0, 2: 1.0}, ""), single) is None          # before its last step
    assert crash_at_exit(ProcessResult(1, {1: 1.0, 2: 1.0, 3: 1.0}, ""), single) is None   # an exit code, not a crash
    assert crash_at_exit(ProcessResult(-9, {1: 1.0, 2: 1.0, 3: 1.0}, ""), single) is None  # killed
    job, done = RunSpec(3, 1, 0, world_size=2), {1: 1.0, 2: 1.0, 3: 1.0}
    report = "[torchrun]   rank      : 1 (local_rank: 1)\n[torchrun]   exitcode  : -6 (pid: 27030)\n"
    assert crash_at_exit(ProcessResult(1, done, report, rank_losses=(done, done)), job) == "SIGABRT"
    assert crash_at_exit(ProcessResult(1, done, report, rank_losses=(done, {1: 1.0})), job) is None
    assert crash_at_exit(ProcessResult(1, done, report.replace("-6", "1"), rank_losses=(done, done)), job) is None
    # torchrun ends the ranks still exiting when one crashed (SIGTERM): measured in a soak, the fresh
    # second run of resume_conformance.fixtures.plain_ddp_trainer, rank 0 SIGABRT at exit, rank 1 -15.
    terminated = "[torchrun]   exitcode  : -15 (pid: 27621)\n" + report
    assert crash_at_exit(ProcessResult(1, done, terminated, rank_losses=(done, done)), job) == "SIGABRT"
    assert crash_at_exit(ProcessResult(1, done, terminated.replace("-6", "-15"), rank_losses=(done, done)), job) is None
    (tmp_path / "aborts_at_exit.py").write_text(
        "import json, os\nif __name__ == '__main__':\n"
        "    with open(os.environ['CONFORMANCE_LOSS_LOG'], 'a') as f:\n"
        "        f.write(json.dumps({'step': 1, 'loss': 1.0}) + '\\n')\n"
        "    os.abort()\n")
    adapter = TrainerAdapter(name="aborts", argv=(sys.executable, "-m", "aborts_at_exit"), pythonpath=(str(tmp_path),))
    runner = WarmRunner()
    (tmp_path / "ckpt").mkdir()
    evidence.take()
    try:
        result = runner.run_process(adapter, RunSpec(1, 1, 0), (tmp_path / "ckpt").resolve(),
                                    (tmp_path / "loss.jsonl").resolve())
    finally:
        runner.close()
    assert (result.returncode, result.exit_crash) == (0, "SIGABRT")
    assert any("died by SIGABRT as it exited" in e.summary() for e in evidence.take())


# -- process identity ----------------------------------------------------------------------------------
IDENTITY_PROBE = """
    import json, os
    from identity_state import STARTUP

    if __name__ == "__main__":
        log = os.environ["CONFORMANCE_LOSS_LOG"]
        with open(log, "a") as f:
            f.write(json.dumps({"step": 1, "loss": float(hash("conformance") % 1000)}) + "\\n")
            f.write(json.dumps({"step": 2, "loss": STARTUP.random()}) + "\\n")
        open(os.path.join(os.environ["CONFORMANCE_CKPT_DIR"], "saved"), "w").close()
"""
# A module the trainer imports (the server imports it once; `python -m` runs the trainer's own
# module again in each child): a generator seeded from the OS as it is imported.
IDENTITY_STATE = "import random\nSTARTUP = random.Random()\n"


def _identity_runs(tmp_path: Path, env_seed: str | None) -> list[dict]:
    (tmp_path / "identity_probe.py").write_text(textwrap.dedent(IDENTITY_PROBE))
    (tmp_path / "identity_state.py").write_text(IDENTITY_STATE)
    adapter = TrainerAdapter(name="identity_probe", argv=(sys.executable, "-m", "identity_probe"),
                             pythonpath=(str(tmp_path),))
    old = os.environ.pop("PYTHONHASHSEED", None)
    if env_seed is not None:
        os.environ["PYTHONHASHSEED"] = env_seed
    try:
        runner = WarmRunner()
    finally:
        os.environ.pop("PYTHONHASHSEED", None)
        if old is not None:
            os.environ["PYTHONHASHSEED"] = old
    ckpt = (tmp_path / "ckpt").resolve()
    ckpt.mkdir()
    try:
        runs = []
        for i in range(3):   # a start on an empty directory, a resume of it, a resume of that
            runs.append(runner.run_process(adapter, RunSpec(2, 1, 0), ckpt, (tmp_path / f"l{i}.jsonl").resolve()).losses)
        return runs
    finally:
        runner.close()


def test_a_resume_runs_with_another_hash_secret_and_other_entropy_than_the_save(tmp_path):
    first, second, third = _identity_runs(tmp_path, None)
    assert first[1] != second[1] and first[2] != second[2], (first, second)   # hash("...") and the generator
    assert third == first   # the one after comes from the first server again: forks of one process agree


def test_a_hash_seed_the_user_fixes_is_kept_for_both_identities(tmp_path):
    first, second, _ = _identity_runs(tmp_path, "123")
    assert first[1] == second[1], (first, second)   # their real restarts share it too
    assert first[2] != second[2]   # each server still draws its own entropy


def test_identities_alternate_on_one_directory_and_a_copy_resumes_on_the_second(tmp_path):
    ids = Identities(("1", "2"))
    empty, copied = tmp_path / "empty", tmp_path / "copied"
    empty.mkdir()
    copied.mkdir()
    (copied / "ckpt-3.pt").write_bytes(b"x")
    assert [ids.choose(empty) for _ in range(3)] == [0, 1, 0]
    assert ids.choose(copied) == 1
    assert hash_seeds({"PYTHONHASHSEED": "7"}, []) == ("7", "7")
    assert hash_seeds({}, ["5", "5", "9"]) == ("5", "9")
    assert len(set(hash_seeds({}, []))) == 2


# -- confirm before blaming ------------------------------------------------------------------------
WARM_ONLY_BUG = '''
"""The reference trainer, wrong only in a process the suite's fork server forked: resumed there,
it logs every loss 1e-3 off. Every real restart of it is correct."""
import sys

from resume_conformance.fixtures.broken._base import adapter_for
from resume_conformance.fixtures.reference_trainer import ReferenceTrainer, main


class WarmOnlyBug(ReferenceTrainer):
    resumed = False

    def restore(self, payload):
        super().restore(payload)
        self.resumed = True

    def train_step(self, batch):
        loss = super().train_step(batch)
        return loss + 1e-3 if self.resumed and "conformance.run.forked" in sys.modules else loss


ADAPTER = adapter_for("warm_only_bug")

if __name__ == "__main__":
    sys.exit(main(WarmOnlyBug))
'''


@pytest.mark.slow
@pytest.mark.needs_strace
def test_a_warm_failure_that_a_fresh_interpreter_does_not_repeat_is_the_suites_problem(run_suite, tmp_path):
    (tmp_path / "warm_only_bug.py").write_text(WARM_ONLY_BUG)
    verdicts, out = run_suite("--adapter=warm_only_bug:ADAPTER", "--hypothesis-profile=conformance-quick", "--confirm=fresh",
                              "-k", "resume_matches_baseline")
    assert verdicts["test_resume_matches_baseline"][0] == "passed", out[-3000:]   # never the trainer's failure
    assert "conformance: RUNNER DISAGREEMENT: the warm runner failed resume_matches_baseline" in out, out[-3000:]
    report = json.loads(Path(tmp_path, "conformance-report", "report.json").read_text())
    assert report["runner_disagreements"] == 1, report
    summary = Path(tmp_path, "conformance-report", "summary.md").read_text()
    assert "**1 runner disagreement(s)**" in summary and "[resume_matches_baseline]" in summary, summary


@pytest.mark.slow
@pytest.mark.needs_strace
def test_a_failure_a_fresh_interpreter_repeats_is_reported_as_confirmed(run_suite):
    verdicts, out = run_suite("--adapter=resume_conformance.fixtures.broken.numpy_rng_not_saved:ADAPTER",
                              "--hypothesis-profile=conformance-quick",
                              "--confirm=fresh", "-k", "resume_matches_baseline")
    outcome, message = verdicts["test_resume_matches_baseline"]
    assert outcome == "failed", out[-3000:]
    assert "\n  confirmed: a fresh interpreter per process fails this case too" in message, message[-3000:]
    assert "RUNNER DISAGREEMENT" not in out


def test_a_failure_hypothesis_cannot_repeat_goes_to_the_fresh_confirmation_with_its_own_message(monkeypatch):
    """Hypothesis replays a failing case before it reports it; when the replay passes it raises
    FlakyFailure around the check's failure (a pytest outcome, so wrapped). The check's message
    must still reach the report, and the fresh-interpreter confirmation decide it."""
    from types import SimpleNamespace

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from conformance import suite

    calls, confirmed = [], []

    @settings(database=None, max_examples=1, deadline=None)
    @given(st.integers(0, 3))
    def drawn(self, request, session, n):
        calls.append(n)
        if len(calls) == 1:
            raise suite.CheckFailed("interrupt: the trainer was still running 5 s after SIGINT", None, None, None)

    monkeypatch.setattr(suite, "_confirmed", lambda request, session, check, param, failed: confirmed.append(failed))
    suite._run_confirmed(drawn, SimpleNamespace(params=()), None, None, None, None)
    assert len(calls) >= 2 and len(confirmed) == 1, (calls, confirmed)
    message = confirmed[0].msg
    assert message.startswith("interrupt: the trainer was still running 5 s after SIGINT"), message
    assert "not repeated: Hypothesis ran this case again in the same runner and it passed" in message, message


# -- where ptrace is restricted ----------------------------------------------------------------------
REFUSING_STRACE = """#!/bin/sh
# strace that refuses to attach to a running process, as under Yama's ptrace_scope=2 or without
# CAP_SYS_PTRACE; it traces what it starts as usual.
for arg in "$@"; do
    if [ "$arg" = "-p" ]; then
        echo "strace: attach: ptrace(PTRACE_SEIZE, 1): Operation not permitted" >&2
        exit 1
    fi
done
exec REAL "$@"
"""


@pytest.mark.slow
@pytest.mark.needs_strace
def test_where_strace_cannot_attach_the_suite_runs_fresh_and_says_why(run_pytest, tmp_path):
    import shutil
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "strace"
    wrapper.write_text(REFUSING_STRACE.replace("REAL", shutil.which("strace")))
    wrapper.chmod(0o755)
    proc = run_pytest("--pyargs", "conformance", "--hypothesis-profile=conformance-quick", "-k",
                      "determinism or resume_matches_baseline", env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "2 passed" in out, out[-3000:]
    header = json.loads((tmp_path / "conformance-report" / "report.json").read_text())["header"]
    assert "runner fresh (strace cannot attach to a running process here (strace could not attach" in header, header
    assert "Operation not permitted" in header, header


# -- nothing left behind -------------------------------------------------------------------------------
def _left(token: str) -> list[str]:
    """The processes whose environment holds `token`, with their command lines."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if token.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid}: {command[:200]}")
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.needs_strace
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_nothing_the_suite_started_outlives_it(tmp_path, signum):
    """pytest ended mid-run, as a CI system ends it on cancel or timeout, while warm jobs and a fresh
    torchrun job of a 2-rank trainer run: 5 s later no process it started is left."""
    from conformance.run.forkclient import ROOT_ENV
    token = f"CONFORMANCE_LEAK_PROBE={os.getpid()}-{signum}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if k not in (ROOT_ENV, "PYTEST_XDIST_WORKER")}
    env[token.split("=")[0]] = token.split("=")[1]
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "--pyargs", "conformance", "-p", "no:cacheprovider", "-q",
                             "-n", "2", "--adapter=resume_conformance.fixtures.plain_ddp_trainer:ADAPTER",
                                 "--hypothesis-profile=conformance-quick",
                             f"--basetemp={tmp_path / 'bt'}"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        # Until a fresh torchrun job runs beside warm ones (the determinism check's fresh run).
        while not any("-m torch.distributed.run" in line for line in _left(token)) and time.monotonic() < deadline:
            assert proc.poll() is None, "the suite ended before the point this test stops it at"
            time.sleep(0.2)
        assert len(_left(token)) > 5, _left(token)
        proc.send_signal(signum)
        proc.wait(timeout=60)
        time.sleep(5)
        assert _left(token) == []
    finally:
        for line in _left(token):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
