"""The rollout rank's main loop.

Read top to bottom: take control messages (credits, weight syncs, stop); start as many
prompt groups as the trainer leader has granted credits for (at most
``rollout.prompts_per_generate`` in flight); advance the engine one step (hf: a whole batch;
vllm: one decoding step of every running request); score and send the groups that
finished; wait when there is nothing to do. The leader's credits are the whole flow and
staleness control: a rank never generates what it was not granted. Each credit names its
prompt (a draw of the leader's data order, ``tasks/order.py``): the rank keeps no
place in the data of its own, so a run can resume on any number of rollout ranks.
Validation groups (VALIDATE, ``validation.py``) share the engine steps and go back to the
leader apart; they are no part of a checkpoint, and a stop signal abandons them.

A weight sync (SYNC) is announced between two engine steps; the trainer leader's broadcast
goes to the engine's members of the weight group (``transport/weight_group.py``: the rank
itself for hf, every vLLM worker for vllm). Before the weights change, the groups in
flight finish under the old weights (no new group starts meanwhile) and are sent, or with
partial rollout they are cut, keep their tokens, and continue under the new weights
(``param_version_end`` > start). vLLM then pauses between two steps while the sync streams
into its workers (``sync/pause_s``): the rank holds no copy of the weights. With in-flight
weight updates (``async_training.inflight_weight_update``, fully_async) the hf engine
instead receives the sync on a side thread into a staging copy of the weights while it
goes on generating under the old ones, and loads the copy between two engine steps once
it is complete (memory: one more copy of the weights in ``model.dtype`` on the rank's
device). Every token records the version that sampled it, so the staleness audit stays
exact.

A checkpoint (CHECKPOINT) cuts the groups in flight at once and writes them, with their
tokens so far, log-probs and per-token versions (``cut_groups.py``), and the rank's RNGs
into this rank's part; they go on afterwards. A stop signal makes the rank stop
generating at once (the hf engine between two tokens) and wait for the leader's
checkpoint, so that the time from the signal to a durable checkpoint does not grow with
the response length. After a resume the cut groups continue from their tokens; without
partial rollout only if the weights are still those that sampled them, otherwise they
start again from the prompt (same uid; the tokens thrown away are counted in
``tokens_regenerated``).

An engine that dies under the rank (``EngineDied``: vLLM's engine core killed, crashed or
stuck past ``rollout.engine_stall_s``) is restarted in place, at most
``rollout.max_engine_restarts`` times per attempt (one more death fails the rank, and
the job restart takes over). The rank says REJOIN at once, so that the leader sends no
weights into the dead engine, takes the groups it had in flight with their tokens so far
(as a checkpoint would: they are the same cut groups), starts a new engine, joins the
weight group's next generation when the leader says REGROUP, and continues the groups
once the leader has sent the weights again: the same version when the leader's weights
have not moved since, so the tokens so far are kept even without partial rollout. The
control message being handled when the engine died is handled again afterwards; a SYNC
announced before the REGROUP is void (its broadcast broke on the dead engine).

Where things are: the engine and the weights it holds (a sync's receiving, loading and
draining, a regroup, a dead engine's place in the weight group) have one owner,
``engine_weights.py``; this rank says what must happen around a load (``before_new_weights``,
``weights_loaded``) and restarts the engine (``restart_engine``); the loop (``run``) and the
answer to each message (``handle``) read top to bottom here (``STYLE.md``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.checkpoint.state import RngState, Stateful
from hpc_asyncppo.config import Config
from hpc_asyncppo.rollout.cut_groups import CutGroup, CutGroups
from hpc_asyncppo.rollout.engine import EngineDied, RolloutEngine
from hpc_asyncppo.rollout.engine_factory import make_engine
from hpc_asyncppo.rollout.engine_weights import EngineWeights
from hpc_asyncppo.rollout.gateway.server import Gateway
from hpc_asyncppo.rollout.gateway.sessions import AgentError, Sessions
from hpc_asyncppo.rollout.generation import Generation, PartialGroup
from hpc_asyncppo.rollout.turns import Turns
from hpc_asyncppo.rollout.validation import Validator
from hpc_asyncppo.runlog import sent_groups_writer
from hpc_asyncppo.runtime import heartbeat, startup
from hpc_asyncppo.runtime.signals import forget_stop, stop_requested
from hpc_asyncppo.runtime.topology import Topology
from hpc_asyncppo.tasks import Prompt, Task, load_task, tokenize_prompt
from hpc_asyncppo.tasks.overlong import usable_prompts
from hpc_asyncppo.timeline import Timeline
from hpc_asyncppo.tools.base import load_tools
from hpc_asyncppo.transport.arrays import pack_arrays
from hpc_asyncppo.transport.samples import Control, SampleGroup, SampleSender
from hpc_asyncppo.transport.weight_group import member_rank
from hpc_asyncppo.transport.weights import WeightUpdate

log = logging.getLogger(__name__)
# data.agent on the hf engine: how long a step waits for the next calls of the sessions just
# answered (an agent's turn is a few milliseconds of HTTP; a turn generated alone is a
# batch of one): Sessions.gather_s
GATHER_S = 0.05


class Rollouter:
    def __init__(
        self,
        cfg: Config,
        topo: Topology,
        run_dir: Path,
        checkpoint: Path | None = None,
        engine: RolloutEngine | None = None,
        sender: SampleSender | None = None,
        new_engine: Callable[[], RolloutEngine] | None = None,
    ):
        """``checkpoint``: the folder to resume from (``restore``), or None. ``engine``,
        ``sender`` and ``new_engine`` (builds the engine of a restart): the rank's own (from
        ``cfg``, over ``topo.inter``) unless given (the unit tests' fakes)."""
        self.cfg, self.topo, self.run_dir = cfg, topo, run_dir
        self.rank = topo.world_rank
        self.task: Task = load_task(cfg.data)
        # Without the prompts the run directory lists as overlong; self.prompts[i].index is
        # a prompt's index in the task (its uid), i its position in the data order.
        self.prompts: list[Prompt] = usable_prompts(self.task.prompts(), run_dir)
        self.new_engine = new_engine or (lambda: make_engine(cfg, topo.device))
        engine = engine if engine is not None else self.new_engine()
        startup.mark("engine built")
        # the engine and the weights it holds, joined to the weight group
        self.weights = EngineWeights(
            cfg, self.rank, engine, topo.weights, self.first_member, run_dir,
            before_load=self.before_new_weights, loaded=self.weights_loaded,
        )  # fmt: skip
        startup.mark("weight group joined")
        self.turns = self.make_turns()  # multi-turn: the trajectories' tool calls (or None)
        # data.agent: the user's agents drive generation through this rank's gateway
        self.sessions, self.gateway = self.make_gateway()
        self.schemas = [t.schema for t in self.turns.tools.values()] if self.turns else None
        # groups submitted to the engine: key -> (data epoch, position in prompts, version at start)
        self.in_flight: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.granted: deque[int] = deque()  # draws (prompts) the leader granted, not started
        self.sender = sender if sender is not None else SampleSender(topo.inter)
        self.validator = Validator(
            cfg, self.rank, topo.rollout_ranks, self.engine, self.sender, self.turns, self.sessions
        )
        self.attach(engine)
        self.synced = False  # the first sync has come (time counts from it)
        self.idle_s = 0.0
        self.started_at = time.monotonic()
        self._encoded: dict[int, list[int]] = {}
        self.timeline = Timeline(run_dir, self.rank, "rollout")
        self.sent_log = (
            sent_groups_writer(run_dir, self.rank) if cfg.rollout.record_sent_groups else None
        )
        self._waiting_since: float | None = None  # end of the last wait, if nothing ran since
        self._waiting_wall = 0.0  # the same, by time.time()
        self._stop_seen: float | None = None  # when this rank saw a stop signal
        self.tokens_regenerated = 0  # tokens of cut responses thrown away (started again)
        self.inbox: deque[tuple[Control, int]] = deque()  # control messages not yet handled
        # cut groups (of the checkpoint, or of a restarted engine), placed once the weights
        # say which version
        self.resumed: list[CutGroup] = []
        if checkpoint is not None:  # last, so that nothing above draws from the restored RNGs
            self.restore(checkpoint)

    def restore(self, checkpoint: Path) -> None:
        """Read this rank's states from its own small part of a checkpoint (its RNGs, none
        if the checkpoint was written by fewer rollout ranks) and the cut groups of the old
        ranks it continues (``protocol.continuing_rank``); nothing else."""
        old_ranks = protocol.read_manifest(checkpoint)["rollout_ranks"]
        names, read = [], 0
        for old in protocol.continued_parts(self.rank, self.topo.rollout_ranks, old_ranks):
            cut = CutGroups()
            states: dict[str, Stateful] = {"cut_groups": cut}
            if old == self.rank:
                states["rng"] = RngState()
            part = checkpoint / protocol.rollout_part(old)
            read += protocol.load_part(part, states)
            self.resumed += cut.groups
            names.append(part.name)
        log.info("resume read %d bytes, from %s only", read, ", ".join(names) or "no part")

    def make_turns(self) -> Turns | None:
        """The rank's multi-turn state, with its tools built (``rollout.multi_turn``)."""
        cfg = self.cfg.rollout.multi_turn
        if not cfg.enable:
            return None
        tools = load_tools(cfg.tool_config_path)
        width = self.cfg.rollout.response_length
        respond = getattr(self.task, "respond", None)  # an environment's plain-text turns
        turns = Turns(cfg, self.engine.tokenizer, tools, self.engine.eos_id, width, respond)
        return turns

    def make_gateway(self) -> tuple[Sessions | None, Gateway | None]:
        """``data.agent``: the sessions, the agents' runner and the HTTP server, listening
        (its address in RUN_DIR/gateway/rank{i}.json)."""
        if not self.cfg.data.agent:
            return None, None
        from hpc_asyncppo.rollout.gateway.addresses import read_token
        from hpc_asyncppo.rollout.gateway.agents import AgentRunner
        from hpc_asyncppo.rollout.gateway.requests import Fields
        from hpc_asyncppo.rollout.gateway.server import Gateway, make_app
        from hpc_asyncppo.tasks.registry import load_agent
        from hpc_asyncppo.tools.tool_parsers import tool_parser

        cfg, token = self.cfg, read_token(self.run_dir)
        gateway: Gateway | None = None
        agent = load_agent(cfg.data)  # None: external agents claim the sessions
        # sessions in flight at most: training groups', and validation's beside them
        val_n = cfg.rollout.val_n if cfg.trainer.test_freq and cfg.data.val else 0
        held = cfg.rollout.prompts_per_generate * (cfg.rollout.n + val_n)
        runner = AgentRunner(agent, lambda: gateway.port, token, held) if agent else None
        sessions = Sessions(
            self.engine.tokenizer, self.engine.eos_id, cfg.rollout.response_length,
            cfg.data.max_prompt_length, cfg.gateway.agent_timeout_s,
            runner.start if runner else None, GATHER_S if cfg.rollout.engine == "hf" else 0.0,
            cfg.gateway.max_sequences,
            tool_parser(cfg.gateway.tool_parser, self.engine.tokenizer.chat_template),
            cfg.gateway.on_session_failure, cfg.gateway.failure_reward,
        )  # fmt: skip
        if runner is not None:
            runner.sessions = sessions
        sampling = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                    "top_k": cfg.rollout.top_k}  # fmt: skip
        fields = Fields(sampling, cfg.gateway.sampling, cfg.gateway.parallel_tool_calls)
        app = make_app(sessions, token, Path(cfg.model.path).name or "model", fields,
                       int(cfg.gateway.max_request_mb * 2**20), cfg.gateway.claim_wait_s)  # fmt: skip
        gateway = Gateway(app, cfg.gateway.host, cfg.gateway.port)
        row = gateway.write_address(self.run_dir, self.rank)
        log.info("rank %d: gateway listening at %s", self.rank, row["url"])
        startup.mark("gateway listening")
        return sessions, gateway

    @property
    def engine(self) -> RolloutEngine:
        return self.weights.engine

    @property
    def version(self) -> int:
        return self.weights.version

    def attach(self, engine: RolloutEngine) -> None:
        """Wire an engine to this rank (at the start, and after each restart): the weights'
        owner holds it; it asks this rank whether to stop mid-step, ends turns at the
        tools' call ends, and validation generates on it."""
        self.weights.attach(engine)
        engine.should_stop = lambda: stop_requested() is not None
        if self.turns is not None:
            engine.turn_ends = self.turns.turn_ends
        if self.sessions is not None:
            engine.turn_ends = self.sessions.turn_ends
        self.validator.engine = engine

    def prompt_of(self, key: Hashable) -> Prompt:
        """The prompt of a group in flight (training or validation)."""
        if self.validator.owns(key):
            return self.validator.prompts[key[2]]
        return self.prompts[key[1]]

    @property
    def first_member(self) -> int:
        return member_rank(self.rank, 0, self.topo.workers_per_rank)

    def run(self) -> None:
        while True:
            try:
                stop = self.handle_control()
                if stop:
                    break
                if self.stopping():
                    continue
                self.weights.load_pending(groups_in_flight=bool(self.in_flight))
                if self.weights.held:
                    self.start_granted_groups()
                    self.validator.top_up(self.version)
                if not self.in_flight and not self.validator.in_flight:
                    heartbeat.doing(f"waiting for credits (weights version {self.version})")
                    self.wait_a_moment()
                    continue
                self._waiting_since = None
                heartbeat.doing(f"generating under weights version {self.version}")
                self.step_and_send()
            except EngineDied as death:
                self.restart_engine(death)
        self.finish_validation()  # a validation asked for before STOP reports
        self.weights.finish()  # a broadcast the leader finished before STOP
        self.engine.interrupt()  # groups still in flight were never counted as sent
        self.engine.close()
        if self.gateway is not None:
            self.gateway.close()
        with self.timeline.span("send"):
            self.sender.finish(self.cfg.timeouts.rank_wait_s)
        self.timeline.close()
        if self.sent_log is not None:
            self.sent_log.close()
        log.info("rollout rank %d sent %d groups", self.rank, self.sender.groups_sent)
        if self.sessions is not None:
            log.info(
                "rollout rank %d: %d agent calls answered from cut sessions' recordings "
                "(%d tokens kept), %d recorded tokens not called for again",
                self.rank,
                self.sessions.replayed_calls,
                self.sessions.replayed_tokens,
                self.sessions.discarded_tokens,
            )

    def handle_control(self) -> bool:
        """Apply every control message that arrived; True on STOP. A message leaves the
        inbox once handled: one whose handling the engine's death broke is handled again
        after the restart."""
        self.inbox.extend(self.sender.poll_control())
        while self.inbox:
            kind, value = self.inbox[0]
            if self.handle(kind, value):
                return True
            self.inbox.popleft()
        return False

    def handle(self, kind: Control, value: int) -> bool:
        """One control message (its value: a credit's draw naming the prompt, a sync's
        version, the weight group's next generation, the step checkpointed or validated);
        True on STOP."""
        if kind == Control.STOP:
            return True
        answer = {
            Control.CREDIT: self.granted.append,
            Control.SYNC: self.weights.sync,
            Control.REGROUP: self.weights.regroup,
            Control.CHECKPOINT: self.checkpoint,
            Control.VALIDATE: self.validate,
        }
        answer[kind](value)
        return False

    def checkpoint(self, step: int) -> None:
        heartbeat.doing(f"writing its part of the checkpoint of step {step}")
        self.engine.interrupt()  # the groups in flight go into the part, cut
        self.write_checkpoint_part(step)

    def validate(self, step: int) -> None:
        self.weights.load_pending(wait=True)  # under the version just synced
        self.validator.request(step, self.weights.announced)

    def restart_engine(self, death: EngineDied) -> None:
        """The engine died: tell the leader (REJOIN), take the groups it had in flight with
        their tokens so far (validation groups start again from their prompts), and start
        a new engine. The rank then waits for REGROUP and the weights (``weights.held``)."""
        self.weights.died(death)
        self.sender.send_control(Control.REJOIN, self.weights.restarts)
        log.error(
            "rank %d: %s; restarting the engine (restart %d of at most %d)",
            self.rank,
            death,
            self.weights.restarts,
            self.cfg.rollout.max_engine_restarts,
        )
        heartbeat.doing(f"restarting its engine after: {death}")
        kept = 0
        for key, partial in self.engine.unfinished():
            if self.validator.owns(key):
                self.validator.again(key)
                if self.turns is not None:
                    self.turns.forget(key, len(partial.finished))
                continue
            self.resumed.append((*self.in_flight.pop(key), partial))  # its tool calls go on
            kept += partial.tokens
        try:
            self.engine.close()
        except Exception as exc:  # noqa: BLE001 - the dead engine's leftovers: log and go on
            log.warning("rank %d: closing the dead engine: %s", self.rank, exc)
        self.attach(self.new_engine())
        log.warning(
            "rank %d: new engine started in %.1fs; %d groups in flight (%d tokens) continue "
            "once the weights are back",
            self.rank,
            time.monotonic() - self.weights.died_at,
            len(self.resumed),
            kept,
        )

    def before_new_weights(self) -> None:
        """What must happen before the engine's weights change: every response of a
        validation has one version; groups in flight are cut (partial rollout: they resume
        under the new weights) or finished under the old ones. A restarted engine has
        nothing running (and no weights to finish anything with)."""
        if not self.weights.held:
            return
        self.finish_validation()
        if self.cfg.async_training.partial_rollout:
            self.engine.interrupt()
        else:
            self.finish_in_flight()

    def finish_validation(self) -> None:
        """Run the validations asked for to their end; none after a stop signal (the
        leader knows and does not wait for them)."""
        if not stop_requested():
            self.validator.finish(
                self.step_and_send,
                stop=lambda: stop_requested() is not None,
                version=self.version if self.weights.held else None,
            )

    def stopping(self) -> bool:
        """After a stop signal: generate nothing more, wait for the leader's checkpoint and
        STOP. A leader that never asks (the signal reached only this rank) is waited for
        ``timeouts.rank_wait_s``, then the rank carries on."""
        if not stop_requested():
            return False
        now = time.monotonic()
        if self._stop_seen is None:
            self._stop_seen = now
            self.engine.interrupt()
            if self.sessions is not None:  # the agents' calls fail: the run is stopping
                self.sessions.stop(f"the run is stopping ({stop_requested()}): this session "
                                   "runs again from its prompt after the resume")  # fmt: skip
            log.warning(
                "rank %d: %s received, waiting for the checkpoint", self.rank, stop_requested()
            )
        if now - self._stop_seen > self.cfg.timeouts.rank_wait_s:
            log.warning(
                "rank %d: no checkpoint asked for after the stop signal: carrying on", self.rank
            )
            forget_stop()
            self._stop_seen = None
            if self.sessions is not None:
                self.sessions.carry_on()
            return False
        self.wait_a_moment()
        return True

    def place_resumed_groups(self) -> None:
        """The checkpoint's cut groups, into the engine: each continues from its tokens if
        partial rollout allows mixing versions or the weights are the same version as those
        that sampled them; otherwise it starts again from its prompt."""
        for epoch, index, version_start, partial in self.resumed:
            sofar = partial.sofar
            sampled = sofar.versions[sofar.versions >= 0]
            same = bool(np.all(sampled == self.version))
            if self.sessions is not None and not (self.sessions.live((epoch, index)) and same):
                # an agent's session runs again from its prompt (its agent too): from a
                # checkpoint, or cut by new weights its conversation cannot continue under.
                # From a checkpoint, where its tokens may continue (partial rollout, or the
                # same weights), the agent's calls are answered from them while they match
                recorded = not self.sessions.live((epoch, index)) and (
                    self.cfg.async_training.partial_rollout or same
                )
                self.sessions.forget((epoch, index), "the session's engine restarted under "
                                     "new weights: it runs again from its prompt")  # fmt: skip
                self.sessions.open_group((epoch, index), self.uid_prefix(epoch, index),
                                         self.prompts[index], self.cfg.rollout.n,
                                         partial if recorded else None)  # fmt: skip
                self.tokens_regenerated += 0 if recorded else partial.tokens
                version_start = self.version
            elif self.sessions is not None:  # a restarted engine's: the sessions go on
                self.engine.resume((epoch, index), partial)
                self.sessions.reattach((epoch, index), self.engine)
            elif self.cfg.async_training.partial_rollout or same:
                self.engine.resume((epoch, index), partial)
                if self.turns is not None and partial.tools is not None:  # from a checkpoint
                    group = self.engine.groups[(epoch, index)]
                    self.turns.load((epoch, index), group, partial.tools)
            else:
                if self.turns is not None:  # its trajectories start again, tools too
                    self.turns.forget((epoch, index), len(partial.finished))
                self.engine.submit((epoch, index), self.prompt_ids(index), self.cfg.rollout.n)
                self.tokens_regenerated += partial.tokens
                version_start = self.version
            self.in_flight[(epoch, index)] = (epoch, index, version_start)
        if self.resumed:
            log.info(
                "rank %d: %d cut groups resumed, %d tokens to generate again",
                self.rank,
                len(self.resumed),
                self.tokens_regenerated,
            )
        self.resumed = []

    def start_granted_groups(self) -> None:
        """Submit new prompt groups while credits last, up to prompts_per_generate in flight."""
        if self.weights.draining:
            return  # new weights are in: the groups in flight drain before they load
        room = self.cfg.rollout.prompts_per_generate - len(self.in_flight)
        for _ in range(max(0, min(len(self.granted), room))):
            epoch, index = divmod(self.granted.popleft(), len(self.prompts))
            if self.sessions is not None:  # its agents' first calls bring the prompt
                prefix = self.uid_prefix(epoch, index)
                self.sessions.open_group(
                    (epoch, index), prefix, self.prompts[index], self.cfg.rollout.n
                )
            else:
                self.engine.submit((epoch, index), self.prompt_ids(index), self.cfg.rollout.n)
            self.in_flight[(epoch, index)] = (epoch, index, self.version)

    def uid_prefix(self, epoch: int, index: int) -> str:
        """What the uids of a group's samples start with (``SampleGroup.uid``)."""
        return f"s{self.cfg.trainer.seed}-e{epoch}-p{self.prompts[index].index}"

    def step_and_send(self) -> None:
        """One engine step, and the groups it finished sent (multi-turn: first the tool
        calls of turns that ended started, and the answers that came put back)."""
        if self.turns is not None and not self.turns.advance(self.engine.groups, self.prompt_of):
            time.sleep(0.002)  # every response waits for a tool: the engine has nothing to do
        if self.sessions is not None:  # agents drive the engine; a group ends with their rewards
            finished = self.sessions.step(self.engine, self.generate)
            gateway = self.cfg.gateway
            broken = self.sessions.broken(gateway.max_failed_in_row, gateway.max_failed_share)
            if broken is not None:  # the same agent fails the same way again: no restart
                raise AgentError(broken)
        else:
            finished = self.generate()
        if not finished:
            return
        with self.timeline.span("send"):
            for key, gen in finished:
                if self.validator.owns(key):
                    self.validator.finished(key, gen)
                    continue
                group = self.sample_group(*self.in_flight.pop(key), gen)
                self.sender.send(group)
                self.record_sent(group)

    def generate(self) -> list[tuple[Hashable, Generation]]:
        with self.timeline.span("generate"):
            return self.engine.step()

    def record_sent(self, group: SampleGroup) -> None:
        if self.sent_log is not None:
            row = {
                "uid_prefix": group.uid(0).rsplit("-r", 1)[0],
                "rollout_rank": self.rank,
                "version_generated": group.param_version_start,
                "version_at_send": self.version,
                "time": time.time(),
            }
            row["model_tokens"] = {}  # each row's tokens the model sampled, in order
            for j in range(group.rows):
                ids = group.response_ids[j, : group.response_lengths[j]]
                if group.loss_mask is not None:
                    ids = ids[group.loss_mask[j, : group.response_lengths[j]] == 1]
                row["model_tokens"][group.uid(j)] = ids.tolist()
            self.sent_log.write([row])

    def finish_in_flight(self) -> None:
        """Generate every group in flight to its end under the current weights, and send it."""
        while self.in_flight:
            self.step_and_send()

    def write_checkpoint_part(self, step: int) -> None:
        """This rank's part of a checkpoint (its RNGs and the groups in flight, cut, with
        their tokens so far), written by itself; the leader gets the part's record, how
        many groups were sent before it, how many were cut (they stay in flight), and the
        draws granted and not started: their credits are void, and the leader hands the
        prompts out again."""
        unused = np.asarray(list(self.granted), dtype=np.int64)
        self.granted.clear()
        cut = CutGroups(
            [
                (*self.in_flight[key], self.with_tools(key, partial))
                for key, partial in self.engine.unfinished()
                if not self.validator.owns(key)  # validation is not checkpointed
            ]
            # cut groups waiting for weights (a restarted engine's, a resume's) are cut too
            + [(e, i, start, self.with_tools((e, i), p)) for e, i, start, p in self.resumed]
            # agents' groups whose sessions have not called yet: empty
            + [
                (*self.in_flight[key], partial)
                for key, partial in (
                    self.sessions.unsubmitted(
                        self.cfg.rollout.response_length, self.engine.pad_id, self.engine
                    )
                    if self.sessions is not None
                    else []
                )
                if not self.validator.owns(key)
            ]
        )
        tree = protocol.tree_of({"rng": RngState(), "cut_groups": cut})
        folder = protocol.step_dir(self.run_dir, step)
        with self.timeline.span("checkpoint"):
            written = protocol.write_own_part(folder, protocol.rollout_part(self.rank), tree)
        self._waiting_since = None  # writing the part was not waiting for credits
        meta = {**written, "groups_sent": self.sender.groups_sent}
        report = pack_arrays({"unused": unused}, {**meta, "partial_groups": len(cut.groups)})
        self.sender.send_state(report, self.cfg.timeouts.rank_wait_s)

    def with_tools(self, key: Hashable, partial: PartialGroup) -> PartialGroup:
        """Multi-turn: the cut group with its tools' state (live, or as resumed)."""
        if self.turns is None:
            return partial
        live = self.turns.state(key, len(partial.finished))
        return replace(partial, tools=live or partial.tools or {})

    def weights_loaded(self, update: WeightUpdate, start: float, wall_start: float) -> None:
        """After a sync (``weights`` holds the new version): the cut groups waiting for
        weights placed, the sync in the timeline."""
        self._waiting_since = None  # loading weights is not waiting for credits
        if not self.synced:  # time counts from the first sync, as on the trainer
            self.synced = True
            self.started_at, self.idle_s = time.monotonic(), 0.0
            startup.mark("first weights loaded")
        if self.resumed:
            self.place_resumed_groups()
        log.info(
            "rank %d: weights v%d loaded in %.3fs (engine paused %.3fs)",
            self.rank,
            update.version,
            time.monotonic() - start,
            update.pause_s,
        )
        self.timeline.record("sync", wall_start, time.time(), version=update.version)

    def wait_a_moment(self) -> None:
        # Idle is the whole no-credit loop, its control polls included: under MPI's
        # yield_when_idle a poll can give the CPU away for milliseconds. The timeline's
        # wait span covers exactly what idle_s counts: it starts where the last wait ended
        # (one merged span however long a poll took), so the two never disagree.
        if self._waiting_since is None:
            start, wall_start = time.monotonic(), time.time()
        else:
            start, wall_start = self._waiting_since, self._waiting_wall
        time.sleep(0.002)
        self._waiting_since, self._waiting_wall = time.monotonic(), time.time()
        self.idle_s += self._waiting_since - start
        self.timeline.record("wait", wall_start, self._waiting_wall)

    def prompt_ids(self, index: int) -> list[int]:
        if index not in self._encoded:
            ids = tokenize_prompt(self.engine.tokenizer, self.prompts[index], self.schemas)
            if len(ids) > self.cfg.data.max_prompt_length:
                raise ValueError(
                    f"prompt {self.prompts[index].index} has {len(ids)} tokens, more than data.max_prompt_length={self.cfg.data.max_prompt_length}"
                )
            self._encoded[index] = ids
        return self._encoded[index]

    def sample_group(
        self, epoch: int, index: int, version_start: int, gen: Generation
    ) -> SampleGroup:
        """Score one finished group. Its end version is the newest that sampled any of its
        tokens: later than the start only when partial rollout cut it at a sync."""
        prompt = self.prompts[index]
        n = self.cfg.rollout.n
        extra: dict[str, float] = {}
        if self.sessions is not None:  # the agents' rewards, and the prompt their calls made
            rewards, dropped, prompt_ids, extra = self.sessions.finish((epoch, index))
        else:
            prompt_ids, dropped = self.prompt_ids(index), ""
            rewards = [
                self.task.reward(
                    prompt, self.engine.decode(gen.response_ids[j, : gen.response_lengths[j]])
                )
                for j in range(n)
            ]
        tools = {}
        if self.turns is not None:  # the tools' rewards add to the task's
            rewards = [
                a + b for a, b in zip(rewards, self.turns.finish((epoch, index), n), strict=True)
            ]
            tools = self.turns.counts
        return SampleGroup(
            seed=self.cfg.trainer.seed,
            epoch=epoch,
            prompt_index=prompt.index,
            rollout_rank=self.rank,
            # the oldest weights that sampled any of its tokens (an agent's session replayed
            # after a resume keeps the tokens sampled before the stop)
            param_version_start=int(
                gen.versions.min(initial=version_start, where=gen.versions >= 0)
            ),
            param_version_end=max(version_start, int(gen.versions.max())),
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            response_ids=gen.response_ids,
            response_lengths=gen.response_lengths,
            rollout_log_probs=gen.log_probs,
            loss_mask=gen.loss_mask,
            rewards=np.asarray(rewards, dtype=np.float32),
            rollout_idle_s=self.idle_s,
            rollout_elapsed_s=time.monotonic() - self.started_at,
            tokens_regenerated=self.tokens_regenerated
            + (self.sessions.discarded_tokens if self.sessions is not None else 0),
            rollout_sync_pause_s=self.weights.pause_s,
            engine_restarts=self.weights.restarts,
            engine_restart_s=self.weights.restart_s,
            dropped=dropped,
            agent_extra=extra,
            row_sessions=gen.row_sessions,  # an agent's session in several sequences
            row_prompts=gen.row_prompts,
            **tools,
        )


def run_rollouter(
    cfg: Config, topo: Topology, run_dir: Path, checkpoint: Path | None = None
) -> None:
    """``checkpoint``: the checkpoint folder to resume from (None for a fresh start)."""
    torch.set_num_threads(cfg.rollout.torch_threads)
    torch.manual_seed(cfg.trainer.seed * 1000 + topo.world_rank)
    rollouter = Rollouter(cfg, topo, run_dir, checkpoint)
    startup.mark("ready for the first sync")
    rollouter.run()
