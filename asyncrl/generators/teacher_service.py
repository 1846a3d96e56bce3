"""The shared OPD teacher: one process that scores every generator's samples (opd.placement =
"service").

Place in the data flow: the launcher starts it before the generators (`scheduler/workers.py`,
peer `opd-teacher`; with `opd.teachers`, one process per teacher that is not "self", peer
`opd-teacher-<name>`) and supervises it like the learner: a teacher that exits or falls silent
fails the run, naming it. It loads the teacher directory once (`opd.teacher`, or the entry of
`opd.teachers` named by `WorkerArgs.teacher`, as a generator would: `torch_gen.load_teacher`), binds a ROUTER on cluster.bind_host and says Hello with that
address, which the launcher hands every generator on its command line
(`teacher_client.TeacherClient`).

Requests (`TeacherRequest`: prompts, completion lengths, [sum T, N] ids) that arrive within
`opd.service_window_ms` of the first waiting one go through the teacher together (the window
closes early once every generator has a request in: a generator's sampling thread waits for its
answer, so none sends another meanwhile): one call of
`opd.teacher_logprobs` (which cuts it into forwards of at most TEACHER_BATCH_ROWS sequences under
its logits budget), off the event loop so heartbeats keep going; each request gets its own
`TeacherScores` ([sum T, N] float32, same layout). A malformed request is answered with an error,
counted, and never stops the service; nor does an answer to a generator that has gone meanwhile
(killed and replaced: its answer is dropped and counted). The teacher's weights live here once,
however many generators there are.

Run as `python -m asyncrl.generators.teacher_service --ctrl ADDR --peer-id ID --run-dir DIR --args '{"model": DIR}'`
(with `"teacher": NAME` in the args for an entry of opd.teachers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch
import zmq

from asyncrl.generators.opd import teacher_logprobs
from asyncrl.messages import Metrics, Shutdown, TeacherMetrics, TeacherRequest, TeacherScores
from asyncrl.runtime import ChildContext, run_child
from asyncrl.transport.codec import tensor_ref
from asyncrl.transport.zmq_io import Endpoint

log = logging.getLogger(__name__)

# Sequences scored together at most (requests beyond it wait for the next batch).
MAX_BATCH_SEQUENCES = 256
# How often the teacher reports its counters to the launcher (after a batch, at most this often).
METRICS_EVERY_S = 1.0


@dataclass
class Pending:
    """One request waiting to be scored: who sent it, the message, its ids frame."""

    sender: bytes
    msg: TeacherRequest
    ids: torch.Tensor


def request_problem(msg: TeacherRequest, ids: torch.Tensor | None, *, vocab_size: int) -> str:
    """Why a request cannot be scored ("" when it can)."""
    if ids is None or ids.dtype != torch.int64 or ids.ndim != 2 or ids.shape[1] < 1:
        return "ids must be an int64 [sum(lengths), N] frame with N >= 1"
    if len(msg.prompt_ids) != len(msg.lengths) or not msg.lengths:
        return f"{len(msg.prompt_ids)} prompts for {len(msg.lengths)} completion lengths"
    if any(n < 1 for n in msg.lengths) or sum(msg.lengths) != ids.shape[0]:
        return f"completion lengths {msg.lengths[:8]} do not fill the {ids.shape[0]} rows of ids"
    if any(not p for p in msg.prompt_ids):
        return "an empty prompt"
    low = min(min(p) for p in msg.prompt_ids)
    high = max(max(p) for p in msg.prompt_ids)
    if ids.numel():
        low, high = min(low, int(ids.min())), max(high, int(ids.max()))
    if low < 0 or high >= vocab_size:
        return f"token ids outside the teacher's vocabulary [0, {vocab_size})"
    return ""


def teacher_path(opd, name: str) -> str:
    """The directory this process serves: opd.teacher, or the entry `name` of opd.teachers (the
    launcher passes the name as `WorkerArgs.teacher`)."""
    if not name:
        return opd.teacher
    for spec in opd.teachers:
        if spec.name == name:
            return spec.path
    raise ValueError(
        f"opd.teachers has no teacher named {name!r} (WorkerArgs.teacher of this teacher process)"
    )


def score_batch(teacher, batch: list[Pending], *, pad_token_id: int) -> list[torch.Tensor]:
    """Every request's [sum T, N] scores from one `teacher_logprobs` call over all its sequences."""
    prompts: list[list[int]] = []
    completions: list[torch.Tensor] = []
    for item in batch:
        prompts += item.msg.prompt_ids
        completions += list(item.ids.split(item.msg.lengths))
    scores = teacher_logprobs(teacher, prompts, completions, pad_token_id=pad_token_id)
    out, start = [], 0
    for item in batch:
        count = len(item.msg.lengths)
        out.append(torch.cat(scores[start : start + count]))
        start += count
    return out


class TeacherService:
    def __init__(self, ctx: ChildContext) -> None:
        from transformers import AutoTokenizer

        from asyncrl.generators.torch_gen import load_teacher
        from asyncrl.models.sampling import resolve_device

        self.ctx = ctx
        cfg = ctx.config
        torch.set_num_threads(cfg.generators.threads)
        device = resolve_device(cfg.generators.device, field="generators.device")
        tokenizer = AutoTokenizer.from_pretrained(ctx.args.model)
        self.pad_token_id = tokenizer.pad_token_id
        self.teacher = load_teacher(
            teacher_path(cfg.opd, ctx.args.teacher),
            tokenizer,
            device=str(device),
            dtype=cfg.learner.publish_dtype,
        )
        self.vocab_size = int(self.teacher.get_output_embeddings().weight.shape[0])
        self.window_s = cfg.opd.service_window_ms / 1000.0
        self.num_clients = cfg.generators.num_generators  # a batch closes once each has asked
        self.sock = Endpoint(ctx.zmq_ctx, zmq.ROUTER, name="teacher.scores", accept=(TeacherRequest,))
        self.address = self.sock.bind()
        self.queue: asyncio.Queue[Pending] = asyncio.Queue()
        self.num_requests = 0
        self.num_batches = 0
        self.num_sequences = 0
        self.num_bad = 0
        self.num_undeliverable = 0  # answers to generators that had gone
        self.busy_s = 0.0
        self.started = time.perf_counter()
        self.metrics_sent_at = 0.0

    async def receive(self) -> None:
        while True:
            sender, msg, frames = await self.sock.recv()
            ids = frames[0] if frames else None
            if problem := request_problem(msg, ids, vocab_size=self.vocab_size):
                self.num_bad += 1
                self.sock.reject(f"bad request: {problem}")
                await self.reply(sender, TeacherScores(request_id=msg.request_id, error=problem))
                continue
            self.queue.put_nowait(Pending(sender, msg, ids.clone()))  # out of the received frame

    async def next_batch(self) -> list[Pending]:
        """The first waiting request and those that arrive within the window after it, until
        every generator has one in (or MAX_BATCH_SEQUENCES)."""
        batch = [await self.queue.get()]
        deadline = time.perf_counter() + self.window_s
        while (
            sum(len(p.msg.lengths) for p in batch) < MAX_BATCH_SEQUENCES
            and len({p.sender for p in batch}) < self.num_clients
        ):
            if not self.queue.empty():
                batch.append(self.queue.get_nowait())
                continue
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.queue.get(), remaining))
            except TimeoutError:
                break
        return batch

    async def serve(self) -> None:
        while True:
            batch = await self.next_batch()
            start = time.perf_counter()
            scores = await asyncio.to_thread(score_batch, self.teacher, batch, pad_token_id=self.pad_token_id)
            self.busy_s += time.perf_counter() - start
            self.num_batches += 1
            self.num_requests += len(batch)
            self.num_sequences += sum(len(p.msg.lengths) for p in batch)
            for item, scores_TN in zip(batch, scores, strict=True):
                reply = TeacherScores(request_id=item.msg.request_id, logprobs=tensor_ref(0, scores_TN))
                await self.reply(item.sender, reply, [scores_TN])
            if time.perf_counter() - self.metrics_sent_at >= METRICS_EVERY_S:
                await self.send_metrics()

    async def reply(self, sender: bytes, msg: TeacherScores, tensors=()) -> bool:
        """Send `msg` to `sender`; False (counted, logged) when it has gone (the ROUTER refuses
        an unknown peer rather than dropping the answer silently)."""
        try:
            await self.sock.send(msg, tensors, to=sender)
            return True
        except zmq.ZMQError as exc:
            self.num_undeliverable += 1
            log.warning("%s: answer %d not delivered: %s", self.ctx.peer_id, msg.request_id, exc)
            return False

    async def send_metrics(self) -> None:
        self.metrics_sent_at = now = time.perf_counter()
        await self.ctx.ctrl.send(
            Metrics(
                source=self.ctx.peer_id,
                time_s=time.time(),
                record=TeacherMetrics(
                    requests=self.num_requests,
                    batches=self.num_batches,
                    sequences=self.num_sequences,
                    bad_requests=self.num_bad,
                    undeliverable=self.num_undeliverable,
                    rejected_frames=self.sock.num_rejected,
                    busy_ratio=self.busy_s / max(1e-9, now - self.started),
                ),
            )
        )

    async def control(self) -> None:
        """Until the launcher says Shutdown."""
        while True:
            _, msg, _ = await self.ctx.ctrl.recv()
            if isinstance(msg, Shutdown):
                return
            log.error(
                "%s: unexpected %s on the control socket; ignored", self.ctx.peer_id, type(msg).__name__
            )

    async def run(self) -> None:
        await self.ctx.hello(endpoint=self.address)
        try:
            async with asyncio.TaskGroup() as tg:
                helpers = [
                    tg.create_task(self.receive(), name="teacher-recv"),
                    tg.create_task(self.serve(), name="teacher-serve"),
                ]
                await tg.create_task(self.control(), name="teacher-ctrl")
                for h in helpers:
                    h.cancel()
        finally:
            self.sock.close()


async def main(ctx: ChildContext) -> None:
    await TeacherService(ctx).run()


if __name__ == "__main__":
    run_child("generator", main)
