"""Agents outside the job, written with the harnesses users already have: claims the
sessions of a ``data.agent=external`` run of the lookup task (``data.task=tool_lookup``)
until it ends, and runs each group's sessions with one harness (``harness_agents.py``: the
OpenAI Agents SDK, LangGraph, smolagents, LiteLLM, the ``anthropic`` SDK, mini-swe-agent),
a group per harness in turn as they are claimed (the n sessions of a group start from
one prompt, so one harness renders them all), unmodified: each is given the session's base URL as its API.

    bash scripts/install_harnesses.sh          # build/harness-venv: the harnesses' pins
    python -m hpc_asyncppo.submit --cluster local --run-dir RUN data.task=tool_lookup \\
        data.agent=external rollout.response_length=12 data.max_prompt_length=4096 &
    build/harness-venv/bin/python examples/harnesses/run_harnesses.py RUN --local \\
        --transcripts RUN/harnesses.jsonl

It ends when the run's ranks are done (the run finished, or a stop signal stopped it:
after ``submit --resume``, start it again; the sessions cut by the stop run again from
their prompts, their calls answered from the checkpoint's recordings while they are the
same). Between the harnesses and the gateway sits a recording proxy (on 127.0.0.1): each call's
status and the exact tokens the gateway answered with (its ``token_ids`` and versions, in
whichever API's shape the harness spoke) go into the session's transcript line, with the
harness, its outcome and any error, so what each harness got back can be compared with
what the trainer trained. The reward is the lookup task's, from what the agent saw: 0.8
for the right answer first in its final text, 0.1 for calling ``lookup`` once, and 0.1
times the share of the call's two words the model's first turn starts with (shaping for a
random model, read from the tokens the first call got back).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harness_agents import HARNESSES, Episode  # noqa: E402

from examples.external_agent import gateways as addresses  # noqa: E402
from examples.external_agent import run_ended  # noqa: E402

CALL_WORDS = ["<tool_call>", '{"name":"lookup","arguments":{}}</tool_call>']


class Proxy:
    """Forwards ``/g{k}/...`` to gateway k, keeping each session's calls (its id is in the
    path: ``/g{k}/sessions/ID/v1/...``)."""

    def __init__(self, gateways: list[str]):
        self.gateways = gateways
        self.calls: dict[str, list[dict]] = {}
        self.lock = threading.Lock()
        self.http = httpx.Client(timeout=None, limits=httpx.Limits(keepalive_expiry=2))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            # one request a connection. Under HTTP/1.1, one call in about 9,000 once hung:
            # its client held a connection to the proxy that no handler thread served (the
            # cause was not pinned down); the clients' own timeouts bound such a wait
            protocol_version = "HTTP/1.0"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self.forward()

            def do_POST(self) -> None:
                self.forward()

            def forward(self) -> None:
                _, gateway, rest = self.path.split("/", 2)
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() in ("authorization", "x-api-key", "content-type",
                                            "anthropic-version")}  # fmt: skip
                r = proxy.http.request(self.command, f"{proxy.gateways[int(gateway[1:])]}/{rest}",
                                       content=body, headers=headers)  # fmt: skip
                proxy.record(rest, r)
                self.send_response(r.status_code)
                self.send_header("content-type", r.headers.get("content-type", "application/json"))
                self.send_header("content-length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def record(self, path: str, r: httpx.Response) -> None:
        parts = path.split("/")
        if len(parts) < 3 or parts[0] != "sessions":
            return
        row = {"path": "/" + "/".join(parts[2:]), "status": r.status_code, **exact_tokens(r)}
        with self.lock:
            self.calls.setdefault(parts[1], []).append(row)

    def take(self, session_id: str) -> list[dict]:
        with self.lock:
            return self.calls.pop(session_id, [])


def exact_tokens(r: httpx.Response) -> dict:
    """The tokens the gateway answered with, from a JSON body or an event stream: the
    object that carries ``token_versions`` (and ``prompt_token_ids``, wherever it is)."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        objects = [json.loads(line[6:]) for line in r.text.splitlines()
                   if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip
    else:
        try:
            objects = [r.json()]
        except ValueError:
            return {}
    found: dict = {}

    def walk(obj) -> None:
        if isinstance(obj, dict):
            if "token_versions" in obj:
                found.update(token_ids=obj["token_ids"], token_versions=obj["token_versions"])
            if "prompt_token_ids" in obj:
                found["prompt_token_ids"] = obj["prompt_token_ids"]
            if obj.get("retried"):  # the same turn as a call before (the same call again)
                found["retried"] = True
            for value in obj.values():
                walk(value)
        elif isinstance(obj, list):
            for value in obj:
                walk(value)

    for obj in objects:
        walk(obj)
    return found


def reward(e: Episode, calls: list[dict], words_of) -> float:
    first = words_of(calls[0].get("token_ids", [])) if calls else []
    prefix = 0
    for word, want in zip(first, CALL_WORDS, strict=False):
        if word != want:
            break
        prefix += 1
    right = e.final.split()[:1] == [e.secret]
    return 0.1 * prefix / len(CALL_WORDS) + 0.1 * (e.calls == 1) + 0.8 * right


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--harnesses", nargs="+", default=list(HARNESSES), choices=list(HARNESSES))
    parser.add_argument("--sessions", type=int, default=8, help="sessions run at once")
    parser.add_argument("--local", action="store_true", help="call 127.0.0.1, not the host name")
    parser.add_argument("--transcripts", type=Path, help="a line per session ended")
    parser.add_argument("--wait-s", type=float, default=300, help="end after this long idle")
    args = parser.parse_args()
    from tokenizers import Tokenizer  # the run's model's, to read the first turn's words

    deadline = time.monotonic() + args.wait_s
    while not (args.run_dir / "gateway" / "token").exists() or not list(
            (args.run_dir / "gateway").glob("rank*.json")):  # fmt: skip
        if time.monotonic() > deadline:
            sys.exit(f"{args.run_dir}: no gateway (is it a data.agent=external run?)")
        time.sleep(0.2)
    token = (args.run_dir / "gateway" / "token").read_text().strip()
    tokenizer = Tokenizer.from_file(str(args.run_dir / "model" / "tokenizer.json"))

    def words_of(ids: list[int]) -> list[str]:
        return [tokenizer.id_to_token(i) or "" for i in ids]

    gateways = [("http://127.0.0.1:" + url.rsplit(":", 1)[1] if args.local else url)
                .removesuffix("/v1") for url in addresses(args.run_dir)]  # fmt: skip
    proxy = Proxy(gateways)
    headers = {"Authorization": f"Bearer {token}"}
    written = threading.Lock()
    ended = {name: 0 for name in args.harnesses}
    harness_of: dict[str, str] = {}  # a group (its sessions' id prefix) -> its harness

    def loop() -> None:
        http = httpx.Client(timeout=None, limits=httpx.Limits(keepalive_expiry=2))
        idle = time.monotonic()
        while time.monotonic() - idle < args.wait_s:
            claimed = None
            for k, gateway in enumerate(gateways):
                try:
                    r = http.post(f"{gateway}/v1/sessions", headers=headers, json={"wait_s": 1})
                except httpx.TransportError:  # the run ended
                    return
                if r.status_code == 200:
                    claimed = (k, r.json())
                    break
            if claimed is None:
                if run_ended(args.run_dir):  # finished, or stopped: a resume starts agents anew
                    return
                continue
            idle = time.monotonic()
            k, session = claimed
            row, sid = session["row"], session["session_id"]
            with written:  # each new group the next harness, in turn
                name = harness_of.setdefault(
                    session["session_id"].rsplit("-r", 1)[0],
                    args.harnesses[len(harness_of) % len(args.harnesses)])  # fmt: skip
            e = Episode(row["messages"][-1]["content"],
                        row["tools_kwargs"]["lookup"]["create_kwargs"]["answer"])  # fmt: skip
            error = None
            try:
                HARNESSES[name](f"http://127.0.0.1:{proxy.port}/g{k}/sessions/{sid}/v1", token, e)
            except Exception as exc:  # noqa: BLE001 - recorded; the session still gets a reward
                error = f"{type(exc).__name__}: {exc}"[:500]
            calls = proxy.take(sid)
            outcome = {"reward": reward(e, calls, words_of), "tool_calls": e.calls}
            try:
                http.post(f"{gateways[k]}/v1/sessions/{sid}/reward", headers=headers, json=outcome)
            except httpx.TransportError:
                return
            line = {"session_id": sid, "harness": name, "outcome": outcome, "final": e.final,
                    "error": error, "agent_errors": e.errors, "calls": calls}  # fmt: skip
            with written:
                ended[name] += 1
                if args.transcripts:
                    with args.transcripts.open("a") as f:
                        f.write(json.dumps(line) + "\n")

    with ThreadPoolExecutor(args.sessions) as pool:
        list(pool.map(lambda _: loop(), range(args.sessions)))
    print("sessions ended per harness: " + ", ".join(f"{k} {v}" for k, v in ended.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
