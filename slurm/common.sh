# shellcheck shell=bash
# Shared logic of the t5ds sbatch scripts (sourced by slurm/*.sbatch, not run on its own).
#
# What a job does (docs/zero_and_slurm.md explains why):
#   1. cd to the repository (T5DS_REPO, else the directory sbatch was run from), run the site hook
#      (SITE_ENV: a file to source for `module load` / conda / container setup; VENV: a venv to activate);
#   2. derive the rendezvous: MASTER_ADDR = first node of the allocation, MASTER_PORT from the job id;
#   3. `srun` one task per GPU (one per --ntasks slot); each task gets RANK / WORLD_SIZE / LOCAL_RANK /
#      LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT, what torch.distributed and DeepSpeed read;
#   4. while the trainer runs, the batch shell traps USR1 (sent by `#SBATCH --signal=B:USR1@N` before the
#      time limit) and TERM and forwards them to every task; the trainer checkpoints at the next step
#      boundary and exits 75 (EXIT_REQUEUE);
#   5. on exit code 75 the job requeues itself (`scontrol requeue`); the rerun resumes from the newest
#      checkpoint in OUTPUT_DIR. Any other code ends the job with that code (FAILED when non-zero).
#
# Settings (environment variables; every one optional):
#   TRAINER        command each task runs                   (script default: python training/pretrain.py)
#   CONFIG         run config YAML                          (script default)
#   DS_CONFIG      DeepSpeed JSON, picks the ZeRO stage     (empty: the trainer's default)
#   OUTPUT_DIR     run directory: checkpoints, metrics      (runs/<config name>; a rerun resumes from it)
#   BUDGET_HOURS   wall-clock budget -> budget.hours=       (empty: train optim.total_steps)
#   OVERRIDES      "key=value key=value" run-config overrides (script arguments are appended after it)
#   T5DS_REPO      repository root                          (SLURM_SUBMIT_DIR)
#   SITE_ENV       file sourced first (modules, conda, container setup)
#   VENV           virtualenv to activate                   (none)
#   REQUEUE        1: requeue on exit code 75; 0: end the job with code 75 (resubmit by hand)
#   MAX_REQUEUES   stop requeueing after this many restarts (default 50)
#   SRUN_WAIT      seconds srun lets the other tasks finish after the first one exits (default 120); a
#                  crashed rank thus ends the job after this long instead of hanging in a collective
#   SRUN_ARGS      extra srun options, e.g. "--cpu-bind=cores" or "--container-image=..." (pyxis)
#   T5DS_MASTER_ADDR, T5DS_MASTER_PORT  override the rendezvous host (first node) and port (from the job id)
#   T5DS_DRY_RUN   1: print the srun command and exit 0 (check a script without running it)

t5ds_log() { echo "[t5ds $(date -u +%Y-%m-%dT%H:%M:%SZ)] $*"; }

# A command as one line that the shell would read back the same (quotes where needed).
t5ds_quote() { local q; q=$(printf '%q ' "$@"); echo "${q% }"; }

# Split a string of words into the named array (no globbing: overrides may contain `*`).
t5ds_split() {
  local -n _into=$1
  set -f
  # shellcheck disable=SC2206
  _into=($2)
  set +f
}

# t5ds_setup DEFAULT_TRAINER DEFAULT_CONFIG: repository, site hook, settings, rendezvous variables.
t5ds_setup() {
  local default_trainer=$1 default_config=$2
  : "${SLURM_JOB_ID:?not inside a SLURM job: submit this script with sbatch}"
  T5DS_REPO=${T5DS_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
  cd "$T5DS_REPO" || { t5ds_log "ERROR: cannot cd to T5DS_REPO=$T5DS_REPO"; exit 2; }
  if [[ -n "${SITE_ENV:-}" ]]; then
    # shellcheck disable=SC1090
    source "$SITE_ENV" || { t5ds_log "ERROR: sourcing SITE_ENV=$SITE_ENV failed"; exit 2; }
  fi
  if [[ -n "${VENV:-}" ]]; then
    # shellcheck disable=SC1091
    source "$VENV/bin/activate" || { t5ds_log "ERROR: cannot activate VENV=$VENV"; exit 2; }
  fi

  TRAINER=${TRAINER:-$default_trainer}
  CONFIG=${CONFIG:-$default_config}
  DS_CONFIG=${DS_CONFIG:-}
  OUTPUT_DIR=${OUTPUT_DIR:-runs/$(basename "$CONFIG" .yaml)}
  BUDGET_HOURS=${BUDGET_HOURS:-}
  OVERRIDES=${OVERRIDES:-}
  REQUEUE=${REQUEUE:-1}
  MAX_REQUEUES=${MAX_REQUEUES:-50}
  SRUN_WAIT=${SRUN_WAIT:-120}
  SRUN_ARGS=${SRUN_ARGS:-}
  [[ -f "$CONFIG" ]] || { t5ds_log "ERROR: CONFIG=$CONFIG not found (relative to $PWD): set CONFIG=path/to/run.yaml"; exit 2; }
  [[ -z "$DS_CONFIG" || -f "$DS_CONFIG" ]] || { t5ds_log "ERROR: DS_CONFIG=$DS_CONFIG not found: pick one of ds_configs/*.json"; exit 2; }
  case "$OUTPUT_DIR" in /*) T5DS_RUN_DIR=$OUTPUT_DIR ;; *) T5DS_RUN_DIR=$PWD/$OUTPUT_DIR ;; esac

  # Rendezvous: rank 0 runs on the first node of the allocation. The port comes from the job id so two
  # jobs sharing a node do not collide, and stays the same when the job is requeued. 15000-29999 keeps
  # it below Linux's ephemeral port range (32768+).
  local first_node
  first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | head -n 1)
  [[ -n "$first_node" ]] || first_node=$(python3 "$T5DS_REPO/slurm/hostfile.py" --first --nodelist "$SLURM_JOB_NODELIST")
  export MASTER_ADDR=${T5DS_MASTER_ADDR:-$first_node}
  export MASTER_PORT=${T5DS_MASTER_PORT:-$((15000 + SLURM_JOB_ID % 15000))}
  # No GPU in the allocation and none visible: DeepSpeed's CPU accelerator (gloo), as in the tests.
  if [[ -z "${DS_ACCELERATOR:-}" && "${SLURM_GPUS_ON_NODE:-0}" == 0 ]] && ! nvidia-smi -L >/dev/null 2>&1; then
    export DS_ACCELERATOR=cpu
  fi
  # One intra-op thread pool per task sized to its CPUs, instead of every task using every core.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
}

T5DS_SIGNAL=""      # the last signal the batch shell received
T5DS_SRUN_PID=""
T5DS_REQUEUED=0

# Forward a signal from the batch shell to every task of the job's steps. `scancel --signal` (without
# --batch) reaches the tasks on every node and not this shell; `kill` on srun is the fallback, which
# srun forwards for USR1 (but turns TERM into a kill of the step, so TERM only goes through scancel).
t5ds_forward() {
  local sig=$1
  T5DS_SIGNAL=$sig
  if [[ $T5DS_REQUEUED == 1 ]]; then return; fi  # our own requeue is ending the job: nothing to save
  t5ds_log "batch shell received SIG$sig: forwarding it to the training tasks (they checkpoint and exit 75)"
  [[ -n "$T5DS_SRUN_PID" ]] || return
  if ! scancel --signal="$sig" "$SLURM_JOB_ID" 2>/dev/null && [[ $sig == USR1 ]]; then
    kill -USR1 "$T5DS_SRUN_PID" 2>/dev/null
  fi
}
trap 't5ds_forward USR1' USR1
trap 't5ds_forward TERM' TERM

t5ds_print_paths() {
  t5ds_log "run directory: $T5DS_RUN_DIR"
  t5ds_log "  metrics:     $T5DS_RUN_DIR/metrics.jsonl"
  t5ds_log "  checkpoints: $T5DS_RUN_DIR/checkpoints"
}

# t5ds_train [override ...]: launch the trainer on every task, wait, then requeue / exit. Never returns.
t5ds_train() {
  local -a trainer extra srun_extra cmd
  t5ds_split trainer "$TRAINER"
  t5ds_split extra "$OVERRIDES"
  t5ds_split srun_extra "$SRUN_ARGS"
  cmd=("${trainer[@]}" --config "$CONFIG")
  [[ -z "$DS_CONFIG" ]] || cmd+=(--deepspeed_config "$DS_CONFIG")
  cmd+=("output_dir=$OUTPUT_DIR")
  [[ -z "$BUDGET_HOURS" ]] || cmd+=("budget.hours=$BUDGET_HOURS")
  cmd+=("${extra[@]}" "$@")

  local nodes ntasks
  nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | paste -sd' ')
  ntasks=${SLURM_NTASKS:?the job has no task count: request tasks with --ntasks-per-node (one per GPU)}
  t5ds_log "job $SLURM_JOB_ID (${SLURM_JOB_NAME:-}) restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NUM_NODES:-1} node(s): ${nodes:-$SLURM_JOB_NODELIST}"
  t5ds_log "$ntasks tasks (${SLURM_NTASKS_PER_NODE:-?} per node), rendezvous $MASTER_ADDR:$MASTER_PORT, DS_ACCELERATOR=${DS_ACCELERATOR:-auto}"
  t5ds_log "trainer: $(t5ds_quote "${cmd[@]}")"
  t5ds_print_paths

  # Each task maps SLURM's per-task ids onto the variables torch.distributed / DeepSpeed read. The
  # inner shell execs the trainer, so signals sent to the task reach Python directly.
  # shellcheck disable=SC2016
  local task_env='export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID'
  # shellcheck disable=SC2016
  task_env+=' LOCAL_WORLD_SIZE=${SLURM_STEP_TASKS_PER_NODE%%[(,]*}; exec "$@"'
  local -a srun_cmd=(srun --ntasks="$ntasks")
  # Explicit, because srun does not inherit everything from sbatch (since Slurm 22.05 it ignores
  # SLURM_CPUS_PER_TASK, which would leave every task one core for its data loader and threads).
  [[ -z "${SLURM_NTASKS_PER_NODE:-}" ]] || srun_cmd+=(--ntasks-per-node="$SLURM_NTASKS_PER_NODE")
  [[ -z "${SLURM_CPUS_PER_TASK:-}" ]] || srun_cmd+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
  srun_cmd+=(--kill-on-bad-exit=0 --wait="$SRUN_WAIT" "${srun_extra[@]}" bash -c "$task_env" t5ds-task "${cmd[@]}")
  if [[ "${T5DS_DRY_RUN:-0}" == 1 ]]; then
    t5ds_log "dry run: $(t5ds_quote "${srun_cmd[@]}")"
    exit 0
  fi

  mkdir -p "$T5DS_RUN_DIR"
  "${srun_cmd[@]}" &
  T5DS_SRUN_PID=$!
  # `wait` returns early whenever a trapped signal arrives; keep waiting until srun itself has ended,
  # then collect its exit status (bash remembers it).
  while kill -0 "$T5DS_SRUN_PID" 2>/dev/null; do wait "$T5DS_SRUN_PID"; done
  wait "$T5DS_SRUN_PID"
  local rc=$?
  t5ds_finish "$rc"
}

# t5ds_finish RC: end the job according to the trainer's exit code. Never returns.
t5ds_finish() {
  local rc=$1
  if [[ $rc == 0 ]]; then
    t5ds_log "training finished (exit 0)"
    t5ds_print_paths
    exit 0
  fi
  if [[ $rc != 75 ]]; then
    t5ds_log "ERROR: training failed with exit code $rc; the job fails with it (see the log above)."
    t5ds_log "Checkpoints written so far stay in $T5DS_RUN_DIR/checkpoints: resubmitting resumes from the newest."
    exit "$rc"
  fi
  # 75: the trainer checkpointed after a stop signal.
  if [[ $T5DS_SIGNAL == TERM ]]; then
    # SLURM itself is ending the job (scancel, time limit, preemption): if the site preempts with
    # requeue, SLURM requeues it; otherwise the checkpoint waits for a resubmission.
    t5ds_log "stopped by SIGTERM and checkpointed; SLURM is ending this job (resubmit to resume)"
    exit 75
  fi
  if [[ $REQUEUE != 1 ]]; then
    t5ds_log "checkpointed after a stop signal; REQUEUE=0: resubmit the job to resume"
    exit 75
  fi
  if (( ${SLURM_RESTART_COUNT:-0} >= MAX_REQUEUES )); then
    t5ds_log "checkpointed, but the job was already requeued $MAX_REQUEUES times (MAX_REQUEUES): not again"
    exit 75
  fi
  T5DS_REQUEUED=1
  if scontrol requeue "$SLURM_JOB_ID"; then
    # SLURM now terminates this run (TERM to this shell) and queues the job again; it becomes eligible
    # after a short hold (EligibleTime, ~2 min) and resumes from the checkpoint.
    t5ds_log "checkpointed; requeued job $SLURM_JOB_ID (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 ))): it resumes from $T5DS_RUN_DIR"
    sleep 30 & wait $!  # the requeue's TERM ends us here
    exit 75
  fi
  t5ds_log "ERROR: scontrol requeue failed (job not requeueable? site JobRequeue=0?): resubmit to resume"
  exit 75
}
