"""The simulated client: the real ClientApp with a mod in front.

The simulation's Grid wrapper (fedrl.sim.simulated_server) stamps each message with a
`fedrl.sim` record: the client's profile, the clock mode, the unit of work and the run's
clock. This mod takes the stamp off (the real app sees only the real protocol), decides
whether the client is reachable at all (offline periods, dropouts: an error reply, as the
SuperLink gives for a vanished node, without a traceback), and runs the real app under a
`SimulatedRuntime`: shaped or virtual links, slowdown, virtual timings, actor frictions.
"""

from __future__ import annotations

import json
import time

import numpy as np
from flwr.app import Context, Error, Message
from flwr.common.constant import ErrorCode

from fedrl.clients.runtime import CommResult, Runtime, Timing, use_runtime
from fedrl.frictions import Frictions, StalenessBuffer
from fedrl.link import Link
from fedrl.protocol import InstructionHead
from fedrl.schema import Schema, SchemaError
from fedrl.sim.attacks import poison
from fedrl.sim.clock import round_seconds
from fedrl.sim.link import make_link
from fedrl.sim.profiles import ClientProfile

STAMP = "fedrl.sim"


class Stamp(Schema):
    profile: str  # ClientProfile JSON
    clock: str  # real | virtual
    step_s: float  # seconds of one local step at speed 1
    now_s: float  # the run's clock when the message was sent
    run: str  # this simulation's token: what keeps one run's actor histories from the next's


class ActorHistories:
    """The snapshots of the actors that lag across rounds, per client: they outlive a message
    (and so a round) in this process. Only the newest run's are kept. Under Ray a client's
    messages may go to several worker processes, each with its own history of the rounds it
    served."""

    def __init__(self):
        self.run, self.buffers = "", {}

    def get(self, run: str, client_id: int, fresh: StalenessBuffer) -> StalenessBuffer:
        if run != self.run:
            self.run, self.buffers = run, {}
        return self.buffers.setdefault(client_id, fresh)


ACTOR_HISTORIES = ActorHistories()


class SimulatedRuntime(Runtime):
    def __init__(self, profile: ClientProfile, virtual: bool, step_s: float, actor_key: tuple | None = None):
        self.profile, self.virtual, self.actor_key = profile, virtual, actor_key
        self.step_v = step_s / profile.speed  # seconds of one step on this client

    def open_link(self) -> Link:
        return make_link(self.profile.link, self.virtual)

    def pace(self, step_wall_s: float) -> None:
        if not self.virtual and self.profile.speed < 1.0:  # a slower machine than this one
            time.sleep((1.0 / self.profile.speed - 1.0) * step_wall_s)

    def link_seconds(self, comm: CommResult | None) -> float:
        return sum(link.virtual_s for link in comm.links) if comm else 0.0

    def landed(self, comm: CommResult, steps_done: int) -> bool:
        if not self.virtual:
            return comm.done.is_set()
        # on the virtual clock the patch lands once the steps so far outlast the link's seconds,
        # whatever the comm thread's wall clock: a loaded machine would otherwise correct a step
        # later now and then, and one seed's run would not repeat (fedavg-lora's 12th round
        # differed). The thread's real transfer is milliseconds over loopback: waiting costs that.
        comm.done.wait()
        return steps_done * self.step_v >= self.link_seconds(comm)

    def timing(self, overlapped, compute, steps, before, after, start) -> Timing:
        if not self.virtual:
            return super().timing(overlapped, compute, steps, before, after, start)
        compute_s, before_s, after_s = (
            steps * self.step_v,
            self.link_seconds(before),
            self.link_seconds(after),
        )
        duration, overlap = round_seconds(overlapped, compute_s, before_s, after_s)
        return Timing(compute_s, before_s + after_s, overlap, duration)

    def frictions(self) -> Frictions:
        p = self.profile
        return Frictions(
            staleness=p.actor_staleness,
            bug_prob=p.bug_prob,
            reward_noise_prob=p.reward_noise_prob,
            logit_noise=p.logit_noise,
        )

    def actor_history(self) -> StalenessBuffer | None:
        fresh = super().actor_history()
        if fresh is None or not self.profile.actor_lags_across_rounds or self.actor_key is None:
            return fresh
        return ACTOR_HISTORIES.get(*self.actor_key, fresh)

    def poison_update(self, base, new, seed, first):
        return poison(self.profile.attack, base, new, seed, first)


def simulated_client(msg: Message, context: Context, call_next) -> Message:
    """Flower mod: see the module docstring. Messages without a stamp pass through untouched."""
    if STAMP not in msg.content.config_records:
        return call_next(msg, context)
    try:
        stamp = Stamp.parse(msg.content.config_records[STAMP], "simulation stamp")
        profile = ClientProfile.from_mapping(json.loads(stamp.profile))
    except ValueError as err:  # SchemaError, ProfileError and bad JSON alike
        return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=str(err)), reply_to=msg)
    del msg.content[STAMP]
    try:
        instr = InstructionHead.from_packed(msg.content["instruction"])  # what the round needs of it
    except (KeyError, SchemaError):
        instr = None  # the real app answers a malformed message itself
    actor_key = (stamp.run, instr.client_id) if instr is not None else None
    runtime = SimulatedRuntime(profile, stamp.clock == "virtual", stamp.step_s, actor_key)
    if instr is not None:
        rng = np.random.default_rng([instr.seed, instr.client_id, instr.round, 1])
        gone = profile.offline_reason(instr.client_id, stamp.now_s, instr.steps * runtime.step_v, rng)
        if gone:
            reason = f"client {instr.client_id} ({profile.name}): {gone}"
            return Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason=reason), reply_to=msg)
    with use_runtime(runtime):
        return call_next(msg, context)
