"""The multi-host test bed (issue 28): two network namespaces as hosts, 2 ranks each, a capped link
between them, launched as a real multi-node job (torchrun --nnodes=2, c10d rendezvous on host 0,
gloo bound to each host's interface). It trains to the same losses, bit for bit, as the same 4
ranks on loopback, and its traffic crosses the hosts' links. Skips where namespaces cannot be
made (not root, no iproute2), and says so."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import netbed  # noqa: E402

WHY = netbed.unavailable()
# slow: seven 4-rank jobs (five across the namespaced hosts, one killed and restarted), each rank a new
# interpreter: ~50 s on an idle 2-core machine for the first five, 158 s for all seven on a loaded one;
# real multi-node launches cannot be made cheaper.
pytestmark = [pytest.mark.skipif(WHY is not None, reason=f"no multi-host test bed here: {WHY}"), pytest.mark.slow]

SCRIPT = [os.path.join(ROOT, "examples", "train_gpt.py"), "--steps", "4", "--batch", "8", "--ctx", "16", "--vocab",
          "32", "--d-model", "32", "--heads", "2", "--layers", "1", "--log-every", "100"]


HYBRID = ["--zero-stage", "3", "--mesh", "2,2"]
# The hybrid ZeRO-3 job, 6 steps with a DCP checkpoint every 2 and restartable: the loopback
# test's hybrid case and the uninterrupted job the kill test resumes onto (one launch for both).
WHOLE = SCRIPT[:2] + ["6"] + SCRIPT[3:] + HYBRID + ["--ckpt-every", "2"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")
RESTARTABLE = dict(ENV, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def _logged(script, tmp_path, name):
    """`script` writing its losses to <name>.json (and, where it checkpoints, to a directory <name>)."""
    ckpt = ["--ckpt-dir", str(tmp_path / name)] if "--ckpt-every" in script else []
    return script + ckpt + ["--log-json", str(tmp_path / f"{name}.json")]


def _on_two_hosts(tmp_path, name, script, restarts=0, timeout=180, monitor_interval=None):
    """`script` as a 2-host job (2 ranks a host) on a new bed: (rank 0's --log-json, both hosts'
    output, the bytes each host sent over its link). Fails if a host's torchrun fails."""
    env = RESTARTABLE if restarts else ENV
    script = _logged(script, tmp_path, name)
    with netbed.NetBed(hosts=2, rate="1gbit") as bed:
        before = [bed.tx_bytes(h) for h in range(2)]
        procs = [bed.popen(h, bed.torchrun(h, 2, script, job=name, restarts=restarts, monitor_interval=monitor_interval), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for h in range(2)]
        try:
            outs = [p.communicate(timeout=timeout)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
        sent = [bed.tx_bytes(h) - before[h] for h in range(2)]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-4000:] for o in outs)
    return json.loads((tmp_path / f"{name}.json").read_text()), "".join(outs), sent


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The WHOLE job on two hosts."""
    return _on_two_hosts(tmp_path_factory.mktemp("whole"), "whole", WHOLE, restarts=1, timeout=300)


@pytest.mark.parametrize("variant", ["flat-zero2", "hybrid-zero3"])
def test_two_hosts_train_as_loopback(tmp_path, variant, request):
    if variant == "flat-zero2":
        script = SCRIPT
        hosts, _, sent = _on_two_hosts(tmp_path, "flat", script)
    else:
        script = WHOLE
        hosts, _, sent = request.getfixturevalue("whole")
    assert hosts["world"] == 4
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                           *_logged(script, tmp_path, "loopback")], env=ENV, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    loopback = json.loads((tmp_path / "loopback.json").read_text())["losses"]
    if variant == "flat-zero2":  # the bed's group spans hosts, loopback's does not: the grads are summed in
        # another order ([Note: collectives across hosts]), which moves the losses in the last bits only
        assert hosts["losses"] == pytest.approx(loopback, rel=1e-5)
    else:
        assert hosts["losses"] == loopback
    # every step's gradients cross: far more than the rendezvous alone (a few KB)
    assert min(sent) > 100_000, sent
    if variant == "hybrid-zero3":  # zerokern's own count of what crossed is what the links carried, at most
        counted = hosts["counted_inter_host_bytes"]
        assert 0 < counted <= sum(sent), (counted, sent)


# Large enough (464k params, 1.9 MB) that 4 steps' traffic dwarfs the launch's (rendezvous, groups).
BYTES = SCRIPT[:1] + ["--steps", "4", "--batch", "8", "--ctx", "16", "--vocab", "512", "--d-model", "128", "--heads",
                      "2", "--layers", "2", "--log-every", "100"]


def test_flat_zero2_sends_no_more_than_ddp_between_hosts(tmp_path):
    """Flat ZeRO-2 over both hosts reduce-scatters and gathers host by host ([Note: collectives
    across hosts]): its links carry less than DDP's all-reduce of the same model (2x the params
    against 3x by the ring model; the one-host choices carried 1.84x DDP's)."""
    _, _, zero = _on_two_hosts(tmp_path, "zero2", BYTES + ["--zero-stage", "2"])
    _, _, ddp = _on_two_hosts(tmp_path, "ddp", BYTES + ["--optimizer", "torch"])
    assert sum(zero) <= sum(ddp), (zero, ddp)


def test_rank_killed_on_one_host_both_hosts_resume(tmp_path, whole):
    """A rank killed on host 1 mid-step: the survivors on both hosts raise, both hosts' torchrun
    agents restart their workers from the last DCP checkpoint (shared by the hosts), and the
    resumed job ends on the uninterrupted job's losses (the WHOLE job's)."""
    # torchrun polling every 2 s, not 0.1: the survivors have that long to raise before it stops
    # them (tests/zero/comm/test_lost_rank.py)
    log, out, _ = _on_two_hosts(tmp_path, "killed", WHOLE + ["--kill-at-step", "3"], restarts=1, timeout=300,
                                monitor_interval=2)
    assert "killed at step 3" in out and "another rank is gone" in out, out[-6000:]
    assert "continuing at step 2" in out, out[-6000:]  # the checkpoint after step 1
    assert log["first_step"] == 2
    assert log["losses"] == whole[0]["losses"][2:], (log["losses"], whole[0]["losses"])
