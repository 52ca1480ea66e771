"""Helper program for test_reference_faults.py (not a test module).

    strace -f -e inject=SYSCALL:...:when=K ... python -B fault_child.py PLAN.json RESULT.json

Runs each scenario of the plan in a forked child and records how the child ended. strace keeps
its `when=` counters per thread, and a forked child starts its own from zero, so a child that
first makes K - n calls of a syscall itself (padding) gets the injection at the n-th call the
library makes. Importing torch once and forking per scenario keeps the whole run to one startup.

This process itself must not make the injected calls: it reports with pwrite(2), not write(2),
and never fsyncs, renames or unlinks.

Exit codes of a scenario child: 0 the action returned; 20 CheckpointWriteError ENOSPC, 21 EIO,
22 another errno, plus 5 if the error says the checkpoint was committed first (25, 26, 27); 10
plain OSError ENOSPC, 11 EIO, 12 other OSError (untyped: the library should never let these out);
13 other CheckpointError, 14 any other exception; killed children report -signal.
Calibration scenarios exit with the number of successful calls before the first failure.
"""
from __future__ import annotations

import errno
import json
import os
import sys

import torch
from resume_conformance import reference


def _payload(step: int) -> dict:
    """The reference trainer's model with Adam- and StepLR-shaped state. No real optimizer: its
    constructor imports torch._dynamo, seconds of startup under ptrace for nothing."""
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    params = list(model.parameters())
    payload = reference.capture(model, global_step=step, loss_history=[1.0 / (i + 1) for i in range(step)])
    payload["optimizer"] = {
        "state": {i: {"step": torch.tensor(float(step)), "exp_avg": torch.randn_like(p),
                      "exp_avg_sq": torch.rand_like(p)} for i, p in enumerate(params)},
        "param_groups": [{"lr": 0.05, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0,
                          "amsgrad": False, "params": list(range(len(params)))}],
    }
    payload["scheduler"] = {"step_size": 4, "gamma": 0.7, "base_lrs": [0.05], "last_epoch": step,
                            "_step_count": step + 1}
    return payload


def _pad(syscall: str, count: int, scratch: str) -> None:
    """Make `count` calls of `syscall` that succeed and change nothing that matters."""
    os.makedirs(scratch, exist_ok=True)
    if syscall == "write":
        fd = os.open(os.devnull, os.O_WRONLY)
        for _ in range(count):
            os.write(fd, b"x")
        os.close(fd)
    elif syscall == "fsync":
        fd = os.open(os.path.join(scratch, "fsync-pad"), os.O_WRONLY | os.O_CREAT, 0o644)
        for _ in range(count):
            os.fsync(fd)
        os.close(fd)
    elif syscall in ("unlink", "unlinkat"):
        dir_fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)
        for i in range(count):
            name = f"unlink-pad-{i}"
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=dir_fd))
            if syscall == "unlink":
                os.unlink(os.path.join(scratch, name))      # unlink(2)
            else:
                os.unlink(name, dir_fd=dir_fd)               # unlinkat(2), as shutil.rmtree does
        os.close(dir_fd)
    elif syscall == "rename":
        a, b = os.path.join(scratch, "rename-a"), os.path.join(scratch, "rename-b")
        os.close(os.open(a, os.O_WRONLY | os.O_CREAT, 0o644))
        for _ in range(count):
            os.replace(a, b)
            a, b = b, a
    elif syscall == "rmdir":
        for i in range(count):
            path = os.path.join(scratch, f"rmdir-pad-{i}")
            os.mkdir(path)
            os.rmdir(path)
    else:
        raise ValueError(syscall)


def _calibrate(syscall: str, scratch: str) -> int:
    """Count successful calls until the first failure (the injection), at most 1000."""
    for n in range(1000):
        try:
            _pad(syscall, 1, os.path.join(scratch, f"cal-{n}"))
        except OSError:
            return n
    return 255


def _act(scenario: dict, payloads: dict) -> None:
    action = scenario["action"]
    payload = payloads[scenario["step"]]
    if action == "save_file":
        reference.save_file(payload, scenario["target"])
    elif action == "save_sharded":
        reference.save_sharded(payload, scenario["target"], num_shards=2,
                               max_workers=scenario.get("workers", 1))
    elif action == "manager_save":
        manager = scenario["_manager"]
        manager.save(payload, force=True)
    else:
        raise ValueError(action)


def _run_child(scenario: dict, pad_target: int, payloads: dict) -> int:
    scratch = scenario["scratch"]
    if scenario["action"] == "calibrate":
        _pad(scenario["syscall"], pad_target - scenario["nth"], scratch)
        return min(_calibrate(scenario["syscall"], scratch), 255)
    if scenario["action"] == "manager_save":
        # built before padding: the constructor itself unlinks nothing (no stale temps) and writes nothing
        scenario["_manager"] = reference.CheckpointManager(
            scenario["run_dir"], keep_last=scenario.get("keep_last"), layout=scenario["layout"],
            num_shards=2, max_workers=scenario.get("workers", 1))
    if scenario.get("syscall"):
        _pad(scenario["syscall"], pad_target - scenario["nth"], scratch)
    try:
        _act(scenario, payloads)
    except reference.CheckpointWriteError as exc:   # the typed error (an OSError too)
        return {errno.ENOSPC: 20, errno.EIO: 21}.get(exc.errno, 22) + (5 if exc.committed else 0)
    except OSError as exc:
        return {errno.ENOSPC: 10, errno.EIO: 11}.get(exc.errno, 12)
    except reference.CheckpointError:
        return 13
    except BaseException:
        return 14
    return 0


def main(plan_path: str, result_path: str) -> int:
    with open(plan_path) as f:
        plan = json.load(f)
    pad_target = int(plan["pad_target"])
    steps = sorted({s["step"] for s in plan["scenarios"] if "step" in s})
    payloads = {step: _payload(step) for step in steps}
    results = {}
    for scenario in plan["scenarios"]:
        pid = os.fork()
        if pid == 0:
            code = 14
            try:
                code = _run_child(scenario, pad_target, payloads)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        results[scenario["id"]] = os.waitstatus_to_exitcode(status)
    data = json.dumps(results).encode()
    fd = os.open(result_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.pwrite(fd, data, 0)  # pwrite64(2): not counted by an injection on write(2)
    os.close(fd)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1], sys.argv[2])
    os._exit(code)  # skip interpreter teardown (seconds under ptrace); nothing is left to flush
