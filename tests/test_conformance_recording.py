"""Meta-tests of the one strace parser and the model of a run built from it: operations,
per-thread counts, targetability, save windows, "committed before", and what varies between runs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conformance.model.process import ProcessResult, RunSpec
from conformance.trace import alignment, recording, saves, strace

TRACE = """\
100  write(1</dev/pts/0>, "hello\\n", 6) = 6
100  openat(AT_FDCWD</run>, "/ck/.a.tmp-1-00", O_WRONLY|O_CREAT|O_EXCL|O_CLOEXEC, 0644) = 3</ck/.a.tmp-1-00>
100  write(3</ck/.a.tmp-1-00>, "data"..., 1024) = 1024
101  write(4</ck/.b.tmp-1-11>, "data"..., 1024 <unfinished ...>
100  fsync(3</ck/.a.tmp-1-00>) = 0
101  <... write resumed>) = 1024
100  rename("/ck/.a.tmp-1-00", "/ck/a") = 0
100  unlinkat(5</ck/step-1>, "meta.pt", 0) = 0
100  openat(AT_FDCWD</run>, "/ck/a", O_RDONLY|O_CLOEXEC) = 3</ck/a>
100  mkdir("/ck/step-2", 0777) = 0
100  write(7</other/loss.jsonl>, "{\\"step\\": 1, \\"loss\\": 0.5}\\n", 27) = 27
100  mkdir("/ck/step-3", 0777) = -1 EEXIST (File exists)
"""
ROOT, LOG = Path("/ck"), Path("/other/loss.jsonl")


def _run(text: str, losses=None, preexisting=frozenset()) -> recording.RecordedRun:
    result = ProcessResult(0, losses if losses is not None else {1: 0.5}, "")
    return recording.build(strace.parse(text), RunSpec(3, 1, 0), result, ROOT, LOG, preexisting=preexisting)


def test_parse_joins_unfinished_calls_and_counts_per_thread():
    calls = strace.parse(TRACE)
    assert [(c.tid, c.name, c.nth) for c in calls[:4]] == [(100, "write", 1), (100, "openat", 1),
                                                           (100, "write", 2), (101, "write", 1)]
    assert calls[3].ret == "1024" and not calls[3].killed
    assert calls[-1].failed and calls[-1].value == -1


def test_mutations_under_root_with_kinds_and_counts():
    run = _run(TRACE)
    ops = [run.ops[i] for i in run.mutations]
    assert [(o.tid, o.syscall, o.nth, o.kind) for o in ops] == [
        (100, "openat", 1, "create"), (100, "write", 2, "write"), (101, "write", 1, "write"),
        (100, "fsync", 1, "fsync"), (100, "rename", 1, "rename"), (100, "unlinkat", 1, "unlink"),
        (100, "mkdir", 1, "mkdir")]
    assert (ops[4].path, ops[4].target) == (".a.tmp-1-00", "a")
    assert ops[5].path == "step-1/meta.pt"
    assert ops[1].data is None          # cut short by strace -s: not replayable, still an operation
    assert run.reads == frozenset({"a"})   # the read-only open is a read, not a mutation


def test_targetable_only_when_no_thread_reaches_the_same_count_earlier():
    run = _run(TRACE)
    ops = [run.ops[i] for i in run.mutations]
    assert ops[1].targetable          # thread 100's 2nd write: nobody else reached a 2nd write first
    assert not ops[2].targetable      # thread 101's 1st write: thread 100 made its 1st write earlier
    assert not ops[0].targetable      # a file creation (openat) is never a target


def test_save_windows_and_committed_before():
    run = _run(TRACE + '100  write(3</ck/step-2/x>, "ab", 2) = 2\n'
               + '100  write(7</other/loss.jsonl>, "{\\"step\\": 2, \\"loss\\": 0.4}\\n", 27) = 27\n'
               + '100  unlink("/ck/a") = 0\n', losses={1: 0.5, 2: 0.4})
    windows = run.windows()
    # Removing a file no save made, after save 1: the retention pass after save 1, no save of its own.
    assert sorted(windows) == [0, 1]
    write_x, unlink_a = windows[1][0], windows[0][-1]
    assert run.committed_before(write_x) == 0 and run.in_progress(write_x) == 1
    assert run.committed_before(unlink_a) == 1 and run.in_progress(unlink_a) is None
    assert run.committed_by_step(1) == 1 and run.committed_by_step(0) == 0
    assert run.role(unlink_a) == "unlink #1 of the retention pass after the save of step 1"
    assert str(saves.name_point(run, run.mutations.index(unlink_a))) == "retention:1/1"
    assert sorted(run.step_logs) == [1, 2]


def test_a_killed_call_is_marked():
    text = ('7  rename("/ck/.x.tmp-7-ab", "/ck/x") = 0\n'
            '7  rename("/ck/.y.tmp-7-cd", "/ck/y") = ?\n'
            '7  +++ killed by SIGKILL +++\n')
    run = _run(text, losses={})
    assert run.killed_op().path == ".y.tmp-7-cd"
    unfinished = _run('7  write(3</ck/f>, "abc", 3 <unfinished ...>\n7  +++ killed by SIGKILL +++\n', losses={})
    assert unfinished.killed_op().kind == "write"


def test_unreplayable_operations_are_named():
    run = _run('1 openat(AT_FDCWD</r>, "/ck/w", O_WRONLY|O_CREAT|O_DIRECT, 0644) = 3</ck/w>\n'
               '1 mmap(NULL, 4096, PROT_READ|PROT_WRITE, MAP_SHARED, 3</ck/w>, 0) = 0x7f0\n', losses={})
    assert "O_DIRECT" in run.unreplayable and "mmap of w" in run.unreplayable


# -- what varies between runs ------------------------------------------------------------------------
def _save(tmp: str, step: int = 3) -> str:
    return "\n".join([
        f'1 openat(AT_FDCWD</r>, "/ck/{tmp}", O_RDWR|O_CREAT|O_EXCL, 0600) = 3</ck/{tmp}>',
        f'1 write(3</ck/{tmp}>, "x", 1) = 1',
        f'1 fsync(3</ck/{tmp}>) = 0',
        f'1 rename("/ck/{tmp}", "/ck/ckpt-{step}.pt") = 0',
        '1 fsync(4</ck>) = 0']) + "\n"


def test_alignment_learns_random_temp_names():
    first, second = _run(_save(".tmp-3qpmo7zx.partial")), _run(_save(".tmp-xjq0x53g.partial"))
    lined_up = alignment.align(first, second)
    assert lined_up.divergence is None
    assert [(n.first, n.second, n.role) for n in lined_up.names] == [
        (".tmp-3qpmo7zx.partial", ".tmp-xjq0x53g.partial", "create #1 of the start of the run")]


def test_alignment_names_where_two_runs_diverge():
    first = _run(_save(".tmp-a") + '1 unlink("/ck/old") = 0\n')
    reordered = _run('1 unlink("/ck/old") = 0\n' + _save(".tmp-b"))
    found = alignment.align(first, reordered).divergence
    assert found is not None and found.position == 0
    assert "create #1" in found.first and "unlink #1" in found.second


def test_a_known_name_turning_into_another_is_a_divergence():
    same_name = _run(_save(".t1", step=3) + '1 unlink("/ck/ckpt-3.pt") = 0\n')
    other_name = _run(_save(".t2", step=3) + '1 unlink("/ck/ckpt-6.pt") = 0\n')
    found = alignment.align(same_name, other_name).divergence
    assert found is not None and found.position == 5 and "ckpt-3.pt" in found.first and "ckpt-6.pt" in found.second
    # names that existed before the run are never run-random
    pre = frozenset({".t1"})
    assert alignment.align(_run(_save(".t1"), preexisting=pre), _run(_save(".t2"), preexisting=pre)).divergence


@pytest.mark.needs_strace
def test_real_strace_injection_kills_at_the_planned_rename(tmp_path):
    script = ("import os,sys; d=sys.argv[1]\n"
              "for i in range(3):\n"
              "    open(f'{d}/t{i}','w').close(); os.rename(f'{d}/t{i}', f'{d}/f{i}')\n")
    out = tmp_path / "trace"
    root = tmp_path / "d"
    root.mkdir()
    proc = subprocess.run(strace.inject_argv(out, "rename", 2) + [sys.executable, "-c", script, str(root)])
    assert proc.returncode in (-9, 137)
    assert sorted(p.name for p in root.iterdir()) == ["f0", "t1"]
    run = recording.build(strace.parse(out.read_text()), RunSpec(1, 1, 0), ProcessResult(-9, {}, ""), root,
                          tmp_path / "log")
    assert (run.killed_op().path, run.killed_op().target) == ("t1", "f1")


@pytest.mark.needs_strace
def test_recordings_and_error_injections_filter_in_the_kernel_and_record_what_full_tracing_records(tmp_path):
    """record_argv and an error injection run with --seccomp-bpf (strace stops only at the traced
    calls of a process it starts); a signal injection cannot, and keeps full tracing. What a
    recording holds is the same either way, and the error still lands on its call."""
    script = ("import os,sys; d=sys.argv[1]\n"
              "for i in range(3):\n"
              "    fd=os.open(f'{d}/t{i}', os.O_WRONLY|os.O_CREAT); os.write(fd, b'x'*10); os.fsync(fd); os.close(fd)\n"
              "    os.rename(f'{d}/t{i}', f'{d}/f{i}')\n")
    assert "--seccomp-bpf" in strace.record_argv(tmp_path / "t", data=True)
    assert "--seccomp-bpf" in strace.inject_argv(tmp_path / "t", "write", 2, action="error=ENOSPC")
    assert "--seccomp-bpf" not in strace.inject_argv(tmp_path / "t", "write", 2, action="signal=TERM")

    def ops(argv_for, name: str) -> tuple[subprocess.CompletedProcess, list[tuple]]:
        root = tmp_path / name
        root.mkdir()
        out = tmp_path / f"{name}.trace"
        proc = subprocess.run(argv_for(out) + [sys.executable, "-c", script, str(root)], capture_output=True, text=True)
        calls = [(c.name, c.nth, tuple(a.replace(str(root), "ROOT") for a in c.args),
                  (c.ret or "").replace(str(root), "ROOT"))
                 for c in strace.parse(out.read_text()) if any(str(root) in a for a in c.args)]
        return proc, calls
    filtered = lambda f: strace.record_argv(f, data=True)
    full = lambda f: [a for a in strace.record_argv(f, data=True) if a != "--seccomp-bpf"]
    assert ops(filtered, "bpf")[1] == ops(full, "full")[1]
    proc, calls = ops(lambda f: strace.inject_argv(f, "write", 2, action="error=ENOSPC"), "enospc")
    assert proc.returncode == 1 and "No space left on device" in proc.stderr, proc.stderr
    assert sorted(p.name for p in (tmp_path / "enospc").iterdir()) == ["f0", "t1"]


def test_in_a_job_a_mkdir_that_found_the_directory_is_the_ranks_operation_with_no_effect():
    """Every rank of a DCP job creates `step-N/`; which one gets EEXIST is a race, so each rank's
    call is its operation (its crash points stay the same run to run) and changes nothing."""
    result = ProcessResult(0, {1: 0.5}, "")
    own = recording.build(strace.parse(TRACE), RunSpec(3, 1, 0, 2), result, ROOT, LOG, rank=1)
    mkdirs = [op for op in own.ops if op.kind == "mkdir"]
    assert [(op.path, op.effect) for op in mkdirs] == [("step-2", True), ("step-3", False)]
    single = _run(TRACE)
    assert [op.path for op in single.ops if op.kind == "mkdir"] == ["step-2"]


def test_an_injected_signal_marks_the_call_it_was_delivered_at():
    """A SIGTERM strace injected (si_code=SI_KERNEL) is delivered as the call returns: that call is
    where the fault landed, and a loss-log write that carried it still logged its step."""
    text = ('100  write(7</other/loss.jsonl>, "{\\"step\\": 1, \\"loss\\": 0.5}\\n", 27) = 27\n'
            '100  --- SIGTERM {si_signo=SIGTERM, si_code=SI_KERNEL} ---\n'
            '100  mkdir("/ck/step-1", 0777) = 0\n'
            '100  --- SIGTERM {si_signo=SIGTERM, si_code=SI_USER, si_pid=1, si_uid=0} ---\n')
    calls = strace.parse(text)
    assert [c.signalled for c in calls] == ["TERM", ""]
    run = _run(text)
    hit = run.signalled_op()
    assert hit is not None and hit.kind == "log" and hit.after_step == 0 and 1 in run.step_logs


def test_a_copy_out_of_the_directory_is_not_one_of_its_operations():
    """A checkpoint file copied elsewhere (an upload to a file:// cold tier, a backup) changes
    nothing under the checkpoint directory: not a mutation, not a crash point. A copy into it is."""
    run = _run('100  openat(AT_FDCWD</run>, "/ck/a", O_RDONLY|O_CLOEXEC) = 3</ck/a>\n'
               '100  openat(AT_FDCWD</run>, "/cold/a.tmp", O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC, 0644) = 4</cold/a.tmp>\n'
               '100  copy_file_range(3</ck/a>, NULL, 4</cold/a.tmp>, NULL, 1024, 0) = 1024\n'
               '100  openat(AT_FDCWD</run>, "/ck/b", O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC, 0644) = 5</ck/b>\n'
               '100  copy_file_range(3</ck/a>, NULL, 5</ck/b>, NULL, 1024, 0) = 1024\n')
    kinds = [(run.ops[i].kind, run.ops[i].path) for i in run.mutations]
    assert kinds == [("create", "b"), ("copy", "b")]
