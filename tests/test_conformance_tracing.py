"""Meta-tests of strace output parsing: events, per-thread counts, targetability, landing."""
from pathlib import Path

import pytest

from conformance.tracing import Trace, killed_at, strace_problem

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
100  write(7</other/loss.jsonl>, "{}\\n", 3) = 3
"""


def test_events_under_root_are_mutations_with_paths_and_per_thread_counts():
    trace = Trace.parse(TRACE)
    events = trace.under(Path("/ck"))
    assert [(e.tid, e.syscall, e.nth, e.op) for e in events] == [
        (100, "openat", 1, "create"), (100, "write", 2, "write"), (101, "write", 1, "write"),
        (100, "fsync", 1, "fsync"), (100, "rename", 1, "rename"), (100, "unlinkat", 1, "unlink"),
        (100, "mkdir", 1, "mkdir")]
    assert events[4].paths == ("/ck/.a.tmp-1-00", "/ck/a")
    assert events[5].paths == ("/ck/step-1/meta.pt",)
    assert events[4].describe(Path("/ck")) == "rename .a.tmp-1-00 -> a"


def test_a_read_only_open_is_not_a_mutation():
    trace = Trace.parse(TRACE)
    assert all(not (e.syscall == "openat" and e.paths == ("/ck/a",)) for e in trace.under(Path("/ck")))


def test_targetable_only_when_no_thread_reaches_the_same_count_earlier():
    trace = Trace.parse(TRACE)
    events = trace.under(Path("/ck"))
    second_write_of_100 = events[1]
    first_write_of_101 = events[2]
    assert trace.targetable(second_write_of_100)
    # thread 100 made its 1st write (to the terminal) before thread 101's 1st write
    assert not trace.targetable(first_write_of_101)


def test_killed_at_reads_the_injected_entry():
    text = ('7  rename("/ck/.x.tmp-7-ab", "/ck/x") = 0\n'
            '7  rename("/ck/.y.tmp-7-cd", "/ck/y") = ?\n'
            '7  +++ killed by SIGKILL +++\n')
    assert killed_at(text, "rename") == ("/ck/.y.tmp-7-cd", "/ck/y")
    assert killed_at(text, "write") is None


def test_killed_at_handles_an_unfinished_entry():
    text = ('7  write(3</ck/f>, "abc", 3 <unfinished ...>\n'
            '7  +++ killed by SIGKILL +++\n')
    assert killed_at(text, "write") == ("/ck/f",)


def test_loss_log_writes_are_found():
    trace = Trace.parse(TRACE)
    assert [e.nth for e in trace.writes_to(Path("/other/loss.jsonl"))] == [3]


@pytest.mark.skipif(strace_problem() is not None, reason=f"strace unusable: {strace_problem()}")
def test_real_strace_injection_kills_at_the_planned_rename(tmp_path):
    import subprocess
    import sys
    from conformance.tracing import strace_prefix
    script = ("import os,sys; d=sys.argv[1]\n"
              "for i in range(3):\n"
              "    open(f'{d}/t{i}','w').close(); os.rename(f'{d}/t{i}', f'{d}/f{i}')\n")
    out = tmp_path / "trace"
    proc = subprocess.run(strace_prefix(out, inject=("rename", 2)) + [sys.executable, "-c", script, str(tmp_path)])
    assert proc.returncode in (-9, 137)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "trace") == ["f0", "t1"]
    assert killed_at(out.read_text(), "rename") == (str(tmp_path / "t1"), str(tmp_path / "f1"))
