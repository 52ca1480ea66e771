"""The development harness itself (conftest.py): the pytest processes the tests start are forked
from a process that imported torch once, and must look to the code they run exactly like a fresh
`python -c` started in their directory with their environment."""
from __future__ import annotations

import textwrap

import pytest

PROBE = '''
import os, signal, sys

def test_probe():
    import localmod   # the directory it was started in comes first, as '' does for python -c
    assert localmod.__file__ == os.path.join(os.getcwd(), "localmod.py")
    assert "" in sys.path
    assert os.environ["PROBE"] == "given" and "PYTEST_XDIST_WORKER" not in os.environ
    assert os.path.join(os.getcwd(), "extra_dir") in sys.path[:4], sys.path   # PYTHONPATH, as python -c has it
    # nothing of this project's test package (a generated project may have its own `tests`)
    assert "tests" not in sys.modules and "conftest" not in sys.modules
    assert signal.getsignal(signal.SIGINT) is {sigint}
    print("PROBE-RAN", file=sys.stderr)
'''


@pytest.mark.parametrize("fresh", ["0", "1"], ids=["forked", "fresh"])
@pytest.mark.parametrize("sigint_ignored", [False, True])
def test_a_pytest_child_sees_what_a_fresh_interpreter_started_there_would(tmp_path, monkeypatch, fresh,
                                                                          sigint_ignored):
    import conftest
    monkeypatch.setenv("CONFORMANCE_TESTS_FRESH", fresh)
    work = tmp_path / "work"
    work.mkdir()
    (work / "localmod.py").write_text("VALUE = 1\n")
    sigint = "signal.SIG_IGN" if sigint_ignored else "signal.default_int_handler"
    (work / "test_probe.py").write_text(textwrap.dedent(PROBE.format(sigint=sigint)))
    env = {**conftest._env(), "PROBE": "given", "PYTHONPATH": "extra_dir"}
    proc = conftest.run_python_pytest(["-q", "-s", "-p", "no:cacheprovider", "test_probe.py"], cwd=work, env=env,
                                      timeout=300, sigint_ignored=sigint_ignored)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PROBE-RAN" in proc.stderr


def test_a_pytest_child_past_its_timeout_is_killed_and_reported_like_subprocess_run(tmp_path):
    import subprocess

    import conftest
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_slow():\n    time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        conftest.run_python_pytest(["-q", "-p", "no:cacheprovider", "test_slow.py"], cwd=tmp_path,
                                   env=conftest._env(), timeout=3)
