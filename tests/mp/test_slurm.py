"""SLURM scripts: syntax, configs and node counts for every model, and a real single-node
SLURM run of the tiny CPU demo where Debian's slurm-wlm is installed (``make setup-slurm``)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess

import pytest

from megatron_refit.config import load_training_yaml, train_layout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLURM = os.path.join(ROOT, "scripts", "slurm")
MODELS = sorted(os.path.basename(p)[:-7] for p in glob.glob(os.path.join(SLURM, "*.sbatch")) if "tiny_cpu" not in p)


def test_every_model_has_a_script():
    configs = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    assert MODELS == configs == ["deepseek-v3", "deepseek-v3-wide-ep", "kimi-k2-fp8-256to128",
                                 "nemotron-3-nano-30b-a3b", "qwen3-235b-a22b", "qwen3-30b-a3b", "qwen3-4b",
                                 "recipe-deepseek-v3", "recipe-kimi-k2", "recipe-llama3-70b", "recipe-nemotron-3-nano",
                                 "recipe-qwen3-235b-a22b", "recipe-qwen3-30b-a3b"]


SCRIPTS = sorted(glob.glob(os.path.join(SLURM, "*.sh")) + glob.glob(os.path.join(SLURM, "*.sbatch")))


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", script], check=True)


@pytest.mark.parametrize("model", MODELS)
def test_script_reads_its_config_and_asks_for_enough_nodes(model):
    with open(os.path.join(SLURM, f"{model}.sbatch")) as f:
        text = f.read()
    assert f"CONFIG=configs/{model}.yaml" in text
    bridge, refit = load_training_yaml(os.path.join(ROOT, "configs", f"{model}.yaml"))
    layout = train_layout(bridge, refit)
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", text).group(1))
    per_node = int(re.search(r"#SBATCH --gpus-per-node=(\d+)", text).group(1))
    needed = -(-layout.world_size // per_node)
    if refit.mode == "disaggregated":
        needed += -(-refit.gen_world_size // per_node)
    assert nodes == needed


def _slurm_missing() -> str | None:
    tools = ("sbatch", "sinfo", "slurmctld", "slurmd", "munged", "mungekey")
    missing = [tool for tool in tools if not shutil.which(tool)]
    if missing:
        return f"slurm-wlm is not installed ({', '.join(missing)} missing; `make setup-slurm` installs it)"
    if os.geteuid() != 0:
        return "a local slurmd needs root"
    return None


@pytest.fixture(scope="module")
def local_slurm(tmp_path_factory):
    reason = _slurm_missing()
    if reason and os.environ.get("REFIT_REQUIRE_SLURM") == "1":  # CI (.ci/run): never skipped there
        pytest.fail(f"REFIT_REQUIRE_SLURM=1 but {reason}")
    if reason:
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("slurm")
    script = os.path.join(SLURM, "local_cluster.sh")
    # started as under torchrun (OMP_NUM_THREADS=1), which must not shrink the node's CPUs
    subprocess.run([script, "start", str(state)], check=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    cpus = re.search(r"CPUs=(\d+)", (state / "slurm.conf").read_text()).group(1)
    assert int(cpus) == len(os.sched_getaffinity(0)), cpus
    try:
        yield {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}, state
    finally:
        subprocess.run([script, "stop", str(state)], check=False, timeout=60)


_DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE"}


def _sbatch_wait(args: list[str], env: dict, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``sbatch ARGS``, then the job's state every half second until it ends: the returned
    ``returncode`` is the job's exit code (or 128 + the signal that ended it), as ``sbatch --wait``
    gives (which polls at growing intervals: up to 15 s after the job ended). A job still queued
    or running after ``timeout_s`` is cancelled and fails the test with what SLURM says of it
    (its state and the reason it waits)."""
    import time

    submitted = subprocess.run(["sbatch", "--parsable", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=60, check=False)
    if submitted.returncode != 0:
        print(submitted.stderr)
        return submitted
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True,
                               timeout=30, check=False).stdout
        state, code = re.search(r"JobState=(\S+)", shown), re.search(r"ExitCode=(\d+):(\d+)", shown)
        if state and state.group(1) in _DONE and code:
            exit_code, signal = int(code.group(1)), int(code.group(2))
            return subprocess.CompletedProcess(args, 128 + signal if signal else exit_code)
        time.sleep(0.5)
    queue = subprocess.run(["squeue", "-h", "-o", "%i %T %r"], env=env, capture_output=True, text=True,
                           timeout=30, check=False).stdout
    subprocess.run(["scancel", "--user", "root"], env=env, timeout=30, check=False)
    pytest.fail(f"sbatch {' '.join(args)} did not end within {timeout_s:g} s; squeue: {queue.strip()!r}")


@pytest.mark.slow
def test_tiny_cpu_demo_under_local_slurm(local_slurm):
    env, state = local_slurm
    out = state / "tiny-%j.out"
    # Two ranks (train TP1 -> gen TP1) keep it short; the defaults run 4. OMP_NUM_THREADS=1, as
    # torchrun sets it, must not shrink the local node below the 2 CPUs the job asks for.
    env = {**env, "OMP_NUM_THREADS": "1"}
    done = _sbatch_wait([f"--output={out}", "scripts/slurm/tiny_cpu.sbatch", "--train-tp", "1", "--gen-dp", "1",
                         "--refits", "1"], env)
    assert done.returncode == 0
    (log,) = glob.glob(str(state / "tiny-*.out"))
    with open(log) as f:
        result = json.loads(f.read().strip().splitlines()[-1])
    assert result["ok"] and result["bit_exact"]


@pytest.mark.slow
def test_model_script_dry_run_under_local_slurm(local_slurm):
    """A model script on one CPU node: the dry run passes; the full job then stops on the
    node count, before any command of the user's runs."""
    env, state = local_slurm
    common = ["--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0"]
    out = state / "dry-%j.out"
    assert _sbatch_wait([*common, f"--output={out}", "scripts/slurm/qwen3-30b-a3b.sbatch"],
                        {**env, "REFIT_DRY_RUN_ONLY": "1"}).returncode == 0
    (log,) = glob.glob(str(state / "dry-*.out"))
    with open(log) as f:
        assert json.loads(f.read().strip().splitlines()[-1])["ok"] is True
    out = state / "full-%j.out"
    done = _sbatch_wait([*common, f"--output={out}", "scripts/slurm/qwen3-30b-a3b.sbatch"], env)
    assert done.returncode != 0
    (log,) = glob.glob(str(state / "full-*.out"))
    with open(log) as f:
        assert "needs 4 nodes of 8 GPUs (disaggregated: 16 train + 16 gen ranks), the job has 1" in f.read()
