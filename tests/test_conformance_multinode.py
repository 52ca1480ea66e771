"""Multi-node jobs and restarts in place, without launching a job: node points, a job's shape, the
torchrun command line of each node, node-local directories, the attempts of a restarted rank's
loss log, how a job of nodes ends, and the usage errors of a shape that does not fit. (The jobs
themselves run in test_conformance_gate.py.)"""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conformance.model.adapters import AdapterError, resolve
from conformance.model.crash import CrashPoint, bound, parse_schedule
from conformance.model.process import RunSpec, mark_restart, node_dir, read_attempts, read_losses, shared_dir
from conformance.run import launch, nodes
from conformance.run.watchdog import Stop


def test_a_node_point_names_its_node_and_binds_to_the_nodes_first_rank():
    point = CrashPoint.parse("save:6/3@node1")
    assert point.whole_node and point.node == 1 and point.rank is None and str(point) == "save:6/3@node1"
    with pytest.raises(ValueError, match="not bound"):
        _ = point.on_rank
    assert point.bound(2).on_rank == 2 and point.bound(3).on_rank == 3 and str(point.bound(2)) == "save:6/3@node1"
    assert CrashPoint.parse(str(point.bound(2))) == point
    assert bound(parse_schedule("step:4@node1,fs:7@r0"), 2) == (CrashPoint("step", 4, 2, node=1), CrashPoint("fs", 7, 0))
    assert point.bound(2).stopped() == "node 1 was lost" and CrashPoint("fs", 3, 1).stopped() == "rank 1 was killed"
    assert CrashPoint("fs", 3, 1).bound(2) == CrashPoint("fs", 3, 1)


@pytest.mark.parametrize("text", ["fs:1@n1", "fs:1@nodeX", "step:2@node-1"])
def test_a_bad_node_point_is_a_value_error_that_says_how_to_write_one(text):
    with pytest.raises(ValueError, match="'@nodeK'|node must be"):
        CrashPoint.parse(text)


def test_a_jobs_shape_spreads_ranks_evenly_over_its_nodes():
    spec = RunSpec(14, 3, 0, 4, nnodes=2)
    assert spec.ranks_per_node == 2 and [spec.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert spec.describe().endswith("world_size=4 nnodes=2")
    assert spec.but(world_size=1, nnodes=1).ranks_per_node == 1
    with pytest.raises(ValueError, match="do not spread evenly"):
        spec.but(world_size=3)


def test_each_node_is_torchruns_node_of_the_same_number_through_c10d_rendezvous():
    spec = RunSpec(14, 3, 0, 4, nnodes=2)
    first, second = (launch.torchrun_flags(spec, 29500, k, logs=Path("/run/err.torchrun")) for k in (0, 1))
    for flags in (first, second):
        assert {"--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29500",
                "--rdzv-id=conformance-29500", "--max-restarts=0"} <= set(flags)
    # The rendezvous numbers nodes in the order of their addresses (as strings): node k is group rank k.
    addrs = [launch.node_address(k) for k in range(12)]
    assert sorted(addrs) == addrs and f"--local-addr={addrs[1]}" in second
    assert "--rdzv-backend=static" in launch.torchrun_flags(RunSpec(14, 3, 0, 2), 29500, logs=Path("/l"))


def test_a_job_torchrun_restarts_in_place_gets_a_store_per_attempt():
    """torchrun hands a restarted attempt the store of the one before (pytorch#135712): elastic
    jobs run with c10d's rendezvous and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."""
    elastic = RunSpec(14, 3, 0, 2, max_restarts=1)
    flags = launch.torchrun_flags(elastic, 29501, logs=launch.Path("/l"))
    assert "--max-restarts=1" in flags and "--rdzv-backend=c10d" in flags
    env = launch.rank_env({}, elastic, stderr_template=launch.Path("/x.{rank}"), straces={})
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    plain = launch.rank_env({}, RunSpec(14, 3, 0, 2), stderr_template=launch.Path("/x.{rank}"), straces={})
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in plain


def test_node_local_storage_gives_each_node_its_own_directory_and_one_shared(tmp_path):
    spec = RunSpec(14, 3, 0, 4, nnodes=2, node_local=True)
    env = spec.env(tmp_path, tmp_path / "loss.jsonl")
    assert env["CONFORMANCE_CKPT_DIR"] == str(node_dir(tmp_path, 0))
    assert env["CONFORMANCE_SHARED_DIR"] == str(shared_dir(tmp_path))
    assert spec.node_env(env, tmp_path, 1)["CONFORMANCE_CKPT_DIR"] == str(tmp_path / "node1")
    plain = RunSpec(14, 3, 0, 4, nnodes=2)
    assert plain.node_env(plain.env(tmp_path, tmp_path / "l"), tmp_path, 1)["CONFORMANCE_CKPT_DIR"] == str(tmp_path)
    assert "CONFORMANCE_SHARED_DIR" not in plain.env(tmp_path, tmp_path / "l")


def test_a_restart_in_place_is_marked_in_the_ranks_log_and_read_as_a_second_attempt(tmp_path):
    log = tmp_path / "loss.jsonl"
    rank_file = tmp_path / "loss.jsonl.rank1"
    rank_file.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n')
    mark_restart(log, 1, 2, 1)
    with open(rank_file, "a") as f:   # resumed at the very step the kill came after: no step goes back
        f.write('{"step": 3, "loss": 3.0}\n{"step": 4, "lo')
    assert read_attempts(log, 1, 2) == [{1: 1.0, 2: 2.0}, {3: 3.0}]
    assert read_losses(rank_file) == {1: 1.0, 2: 2.0, 3: 3.0} and read_attempts(log, 0, 2) == [{}]


class _Watch:
    """A Watchdog stand-in: no limits broken until `problem_after` calls."""

    def __init__(self, node=None, problem_after=None):
        self.stop, self.calls, self.problem_after, self.followed = Stop(signal="STOP", node=node), 0, problem_after, []

    def follow(self, pid):
        self.followed.append(pid)

    def problem(self):
        self.calls += 1
        return "over time" if self.problem_after is not None and self.calls > self.problem_after else None


def _agents(codes: dict[int, int | None], stopped: dict[int, str]):
    """Each node's "agent" is a real `sleep` (the job kills process trees by pid): it ends with
    codes[k] once that is set, or -9 when the job stops it."""
    def run(k, should_stop, started):
        proc = subprocess.Popen(["sleep", "30"])
        started(proc.pid)
        try:
            while codes[k] is None:
                why = should_stop()
                if why:
                    stopped[k] = why
                    proc.kill()
                    return -9
                if proc.poll() is not None:   # killed by the job
                    return proc.returncode
                time.sleep(0.005)
            return codes[k]
        finally:
            proc.kill()
            proc.wait()
    return run


def test_a_job_of_nodes_exits_with_the_first_failure_of_a_node_that_was_not_lost():
    job = nodes.NodeJob(RunSpec(14, 3, 0, 4, nnodes=2), _Watch(), poll=0.005)
    assert job.run(_agents({0: 0, 1: 0}, {})) == (0, None)
    job = nodes.NodeJob(RunSpec(14, 3, 0, 4, nnodes=2), _Watch(node=1), poll=0.005)
    codes, stopped = {0: None, 1: None}, {}
    threading.Timer(0.05, lambda: (job.on_signal(signal.SIGSTOP), codes.update({0: 1}))).start()
    rc, why = job.run(_agents(codes, stopped))
    assert rc == 1 and why is None and stopped == {1: "node 1 was lost"} and job.nodes[1].lost


def test_an_agent_left_waiting_for_a_failed_node_is_stopped_and_the_failure_is_the_jobs():
    """torchrun's exit barrier waits 300 s for an agent that already failed: an agent with no rank
    left once another node failed is stopped, and the job's status is the failed node's."""
    job = nodes.NodeJob(RunSpec(14, 3, 0, 4, nnodes=2), _Watch(), poll=0.005)
    codes, stopped = {0: None, 1: 3}, {}
    rc, why = job.run(_agents(codes, stopped))
    assert rc == 3 and why is None and job.nodes[0].after_peer and stopped == {}


def test_a_broken_limit_stops_every_node():
    job = nodes.NodeJob(RunSpec(14, 3, 0, 4, nnodes=2), _Watch(problem_after=3), poll=0.005)
    stopped: dict[int, str] = {}
    rc, why = job.run(_agents({0: None, 1: None}, stopped))
    assert why == "over time" and stopped == {0: "over time", 1: "over time"} and rc == -9


@pytest.mark.parametrize("nnodes, size, match", [(3, 4, "does not divide"), (8, 4, "does not divide"),
                                                 ("two", 4, "not a whole number")])
def test_a_shape_that_does_not_fit_is_an_adapter_error_naming_both_options(nnodes, size, match):
    with pytest.raises(AdapterError, match=match):
        resolve("resume_conformance.fixtures.ddp_trainer:ADAPTER", None, world_size=size, nnodes=nnodes)
    assert resolve("resume_conformance.fixtures.ddp_trainer:ADAPTER", None, world_size=4, nnodes=2).replay_args()[-2:] == (
        "--world-size=4", "--nnodes=2")
