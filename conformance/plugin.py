"""pytest plugin (entry point `pytest11: conformance`): options, Hypothesis profiles, fixtures.

    pytest --pyargs conformance -n auto --adapter=pkg.module:attr
    pytest --pyargs conformance -n auto --trainer-cmd="python train.py --foo"

Both can live in the team's pytest configuration (`conformance_adapter = ...`,
`conformance_trainer_cmd = ...`), so the CI gate is a bare `pytest -n auto`.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings

from . import checks
from .adapters import resolve
from .trials import SubprocessRunner, WarmRunner

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.function_scoped_fixture])
# quick and ci are derandomized: a gate must give the same verdict on the same code every time.
# fuzz explores: random draws, and failures are kept in the example database for replay.
settings.register_profile("quick", max_examples=3, derandomize=True,
                          phases=[Phase.explicit, Phase.generate], **_COMMON)
settings.register_profile("ci", max_examples=8, derandomize=True, **_COMMON)
settings.register_profile("fuzz", max_examples=5000, derandomize=False, **_COMMON)


def pytest_addoption(parser):
    group = parser.getgroup("conformance", "resume-determinism conformance suite")
    group.addoption("--adapter", default=None,
                    help="Python adapter 'package.module:attribute' (default: the bundled reference trainer)")
    group.addoption("--trainer-cmd", default=None,
                    help="command that starts the trainer following the command contract")
    group.addoption("--runner", choices=("warm", "fresh"), default=None,
                    help="warm: fork trainer processes from a process that imported torch once "
                         "(default); fresh: a new interpreter per process")
    group.addoption("--loss-tol", type=float, default=None,
                    help=f"max absolute loss difference per step (default {checks.DEFAULT_TOL:g})")
    parser.addini("conformance_adapter", "default for --adapter")
    parser.addini("conformance_trainer_cmd", "default for --trainer-cmd")
    parser.addini("conformance_loss_tol", "default for --loss-tol")
    parser.addini("conformance_runner", "default for --runner")


def _option(config, name: str):
    opt = {"adapter": "--adapter", "trainer_cmd": "--trainer-cmd", "loss_tol": "--loss-tol",
           "runner": "--runner"}[name]
    value = config.getoption(opt)
    if value is None:
        value = config.getini(f"conformance_{name}") or None
    return value


@pytest.fixture(scope="session")
def conformance_session_for(request, tmp_path_factory):
    """Factory: a cached checks.Session for an adapter given by class attribute or options."""
    config = request.config
    cache: dict = {}
    tol = _option(config, "loss_tol")
    tol = float(tol) if tol is not None else checks.DEFAULT_TOL

    def get(adapter=None, trainer_cmd=None) -> checks.Session:
        if adapter is None and trainer_cmd is None:
            adapter, trainer_cmd = _option(config, "adapter"), _option(config, "trainer_cmd")
        key = (repr(adapter), trainer_cmd)
        if key not in cache:
            if adapter is not None and not isinstance(adapter, str):
                from .adapters import TrainerAdapter
                resolved = adapter if isinstance(adapter, TrainerAdapter) else None
                if resolved is None:
                    raise pytest.UsageError(f"adapter class attribute must be a 'pkg.mod:attr' string or "
                                            f"a TrainerAdapter, got {adapter!r}")
            else:
                try:
                    resolved = resolve(adapter, trainer_cmd)
                except (ImportError, AttributeError, ValueError, TypeError) as exc:
                    raise pytest.UsageError(f"cannot load the trainer adapter: {exc}") from exc
            runner = SubprocessRunner() if _option(config, "runner") == "fresh" else WarmRunner()
            cache[key] = checks.Session(resolved, tmp_path_factory.mktemp("conformance"), runner=runner, tol=tol)
        return cache[key]

    yield get
    for session in cache.values():
        session.close()
