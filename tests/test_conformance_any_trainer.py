"""What any trainer can say to the suite (issue 53, part E): a trainer command declares capabilities
(--capabilities, ini conformance_capabilities); a failure's replay line carries the environment
variables that chose the trainer's variant (--carry-env) and names those it left out; state_digest
digests any state a real optimizer or scheduler holds, and names what it left out."""
from __future__ import annotations

import collections
import json
import os
import random
import shlex
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest

from conformance.__main__ import build_parser
from conformance.checks.failures import fail, replay_command
from conformance.contract import StateLeftOut, state_digest
from conformance.model.adapters import AdapterError, Capability, resolve
from conformance.model.digest import MAX_DEPTH, Why
from conformance.model.process import RunSpec

REPO = Path(__file__).resolve().parents[1]
COMMAND = f"{sys.executable} -m resume_conformance.fixtures.reference_trainer"
ADAPTER = "resume_conformance.fixtures.reference_trainer:ADAPTER"


def replayed(line: str):
    """The replay line as `python -m conformance replay` parses it: (what precedes `python`, its args)."""
    argv = shlex.split(line)
    start = argv.index("python")
    return argv[:start], build_parser().parse_args(argv[start + 3:])


# -- capabilities of a trainer command ---------------------------------------------------------------
def test_a_trainer_command_declares_capabilities_and_its_replay_line_carries_them():
    plain = resolve(None, COMMAND, environ={})
    assert plain.capabilities == {Capability.SYSCALL_CRASH}
    assert plain.lacks("extendable") == ("adapter lacks capability 'extendable' (a trainer command declares it: "
                                         "--capabilities=extendable)")
    adapter = resolve(None, COMMAND, capabilities="resume_from, extendable", environ={})
    assert adapter.capabilities == {Capability.SYSCALL_CRASH, Capability.EXTENDABLE, Capability.RESUME_FROM}
    line = replay_command(adapter, "extend_run", RunSpec(14, 3, 0))
    assert "--capabilities=extendable,resume_from" in line, line
    _, args = replayed(line)
    again = resolve(args.adapter, args.trainer_cmd, capabilities=args.capabilities, environ={})
    assert again.capabilities == adapter.capabilities


def test_the_ini_keys_reach_the_trainer_the_plugin_resolves(monkeypatch, tmp_path):
    from conformance import plugin
    monkeypatch.setattr(plugin, "_freeze", lambda: None)            # this test process's collector stays as it is
    monkeypatch.setattr(plugin, "_SUITE_LOADED", [])
    monkeypatch.setenv("DS_ZERO_STAGE", "2")
    ini = {"conformance_capabilities": "extendable\nresume_from", "conformance_carry_env": "DS_ZERO_STAGE"}

    class Config:       # what options.option reads: no flag given, the ini values above
        rootpath = tmp_path

        @staticmethod
        def getoption(dest):
            return None

        @staticmethod
        def getini(key):
            return ini.get(key, "")

    found = plugin._resolve(Config, None, COMMAND)
    assert {Capability.EXTENDABLE, Capability.RESUME_FROM} <= found.capabilities
    assert found.carried_env == (("DS_ZERO_STAGE", "2"),)
    with pytest.raises(AdapterError, match="which declares its own"):
        plugin._resolve(Config, ADAPTER, None)


@pytest.mark.parametrize("given, message", [
    ("extendible", "--capabilities (ini key conformance_capabilities): 'extendible' is not a capability "
                   "(did you mean 'extendable'?)"),
    ("extendable,Resume_From", "'Resume_From' is not a capability (did you mean 'resume_from'?)"),
    ("legacy_samples", "legacy_samples is not declared by name"),
])
def test_an_unknown_capability_names_the_option_and_the_nearest_capability(given, message):
    with pytest.raises(AdapterError) as info:
        resolve(None, COMMAND, capabilities=given, environ={})
    assert message in info.value.cause, info.value.cause


def test_a_python_adapter_declares_its_own_capabilities():
    with pytest.raises(AdapterError) as info:
        resolve(ADAPTER, None, capabilities="extendable", environ={})
    assert "which declares its own (extendable, preemption_save, sharded, syscall_crash)" in info.value.cause
    assert info.value.fix.startswith("declare them in the adapter's `capabilities`")


# -- the environment a replay line carries -------------------------------------------------------------
RUN_ENV = {"DS_ZERO_STAGE": "2", "MY_VARIANT": "it's a \"b\" $HOME\nline", "DS_ACCELERATOR": "cpu",
           "TORCH_HOME": "/cache/torch", "HF_TOKEN": "secret", "OMP_NUM_THREADS": "4", "CONFORMANCE_SEED": "3",
           "PATH": "/usr/bin"}


def test_the_replay_line_sets_the_carried_variables_as_the_run_had_them(tmp_path):
    adapter = resolve(None, COMMAND, carry_env="MY_VARIANT, DS_ZERO_STAGE,NOT_SET", environ=RUN_ENV)
    line = replay_command(adapter, "resume_matches_baseline", RunSpec(14, 3, 0), {"schedule": "step:10"})
    before, args = replayed(line)
    assert before[0] == "env" and args.carry_env == "MY_VARIANT,DS_ZERO_STAGE,NOT_SET", line
    # The prefix, run in a shell whose environment differs, gives the process after it the run's values.
    shown = "import json, os; print(json.dumps({k: os.environ.get(k) for k in ('MY_VARIANT', 'DS_ZERO_STAGE', 'NOT_SET')}))"
    prefix = line[:line.index(" python ")]
    proc = subprocess.run(["bash", "-c", f"{prefix} {shlex.quote(sys.executable)} -c {shlex.quote(shown)}"],
                          env={"PATH": "/usr/bin:/bin", "NOT_SET": "mine", "DS_ZERO_STAGE": "3"},
                          capture_output=True, text=True, timeout=60)
    assert json.loads(proc.stdout) == {"MY_VARIANT": RUN_ENV["MY_VARIANT"], "DS_ZERO_STAGE": "2", "NOT_SET": None}, proc
    # The replay, run with the values it set, carries them again.
    again = resolve(args.adapter, args.trainer_cmd, carry_env=args.carry_env, environ={**RUN_ENV, "NOT_SET": ""})
    assert again.carried_env[:2] == adapter.carried_env[:2]


def test_the_failure_names_variant_variables_it_did_not_carry():
    adapter = resolve(None, COMMAND, carry_env="DS_ZERO_STAGE", environ=RUN_ENV)
    assert adapter.env_left_out == ("DS_ACCELERATOR", "OMP_NUM_THREADS")   # not a place, a token, nor the suite's
    message = str(fail("extend_run", adapter, RunSpec(14, 3, 0), "it failed")).splitlines()
    at = next(i for i, line in enumerate(message) if line.startswith("  replay:   env DS_ZERO_STAGE=2 python -m"))
    assert message[at + 1].strip().startswith("not carried: DS_ACCELERATOR, OMP_NUM_THREADS (set in this run"), message
    assert "--carry-env=DS_ZERO_STAGE,DS_ACCELERATOR,OMP_NUM_THREADS" in message[at + 1]
    assert "cpu" not in message[at + 1]                                   # names, never values
    quiet = resolve(None, COMMAND, carry_env="DS_ZERO_STAGE,DS_ACCELERATOR,OMP_NUM_THREADS", environ=RUN_ENV)
    assert quiet.replay_note() is None


VARIANT = textwrap.dedent("""\
    import os, runpy
    broken = os.environ.get("MY_VARIANT") == "broken"    # the variant the environment chooses
    runpy.run_module("resume_conformance.fixtures.broken.total_from_checkpoint" if broken
                     else "resume_conformance.fixtures.reference_trainer", run_name="__main__")
""")


@pytest.mark.slow
@pytest.mark.needs_strace
def test_the_replay_line_replays_the_variant_the_environment_chose(tmp_path, monkeypatch):
    """The replay line of a trainer command that declares `extendable`, pasted into a shell without
    the variable, replays the variant that failed (without it the trainer is the bundled one, which
    extends a finished run), and prints the same line again."""
    (tmp_path / "train.py").write_text(VARIANT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MY_VARIANT", "broken")
    adapter = resolve(None, f"{sys.executable} train.py", capabilities="extendable", carry_env="MY_VARIANT")
    line = replay_command(adapter, "extend_run", RunSpec(14, 3, 0))
    assert line.startswith("env MY_VARIANT=broken python -m conformance replay ") and "--capabilities=extendable" in line
    env = {k: v for k, v in os.environ.items() if k != "MY_VARIANT"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"    # `python` is this interpreter
    proc = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and proc.stdout.startswith("FAIL"), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"  replay:   {line}" in proc.stdout.splitlines(), proc.stdout[-2000:]


@pytest.mark.parametrize("names, message", [
    ("DS_ZERO_STAGE,CONFORMANCE_SEED", "CONFORMANCE_SEED is in the suite's own namespace"),
    ("DS-ZERO", "'DS-ZERO' is not an environment variable's name"),
])
def test_carry_env_refuses_the_suites_variables_and_what_is_not_a_name(names, message):
    with pytest.raises(AdapterError) as info:
        resolve(ADAPTER, None, carry_env=names, environ=RUN_ENV)
    assert message in info.value.cause and info.value.cause.startswith("--carry-env (ini key conformance_carry_env)")


# -- state_digest: any state a real optimizer or scheduler holds -----------------------------------------
class DynamicLossScaler:
    """The attributes of DeepSpeed 0.19's DynamicLossScaler (deepspeed/runtime/fp16/loss_scaler.py)."""

    def __init__(self, scale=2.0 ** 16):
        import torch
        self.cur_scale, self.cur_iter, self.last_overflow_iter = scale, 0, -1
        self.scale_factor, self.scale_window, self.min_scale = 2.0, 1000, 1
        self.delayed_shift = self.cur_hysteresis = 2
        self.consecutive_hysteresis = self.raise_error_at_min_scale = False
        self.dynamic, self.dtype = True, torch.float16


class ZeroOptimizer:
    """A ZeRO optimizer's state_dict(): tensors, a wrapped optimizer's state, and the LossScaler object."""

    def __init__(self, scale=2.0 ** 16):
        import torch
        self.partition = torch.arange(4, dtype=torch.float32)
        self.scaler = DynamicLossScaler(scale)

    def state_dict(self):
        return {"loss_scaler": self.scaler, "dynamic_loss_scale": True, "overflow": False, "zero_stage": 2,
                "single_partition_of_fp32_groups": [self.partition], "ds_version": "0.19.8"}


def test_a_zero_optimizers_state_dict_with_its_loss_scaler_is_digested():
    pytest.importorskip("torch")
    digests = state_digest(optimizer=ZeroOptimizer())
    assert digests.left_out == ()
    assert digests == state_digest(optimizer=ZeroOptimizer())
    assert digests != state_digest(optimizer=ZeroOptimizer(scale=2.0 ** 15))      # the scaler's state is in it
    stepped = ZeroOptimizer()
    stepped.scaler.cur_iter = 1
    assert digests != state_digest(optimizer=stepped)


class Scheduler:
    """What real objects hold besides state: a lambda, a lock, an open file, a thread, a logger, a generator."""

    def __init__(self, base_lr, log):
        import logging
        self.base_lr, self.history, self.tags = base_lr, collections.deque([1, 2]), {"warmup", "cosine"}
        self.lr_lambda = lambda step, k=base_lr: k * step
        self.lock, self.log, self.worker = threading.Lock(), log, threading.Thread(target=print)
        self.logger, self.batches = logging.getLogger("x"), (i for i in range(3))
        self.rng = random.Random(4)


def test_what_has_no_state_is_left_out_and_named_not_refused(tmp_path):
    with open(tmp_path / "log", "w") as log:
        with pytest.warns(StateLeftOut, match=r"left out 6 value\(s\).*scheduler\.batches \(builtins\.generator"):
            digests = state_digest(scheduler=Scheduler(0.1, log))
        assert {x.path: x.why for x in digests.left_out} == {
            "scheduler.batches": Why.RUNNING, "scheduler.lock": Why.RESOURCE, "scheduler.log": Why.RESOURCE,
            "scheduler.logger": Why.RESOURCE, "scheduler.lr_lambda": Why.CODE, "scheduler.worker": Why.RESOURCE}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StateLeftOut)
            same = state_digest(scheduler=Scheduler(0.1, log))
            other = Scheduler(0.1, log)
            other.rng.random()                                   # a generator's state is state
            moved = state_digest(scheduler=other)
            assert state_digest(scheduler=Scheduler(0.2, log)) != digests
            assert json.loads(json.dumps(digests)) == dict(digests)
    assert same == digests and moved != digests


def test_a_cycle_is_a_reference_and_the_walk_below_attributes_is_bounded(monkeypatch):
    from conformance.model import digest
    monkeypatch.setattr(digest, "MAX_VALUES", 1000)    # the bound's arithmetic, without walking 100000 values

    class Node:
        def __init__(self, inner=None):
            self.inner, self.me = inner, self

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StateLeftOut)
        cyclic = state_digest(x=Node(Node()))
        assert cyclic.left_out == () and cyclic == state_digest(x=Node(Node()))
        deep = Node()
        for _ in range(MAX_DEPTH + 5):
            deep = Node(deep)
        (left,) = state_digest(x=deep).left_out
        assert left.why is Why.DEEP and left.path.startswith("x" + ".inner" * (MAX_DEPTH // 2))
        big = Node()
        big.items, big.later = [[i] for i in range(1001)], [[1], [2]]   # attributes go by name
        (left,) = state_digest(x=big).left_out
        assert (left.path, left.why, left.more) == ("x.items", Why.LARGE, 1)   # and `later`, after it
        assert state_digest(x=[[i] for i in range(2000)]).left_out == ()   # a component itself is digested whole


DETERMINISM = textwrap.dedent("""
    import enum, importlib.util, json, sys, threading
    spec = importlib.util.spec_from_file_location("digest", sys.argv[1])   # alone: no torch, no suite to import
    digest = sys.modules["digest"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digest)
    state_digest = digest.state_digest

    class Color(enum.Enum):
        RED = 1

    class Key:                                   # a default repr: its address
        def __init__(self, name):
            self.name = name

    class Slotted:
        __slots__ = ("a", "__b")
        def __init__(self):
            self.a, self.__b = {"z", "y", "x"}, frozenset({("k", 1), ("j", 2)})

    class Holder:
        def __init__(self):
            names = {"alpha", "beta", "gamma", "delta", "epsilon"}   # iterates in another order per process
            self.by_key = {Key(n): n for n in names}
            self.names, self.color, self.slotted, self.me = names, Color.RED, Slotted(), self
            self.fn, self.lock, self.z = (lambda: 0), threading.Lock(), 1 + 2j

    digests = state_digest(optimizer={"holder": Holder(), "hooks": [print, len]})
    print(json.dumps({"digests": digests, "left_out": [x.describe() for x in digests.left_out]}))
""")


def test_the_digest_is_the_same_in_two_interpreters(tmp_path):
    script = tmp_path / "digest_it.py"
    script.write_text(DETERMINISM)
    outs = []
    for seed in ("1", "2"):
        proc = subprocess.run([sys.executable, "-W", "ignore", str(script), str(REPO / "conformance/model/digest.py")],
                              capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": seed},
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(json.loads(proc.stdout))
    assert outs[0] == outs[1]
    assert len(outs[0]["left_out"]) == 4, outs[0]     # the lambda, the lock, print, len


# A value of each kind digested before objects and sets were, and its digest then (computed with
# the code before this change): recorded digests of every trainer stay valid.
class Stateful:
    """An object with a state_dict(), as a scheduler is (constructing a torch optimizer here would import
    torch._dynamo: seconds)."""

    def state_dict(self):
        return {"base_lrs": [0.1], "last_epoch": 1, "_step_count": 2, "step_size": 2, "gamma": 0.5, "verbose": False}


def existing_kinds():
    import numpy as np
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.arange(6, dtype=torch.float64).reshape(2, 3) / 7)
        model[0].bias.copy_(torch.tensor([0.5, -0.25], dtype=torch.float64))
    adam = {"state": {1: {"step": torch.tensor(1.0), "exp_avg": torch.full((2,), 0.4, dtype=torch.float64),
                          "exp_avg_sq": torch.full((2,), 0.016, dtype=torch.float64)},
                      0: {"step": torch.tensor(1.0), "exp_avg": torch.full((2, 3), 0.4, dtype=torch.float64),
                          "exp_avg_sq": torch.full((2, 3), 0.016, dtype=torch.float64)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0, "amsgrad": False,
                              "maximize": False, "foreach": None, "capturable": False, "fused": None, "params": [0, 1]}]}
    point = collections.namedtuple("Point", "x y")
    return {
        "model": model, "optimizer": adam, "scheduler": Stateful(),
        "python_rng": random.Random(7).getstate(), "numpy_rng": np.random.RandomState(3).get_state(),
        "torch_rng": torch.Generator().manual_seed(5).get_state(),
        "mixed": {2: [1.5, -0.0, float("inf")], 1: (None, True, False), "s": "\u00e9", b"k": b"\x00\x01",
                  "nested": {"a": [[], {}], "ba": bytearray(b"zz")}, 1.5: "float key"},
        "ints": [1, 2, 3, 2 ** 70], "odict": collections.OrderedDict([("b", 1), ("a", 2)]), "named": point(1, 2.0),
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "np_scalars": [np.float64(1.25), np.int32(-3), np.bool_(True), np.str_("x")],
        "torch_meta": [torch.float16, torch.device("cpu"), torch.Size([2, 3])],
        "tensor_view": torch.arange(10, dtype=torch.int64)[::3], "bf16": torch.ones(2, dtype=torch.bfloat16),
    }


EXISTING = {
    "model": "b081fd121beab653b10ee6e885f5e2f3aa67edff68f9c9e16c26dd07dc52615d",
    "optimizer": "653b43797422b6a0886f2ac41b2e12177a1d2b28e7d30edd9af800f241785f61",
    "scheduler": "ce366f8d88b5b4b23eff3fc0c9395f099df765d8689fa5b4a3982f266394396b",
    "python_rng": "9a1c0c22ca32f85ba949a2b4eb931f5421aec714e6cbcb36386ab549aa46bed5",
    "numpy_rng": "a4e459b2e21665dff6ff602936343cac734acb68c985c97fed486ea1d2f3df20",
    "torch_rng": "7dc8c767e7792ccd49cae0ae423370a09c89e84f6079a624495f92e49a3b3555",
    "mixed": "2e2241ad520b67fb56a52bb1c3f19e16dc82bbce9478ff6ebe8fbe284b89e4f3",
    "ints": "ede4a812cad9f9350ddd4a2f2eb9696fe481cf5fd64ed04a881cb04fff5081a4",
    "odict": "76d37bb419f2ec881ec6473e0e644aac903976371b3ebe3c1447ec1013228bca",
    "named": "c4ee536edefff2a1b4be144c886fac353a820761e79ce9dc918feb5fb29a9c21",
    "array": "708a91ab25b700058fee4de1420147013eb0b573b9e7c7a92fbd8f2827c2efbf",
    "np_scalars": "38be2bbcbffaac101b541f39dd0d4b0a5d5492cbcc4aa876697f49dfeba26565",
    "torch_meta": "112d57fe985ce60d820e1f13a7d44b3cc619e131ff5dc1fcf381c9f51b5297fa",
    "tensor_view": "d0c613873307a1d326a660da8966ccf6e4202efab3c0fa201b5b64ae45ab04e6",
    "bf16": "81f20d7c24f47369bec77d9ec0dd13e89d3eb85c1a3bfcf662093ff8a8cee36c",
}


def test_what_was_digested_before_digests_as_it_did():
    pytest.importorskip("torch")
    assert dict(state_digest(**existing_kinds())) == EXISTING


# -- the docs ---------------------------------------------------------------------------------------
def test_the_options_table_in_running_md_is_the_flags_table():
    from conformance.model.flags import markdown_table
    from conformance.report.readme import OPTIONS_MARKER, table_after
    assert table_after(REPO / "docs" / "running.md", OPTIONS_MARKER) == markdown_table(), \
        "docs/running.md's options table is stale: regenerate it with python -m conformance.report.readme"
