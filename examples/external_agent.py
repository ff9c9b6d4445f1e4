"""An agent outside the job: any process, on any node that reaches the rollout nodes,
in any language that speaks HTTP. Here Python with the ``openai`` client, running the
lookup agent of ``lookup_agent.py`` on sessions it claims until the run ends.

    python -m hpc_asyncppo.submit data.task=tool_lookup rollout.response_length=10 \
        data.agent=external --run-dir RUN_DIR &
    python examples/external_agent.py RUN_DIR        # as many as you like, anywhere

Each rollout rank writes its address to RUN_DIR/gateway/rank{i}.json once it listens;
RUN_DIR/gateway/token is the bearer token (readable by the run's owner only). The loop:
``POST /v1/sessions`` (a session id, its base URL and its prompt row), the agent's calls
through that base URL, ``POST /v1/sessions/{id}/reward``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

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


def agent_loop(args: argparse.Namespace, token: str) -> int:
    """Claim, run, reward, until no gateway gives a session for ``--wait-s``; the count."""
    headers = {"Authorization": f"Bearer {token}"}
    http = httpx.Client(timeout=None)
    done, turn = 0, 0
    started = time.monotonic()
    last = None  # when a gateway last gave a session
    while True:
        now = time.monotonic()
        if (last is None and now - started > args.start_wait_s) or (
            last is not None and now - last > args.wait_s
        ):
            return done  # the run never started, or has ended
        urls = gateways(args.run_dir)
        if not urls:
            time.sleep(0.1)
            continue
        turn += 1
        url = urls[turn % len(urls)]
        if args.local:
            url = "http://127.0.0.1:" + url.rsplit(":", 1)[1]
        base = url.removesuffix("/v1")
        try:
            r = http.post(f"{base}/v1/sessions", headers=headers, json={})
        except httpx.TransportError:  # that rank is gone (the run ended, or restarts)
            time.sleep(0.1)
            continue
        if r.status_code != 200:  # 429: every session taken; 503: stopping
            time.sleep(0.1)
            continue
        last = time.monotonic()
        claimed = r.json()
        row = types.SimpleNamespace(**claimed["row"])
        client = openai.OpenAI(base_url=claimed["base_url"], api_key=token, max_retries=0,
                               http_client=http)  # fmt: skip
        try:
            outcome = lookup(client, row)
        except openai.APIError:  # the run is stopping, or the session ended
            continue
        http.post(f"{base}/v1/sessions/{claimed['session_id']}/reward", headers=headers,
                  json=outcome)  # fmt: skip
        done += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--sessions", type=int, default=8, help="sessions run at once")
    parser.add_argument(
        "--start-wait-s", type=float, default=600, help="for the first session (start-up)"
    )
    parser.add_argument(
        "--wait-s", type=float, default=60, help="then end after this long without one"
    )
    parser.add_argument("--local", action="store_true", help="call 127.0.0.1, not the host name")
    args = parser.parse_args()
    token_file = args.run_dir / "gateway" / "token"
    deadline = time.monotonic() + args.start_wait_s
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
