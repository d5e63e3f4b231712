"""The stage is a value read in one place (issue 25): zerokern/zero/core/stage.py turns (stage, world
size) into a Strategy; no other runtime file compares a stage number. The planner (zerokern/plan)
models the stages themselves and is not runtime code."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[3] / "zerokern"
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
# Issue 48: the mode also reads as the Strategy's values and the flags the grad path hands its
# buckets, under their own names: a read (`.needs_units`) or a setting (`scatters=...`) of one.
FLAGS = ("shards_state", "frees_grads_after_step", "needs_units", "materializes_meta", "reduce_scatters",
         "local_grads", "layout_world", "scatters", "draws_from_pool")
FLAG = re.compile(r"\.(" + "|".join(FLAGS) + r")\b|(?<![\w.-])(" + "|".join(FLAGS) + r")\s*=(?!=)|"
                  r"\bstrategy\.(grads|params)\b")
# The flag reads outside MODE_FILES, by file, each with its reason: a value the file acts on that
# no policy object stands for. A flag read in a file, or a file, not named here fails the test.
FLAG_READS = {
    "zero/engine.py": {"needs_units": "refuses params outside zerokern.shard() units, saying why",
                       "frees_grads_after_step": "step() ends the round, freeing the full grad buffers",
                       "shards_state": "the grad norm sums over shards or over whole buckets"},
    "zero/unit.py": {"shards_state": "a unit's rank among those its state is split over",
                     "layout_world": "how many slices its bucket layout cuts"},
    "zero/api.py": {"materializes_meta": "shard() materializes a meta-device module"},
    "zero/grads/bucket.py": {"scatters": "the bucket's reduction, as the grad path built it",
                             "draws_from_pool": "the class's own flag (a pooled full buffer or its own)"},
    "zero/grads/released.py": {"draws_from_pool": "the class's own flag"},
    "zero/grads/schedule.py": {"draws_from_pool": "hands the pool to the buckets that draw from it"},
    "optim/fused_zero_adam.py": {"shards_state": "a checkpoint's state is this rank's shard or whole"},
    "optim/zero_optimizer.py": {"shards_state": "a checkpoint's state is this rank's shard or whole"},
    "optim/state_dict.py": {"shards_state": "a checkpoint's state is this rank's shard or whole"},
    "optim/wire_checkpoint.py": {"shards_state": "the residuals a checkpoint folds are shards or whole"},
}


def _flags(line):
    return {next(g for g in m.groups() if g) if not m.group(3) else f"strategy.{m.group(3)}"
            for m in FLAG.finditer(_code(line))}


def test_only_the_stage_definition_and_the_two_policies_ask_the_mode():
    offenders = _reads(MODE, MODE_FILES)
    assert not offenders, "modes asked outside the stage definition and the policies:\n" + "\n".join(offenders)


def test_the_strategy_flags_are_read_only_where_listed():
    offenders = []
    for line in _reads(FLAG, MODE_FILES):
        where = line.split(":", 1)[0].split("/", 1)[1]
        extra = _flags(line.split(":", 2)[2]) - set(FLAG_READS.get(where, ()))
        if extra:
            offenders.append(f"{line} ({', '.join(sorted(extra))})")
    assert not offenders, ("the mode asked outside the stage definition and the policies (ask the grad path or "
                           "the param policy, or list the read in FLAG_READS with its reason):\n"
                           + "\n".join(offenders))
    stale = [f"{where}: {name}" for where, names in FLAG_READS.items() for name in names
             if not any(name in _flags(line) for line in (ROOT / where).read_text().splitlines())]
    assert not stale, "listed in FLAG_READS but read there no more: " + ", ".join(stale)


def test_the_mode_check_finds_a_mode_read():
    for line in ("if self.releases:", "if f.shards_params:", "if f.param_shards is not None:",
                 "if self.stage3 is None:", "grads is GradMode.SCATTER_RELEASE", "opt.strategy.params is ParamMode.WHOLE",
                 "releases = True"):
        assert MODE.search(line), line
    assert not MODE.search("self.param_shards = [buf.shard(b) for b in range(n)]")
    for line, flag in (("if self.strategy.frees_grads_after_step:", "frees_grads_after_step"),
                       ("if strategy.local_grads and x:", "local_grads"), ("if s.needs_units:", "needs_units"),
                       ("if strategy.materializes_meta:", "materializes_meta"), ("if self.scatters:", "scatters"),
                       ("GradBucket(..., scatters=True)", "scatters"), ("draws_from_pool = True", "draws_from_pool"),
                       ("if b.draws_from_pool:", "draws_from_pool"), ("n = strategy.layout_world", "layout_world"),
                       ("if opt.strategy.shards_state:", "shards_state"), ("k = s.reduce_scatters", "reduce_scatters"),
                       ("if strategy.grads is not x:", "strategy.grads"), ("strategy.params is y", "strategy.params")):
        assert _flags(line) == {flag}, line
    for line in ("it reduce-scatters the grads", "n_scatters = 3", "if scatters == 1:", "flat.grads.launch(b)", "# if self.scatters:"):
        assert not _flags(line), line
