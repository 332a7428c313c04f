# Shared body of scripts/slurm/<model>.sbatch; sourced after CONFIG is set.
#
# Submit from the repository root:  sbatch scripts/slurm/<model>.sbatch
# The user supplies (environment variables):
#   TRAIN_CMD   the training entry run on every train rank (one task per GPU), e.g. a
#               Megatron-Bridge GRPO loop that loads $CONFIG (Bridge reads its sections;
#               megatron_refit.config.load_training_yaml reads refit:) with
#               conversion.refit_callback.RefitCallback in Bridge's callbacks.
#   GEN_CMD     the generation entry run on every gen rank (one task per GPU): the engine
#               (vLLM with --weight-transfer-config '{"backend": "megatron_refit"}', or
#               another engine with megatron_refit's engine_refit); it may use its own venv.
#   PYTHON      interpreter for the dry run (default: .venv/bin/python).
#   REFIT_DRY_RUN_ONLY=1  stop after the dry run (validates the config and the plan).
# Exported to both commands: REFIT_CONFIG, REFIT_HOST / REFIT_PORT (rendezvous of the
# refit group, on the first train node; the shipped configs read them: host: ${oc.env:REFIT_HOST,...}), MASTER_ADDR,
# REFIT_TRAIN_NODES, REFIT_GEN_NODES.
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$PWD}"
PYTHON="${PYTHON:-.venv/bin/python}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
test -f "$CONFIG" || { echo "config $CONFIG not found (submit from the repository root)" >&2; exit 2; }

echo "== dry run: $CONFIG"
"$PYTHON" -m megatron_refit.dryrun --config "$CONFIG" --json
if [[ "${REFIT_DRY_RUN_ONLY:-0}" == 1 ]]; then
    exit 0
fi

read -r TRAIN_WORLD GEN_WORLD MODE PORT < <("$PYTHON" -c "
from megatron_refit.tools.dryrun import load_config
refit, _, layout = load_config('$CONFIG')
print(layout.world_size, refit.gen_world_size, refit.mode, refit.port)")
TRAIN_NODES=$(( (TRAIN_WORLD + GPUS_PER_NODE - 1) / GPUS_PER_NODE ))
GEN_NODES=$(( (GEN_WORLD + GPUS_PER_NODE - 1) / GPUS_PER_NODE ))
[[ "$MODE" == colocated ]] && NEEDED=$TRAIN_NODES || NEEDED=$(( TRAIN_NODES + GEN_NODES ))
if (( SLURM_JOB_NUM_NODES != NEEDED )); then
    echo "$CONFIG needs $NEEDED nodes of $GPUS_PER_NODE GPUs ($MODE: $TRAIN_WORLD train + $GEN_WORLD gen ranks)," \
         "the job has $SLURM_JOB_NUM_NODES" >&2
    exit 2
fi
: "${TRAIN_CMD:?set TRAIN_CMD to your training entry (see scripts/slurm/common.sh)}"
: "${GEN_CMD:?set GEN_CMD to your generation entry (see scripts/slurm/common.sh)}"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
TRAIN_LIST=$(IFS=,; echo "${NODES[*]:0:TRAIN_NODES}")
if [[ "$MODE" == colocated ]]; then
    GEN_LIST=$TRAIN_LIST
    OVERLAP=--overlap
else
    GEN_LIST=$(IFS=,; echo "${NODES[*]:TRAIN_NODES:GEN_NODES}")
    OVERLAP=
fi
export REFIT_CONFIG="$CONFIG" REFIT_HOST="${NODES[0]}" REFIT_PORT="$PORT" MASTER_ADDR="${NODES[0]}"
export REFIT_TRAIN_NODES="$TRAIN_LIST" REFIT_GEN_NODES="$GEN_LIST"

echo "== $MODE: train $TRAIN_WORLD ranks on $TRAIN_LIST; gen $GEN_WORLD ranks on $GEN_LIST"
srun --nodes="$TRAIN_NODES" --nodelist="$TRAIN_LIST" --ntasks="$TRAIN_WORLD" --ntasks-per-node="$GPUS_PER_NODE" \
     --gpus-per-task=1 $OVERLAP bash -c "$TRAIN_CMD" &
train_pid=$!
srun --nodes="$GEN_NODES" --nodelist="$GEN_LIST" --ntasks="$GEN_WORLD" --ntasks-per-node="$GPUS_PER_NODE" \
     --gpus-per-task=1 $OVERLAP bash -c "$GEN_CMD" &
gen_pid=$!
# Both groups must finish; a failure of either fails the job.
wait "$train_pid" && wait "$gen_pid"
