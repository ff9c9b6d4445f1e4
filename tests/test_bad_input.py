"""Bad input through the real CLI: one line on stderr naming the input, the right exit code,
no traceback, and nothing half-written.

Every case runs the CLI, ``hpc_asyncppo.submit``'s ``main`` (cwd = the repository): as
``python -m hpc_asyncppo.submit ...`` in a subprocess for the cases that start ranks, set
the environment or are in ``SUBPROCESS_CASES`` (the interpreter's own start and exit), in
this process for the others (the same code, without an interpreter's start each), and
checks: the exit code (2: the input is wrong, 1: the input is fine but something failed);
no "Traceback" on stderr; its error is one line (``error: ...``; ``warning: ...`` lines may
come first), or for a failure inside the ranks that line plus one ``  rank ...`` line per
failed rank; one line holds every key word below. Cases that fail before any rank starts
must also leave the filesystem as it was: no run directory, no rewritten config.yaml or
launch.json (every file under the test's tmp dir is compared before and after).

| case                          | input                                              | code | key words |
|-------------------------------|----------------------------------------------------|------|-----------|
| yaml_file_malformed           | --config bad.yaml with an unclosed bracket          | 2 | bad.yaml, not valid YAML, line 3 |
| yaml_file_not_a_mapping       | --config list.yaml (a YAML list)                    | 2 | list.yaml, mapping |
| config_file_missing           | --config no-such-config                             | 2 | no-such-config, not found |
| override_unclosed_bracket     | actor.lr=[0.001                                     | 2 | actor.lr=[0.001, not valid YAML |
| override_without_equals       | actor.lr                                            | 2 | 'actor.lr', key=value |
| override_unknown_key          | actor.lrr=1                                         | 2 | actor.lrr, valid keys |
| timeout_negative              | timeouts.sample_wait_s=-1                           | 2 | timeouts.sample_wait_s, > 0 |
| rollout_ranks_zero            | --rollout-ranks 0 (used to become 1)                | 2 | --rollout-ranks 0 |
| train_ranks_zero              | --train-ranks 0 (used to become 1)                  | 2 | --train-ranks 0 |
| flag_value_unknown            | --cluster cloud                                     | 2 | --cluster, invalid choice |
| flag_unknown                  | --bogus                                             | 2 | unrecognized arguments, --bogus |
| flag_value_not_int            | --rollout-ranks two                                 | 2 | --rollout-ranks, invalid int |
| vllm_top_p_with_rollout_is    | engine=vllm, top_p=0.9, rollout_is=token            | 2 | top_p=0.9, truncated |
| vllm_top_k_warns              | engine=vllm, top_k=5, no IS (warning), a bad path   | 2 | warning line + model.path |
| rollout_lp_with_rollout_is    | use_rollout_log_probs=true + rollout_is=token       | 2 | use_rollout_log_probs, rollout_is=token |
| tp_above_rollout_gpus         | --cluster slurm, 2 GPUs/node, tensor_parallel 4     | 2 | tensor_parallel_size=4, 1 GPU |
| rollout_gpu_too_small         | 7B recipe, slurm.rollout.gpu_memory_gb=16           | 2 | rollout, 16 GB, gpu_memory_utilization=0.85, lower it |
| trainer_gpu_too_small         | 7B recipe, 16 trainer ranks, slurm.train.gpu_memory_gb=16 | 2 | 16 trainer ranks, 38.0 GB, actor.ppo_max_token_len_per_gpu |
| model_path_missing            | model.path=/no/such/model                           | 2 | model.path, does not exist |
| model_path_is_a_file          | model.path=<a file>                                 | 2 | model.path, is a file |
| model_path_no_tokenizer       | model.path=<folder with only config.json>           | 2 | model.path, tokenizer |
| task_not_importable           | data.task=no_such_pkg.mod:make                      | 2 | data.task, cannot be imported |
| response_too_short_for_task   | data.task=long_tail, rollout.response_length 6      | 2 | rollout.response_length=6, long_tail, =49 |
| agent_not_importable          | data.agent=no_such_pkg.mod:run                      | 2 | data.agent, cannot be imported |
| agent_with_own_tools          | data.agent + rollout.multi_turn on                  | 2 | data.agent, multi_turn.enable=false |
| tool_config_not_tools         | multi_turn on, tool_config_path=<a YAML list>       | 2 | tools.yaml, 'tools' |
| multi_turn_no_chat_template   | multi_turn on, next_digit's tiny model (no template) | 2 | multi_turn, chat template, data.task=tool_lookup |
| data_train_missing            | data.task=jsonl without data.train                  | 2 | data.train |
| data_train_no_such_file       | data.train=<missing file>                           | 2 | data.train, no such file |
| jsonl_row_missing_field       | a JSONL row without ground_truth                    | 2 | rows.jsonl:2, ground_truth |
| jsonl_row_not_json            | a JSONL row that is not JSON                        | 2 | rows.jsonl:1, not valid JSON |
| parquet_not_parquet           | data.task=verl data.train=junk.parquet              | 2 | junk.parquet, parquet |
| prompt_overlong_refused       | a 20-token prompt, filter_overlong_prompts=false    | 2 | prompt 1, max_prompt_length=16, filter_overlong_prompts |
| prompt_all_overlong           | every prompt too long (filter on)                   | 2 | every prompt, max_prompt_length |
| run_dir_exists                | --run-dir of an existing run                        | 2 | already holds a run |
| run_dir_under_a_file          | --run-dir <file>/run                                | 1 | cannot write the run directory, Not a directory |
| run_root_read_only            | --run-dir on a read-only tmpfs (mount)              | 1 | cannot write the run directory, Read-only |
| resume_not_a_run_dir          | --resume <empty dir>                                | 2 | not a run directory |
| resume_no_such_dir            | --resume <missing dir>                              | 2 | no such directory |
| resume_with_config            | --resume RUN --config X                             | 2 | drop --config |
| resume_changes_n              | --resume RUN rollout.n=4 (crashed in collate)       | 2 | --resume, rollout.n |
| resume_changes_response_len   | --resume RUN rollout.response_length=9              | 2 | --resume, rollout.response_length |
| resume_corrupt_checkpoint     | --resume RUN whose only checkpoint is garbage       | 2 | no valid checkpoint (+ a warning naming it) |
| resume_under_tmp_slurm        | --cluster slurm --resume RUN under /tmp             | 2 | under /tmp |
| resume_with_space_slurm       | --cluster slurm --resume 'run dir' (a space)        | 2 | must not contain spaces |
| slurm_partition_no_sbatch     | --cluster slurm --partition-rollout nosuch, no sbatch | 2 | sbatch not found |
| disk_full_at_checkpoint (mpi) | checkpoints/ on a 256 KiB tmpfs: ENOSPC mid-run     | 1 | rank 1 (trainer, No space left on device (h5py's 2nd line); --resume hint; no temp file left |
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from transformers.utils import logging as hf_logging

from hpc_asyncppo import submit
from hpc_asyncppo.runlog import read_jsonl
from tests.conftest import QWEN2_5_7B_CONFIG
from tests.harness import REPO, Run

REWARD = "data.reward_fn=hpc_asyncppo.tasks.gsm8k:gsm8k_reward"
VLLM_TINY = ["rollout.engine=vllm", "model.tiny.num_heads=2"]
# a few seconds of real training: 2 prompts x 8 responses a step
FAST = ["actor.ppo_mini_batch_size=2", "async_training.trigger_parameter_sync_step=1"]
MULTI_TURN = ["rollout.multi_turn.enable=true"]


class Workspace:
    """Where a case builds its inputs: files under ``tmp``, mounts undone after the test."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.mounts: list[Path] = []

    def file(self, name: str, text: str | bytes) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path

    def rows(self, *rows: dict | str) -> Path:
        lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
        return self.file("rows.jsonl", "\n".join(lines) + "\n")

    def run_dir(self, name: str = "made-run", *overrides: str) -> Path:
        """A real run directory (config.yaml, tiny model), made without starting any rank."""
        run = self.tmp / name
        cmd = [sys.executable, "-m", "hpc_asyncppo.launch.slurm.prepare", str(run), *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return run

    def mount_tmpfs(self, where: Path, options: str) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            if os.environ.get("CI") == "true":  # CI runs as root: the case must run there
                pytest.fail(f"cannot mount a tmpfs: {proc.stderr.strip()}")
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        self.mounts.append(where)
        return where

    def unmount_all(self) -> None:
        for where in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(where)], check=False)


@dataclass(frozen=True)
class Case:
    args: Callable[[Workspace], list[str]]  # builds the inputs, returns the CLI arguments
    code: int
    words: tuple[str, ...]  # all in one line of stderr
    before_ranks: bool = True  # fails before any rank starts: nothing may change on disk
    env: Callable[[Workspace], dict[str, str]] = field(default=lambda ws: {})
    after: Callable[[Workspace], None] = field(default=lambda ws: None)


def _run(ws: Workspace, *args: str) -> list[str]:
    return ["--cluster", "local", "--run-dir", str(ws.tmp / "run"), *args]


def _jsonl(ws: Workspace, *rows: dict | str) -> list[str]:
    return ["data.task=jsonl", f"data.train={ws.rows(*rows)}", REWARD]


def _row(words: int, truth: str = "1") -> dict:
    return {"prompt": " ".join(["7"] * words), "ground_truth": truth}


def _qwen_7b(ws: Workspace) -> list[str]:
    """The 7B recipe on a folder with Qwen2.5-7B's config.json (the memory check reads it)."""
    folder = ws.file("qwen7b/config.json", json.dumps(QWEN2_5_7B_CONFIG)).parent
    return ["--config", "qwen2.5-7b-gsm8k", f"model.path={folder}"]


def _disk_full(ws: Workspace) -> list[str]:
    ws.mount_tmpfs(ws.tmp / "run" / "checkpoints", "size=256k")
    return _run(ws, *FAST, "trainer.total_steps=4", "checkpoint.save_every=2")


def _no_checkpoint_litter(ws: Workspace) -> None:
    # the failed save removed its temporary file; nothing else was written there
    assert list((ws.tmp / "run" / "checkpoints").iterdir()) == []


def _corrupt_checkpoint(ws: Workspace) -> list[str]:
    run = ws.run_dir()
    ws.file("made-run/checkpoints/step_00000002/manifest.json", b"not a manifest" * 64)
    return ["--cluster", "local", "--resume", str(run)]


CASES: dict[str, Case] = {
    "yaml_file_malformed": Case(
        lambda ws: _run(ws, "--config", str(ws.file("bad.yaml", "actor:\n  lr: [0.1\n"))),
        2,
        ("bad.yaml", "not valid YAML", "line 3"),
    ),
    "yaml_file_not_a_mapping": Case(
        lambda ws: _run(ws, "--config", str(ws.file("list.yaml", "- 1\n- 2\n"))),
        2,
        ("list.yaml", "mapping"),
    ),
    "config_file_missing": Case(
        lambda ws: _run(ws, "--config", "no-such-config"), 2, ("no-such-config", "not found")
    ),
    "override_unclosed_bracket": Case(
        lambda ws: _run(ws, "actor.lr=[0.001"), 2, ("actor.lr=[0.001", "not valid YAML")
    ),
    "override_without_equals": Case(
        lambda ws: _run(ws, "actor.lr"), 2, ("'actor.lr'", "key=value")
    ),
    "override_unknown_key": Case(
        lambda ws: _run(ws, "actor.lrr=1"), 2, ("actor.lrr", "valid keys")
    ),
    "timeout_negative": Case(
        lambda ws: _run(ws, "timeouts.sample_wait_s=-1"), 2, ("timeouts.sample_wait_s", "> 0")
    ),
    "rollout_ranks_zero": Case(
        lambda ws: _run(ws, "--rollout-ranks", "0"), 2, ("--rollout-ranks 0",)
    ),
    "train_ranks_zero": Case(lambda ws: _run(ws, "--train-ranks", "0"), 2, ("--train-ranks 0",)),
    "flag_value_unknown": Case(
        lambda ws: ["--cluster", "cloud"], 2, ("--cluster", "invalid choice")
    ),
    "flag_unknown": Case(lambda ws: _run(ws, "--bogus"), 2, ("unrecognized arguments", "--bogus")),
    "flag_value_not_int": Case(
        lambda ws: _run(ws, "--rollout-ranks", "two"), 2, ("--rollout-ranks", "invalid int")
    ),
    "vllm_top_p_with_rollout_is": Case(
        lambda ws: _run(ws, *VLLM_TINY, "rollout.top_p=0.9", "algorithm.rollout_is=token"),
        2,
        ("top_p=0.9", "truncated"),
    ),
    "vllm_top_k_warns": Case(
        lambda ws: _run(
            ws,
            *VLLM_TINY,
            "rollout.top_k=5",
            "algorithm.rollout_is=none",
            "model.path=/no/such/model",
        ),
        2,
        ("model.path", "does not exist"),
    ),
    "rollout_lp_with_rollout_is": Case(
        lambda ws: _run(
            ws, "async_training.use_rollout_log_probs=true", "algorithm.rollout_is=token"
        ),
        2,
        ("use_rollout_log_probs", "rollout_is=token"),
    ),
    "tp_above_rollout_gpus": Case(
        lambda ws: [
            "--cluster",
            "slurm",
            "--gpus-per-node-rollout",
            "2",
            *VLLM_TINY,
            "rollout.tensor_parallel_size=4",
        ],  # fmt: skip
        2,
        ("tensor_parallel_size=4", "1 GPU"),
    ),
    "rollout_gpu_too_small": Case(
        lambda ws: _run(ws, *_qwen_7b(ws), "slurm.rollout.gpu_memory_gb=16"),
        2,
        ("rollout", "16 GB", "gpu_memory_utilization=0.85", "lower it"),
    ),
    "trainer_gpu_too_small": Case(
        lambda ws: _run(ws, "--train-ranks", "16", *_qwen_7b(ws), "slurm.train.gpu_memory_gb=16"),
        2,
        ("16 trainer ranks", "38.0 GB", "actor.ppo_max_token_len_per_gpu"),
    ),
    "model_path_missing": Case(
        lambda ws: _run(ws, "model.path=/no/such/model"), 2, ("model.path", "does not exist")
    ),
    "model_path_is_a_file": Case(
        lambda ws: _run(ws, f"model.path={ws.file('weights.bin', b'0')}"),
        2,
        ("model.path", "is a file"),
    ),
    "model_path_no_tokenizer": Case(
        lambda ws: _run(ws, f"model.path={ws.file('model/config.json', '{}').parent}"),
        2,
        ("model.path", "tokenizer"),
    ),
    "tool_config_not_tools": Case(
        lambda ws: _run(
            ws, *MULTI_TURN, f"rollout.multi_turn.tool_config_path={ws.file('tools.yaml', '- a')}"
        ),
        2,
        ("tools.yaml", "'tools'"),
    ),
    "multi_turn_no_chat_template": Case(
        lambda ws: _run(ws, *MULTI_TURN, "rollout.multi_turn.tool_config_path=tools/lookup.yaml"),
        2,
        ("multi_turn", "chat template", "data.task=tool_lookup"),
    ),
    "task_not_importable": Case(
        lambda ws: _run(ws, "data.task=no_such_pkg.mod:make"),
        2,
        ("data.task", "cannot be imported"),
    ),
    "response_too_short_for_task": Case(
        lambda ws: _run(ws, "data.task=long_tail"),
        2,
        ("rollout.response_length=6", "data.task='long_tail'", "rollout.response_length=49"),
    ),
    "agent_not_importable": Case(
        lambda ws: _run(ws, "data.task=tool_lookup", "data.agent=no_such_pkg.mod:run"),
        2,
        ("data.agent", "cannot be imported"),
    ),
    "agent_with_own_tools": Case(
        lambda ws: _run(
            ws,
            "data.task=tool_lookup",
            "data.agent=examples.lookup_agent:run",
            "rollout.multi_turn.enable=true",
            "rollout.multi_turn.tool_config_path=x.yaml",
        ),  # fmt: skip
        2,
        ("data.agent", "multi_turn.enable=false"),
    ),
    "data_train_missing": Case(lambda ws: _run(ws, "data.task=jsonl", REWARD), 2, ("data.train",)),
    "data_train_no_such_file": Case(
        lambda ws: _run(ws, "data.task=jsonl", f"data.train={ws.tmp / 'none.jsonl'}", REWARD),
        2,
        ("data.train", "no such file"),
    ),
    "jsonl_row_missing_field": Case(
        lambda ws: _run(ws, *_jsonl(ws, _row(3), {"prompt": "1 2"})),
        2,
        ("rows.jsonl:2", "ground_truth"),
    ),
    "jsonl_row_not_json": Case(
        lambda ws: _run(ws, *_jsonl(ws, "{prompt: 1")), 2, ("rows.jsonl:1", "not valid JSON")
    ),
    "parquet_not_parquet": Case(
        lambda ws: _run(
            ws, "data.task=verl", f"data.train={ws.file('junk.parquet', b'PAR0' * 100)}"
        ),
        2,
        ("junk.parquet", "parquet"),
    ),
    "prompt_overlong_refused": Case(
        lambda ws: _run(ws, *_jsonl(ws, _row(3), _row(20)), "data.filter_overlong_prompts=false"),
        2,
        ("prompt 1", "20 tokens", "max_prompt_length=16", "filter_overlong_prompts"),
    ),
    "prompt_all_overlong": Case(
        lambda ws: _run(ws, *_jsonl(ws, _row(17), _row(20))),
        2,
        ("every prompt", "max_prompt_length=16"),
    ),
    "run_dir_exists": Case(
        lambda ws: ["--cluster", "local", "--run-dir", str(ws.run_dir())],
        2,
        ("already holds a run",),
    ),
    "run_dir_under_a_file": Case(
        lambda ws: ["--cluster", "local", "--run-dir", str(ws.file("plain", "x") / "run")],
        1,
        ("cannot write the run directory", "Not a directory"),
    ),
    "run_root_read_only": Case(
        lambda ws: [
            "--cluster",
            "local",
            "--run-dir",
            str(ws.mount_tmpfs(ws.tmp / "ro", "ro,size=64k") / "run"),
        ],  # fmt: skip
        1,
        ("cannot write the run directory", "Read-only"),
    ),
    "resume_not_a_run_dir": Case(
        lambda ws: ["--cluster", "local", "--resume", str(ws.file("empty/x", "").parent)],
        2,
        ("not a run directory",),
    ),
    "resume_no_such_dir": Case(
        lambda ws: ["--cluster", "local", "--resume", str(ws.tmp / "gone")],
        2,
        ("no such directory",),
    ),
    "resume_with_config": Case(
        lambda ws: ["--cluster", "local", "--resume", str(ws.run_dir()), "--config", "local-slurm"],
        2,
        ("drop --config",),
    ),
    "resume_changes_n": Case(
        lambda ws: ["--cluster", "local", "--resume", str(ws.run_dir()), "rollout.n=4"],
        2,
        ("--resume", "rollout.n", "8", "4"),
    ),
    "resume_changes_response_len": Case(
        lambda ws: [
            "--cluster",
            "local",
            "--resume",
            str(ws.run_dir()),
            "rollout.response_length=9",
        ],  # fmt: skip
        2,
        ("--resume", "rollout.response_length"),
    ),
    "resume_corrupt_checkpoint": Case(_corrupt_checkpoint, 2, ("no valid checkpoint",)),
    "resume_under_tmp_slurm": Case(
        lambda ws: ["--cluster", "slurm", "--resume", str(ws.run_dir())], 2, ("under /tmp",)
    ),
    "resume_with_space_slurm": Case(
        lambda ws: ["--cluster", "slurm", "--resume", str(ws.run_dir("run dir"))],
        2,
        ("must not contain spaces",),
    ),
    "slurm_partition_no_sbatch": Case(
        # outside /tmp, so that the sbatch check is reached; never created
        lambda ws: [
            "--cluster",
            "slurm",
            "--partition-rollout",
            "nosuch",
            "--run-dir",
            str(REPO / "runs" / f"bad-input-{uuid.uuid4().hex[:8]}"),
        ],  # fmt: skip
        2,
        ("sbatch not found",),
        env=lambda ws: {"PATH": str(ws.file("empty-bin/.keep", "").parent)},
    ),
    "disk_full_at_checkpoint": Case(
        _disk_full,
        1,
        ("rank 1 (trainer", "No space left on device"),
        before_ranks=False,
        after=_no_checkpoint_litter,
    ),
}
MPI_CASES = {"disk_full_at_checkpoint"}
# also through a fresh interpreter: a bad flag (argparse's exit), a bad config file, a
# model path that is missing, a run directory that cannot be written
SUBPROCESS_CASES = {"flag_unknown", "yaml_file_malformed", "model_path_missing",
                    "run_dir_under_a_file"}  # fmt: skip


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def run_dirs_given(args: list[str]) -> list[Path]:
    return [Path(args[i + 1]) for i, a in enumerate(args[:-1]) if a == "--run-dir"]


@pytest.fixture
def workspace(tmp_path: Path) -> Iterator[Workspace]:
    ws = Workspace(tmp_path)
    yield ws
    ws.unmount_all()


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.mpi) if n in MPI_CASES else n for n in CASES],
)
def test_bad_input_is_one_clear_line(
    name: str, workspace: Workspace, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES[name]
    args = case.args(workspace)
    extra_env = case.env(workspace)
    new_dirs = [d for d in run_dirs_given(args) if not d.exists()]
    before = snapshot(workspace.tmp)
    if extra_env or not case.before_ranks or name in SUBPROCESS_CASES:
        proc = subprocess.run(
            [sys.executable, "-m", "hpc_asyncppo.submit", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, **extra_env},
            timeout=300,  # a hang, not a speed claim
        )
    else:  # submit's own main in this process: the same code without an interpreter's start
        monkeypatch.chdir(REPO)
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # submit's, undone after
        capsys.readouterr()
        # what HF_HUB_DISABLE_PROGRESS_BARS, which submit sets, does in a fresh interpreter
        # (transformers reads it once, at its import)
        hf_logging.disable_progress_bar()
        try:
            code = submit.main(args)
        except SystemExit as exc:  # argparse's refusals
            code = exc.code
        finally:
            hf_logging.enable_progress_bar()
        said = capsys.readouterr()
        proc = subprocess.CompletedProcess(args, code, said.out, said.err)
    err = proc.stderr
    assert proc.returncode == case.code, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith("warning:")]
    assert errors and errors[0].startswith("error: "), err
    if case.before_ranks:
        assert len(errors) == 1, err
        assert snapshot(workspace.tmp) == before, "a refused run changed files"
        assert not any(d.exists() for d in new_dirs), "a refused run left its run directory"
    else:
        assert all(line.startswith("  rank ") for line in errors[1:]), err
    assert any(all(word in line for word in case.words) for line in errors), err
    if name == "vllm_top_k_warns":
        assert any("warning: rollout.engine=vllm with top_p < 1 or top_k > 0" in x for x in lines)
    if name == "disk_full_at_checkpoint":  # what to do once space is freed
        assert f"--resume {workspace.tmp / 'run'}" in errors[0], err
    if name == "resume_corrupt_checkpoint":
        assert any(x.startswith("warning: ") and "step_00000002" in x for x in lines), err
    case.after(workspace)


def test_overlong_prompts_are_dropped_before_the_run_starts(workspace: Workspace) -> None:
    """filter_overlong_prompts (the default): one warning line, and the run dir lists them."""
    from hpc_asyncppo.config import load_config
    from hpc_asyncppo.launch.rundir import prepare_run_dir
    from hpc_asyncppo.tasks import load_task
    from hpc_asyncppo.tasks.overlong import usable_prompts

    cfg = load_config(None, _jsonl(workspace, _row(3), _row(20), _row(16), _row(17)))
    said: list[str] = []
    cfg = prepare_run_dir(cfg, workspace.tmp / "run", warn=said.append)
    assert len(said) == 1 and "dropped 2 of 4 prompts" in said[0], said
    kept = usable_prompts(load_task(cfg.data).prompts(), workspace.tmp / "run")
    assert [p.index for p in kept] == [0, 2]  # indices (uids) stay those of the file


@pytest.mark.mpi
def test_a_run_with_overlong_prompts_trains_only_the_others(workspace: Workspace) -> None:
    """The prompt that used to stop the job mid-run is never generated for."""
    rows = [_row(2 + i % 4, str(i % 10)) for i in range(8)]
    rows[5] = _row(30)
    args = [*_jsonl(workspace, *rows), *FAST, "trainer.total_steps=6"]
    proc = Run.start(workspace.tmp / "run", *args).finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warning: dropped 1 of 8 prompts" in proc.stderr
    trained = read_jsonl(workspace.tmp / "run" / "trained_samples.jsonl")
    prompts = {row["uid"].split("-")[2] for row in trained}
    assert len(trained) == 6 * 16 and "p5" not in prompts and len(prompts) == 7
