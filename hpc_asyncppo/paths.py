"""The names of the files and folders in a run directory (RUN_DIR), in one place.

Created before any rank starts (``launch/rundir.py``), read by every rank and by the tools
(status, report, export)::

  RUN_DIR/config.yaml             CONFIG     the resolved config (the ranks read only this)
  RUN_DIR/launch.json             LAUNCH     where and with how many ranks the run was started
  RUN_DIR/model/                  MODEL      the tiny default model, when model.path was empty
                                             (a copy of a cached build, models/tiny.py)
  RUN_DIR/tool_config.yaml        TOOLS      multi-turn: the run's copy of its tool config
  RUN_DIR/overlong_prompts.json   OVERLONG   prompts left out for exceeding
                                             data.max_prompt_length (if any)
  RUN_DIR/ranks/rank{i}.json      RANKS      where each rank ran (host, Slurm partition, pid,
                                             GPUs) and its state
  RUN_DIR/heartbeats/rank{i}.json  HEARTBEATS  each rank's count of beats and what it is doing
                                             (runtime/heartbeat.py)
  RUN_DIR/errors/rank{i}.txt      ERRORS     one line per failed rank: what went wrong
  RUN_DIR/logs/                   LOGS       per-rank logs and the launcher's log
  RUN_DIR/slurm/                  SLURM      the batch job's output; slurm/job_id (JOB_ID) its id
  RUN_DIR/metrics.jsonl           METRICS    one row per trainer step (runlog.py)
  RUN_DIR/tensorboard/            TENSORBOARD  the same metrics for TensorBoard
  RUN_DIR/trained_samples.jsonl   TRAINED    one line per response trained on
  RUN_DIR/dropped_samples.jsonl   DROPPED    one line per response dropped, with its reason
  RUN_DIR/weights/rank{i}.jsonl   WEIGHTS    weight digests at every sync (if recorded)
  RUN_DIR/sent/rank{i}.jsonl      SENT       the groups a rollout rank sent (if recorded)
  RUN_DIR/timeline/rank{i}.jsonl  TIMELINE   each rank's spans (timeline.py)
  RUN_DIR/goodput.jsonl           GOODPUT    where the wall time went, per attempt (goodput.py)
  RUN_DIR/checkpoints/            CHECKPOINTS  HDF5 checkpoints (hpc_asyncppo.checkpoint)
  RUN_DIR/overflow.h5             OVERFLOW   the trainer's sample queue beyond its memory limit
  RUN_DIR/preempted               PREEMPTED  present while the run is stopped on a signal with
                                             a checkpoint, to resume
  RUN_DIR/restart                 RESTART    left by a failed Slurm attempt that is to start
                                             again: the batch script requeues the job
                                             (launch/job_restarts.py)
  RUN_DIR/hf_final/               HF_FINAL   the final checkpoint as a Hugging Face folder
                                             (checkpoint.save_hf_final)
  RUN_DIR/report.png              REPORT     ``python -m hpc_asyncppo.report``'s image
  RUN_DIR/gateway/                GATEWAY    data.agent: the run's bearer token and each rollout
                                             rank's gateway address (rollout/gateway/addresses.py)
  RUN_DIR/faults_fired.jsonl      FAULTS_FIRED  faults a test or drill injected, once each
                                             (runtime/faults.py)

Names only, no imports: any module may use them without an import cycle.
"""

CONFIG = "config.yaml"
LAUNCH = "launch.json"
MODEL = "model"
TOOLS = "tool_config.yaml"
OVERLONG = "overlong_prompts.json"
RANKS = "ranks"
HEARTBEATS = "heartbeats"
ERRORS = "errors"
LOGS = "logs"
SLURM = "slurm"
JOB_ID = "job_id"  # inside SLURM
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
TRAINED = "trained_samples.jsonl"
DROPPED = "dropped_samples.jsonl"
WEIGHTS = "weights"
SENT = "sent"
GATEWAY = "gateway"
TIMELINE = "timeline"
GOODPUT = "goodput.jsonl"
CHECKPOINTS = "checkpoints"
OVERFLOW = "overflow.h5"
PREEMPTED = "preempted"
RESTART = "restart"
HF_FINAL = "hf_final"
REPORT = "report.png"
FAULTS_FIRED = "faults_fired.jsonl"
