"""Every command in the README and docs/ is exercised here, so the documentation cannot drift from
the code: each ```bash line is classified by the program it runs, and each is either run for real
(with placeholders such as `mytrain` filled in by a small real trainer) or, where running it would
take minutes (a whole suite, a benchmark, a soak), parsed by that program's own argument parser or
collected by pytest. A command of a kind this module does not know fails the test.

The README's adapter example is itself written to disk and used as the `mytrain` package."""
from __future__ import annotations

import importlib
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK_RE = re.compile(r"```(\w+)\n(.*?)```", re.DOTALL)

# A training script with the `main(...)` the README's adapter example calls, and the command
# contract when run as `python -m mytrain.train` or `python train.py`: the bundled trainer underneath.
TRAIN_PY = '''\
import sys
from pathlib import Path

from resume_conformance.fixtures.contract import LossLog, RunConfig
from resume_conformance.fixtures.reference_trainer import ReferenceTrainer


def main(ckpt_dir, max_steps, save_every, seed, on_step):
    class Log:   # the bundled trainer's LossLog, reporting to on_step (its state digests dropped)
        def log(self, step, loss, metric=None, state=None):
            on_step(step, loss)

        def resumed(self, step, state):
            pass
    import resume_conformance.fixtures.reference_trainer as rt
    rt.LossLog = lambda path: Log()
    return ReferenceTrainer(RunConfig(Path(ckpt_dir), max_steps, save_every, seed, Path("unused"))).run()


if __name__ == "__main__":
    cfg = RunConfig.from_env()
    sys.exit(ReferenceTrainer(cfg).run())
'''


def blocks(page: Path, language: str) -> list[str]:
    return [body for lang, body in BLOCK_RE.findall(page.read_text()) if lang == language]


def commands() -> list[tuple[str, str]]:
    """(page, command) for every command line of every ```bash block (`&&` chains split)."""
    out = []
    for page in PAGES:
        for body in blocks(page, "bash"):
            for line in body.replace("\\\n", " ").splitlines():
                line = re.split(r"\s{2,}#", line)[0].strip()
                if line and not line.startswith("#"):
                    out += [(page.name, part.strip()) for part in line.split("&&")]
    return out


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A directory with the README's `mytrain` adapter, a script trainer, a checkpoint directory
    and a saved report, where the documented commands run."""
    d = tmp_path_factory.mktemp("docs")
    (d / "mytrain").mkdir()
    (d / "mytrain" / "__init__.py").write_text("")
    (d / "mytrain" / "train.py").write_text(TRAIN_PY)
    example = next(b for b in blocks(REPO / "README.md", "python") if "conformance_adapter.py" in b)
    (d / "mytrain" / "conformance_adapter.py").write_text(example)
    (d / "train.py").write_text("import runpy\nrunpy.run_module('mytrain.train', run_name='__main__')\n")
    from resume_conformance import reference

    from tests.strategies import trainer_payload
    (d / "path" / "to" / "checkpoints").mkdir(parents=True)
    reference.CheckpointManager(d / "path" / "to" / "checkpoints").save(trainer_payload(step=3), force=True)
    from conformance.report import report
    report.write_report(report.environment(None, "ci", []), d / "conformance-report")
    (d / "fixtures").symlink_to(REPO / "fixtures")   # documented paths are relative to the repository root
    (d / "conformance-expected-failures.txt").write_text((REPO / "examples" / "conformance-expected-failures.txt").read_text())
    return d


def _argv(command: str, workspace: Path) -> list[str]:
    command = command.replace("mypkg.train:ADAPTER", "mytrain.conformance_adapter:ADAPTER")
    command = command.replace('"python train.py --small"', f'"{sys.executable} train.py --small"')
    command = command.replace('"python -m mytrain.train --small"', f'"{sys.executable} -m mytrain.train --small"')
    argv = shlex.split(command)
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def _parser_of(module: str):
    import importlib
    if module == "conformance":
        return importlib.import_module("conformance.__main__").build_parser()
    if module == "resume_conformance.reference":
        return importlib.import_module("resume_conformance.reference.__main__").parser()
    if module in ("conformance.bench", "resume_conformance.reference.bench"):
        mod = importlib.import_module(f"{module}.cli" if module == "resume_conformance.reference.bench" else f"{module}.measure")
        return mod.build_parser()
    raise AssertionError(f"no parser known for python -m {module}")


def exercise(command: str, workspace: Path) -> None:
    argv = _argv(command, workspace)
    run = lambda args, **kw: subprocess.run(args, cwd=workspace, capture_output=True, text=True,  # noqa: E731
                                            timeout=600, **kw)
    if argv[:2] == ["git", "clone"] or argv[0] == "cd":   # the README's first command starts from a clone
        assert argv[0] == "git" or argv[1:] == ["resume-conformance"], command
        return
    if argv[:2] == ["pip", "install"]:
        extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
        for word in argv[2:]:
            m = re.search(r"\[([\w,]+)\]", word)
            if m:
                assert set(m.group(1).split(",")) <= extras, f"unknown extra in {command!r}"
            if word.startswith("torch=="):
                assert re.fullmatch(r"torch==\d+\.\d+\.\d+", word)
        return
    is_pytest = argv[0] == "pytest" or argv[1:3] == ["-m", "pytest"]
    if is_pytest:
        args = argv[1:] if argv[0] == "pytest" else argv[3:]
        adapter = next((a.split("=", 1)[1] for a in args if a.startswith("--adapter=resume_conformance.fixtures.")), None)
        if adapter:    # a documented trainer of a real library runs where its extra is installed
            try:
                importlib.import_module(adapter.partition(":")[0])
            except ImportError as exc:
                if "pip install resume-conformance[" not in str(exc):
                    raise
                pytest.skip(f"{command}: {exc}")
        if args and args[-1] == "tests":        # the project's own test command: collect from the checkout
            proc = subprocess.run([sys.executable, "-m", "pytest", *args, "--collect-only", "-q"], cwd=REPO,
                                  capture_output=True, text=True, timeout=600)
        else:
            proc = run([sys.executable, "-m", "pytest", *args, "--collect-only", "-q", "-p", "no:cacheprovider"])
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        assert "collected" in proc.stdout or "tests collected" in proc.stdout
        return
    if argv[0] == sys.executable and argv[1].endswith(".py"):   # a script of this repository
        proc = run([sys.executable, str(REPO / argv[1]), *argv[2:]])
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
        return
    assert argv[0] == sys.executable and argv[1] == "-m", f"a command of a kind this test does not know: {command!r}"
    module, args = argv[2], argv[3:]
    if module == "resume_conformance.reference" or (module == "conformance" and args[0] in ("report", "replay", "badge")):
        proc = run([sys.executable, "-m", module, *args])
        allowed = {0, 1} if module == "conformance" else {0}
        assert proc.returncode in allowed, f"{command}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        return
    # a soak, a benchmark, or init (whose run of the suite test_conformance_levels.py makes end to end): parse only
    try:
        parsed = vars(_parser_of(module).parse_args(args))
    except SystemExit as exc:     # argparse refuses the command: its usage error is on stderr
        pytest.fail(f"{command}: its parser refuses it (exit {exc.code})")
    for word in args:              # every value the command gives lands in some option
        flag, eq, value = word.partition("=")
        if flag.startswith("--") and eq:
            assert any(value == str(v) or value in repr(v) for v in parsed.values()), \
                f"{command}: {word} was not taken as given ({parsed})"


@pytest.mark.slow
@pytest.mark.parametrize("page, command", commands(), ids=[f"{p}:{c[:60]}" for p, c in commands()])
def test_every_documented_command_runs(workspace, page, command):
    exercise(command, workspace)


def test_the_docs_have_commands():
    assert len(commands()) >= 10


README = REPO / "README.md"
# What the README is for, in its order: the rest of it (the checks, CI, the reference library) may grow.
README_SECTIONS = ("The two commands", "Test your own trainer", "Reading a failure", "The command contract")


def sections(page: Path) -> dict[str, str]:
    """A page's `## ` sections: heading -> its text up to the next `## ` heading (fenced blocks kept whole)."""
    out: dict[str, str] = {}
    heading, fenced = None, False
    for line in page.read_text().splitlines(keepends=True):
        fenced ^= line.startswith("```")
        if line.startswith("## ") and not fenced:
            heading = line[3:].strip()
            out[heading] = ""
        elif heading is not None:
            out[heading] += line
    return out


def section_blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in BLOCK_RE.findall(text) if lang == language]


def test_the_readme_has_its_sections_in_order():
    headings = list(sections(README))
    assert [h for h in headings if h in README_SECTIONS] == list(README_SECTIONS), headings


def test_the_two_commands_are_the_suites_and_the_projects_own():
    """The first runs the suite from a clone, as the neighbours test runs it; the second is the test
    command CI runs (.ci/run)."""
    from tests.test_conformance_citizen import README_FIRST
    first, own = [body.replace("\\\n", " ") for body in section_blocks(sections(README)["The two commands"], "bash")]
    assert first.startswith("git clone ") and "pip install -e " in first, first
    assert " ".join(README_FIRST[1:]) in " ".join(first.split()), first   # README_FIRST: ["-m", "pytest", ...]
    assert own.strip() in (REPO / ".ci" / "run").read_text().splitlines(), f"{own.strip()!r} is not what .ci/run runs"


def test_test_your_own_trainer_shows_an_adapter_and_a_command_for_each_kind_of_trainer():
    text = sections(README)["Test your own trainer"]
    assert any("conformance_adapter.py" in b and "def run(self, ctx" in b for b in section_blocks(text, "python"))
    runs = " ".join(section_blocks(text, "bash"))
    assert "--adapter=mytrain.conformance_adapter:ADAPTER" in runs and "--trainer-cmd=" in runs, runs


def test_reading_a_failure_shows_a_failure_of_a_real_check_and_its_replay_line():
    from conformance.checks.registry import all_check_ids
    shown = section_blocks(sections(README)["Reading a failure"], "text")
    assert len(shown) == 1, shown
    check = re.match(r"\[(\w+)\]", shown[0]).group(1)
    assert check in all_check_ids(), check
    replay = next(line.split("replay:", 1)[1].strip() for line in shown[0].splitlines() if "replay:" in line)
    argv = shlex.split(replay)
    assert argv[:4] == ["python", "-m", "conformance", "replay"], replay
    assert _parser_of("conformance").parse_args(argv[3:]).check == check, f"{replay!r} does not replay {check}"


def test_the_command_contract_table_is_what_a_trainer_is_given():
    """Every variable the table names is one RunContext.from_env reads, and every one it cannot do
    without (read as e["..."], not as optional) is in the table."""
    import inspect

    from conformance import RunContext
    table = {m for m in re.findall(r"^\| `(CONFORMANCE_\w+)` \|", sections(README)["The command contract"], re.MULTILINE)}
    source = inspect.getsource(RunContext.from_env)
    assert table <= set(re.findall(r"CONFORMANCE_\w+", source)), sorted(table - set(re.findall(r"CONFORMANCE_\w+", source)))
    required = set(re.findall(r'e\["(CONFORMANCE_\w+)"\]', source))
    assert required and required <= table, sorted(required - table)


def test_no_readme_line_over_200_characters():
    """Prose and hand-written tables wrap, and so do commands (a `\\` continuation, which commands()
    joins). Exempt: ```text blocks, which show output as it is printed. The generated checks table
    counts too: each row is a check's short title, and docs/checks.md holds its full summary."""
    long, fence = [], None
    for n, line in enumerate(README.read_text().splitlines()):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        if len(line) > 200 and fence != "text":
            long.append(f"README.md:{n + 1} ({len(line)} characters): {line[:60]}...")
    assert not long, long


def test_each_check_has_a_short_title_and_a_full_summary():
    """The README's table shows the title; a title that grows into the summary makes the row unreadable."""
    from conformance.checks.registry import CHECKS
    long = [(c.id, len(c.title)) for c in CHECKS if not 20 <= len(c.title) <= 90 or len(c.title) >= len(c.summary)]
    assert not long, long


def test_every_link_to_a_heading_of_the_docs_finds_it():
    """A fact moved to another page is reached by its link, so the link must land."""
    def slug(heading: str) -> str:
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    def anchors(page: Path) -> set[str]:
        fenced, out = False, set()
        for line in page.read_text().splitlines():
            fenced ^= line.startswith("```")
            if line.startswith("#") and not fenced:
                out.add(slug(line.lstrip("#")))
        return out
    broken = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)\s#]*)#([^)\s]+)\)", page.read_text()):
            linked = (page.parent / target) if target else page
            if not linked.is_file() or anchor not in anchors(linked):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert not broken, broken


def test_the_bench_commands_leave_the_hand_measured_section_alone(tmp_path):
    """docs/benchmarks.md's "Measured by hand" section is not any command's: each `--update-readme`
    replaces what follows its marker up to the next heading, so the section must survive both."""
    from conformance.report.readme import replace_section
    page = tmp_path / "benchmarks.md"
    page.write_text((REPO / "docs" / "benchmarks.md").read_text())
    hand = sections(page)["Measured by hand (not regenerated)"]
    markers = re.findall(r"^<!-- [\w-]+-bench -->$", page.read_text(), re.MULTILINE)
    assert len(markers) == 2, markers
    for marker in markers:
        replace_section(page, marker, "| regenerated |")
    assert sections(page)["Measured by hand (not regenerated)"] == hand


def test_the_broken_trainer_table_is_the_catalogue():
    from resume_conformance.fixtures.broken import CATALOGUE
    text = (REPO / "docs" / "fixtures.md").read_text()
    for trainer, (_, check) in CATALOGUE.items():
        assert re.search(rf"\| `{trainer}` \| `{re.escape(check)}` \|", text), f"docs/fixtures.md lacks {trainer}"


@pytest.mark.slow
def test_the_readme_adapter_example_passes_determinism(workspace):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pyargs", "conformance",
                           "--adapter=mytrain.conformance_adapter:ADAPTER", "-k", "determinism"],
                          cwd=workspace, capture_output=True, text=True, timeout=600)
    assert "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_the_docs_name_one_gate_command_and_it_is_the_one_init_writes():
    """docs/running.md's gate command is init's, which test_conformance_levels.py runs as written."""
    from conformance.cli.init import GATE
    lines = (REPO / "docs" / "running.md").read_text().splitlines()
    at = lines.index("<!-- the gate command -->")
    assert lines[at + 1:at + 4] == ["```bash", GATE, "```"]
