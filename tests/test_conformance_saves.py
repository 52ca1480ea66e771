"""Meta-tests of how a recorded run's operations are attributed to saves (`recording.attribute_saves`)
and of what two runs must make alike (`alignment.align`): saves in flight across steps, writer
threads (one long-lived, or one per save), a commit the main thread does later, and the order in
which threads interleave, which is a race and no property of the trainer."""
from __future__ import annotations

from pathlib import Path

import pytest

from conformance.model.crash import CrashPoint
from conformance.model.process import ProcessResult, RunSpec
from conformance.trace import alignment, recording, saves, strace

ROOT, LOG = Path("/ck"), Path("/other/loss.jsonl")
MAIN = 100


def log(step: int, tid: int = MAIN) -> str:
    return f'{tid}  write(7</other/loss.jsonl>, "{{\\"step\\": {step}, \\"loss\\": 0.5}}\\n", 27) = 27'


def staged_save(step: int, tid: int, fd: int = 3) -> list[str]:
    """A commit-marker style save: a temp directory, a file, its fsync (no commit yet)."""
    tmp = f"/ck/.tmp-ckpt-{step}"
    return [f'{tid}  mkdir("{tmp}", 0777) = 0',
            f'{tid}  openat(AT_FDCWD</run>, "{tmp}/model", O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC, 0644) = {fd}<{tmp}/model>',
            f'{tid}  write({fd}<{tmp}/model>, "w{step}", 2) = 2',
            f'{tid}  fsync({fd}<{tmp}/model>) = 0']


def commit(step: int, tid: int) -> list[str]:
    return [f'{tid}  rename("/ck/.tmp-ckpt-{step}", "/ck/ckpt-{step}") = 0',
            f'{tid}  fsync(9</ck>) = 0']


def build(lines: list[str], total: int = 9, every: int = 3) -> recording.RecordedRun:
    losses = {s: 0.5 for s in range(1, total + 1)}
    return recording.build(strace.parse("\n".join(lines) + "\n"), RunSpec(total, every, 0),
                           ProcessResult(0, losses, ""), ROOT, LOG)


def saves_of(run: recording.RecordedRun) -> list[tuple[str, int, int]]:
    return [(run.ops[i].kind, run.ops[i].save, run.ops[i].lane) for i in run.mutations]


def in_flight_run(writer_late: bool = False, interleave: int = 0) -> list[str]:
    """Saves at 3 and 6 on one long-lived writer thread (200), each committed two steps after it
    began. `writer_late`: the writer staged save 6 only after step 7 was logged. `interleave`
    moves the writer's first operations past that many more main-thread log lines."""
    lines = [log(1), log(2), log(3)]
    first = staged_save(3, 200)
    lines += first[:1 + interleave] + [log(4)] + first[1 + interleave:] + [log(5)] + commit(3, 200)
    lines += [log(6)]
    second = staged_save(6, 200)
    if writer_late:
        lines += [log(7)] + second + [log(8)] + commit(6, 200) + [log(9)]
    else:
        lines += second + [log(7), log(8)] + commit(6, 200) + [log(9)]
    return lines


def test_a_sync_save_is_the_window_between_two_log_lines():
    run = build([log(1), log(2), log(3)] + staged_save(3, MAIN) + commit(3, MAIN) + [log(4), log(5), log(6)]
                + staged_save(6, MAIN) + commit(6, MAIN) + [log(7), log(8), log(9)])
    assert {s for _, s, _ in saves_of(run)} == {3, 6}
    assert all(lane == 0 for _, _, lane in saves_of(run))
    assert run.committed_by_step(3) == 3 and run.committed_by_step(5) == 3 and run.committed_by_step(6) == 6


def test_a_save_in_flight_across_steps_belongs_to_the_step_it_began_at():
    run = build(in_flight_run())
    assert [s for _, s, _ in saves_of(run)] == [3] * 6 + [6] * 6
    assert all(lane == 1 for _, _, lane in saves_of(run))
    # Save 3 commits after step 5 is logged, on its thread: surely only once the next save step
    # (6) is logged, where the trainer waits for it; until then a kill may find it either way.
    assert [run.committed_by_step(k) for k in range(1, 10)] == [0, 0, 0, 0, 0, 3, 3, 3, 6]
    rename3 = next(i for i in run.mutations if run.ops[i].kind == "rename")
    synced = next(i for i in run.mutations if i > rename3)     # the directory's fsync ends the save
    assert run.committed_before(rename3) == 0 and run.committed_before(synced) == 0
    assert run.committed_before(synced + 1) == 3
    assert run.in_progress(rename3) == 3
    assert run.role(rename3) == "rename #5 of the save of step 3 (background thread 1)"


def test_a_writer_that_starts_a_save_after_the_next_step_was_logged_still_takes_the_oldest_save_step():
    run = build(in_flight_run(writer_late=True))
    assert [s for _, s, _ in saves_of(run)] == [3] * 6 + [6] * 6


def test_a_thread_per_save_is_attributed_like_a_long_lived_writer():
    lines = [log(1), log(2), log(3)] + staged_save(3, 201) + [log(4), log(5)] + commit(3, 201) + [log(6)]
    lines += [log(7)] + staged_save(6, 202) + [log(8)] + commit(6, 202) + [log(9)]
    run = build(lines)
    assert [s for _, s, _ in saves_of(run)] == [3] * 6 + [6] * 6


def test_a_second_writer_thread_joins_the_save_whose_directory_it_writes_into():
    lines = [log(1), log(2), log(3)] + staged_save(3, 200)
    lines += [log(4),
              '201  openat(AT_FDCWD</run>, "/ck/.tmp-ckpt-3/optim", O_WRONLY|O_CREAT|O_TRUNC, 0644) = 5</ck/.tmp-ckpt-3/optim>',
              '201  write(5</ck/.tmp-ckpt-3/optim>, "o", 1) = 1'] + commit(3, 200) + [log(5), log(6)]
    run = build(lines, total=6)
    assert {(s, lane) for _, s, lane in saves_of(run)} == {(3, 1), (3, 2)}


def test_a_commit_the_main_thread_makes_later_belongs_to_the_save_in_flight():
    lines = [log(1), log(2), log(3)] + staged_save(3, 200) + [log(4)] + commit(3, MAIN) + [log(5), log(6)]
    run = build(lines, total=6)
    assert [(s, lane) for _, s, lane in saves_of(run)] == [(3, 1)] * 4 + [(3, 0)] * 2
    assert run.committed_by_step(4) == 3 and run.committed_by_step(3) == 0


def test_the_interleaving_of_threads_does_not_count_as_a_difference_between_runs():
    a, b = build(in_flight_run()), build(in_flight_run(interleave=2))
    assert [run.ops[i].after_step for run in (a, b) for i in run.mutations[1:2]] == [4, 3]   # timing differs
    lined_up = alignment.align(a, b)
    assert lined_up.divergence is None and lined_up.compared == 12


def test_a_thread_that_writes_something_else_is_a_difference_named_in_both_runs():
    other = in_flight_run()
    other[other.index(staged_save(6, 200)[2])] = '200  write(3</ck/.tmp-ckpt-6/model>, "w6", 2) = 2\n' \
        '200  write(3</ck/.tmp-ckpt-6/model>, "x", 1) = 1'
    lined_up = alignment.align(build(in_flight_run()), build("\n".join(other).splitlines()))
    assert lined_up.divergence is not None
    assert "fsync #4 of the save of step 6 (background thread 1): fsync .tmp-ckpt-6/model" == lined_up.divergence.first
    assert "write #4 of the save of step 6 (background thread 1): write 1 bytes to .tmp-ckpt-6/model" \
        == lined_up.divergence.second


def test_a_commit_the_main_thread_makes_at_the_next_save_step_belongs_to_the_save_in_flight():
    # save_every 2: save 2's background write is committed by the main thread only at step 4,
    # just before save 4 begins.
    lines = [log(1), log(2)] + staged_save(2, 200) + [log(3), log(4)] + commit(2, MAIN)
    lines += [f'{MAIN}  unlink("/ck/ckpt-0-old") = 0'] + staged_save(4, MAIN, fd=4) + commit(4, MAIN) + [log(5), log(6)]
    run = build(lines, total=6, every=2)
    assert [(k, s) for k, s, _ in saves_of(run)] == [
        ("mkdir", 2), ("create", 2), ("write", 2), ("fsync", 2), ("rename", 2), ("fsync", 2), ("unlink", 0),
        ("mkdir", 4), ("create", 4), ("write", 4), ("fsync", 4), ("rename", 4), ("fsync", 4)]
    # Removing a checkpoint from before the run, right after save 2's commit: its retention pass.
    assert [run.ops[i].retention for i in run.mutations if run.ops[i].kind == "unlink"] == [2]
    assert run.committed_by_step(3) == 0 and run.committed_by_step(4) == 4


def test_a_step_kill_while_a_save_is_in_flight_allows_that_save_too():
    from conformance.faults.scenario import plan
    run = build(in_flight_run())
    assert [run.in_flight_by_step(k) for k in range(1, 10)] == [None, None, 3, 3, 3, 6, 6, 6, None]
    kill = plan(CrashPoint("step", 4), run)            # logging step 5: save 3 commits after it, or before
    assert kill.newest_committed == 0 and kill.allowed_resumes() == {0, 3}
    assert plan(CrashPoint("step", 6), run).allowed_resumes() == {3, 6}


def test_a_crash_point_named_by_its_save_and_thread_replays_the_same_operation_however_threads_interleave():
    from conformance.faults.scenario import plan
    from conformance.trace.saves import name_point
    retention = f'{MAIN}  unlink("/ck/ckpt-0-old") = 0'
    staged = staged_save(3, 200)
    a = build([log(1), log(2), log(3)] + staged + [retention, log(4)] + commit(3, MAIN) + [log(5), log(6)], total=6)
    b = build([log(1), log(2), log(3), retention] + staged + [log(4)] + commit(3, MAIN) + [log(5), log(6)], total=6)
    fsync_a = next(k for k in a.crash_points() if a.ops[a.mutations[k]].kind == "fsync")
    point = name_point(a, fsync_a)
    assert str(point) == "save:3/t1/4" and CrashPoint.parse(str(point)) == point
    in_a, in_b = plan(point, a), plan(point, b)
    assert in_a.text == in_b.text == "fsync #4 of the save of step 3 (background thread 1): fsync .tmp-ckpt-3/model"
    # The same operation's position among the mutations is another in each run: `fs:i` would
    # name the save's mkdir in one and the unlink in the other.
    mkdir_a = next(k for k, i in enumerate(a.mutations) if a.ops[i].kind == "mkdir")
    assert plan(CrashPoint("fs", mkdir_a), a).text.startswith("mkdir")
    assert plan(CrashPoint("fs", mkdir_a), b).text.startswith("unlink")
    # A save point that names no operation of this run is not planned (another point is drawn).
    assert plan(CrashPoint("save", 3, op=9, thread=1), b) is None and plan(CrashPoint("save", 6, op=1), b) is None


def test_an_fs_point_names_the_same_operation_when_another_process_takes_the_first_counts():
    """`fs:i` counts the trainer's mutations, not the ones a kill by count can hit: which of those
    a process can hit depends on one-time work it does or does not do (a library's lazy probe
    writes from the main thread, a helper child process under `strace -f` counts first), and a
    fork server that did that work before the fork shifts them. Measured: one fresh process's
    ordinal 12 was a mkdir of the save of step 9, the warm one's a write of the save of step 6."""
    from conformance.faults.scenario import plan
    from conformance.trace.saves import name_point
    retention = f'{MAIN}  unlink("/ck/ckpt-0-old") = 0'
    trainer = [retention, log(1), log(2), log(3)] + staged_save(3, MAIN) + commit(3, MAIN) + [log(4), log(5), log(6)]
    probe = ['300  write(1<pipe:[77]>, "x", 1) = 1'] * 4    # reaches write #1-#4 before the trainer's save
    a, b = build(trainer, total=6), build(probe + trainer, total=6)
    assert [a.ops[i].kind for i in a.mutations] == [b.ops[i].kind for i in b.mutations]
    unlink = next(k for k, i in enumerate(a.mutations) if a.ops[i].kind == "unlink")
    assert len(a.crash_points()) != len(b.crash_points())   # b cannot hit the save's write by count
    point = name_point(a, unlink)
    assert point == CrashPoint("fs", unlink) == name_point(b, unlink)
    assert plan(point, a).text == plan(point, b).text == 'unlink #1 of the start of the run: unlink ckpt-0-old'
    # A mutation that this process cannot hit names the next one it can.
    write = next(k for k, i in enumerate(b.mutations) if b.ops[i].kind == "write")
    assert plan(CrashPoint("fs", write), a).text.startswith("write") and plan(CrashPoint("fs", write), b).text.startswith("fsync")


def test_a_rank_killed_as_it_logs_a_save_step_that_rank_0_alone_writes_allows_that_save():
    """A replicated-state job (rank 0 writes every checkpoint, then a barrier): rank 1 killed on
    entry to logging step 6 had trained step 6, so rank 0 may log it and commit ckpt-6 before it
    next waits for rank 1 (the soak found this resume called lost work). A save rank 1 writes part of
    is not allowed before rank 1 finished its part."""
    from conformance.faults.scenario import plan
    spec = RunSpec(6, 3, 0, world_size=2)

    def rank_lines(rank: int, writes: bool) -> list[str]:
        tid, lines, t = 100 + rank, [], 1000.0 + rank * 0.01
        logname = f"/other/loss.jsonl.rank{rank}"
        for step in range(1, 7):
            t += 1
            lines.append(f'{tid} {t:.6f} write(7<{logname}>, "{{\\"step\\": {step}, \\"loss\\": 0.5}}\\n", 27) = 27')
            if step % 3 == 0 and writes:
                tmp = f"/ck/.ckpt-{step}.pt.tmp"
                lines += [f'{tid} {t + 0.1:.6f} openat(AT_FDCWD</run>, "{tmp}", O_WRONLY|O_CREAT|O_EXCL, 0600) = 3<{tmp}>',
                          f'{tid} {t + 0.2:.6f} write(3<{tmp}>, "w{step}", 2) = 2',
                          f'{tid} {t + 0.3:.6f} fsync(3<{tmp}>) = 0',
                          f'{tid} {t + 0.4:.6f} rename("{tmp}", "/ck/ckpt-{step}.pt") = 0']
        return lines

    def job(rank1_writes: bool) -> recording.RecordedRun:
        views = {}
        for rank in (0, 1):
            own = ProcessResult(0, {s: 0.5 for s in range(1, 7)}, "")
            views[rank] = recording.build(strace.parse("\n".join(rank_lines(rank, rank == 0 or rank1_writes)) + "\n"),
                                          spec, own, ROOT, Path(f"/other/loss.jsonl.rank{rank}"), rank=rank)
        return recording.merge(views, spec, ProcessResult(0, {}, ""), ROOT, frozenset())

    replicated = job(rank1_writes=False)
    assert replicated.saves() == [3, 6] and not replicated.rank_view(1).saves()
    kill = plan(CrashPoint("step", 5, rank=1), replicated)   # rank 1, on entry to logging step 6
    assert kill.newest_committed == 3 and kill.allowed_resumes() == {3, 6}, kill
    assert plan(CrashPoint("step", 4, rank=1), replicated).allowed_resumes() == {3}   # step 5: no save
    sharded = job(rank1_writes=True)
    assert plan(CrashPoint("step", 5, rank=1), sharded).allowed_resumes() == {3}   # rank 1's part of save 6 not written


def purge(step: int, tid: int) -> list[str]:
    """A purge thread removing the checkpoint of `step` (shutil.rmtree: unlink, then rmdir)."""
    return [f'{tid}  unlinkat(AT_FDCWD</run>, "/ck/ckpt-{step}/model", 0) = 0',
            f'{tid}  rmdir("/ck/ckpt-{step}") = 0']


def purged_run(late: int = 0) -> list[str]:
    """Saves at 3, 6, 9 on the main thread; a purge thread (300) removes ckpt-3 after save 9 was
    committed, `late` log lines after step 9 (torchtitan's keep_latest_k=2)."""
    lines = [log(1), log(2), log(3)] + staged_save(3, MAIN) + commit(3, MAIN) + [log(4), log(5), log(6)]
    lines += staged_save(6, MAIN, fd=4) + commit(6, MAIN) + [log(7), log(8), log(9)] + staged_save(9, MAIN, fd=5)
    lines += commit(9, MAIN)
    after = [log(10), log(11)]
    return lines + after[:late] + purge(3, 300) + after[late:]


def test_a_background_thread_removing_an_older_checkpoint_is_retention_never_a_save():
    for late in (0, 1, 2):   # steps 10 and 11 are no save steps: however late the purge lands
        run = build(purged_run(late), total=11)
        assert run.saves() == [3, 6, 9]
        removals = [i for i in run.mutations if run.ops[i].kind in ("unlink", "rmdir")]
        assert [(run.ops[i].save, run.ops[i].retention) for i in removals] == [(0, 9), (0, 9)]
        assert [str(saves.name_point(run, run.mutations.index(i))) for i in removals] == ["retention:9/1", "retention:9/2"]
        assert run.role(removals[1]) == "rmdir #2 of the retention pass after the save of step 9"
        assert run.committed_before(removals[0]) == 9
        point = saves.locate_point(run, CrashPoint.parse("retention:9/2"))
        assert run.mutations[point] == removals[1]


def test_when_retention_lands_is_no_difference_between_runs_what_it_leaves_is():
    a, b = build(purged_run(0), total=11), build(purged_run(2), total=11)
    assert alignment.align(a, b).divergence is None
    assert alignment.retention_outcome(a, b) == ""
    assert a.kept == {3: "removed", 6: "kept", 9: "kept"}
    kept_all = build(purged_run(0)[:-len(purge(3, 300)) - 2] + [log(10), log(11)], total=11)
    assert alignment.retention_outcome(a, kept_all) == "run 1 kept the checkpoints of steps 6, 9; run 2 kept 3, 6, 9"


def test_removing_a_pointer_that_the_same_save_makes_again_is_part_of_the_save():
    lines = [log(1), log(2), log(3)] + staged_save(3, MAIN) + commit(3, MAIN)
    lines += [f'{MAIN}  symlink("ckpt-3", "/ck/latest") = 0', log(4), log(5), log(6)] + staged_save(6, MAIN, fd=4)
    lines += commit(6, MAIN) + [f'{MAIN}  unlink("/ck/latest") = 0', f'{MAIN}  symlink("ckpt-6", "/ck/latest") = 0']
    run = build(lines + [log(7)], total=7)
    unlink = next(i for i in run.mutations if run.ops[i].kind == "unlink")
    assert (run.ops[unlink].save, run.ops[unlink].retention) == (6, 0)


def test_a_retention_point_is_written_and_read_back():
    point = CrashPoint.parse("retention:9/2@r1")
    assert (point.kind, point.index, point.op, point.rank) == ("retention", 9, 2, 1)
    assert str(point) == "retention:9/2@r1"
    for bad in ("retention:9", "retention:9/t1/2", "retention:0/1"):
        with pytest.raises(ValueError, match="retention"):
            CrashPoint.parse(bad)


def test_a_save_with_only_its_syncs_left_is_whole_for_a_kill():
    run = build(in_flight_run())
    rename3 = next(i for i in run.mutations if run.ops[i].kind == "rename")
    synced = next(i for i in run.mutations if i > rename3)     # the directory's fsync ends save 3
    assert run.committed_before(synced) == 0 and run.settled_before(synced) == 3
    assert run.settled_before(rename3) == 0


def test_a_writer_emptying_what_it_renamed_out_of_the_way_stays_in_its_save_however_far_the_main_thread_is():
    # Save 6 on the writer thread renames ckpt-3 aside and empties it while the main thread has
    # already logged step 9 (a loaded machine): its own save's work, not retention of step 9.
    lines = [log(1), log(2), log(3)] + staged_save(3, 200) + commit(3, 200) + [log(4), log(5), log(6)]
    lines += staged_save(6, 200) + commit(6, 200) + ['200  rename("/ck/ckpt-3", "/ck/.del-ckpt-3") = 0',
                                                   log(7), log(8), log(9),
                                                   '200  unlinkat(AT_FDCWD</run>, "/ck/.del-ckpt-3/model", 0) = 0',
                                                   '200  rmdir("/ck/.del-ckpt-3") = 0']
    lines += staged_save(9, 200) + commit(9, 200) + [log(10)]
    run = build(lines, total=10)
    removals = [run.ops[i] for i in run.mutations if run.ops[i].kind in ("unlink", "rmdir")]
    assert [(op.save, op.retention) for op in removals] == [(6, 0), (6, 0)]
