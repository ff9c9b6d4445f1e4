"""An agent outside the job: any process, on any node that reaches the rollout nodes,
in any language that speaks HTTP. Here Python with the ``openai`` client, running the
lookup agent of ``lookup_agent.py`` on sessions it claims until the run ends.

    python -m hpc_asyncppo.submit data.task=tool_lookup rollout.response_length=10 \
        data.agent=external --run-dir RUN_DIR &
    python examples/external_agent.py RUN_DIR        # as many as you like, anywhere

Each rollout rank writes its address to RUN_DIR/gateway/rank{i}.json once it listens;
RUN_DIR/gateway/token is the bearer token (readable by the run's owner only). The loop:
``POST /v1/sessions`` (a session id, its base URL and its prompt row), the agent's calls
through that base URL, ``POST /v1/sessions/{id}/reward`` with the reward, or with
``{"error": ...}`` where the agent failed (the run is stopping, a call was refused, a bug):
a session never ended holds its whole group until ``gateway.agent_timeout_s``. The run has
ended when every rank's record (RUN_DIR/ranks/rank{i}.json) says ``"state": "done"``.

``--transcripts FILE`` appends a line per session ended: its id, the last call's messages
with the model's last answer, and per call the exact tokens the gateway returned (the
context's ids, the sampled ids, their log-probs and versions): what the trainer gets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

# the client's response types built at import: built at first use, this agent's threads
# race on it and a call fails with pydantic's "BaseModel cannot be instantiated directly"
os.environ.setdefault("DEFER_PYDANTIC_BUILD", "false")
import openai  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.lookup_agent import run as lookup  # noqa: E402


def gateways(run_dir: Path) -> list[str]:
    """The rollout ranks' addresses, read again before each claim: ranks that start late
    or restart (a resumed or restarted job listens on new ports) are found."""
    urls = []
    for path in sorted(run_dir.glob("gateway/rank*.json")):
        try:
            urls.append(json.loads(path.read_text())["url"])
        except (OSError, ValueError):  # being replaced
            continue
    return urls


def run_ended(run_dir: Path) -> bool:
    """Every rank of the run says it is done (RUN_DIR/ranks/rank{i}.json, "state")."""
    states = []
    for path in run_dir.glob("ranks/rank*.json"):
        try:
            states.append(json.loads(path.read_text())["state"])
        except (OSError, ValueError, KeyError):  # being written
            return False
    return bool(states) and all(state == "done" for state in states)


def claim(http: httpx.Client, args: argparse.Namespace, headers: dict) -> dict | None:
    """A session from any rank that has one free (each asked in turn, waiting a second),
    or None when none has."""
    for url in gateways(args.run_dir):
        if args.local:
            url = "http://127.0.0.1:" + url.rsplit(":", 1)[1]
        base = url.removesuffix("/v1")
        try:
            r = http.post(f"{base}/v1/sessions", headers=headers, json={"wait_s": 1})
        except httpx.TransportError:  # that rank is gone (the run ended, or restarts)
            continue
        if r.status_code == 200:  # 429: every session on that rank is taken; 503: stopping
            return {**r.json(), "gateway": base}
    return None


class Transcript:
    """An ``openai`` client that keeps what its session's calls sent and got back."""

    def __init__(self, client: openai.OpenAI):
        self.client, self.chat, self.completions = client, self, self
        self.messages: list[dict] = []
        self.calls: list[dict] = []

    def create(self, **kwargs):
        answer = self.client.chat.completions.create(**kwargs)
        choice = answer.choices[0]
        self.messages = [*kwargs["messages"], choice.message.model_dump(exclude_none=True)]
        extra = choice.model_extra
        self.calls.append({
            "prompt_token_ids": answer.model_extra["prompt_token_ids"],
            **{k: extra[k] for k in ("token_ids", "token_logprobs", "token_versions")},
            "finish_reason": choice.finish_reason,
        })  # fmt: skip
        return answer


_written = threading.Lock()


def write_transcript(path: Path, session_id: str, transcript: Transcript, outcome: dict) -> None:
    line = {"session_id": session_id, "outcome": outcome, "messages": transcript.messages,
            "calls": transcript.calls}  # fmt: skip
    with _written, path.open("a") as f:
        f.write(json.dumps(line) + "\n")


def agent_loop(args: argparse.Namespace, token: str) -> int:
    """Claim, run, end, until the run has ended (or no rank gave a session for
    ``--wait-s``); the count of sessions ended with a reward."""
    headers = {"Authorization": f"Bearer {token}"}
    # idle connections closed before the server's keep-alive (uvicorn: 5 s) would close them
    http = httpx.Client(timeout=None, limits=httpx.Limits(keepalive_expiry=2))
    done = 0
    last = time.monotonic()  # when a gateway last gave a session (or we started)
    while not run_ended(args.run_dir):
        claimed = claim(http, args, headers)
        if claimed is None:
            if time.monotonic() - last > args.wait_s:
                break
            time.sleep(0.1)
            continue
        last = time.monotonic()
        row = types.SimpleNamespace(**claimed["row"])
        client = openai.OpenAI(base_url=claimed["base_url"], api_key=token, max_retries=0,
                               http_client=http)  # fmt: skip
        transcript = Transcript(client)
        try:
            outcome = lookup(transcript if args.transcripts else client, row)
        except Exception as exc:  # noqa: BLE001 - the session fails, the agent goes on
            outcome = {"error": f"{type(exc).__name__}: {exc}"}  # its group is dropped
        if args.transcripts:
            write_transcript(args.transcripts, claimed["session_id"], transcript, outcome)
        try:  # end it: a session never ended holds its group gateway.agent_timeout_s
            http.post(f"{claimed['gateway']}/v1/sessions/{claimed['session_id']}/reward",
                      headers=headers, json=outcome)  # fmt: skip
        except httpx.TransportError:  # that rank is gone: its sessions went with it
            continue
        done += "error" not in outcome
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--sessions", type=int, default=8, help="sessions run at once")
    parser.add_argument(
        "--wait-s",
        type=float,
        default=600,
        help="end after this long without a session (the run has not started, or is gone)",
    )
    parser.add_argument("--local", action="store_true", help="call 127.0.0.1, not the host name")
    parser.add_argument(
        "--transcripts", type=Path, help="append each session's calls and exact tokens here"
    )
    args = parser.parse_args()
    token_file = args.run_dir / "gateway" / "token"
    deadline = time.monotonic() + args.wait_s
    while not token_file.exists():  # the run directory is being made
        if time.monotonic() > deadline:
            sys.exit(f"{token_file}: no such file (is {args.run_dir} a data.agent run?)")
        time.sleep(0.1)
    token = token_file.read_text().strip()
    with ThreadPoolExecutor(args.sessions) as pool:
        done = sum(pool.map(lambda _: agent_loop(args, token), range(args.sessions)))
    print(f"external agent: {done} sessions ended")
    return 0


if __name__ == "__main__":
    sys.exit(main())
