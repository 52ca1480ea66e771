"""A warm job that stops making progress is stopped, and the message says what each of its
processes was doing just before the kill: the last syscall from /proc, and the Python stack
py-spy reads (watchdog.where)."""
from __future__ import annotations

import dataclasses
import shutil
import sys
import textwrap

import pytest

from conformance.model.adapters import TrainerAdapter
from conformance.model.process import RunSpec
from conformance.run.runners import Limits, ProcessOverran
from conformance.run.warm import WarmRunner

# Rank 1 logs step 1 and then sleeps for ever; rank 0 waits for it in a barrier. Until step 1 is
# logged a thread keeps each rank busy: joining the group may legitimately sit idle for seconds
# (c10d's connect back-off on a loaded machine), which a 3 s stall limit would otherwise catch
# before the stall this test is about (CI at 28546d1 did, once).
STALLS_AFTER_STEP_1 = textwrap.dedent("""\
    import datetime, json, os, threading, time
    import torch.distributed as dist

    def rank_one_hangs_here():
        time.sleep(3600)

    started = threading.Event()
    def busy_until_started():
        while not started.is_set():
            sum(range(10000))
    threading.Thread(target=busy_until_started, daemon=True).start()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    with open(os.environ["CONFORMANCE_LOSS_LOG"] + f".rank{rank}", "a") as log:
        log.write(json.dumps({"step": 1, "loss": 1.0}) + "\\n")
    started.set()
    if rank == 1:
        rank_one_hangs_here()
    dist.barrier()
""")


def test_a_stalled_warm_job_says_where_each_process_was(tmp_path):
    script = tmp_path / "stalls.py"
    script.write_text(STALLS_AFTER_STEP_1)
    adapter = TrainerAdapter(name="stalls", argv=(sys.executable, str(script)), world_size=2)
    limits = Limits(total_s=120, stall_s=3)
    if "job_stall_s" in {f.name for f in dataclasses.fields(Limits)}:
        limits = dataclasses.replace(limits, job_stall_s=3)   # a job's own floor on "no progress"
    runner = WarmRunner(limits=limits)
    (tmp_path / "ckpt").mkdir()
    log = tmp_path / "loss.jsonl"
    try:
        with pytest.raises(ProcessOverran) as caught:
            runner.run_process(adapter, RunSpec(total_steps=3, save_every=0, seed=0, world_size=2),
                               tmp_path / "ckpt", log)
    finally:
        runner.close()
    problem = caught.value.problem
    assert "made no progress" in problem, problem
    where = caught.value.details   # where each process was: said with the problem, in the failure's details
    assert where.count("pid ") >= 2, where       # both ranks (the agent is listed, not counted)
    if shutil.which("py-spy"):
        assert "rank_one_hangs_here" in where, where   # the stalled rank's Python stack
