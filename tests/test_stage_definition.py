"""The stage is a value read in one place (issue 25): zerokern/zero/core/stage.py turns (stage, world
size) into a Strategy; no other runtime file compares a stage number. The planner (zerokern/plan)
models the stages themselves and is not runtime code."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "zerokern"
DEFINITION = ROOT / "zero" / "core" / "stage.py"
# a stage number compared or tested: `stage == 3`, `zero_stage in (1, 2)`, `config.stage >= 1`, ...
READ = re.compile(r"\b(zero_)?stage\s*(==|!=|>=|<=|>|<|\bin\b|\bnot in\b)|(==|!=|>=|<=|>|<)\s*\w*\.?(zero_)?stage\b")


def _code(line):
    return line.split("#", 1)[0]


def _reads(pattern, allowed):
    """Every code line (comments aside) of zerokern/ outside `allowed` and the planner that matches."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if path in allowed or "plan" in path.relative_to(ROOT).parts:
            continue
        for k, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(_code(line)):
                offenders.append(f"{path.relative_to(ROOT.parent)}:{k}: {line.strip()}")
    return offenders


def test_only_the_stage_definition_reads_a_stage_number():
    offenders = _reads(READ, {DEFINITION})
    assert not offenders, "stage numbers read outside zerokern/zero/core/stage.py:\n" + "\n".join(offenders)


def test_the_check_finds_a_stage_read():
    """The pattern is not vacuous: each way the old code read the stage is caught."""
    for line in ("if config.stage == 3 and loose:", "gathered = self.zero_stage in (1, 2)",
                 "sharded = self.comm.distributed and self.zero_stage >= 1", "if 2 == stage:"):
        assert READ.search(line), line
    assert not READ.search("self.zero_stage = config.stage")


# Issue 36: the modes are behaviour. Outside the stage definition, only the grad path
# (grads/path.py) and the param policy (params/policy.py) ask which mode a unit is in; the other
# files call the objects those two hand out.
MODE_FILES = {DEFINITION, ROOT / "zero" / "grads" / "path.py", ROOT / "zero" / "params" / "policy.py"}
MODE = re.compile(r"\.releases\b|\breleases\s*=|shards_params|param_shards\s+is\s+(not\s+)?None|"
                  r"stage3\s+is\s+(not\s+)?None|\b(GradMode|ParamMode)\.")


def test_only_the_stage_definition_and_the_two_policies_ask_the_mode():
    offenders = _reads(MODE, MODE_FILES)
    assert not offenders, "modes asked outside the stage definition and the policies:\n" + "\n".join(offenders)


def test_the_mode_check_finds_a_mode_read():
    for line in ("if self.releases:", "if f.shards_params:", "if f.param_shards is not None:",
                 "if self.stage3 is None:", "grads is GradMode.SCATTER_RELEASE", "opt.strategy.params is ParamMode.WHOLE",
                 "releases = True"):
        assert MODE.search(line), line
    assert not MODE.search("self.param_shards = [buf.shard(b) for b in range(n)]")
