"""`python -m conformance init`: the files a team needs to adopt the gate, then one green run.

Writes, for `--framework plain|lightning|accelerate|hf`:
- `conformance_adapter.py`: an adapter following the contract for that framework, with the team's
  own code left as holes marked `TODO`;
- `.github/workflows/checkpoint-conformance.yml`: the CI gate (pull requests: `ci`; nightly: `fuzz`);
- `conformance-expected-failures.txt`: empty, with the format in comments;
- `conformance-pytest.toml`: the `[tool.pytest.ini_options]` lines to merge into pyproject.toml.

Then it runs the `quick` profile once against the bundled reference trainer, so the team sees a
green run before changing anything. Existing files are never overwritten without `--force`.
"""
from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata, resources
from pathlib import Path

FRAMEWORKS = ("plain", "lightning", "accelerate", "hf")

_HEADER = '''"""Resume-conformance adapter for {framework}: written by `python -m conformance init`.

Fill in the TODOs with your own model, data and checkpoint code (keep them tiny: 14 steps should
take a second or two), then:

    pytest --pyargs conformance --adapter=conformance_adapter:ADAPTER --hypothesis-profile=conformance-quick

The contract: train from ctx.ckpt_dir (resume from the newest valid checkpoint there, else start
from ctx.seed), save every ctx.save_every steps, stop after ctx.total_steps optimizer steps, and
call ctx.log_step(step, loss) after every step, before that step's save.
"""
'''

_BODIES = {
    "plain": '''
class Adapter:
    name = "my-trainer"

    def run(self, ctx) -> int:
        model, optimizer = ..., ...              # TODO: your model and optimizer, seeded from ctx.seed
        step = 0
        # TODO: load the newest checkpoint in ctx.ckpt_dir that verifies, and restore model, optimizer,
        # scheduler, data position and every RNG from it; set `step` to its global step.
        while step < ctx.total_steps:
            loss = ...                           # TODO: one optimizer step of your training loop
            step += 1
            ctx.log_step(step, float(loss))
            if step % ctx.save_every == 0:
                ...                              # TODO: your checkpoint save (temp file, fsync, rename, fsync dir)
        return 0


ADAPTER = Adapter()
''',
    "lightning": '''import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint


class LogLoss(Callback):
    def __init__(self, ctx):
        self.ctx = ctx

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.ctx.log_step(trainer.global_step, float(outputs["loss"]))


class Adapter:
    name = "my-lightning-trainer"

    def run(self, ctx) -> int:
        L.seed_everything(ctx.seed)
        module, loader = ..., ...                # TODO: your LightningModule and a tiny DataLoader
        checkpoints = ModelCheckpoint(dirpath=ctx.ckpt_dir, every_n_train_steps=ctx.save_every, save_last=True)
        trainer = L.Trainer(max_steps=ctx.total_steps, callbacks=[checkpoints, LogLoss(ctx)], logger=False,
                            enable_progress_bar=False, accelerator="cpu", devices=1)
        trainer.fit(module, loader, ckpt_path="last")
        return 0


ADAPTER = Adapter()
''',
    "accelerate": '''from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed


class Adapter:
    name = "my-accelerate-trainer"

    def run(self, ctx) -> int:
        set_seed(ctx.seed)
        accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
            project_dir=str(ctx.ckpt_dir), automatic_checkpoint_naming=True, total_limit=2))
        model, optimizer, loader = ..., ..., ...   # TODO: your model, optimizer and a tiny DataLoader
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        step = 0
        # TODO: if ctx.ckpt_dir holds a checkpoint: accelerator.load_state(), restore `step` (e.g. an object
        # given to accelerator.register_for_checkpointing) and skip the batches already seen this epoch.
        while step < ctx.total_steps:
            for batch in loader:
                loss = ...                           # TODO: forward, accelerator.backward(loss), optimizer.step()
                step += 1
                ctx.log_step(step, float(loss))
                if step % ctx.save_every == 0:
                    accelerator.save_state()
                if step >= ctx.total_steps:
                    break
        return 0


ADAPTER = Adapter()
''',
    "hf": '''import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint


class LogLoss(TrainerCallback):
    def __init__(self, ctx):
        self.ctx = ctx

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.ctx.log_step(state.global_step, logs["loss"])


class Adapter:
    name = "my-hf-trainer"

    def run(self, ctx) -> int:
        transformers.set_seed(ctx.seed)
        model, dataset = ..., ...                # TODO: a tiny model built from a config, and a small dataset
        args = TrainingArguments(output_dir=str(ctx.ckpt_dir), max_steps=ctx.total_steps, save_steps=ctx.save_every,
                                 save_total_limit=2, logging_steps=1, seed=ctx.seed, use_cpu=True, report_to="none")
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[LogLoss(ctx)])
        resume = get_last_checkpoint(str(ctx.ckpt_dir)) is not None
        trainer.train(resume_from_checkpoint=True if resume else None)
        return 0


ADAPTER = Adapter()
''',
}

_EXPECTED = """# Expected failures: `<check id> : <reason>`, one per line (exact ids, e.g. corruption_detected[bitflip];
# an id without its parameter covers all of them). A listed check that passes fails the gate until its
# line is removed. Leave this file empty to gate on every check.
"""

GATE = "pytest --pyargs conformance -n auto -p no:cacheprovider"
_PYTEST = f"""# Merge into pyproject.toml. The CI gate is then this command, with no other option:
#     {GATE}
# (`--pyargs conformance` names the suite: a bare `pytest` collects only your own tests.) The suite's
# tests run under its gate profile, conformance-ci (seeded: the same code gets the same verdict),
# unless --hypothesis-profile selects another of its profiles; your own tests keep yours.
[tool.pytest.ini_options]
conformance_adapter = "conformance_adapter:ADAPTER"
conformance_expected_failures = "conformance-expected-failures.txt"
conformance_report = "conformance-report"
"""
_SUITE_LINE = "  SUITE: "   # the template's line that init fills in


def suite_requirement() -> tuple[str, str]:
    """(requirement, comment) for the workflow's SUITE line. The suite is on no package index, so CI
    installs it from the git commit this one was installed from, when pip recorded one."""
    try:
        info = json.loads(metadata.distribution("resume-conformance").read_text("direct_url.json") or "null")
    except metadata.PackageNotFoundError:
        info = None
    vcs = (info or {}).get("vcs_info")
    if vcs and vcs.get("commit_id"):
        return (f"resume-conformance[plots] @ {vcs['vcs']}+{info['url']}@{vcs['commit_id']}",
                "the commit this suite was installed from")
    return ("resume-conformance[plots] @ git+https://YOUR-GIT-HOST/resume-conformance@COMMIT",
            "EDIT: the suite is on no package index: its git URL and the commit you adopted (or a path)")


class InitError(Exception):
    """Files exist and --force was not given, or the directory cannot be written."""


def files(framework: str) -> dict[str, str]:
    """Relative path -> content for `framework`."""
    if framework not in FRAMEWORKS:
        raise InitError(f"unknown framework {framework!r}: one of {', '.join(FRAMEWORKS)}")
    workflow = resources.files("conformance").joinpath("templates/checkpoint-conformance.yml").read_text()
    workflow = workflow.replace("ADAPTER: mypkg.train:ADAPTER", "ADAPTER: conformance_adapter:ADAPTER")
    requirement, why = suite_requirement()
    workflow = "\n".join(f'  SUITE: "{requirement}"   # {why}' if line.startswith(_SUITE_LINE) else line
                          for line in workflow.splitlines()) + "\n"
    return {"conformance_adapter.py": _HEADER.format(framework=framework) + _BODIES[framework],
            ".github/workflows/checkpoint-conformance.yml": workflow,
            "conformance-expected-failures.txt": _EXPECTED,
            "conformance-pytest.toml": _PYTEST}


def write(directory: Path, framework: str, *, force: bool = False) -> list[Path]:
    """Write the files; refuses (writing nothing) if any exists, unless `force`."""
    planned = {directory / rel: text for rel, text in files(framework).items()}
    existing = [p for p in planned if p.exists()]
    if existing and not force:
        raise InitError("refusing to overwrite " + ", ".join(str(p) for p in existing) + " (use --force)")
    for path, text in planned.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return list(planned)


def first_run(directory: Path) -> int:
    """The quick profile against the bundled trainer, in `directory`: a green run to start from."""
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "conformance", "-p", "no:cacheprovider", "-n", "auto",
           "--hypothesis-profile=conformance-quick"]
    print("$ " + " ".join(cmd[2:]), flush=True)
    return subprocess.run(cmd, cwd=directory).returncode


def main(args) -> int:
    directory = Path(args.dir).resolve()
    try:
        written = write(directory, args.framework, force=args.force)
    except InitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path.relative_to(directory)}")
    print("next: fill in the TODOs of conformance_adapter.py, merge conformance-pytest.toml into pyproject.toml")
    if args.no_run:
        return 0
    print("first, a run against the bundled reference trainer (it should pass):", flush=True)
    return first_run(directory)
