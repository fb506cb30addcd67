"""The coordinator daemon: owns the prefix snapshot store, dispatches requests to
workers, streams tokens back to clients.

    client --DEALER--> [ROUTER clients]  coordinator  [ROUTER workers] <--DEALER-- cpu_worker x N
                                             |
                                 shared memory: snapshot arena (only we unlink it)

A request: tokenise -> look up the longest cached prefix -> queue -> a worker
restores it, prefills the rest writing the planned snapshots, decodes -> tokens
are detokenised here (stop strings too) and streamed -> Done. With GPU workers the
uncached part may be prefilled on one instead (gpu_prefill.py, placement.py): it
writes the snapshots, the last one at the prompt's end, and a CPU worker resumes from
that one and decodes. A request's phase (requests.Phase) says where it stands.
Workers that die are restarted; their requests replay from the snapshots with the
same seed and the tokens already sent are not sent again.
"""
from __future__ import annotations

import logging
import os
import random
import signal
import sys
import time

import msgspec
import zmq

from shared import protocol as P
from shared.chat import reasoning_kwargs, turn_marks
from shared.vision.chat import plan, template_places_images
from shared.vision.image import ImageLimits
from shared.vision.prompt import IMAGE_PAD
from shared.curve import CLIENTS, WORKERS, ClientKeys, HandshakeWatch
from shared.errors import FermoeError, PromptTooLong, ProtocolError
from shared.expert_segment import ExpertSegment, expert_nbytes, unshareable
from shared.grammar import compile_constraint, reasoning_open
from shared.sampling import MAX_TOP_LOGPROBS, SamplingParams, with_defaults
from shared.engine import update_rate
from shared.hybrid_link import MAILBOX_PREFIX
from shared.model import Model
from shared.state import recurrent_nbytes
from shared.model import has_random_weights, random_weights_notice

from .memory import host_footprint, resolve_max_model_len, snapshot_store
from .gpu_prefill import GPUPrefills
from .images import ImageDecoder
from .requests import Phase, Request, SnapshotIntake, TextStream, Unfinished, planned_refs, resume_refs
from .scheduler import WorkerView, hybrid_pairs, pick_worker
from .snapshots import SnapshotIndex
from .supervisor import Supervisor, worker_plan

log = logging.getLogger("fermoe.coordinator")
# Silence after which a worker counts as dead (hung, or a lost host). Workers beat
# between prompt chunks, which take seconds on a big model on a small machine.
WORKER_TIMEOUT_S = 60.0
MAX_ATTEMPTS = 3
# (KV, state) slot pairs a decoding sequence starts with for its snapshots: one for each
# block boundary its max_tokens can cross and one for where it ends, at most DECODE_SLOTS;
# each boundary snapshot adopted is replaced at once, so a long generation always has one ahead.
DECODE_SLOTS = 4
UNAVAILABLE = "unavailable"     # the Error code of a request refused because no worker can run it
NO_DECODER = ("no CPU worker is left to decode: each one failed to start or kept dying and was given up "
              "(see the coordinator log)")


class Coordinator:
    def __init__(self, opts):
        self.opts = opts
        self.model = Model(opts.model_path, convert=False)     # its shapes, tokenizer, fingerprint: no tensor copied
        if has_random_weights(self.model.file.metadata):
            log.warning("%s", random_weights_notice(opts.model))
        self.tokenizer = self.model.tokenizer
        if opts.chat_template is not None:          # --chat-template, --chat-template-file
            self.tokenizer.chat_template = opts.chat_template
        self.vision = self._vision_config(opts)     # the tower's shapes (--mmproj), for images' token counts
        self.image_limits = ImageLimits()
        self.images = ImageDecoder() if self.vision is not None else None     # its pool starts with the first image
        gpus = len(opts.gpus)
        why_not_shared = unshareable(self.model) if gpus else "no GPU worker"
        weight_bytes, sequences = host_footprint(
            os.path.getsize(opts.model_path), expert_nbytes(self.model) if gpus else 0,
            opts.max_sequences * len(worker_plan(opts)), gpus, shared_experts=why_not_shared is None,
            snapshot_bytes=opts.snapshot_mem, state_bytes=recurrent_nbytes(self.model.config))
        self.max_model_len = resolve_max_model_len(opts.max_model_len, self.model.config, opts.kv_cache_dtype,
                                                   weight_bytes, sequences)
        self._store = snapshot_store(self.model.config, opts.block, opts.kv_cache_dtype, opts.snapshot_mem,
                                     getattr(opts, "snapshot_states", None))   # an impossible one fails before binding
        self._bind_sockets()
        self.http = None
        if opts.http:                           # the HTTP front end: a client process of ours
            from .frontend_process import FrontEnd, client_endpoint
            self.http = FrontEnd(opts, client_endpoint(self.clients),
                                 self.keys.own_client if self.keys else None)
        self._make_snapshot_store()
        self.experts = self._share_experts(why_not_shared) if gpus else None
        self.workers: dict[str, WorkerView] = {}
        self.last_seen: dict[str, float] = {}
        self.idle_since = time.monotonic()     # no request since (--sleep-idle-seconds)
        self.requests: dict[str, Request] = {}
        self.queue: list[str] = []
        self.loading: dict[str, object] = {}     # requests waiting aside while the disk tier loads their prefix
        self.unfinished = Unfinished(self.index)
        self.intake = SnapshotIntake(self.index, self.arena, opts.block, self.send_worker)
        self.gpu = GPUPrefills(opts, self.index, self.arena, self.workers, self.requests, self.send_worker,
                               self.unfinished)
        self.supervisor = Supervisor(opts, self.worker_endpoint, self.experts.name if self.experts else None,
                                     self.keys.own_worker if self.keys else None)
        self.client_handlers = {P.Generate: self.handle_generate, P.Cancel: self.handle_cancel,
                                P.Status: self.handle_status}
        # every worker message but Hello; data: the frames after it (only a SnapshotWritten has any)
        self.worker_handlers = {
            P.Attached: self.handle_attached, P.Heartbeat: self.handle_heartbeat, P.Error: self.handle_error,
            P.HybridMailbox: self.handle_hybrid_mailbox,
            P.Sampled: self.handle_sampled, P.SnapshotWritten: self.handle_snapshotwritten,
            P.Finished: self.handle_finished, P.Prefilled: self.handle_prefilled, P.Goodbye: self.handle_goodbye,
            P.Progress: self.handle_progress}
        self.stopping = False
        self.unavailable: str | None = None     # why no request can be served (no CPU worker left), else None

    def _vision_config(self, opts):
        if getattr(opts, "mmproj", None) is None:
            return None
        from shared.vision.mmproj import Mmproj
        tower = Mmproj(opts.mmproj)
        try:
            tower.check_text_model(self.model.config.n_embd, opts.model_path)
            if not template_places_images(self.tokenizer):
                log.warning("the model's chat template places no image (no %s for an image part): every request "
                            "with an image will be refused, although --mmproj is given", IMAGE_PAD)
            return tower.config
        finally:
            tower.close()

    def _bind_sockets(self) -> None:
        """The client and worker ROUTERs; with --curve-keys, CURVE servers of their own
        context, whose ZAP handler (one per context) admits the listed keys, each socket's
        own list. The log says which it is."""
        self.keys = getattr(self.opts, "server_keys", None)
        self.watches = []                       # their failed handshakes, logged
        if self.keys is None:
            self.ctx = zmq.Context.instance()
        else:
            for own in (self.keys.own_worker, *([self.keys.own_client] if self.opts.http else [])):
                ClientKeys(own)                 # what our own workers and front end connect with
            self.ctx = zmq.Context()            # our ZAP handler's: not that of a client in this process
            self.keys.start(self.ctx)
        try:
            self.clients = self._socket(self.opts.bind, CLIENTS, mandatory=True)
            self.workers_sock = self._socket(self.opts.worker_bind, WORKERS)
        except FermoeError:
            self._close_security()
            raise
        self.worker_endpoint = self.workers_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # (not "workers on ...": the ready line's words, which scripts read the endpoint from)
        where = f"client socket {self.opts.bind}, worker socket {self.worker_endpoint}"
        if self.keys is not None:
            self.watches = [HandshakeWatch(self.clients, "client"), HandshakeWatch(self.workers_sock, "worker")]
            log.info("CURVE security on: %d client keys, %d worker keys (%s); %s", len(self.keys.clients.keys),
                     len(self.keys.workers.keys), self.keys.dir, where)
        elif self.opts.insecure:
            log.warning("--insecure: no CURVE keys; %s: anyone who reaches these ports can submit work, or join as "
                        "a worker and read every prompt", where)
        else:
            log.info("no CURVE keys, loopback only: %s", where)

    def _close_security(self) -> None:
        for watch in self.watches:
            watch.close()
        if self.keys is not None:
            self.keys.stop()

    def _socket(self, endpoint: str, domain: str, mandatory: bool = False):
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            self.keys.apply(sock, domain)
        # the largest frame either socket takes: a client's message (one over --max-request-size is
        # refused by P.decode with an Error naming the option, while ZeroMQ's own cut drops the
        # connection unanswered, so that cut lies well above it), or a snapshot that a worker
        # without the arena sends as a frame (a KV slot or a state slot)
        P.set_max_message_bytes(self.opts.max_request_size)
        slot = max(self._store.kv_slot_bytes, self._store.state_slot_bytes)
        sock.setsockopt(zmq.MAXMSGSIZE, max(2 * self.opts.max_request_size, slot) + (1 << 20))
        if mandatory:           # sending to a vanished client raises, so its request is freed
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise FermoeError(f"cannot bind {endpoint}: {e}") from None
        return sock

    def _make_snapshot_store(self) -> None:
        from shared.shm_arena import SnapshotArena
        for name in SnapshotArena.remove_stale():       # left by a coordinator killed with SIGKILL
            log.warning("removed stale snapshot arena %s", name)
        SnapshotArena.remove_stale(MAILBOX_PREFIX)      # and CPU workers' hybrid mailboxes
        store = self._store
        self.index = SnapshotIndex(store.kv_slots, self.opts.block, n_state_slots=store.state_slots)
        self.arena = (SnapshotArena.create(store.kv_slot_bytes, store.kv_slots, state_slot_bytes=store.state_slot_bytes,
                                           n_state_slots=store.state_slots) if store.kv_slots else None)
        how = (f"default: {self.opts.snapshot_mem_default}" if self.opts.snapshot_mem_default
               else "--snapshot-mem")
        log.info("snapshot store: %s%s (%s)", store.describe(self.opts.block),
                 f" ({self.arena.name})" if self.arena else "", how)
        self.disk = None                        # the disk tier under it (--snapshot-disk; 0: none)
        if self.arena is not None and self.opts.snapshot_disk != 0:
            from .snapshot_disk import DiskCache
            self.disk = DiskCache(self.opts.snapshot_dir, self.opts.snapshot_disk, self.opts.model_path,
                                  self.model.fingerprint, self.opts.kv_cache_dtype, self.index, self.arena)

    def _share_experts(self, why_not: str | None):
        """The experts packed into shared memory for every worker, so that a GPU worker's
        page-locked experts and the CPU workers' are the same pages; None (each worker
        reads its own) where they cannot be."""
        if why_not is not None:
            log.warning("the experts are not shared between workers (%s): a GPU worker keeps a page-locked copy "
                        "of its own beside the CPU workers' mapped file", why_not)
            return None
        try:
            return ExpertSegment.create(self.model)
        except FermoeError as e:
            log.warning("the experts could not be put in shared memory (%s): a GPU worker keeps a copy of its own",
                        e)
            return None

    # ---- the loop -----------------------------------------------------------
    def event_loop(self) -> None:
        self.supervisor.start_all()
        if self.http:
            self.http.start()
        poller = zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.workers_sock, zmq.POLLIN)
        if self.images:
            poller.register(self.images.fd, zmq.POLLIN)
        if self.disk:
            poller.register(self.disk.fd, zmq.POLLIN)
        for watch in self.watches:
            poller.register(watch.monitor, zmq.POLLIN)
        ready_logged = False
        while not self.stopping:
            events = dict(poller.poll(200))
            if self.images and self.images.fd in events:
                self.images_decoded()
            if self.disk and self.disk.fd in events:
                self.snapshots_loaded()
            if self.workers_sock in events:
                self._drain(self.workers_sock, self.handle_worker_frames)
            if self.clients in events:
                self._drain(self.clients, self.handle_client_frames)
            for watch in self.watches:
                if watch.monitor in events:
                    watch.drain()
            self.supervise()
            self.schedule()
            self.doze()
            if not ready_logged and self.workers and all(w.ready for w in self.workers.values()):
                log.info("ready: %d worker(s), clients on %s, workers on %s", len(self.workers), self.opts.bind,
                         self.worker_endpoint)
                ready_logged = True

    def _drain(self, sock, handler, limit: int = 256) -> None:
        for _ in range(limit):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handler(frames)

    # ---- clients --------------------------------------------------------------
    def reply(self, client: bytes, msg) -> bool:
        try:
            self.clients.send_multipart([client, P.encode(msg)])
            return True
        except zmq.ZMQError:    # EHOSTUNREACH: the client is gone
            self.client_gone(client)
            return False

    def handle_client_frames(self, frames: list[bytes]) -> None:
        client, body = frames[0], frames[1:]
        if len(body) != 1:
            self.reply(client, P.Error(message=f"expected one message frame, got {len(body)}"))
            return
        try:
            msg = P.decode(body[0], P.CLIENT_MESSAGES)
        except ProtocolError as e:
            self.reply(client, P.Error(message=str(e), request_id=P.request_id_of(body[0])))
            return
        try:
            self.client_handlers[type(msg)](client, msg)
        except Exception as e:             # a bug met by one message must not stop the daemon
            log.exception("handling a %s failed", type(msg).__name__)
            self.reply(client, P.Error(message=f"internal error: {type(e).__name__}: {e}",
                                       request_id=getattr(msg, "request_id", None)))

    def sampling_defaults(self) -> SamplingParams:
        """What a request that sets no sampling field gets (llama-server's --temp, ...)."""
        return SamplingParams(**self.opts.sampling_defaults)

    def handle_generate(self, client: bytes, msg: P.Generate) -> None:
        if self.supervisor.asleep:
            self.wake()
        try:
            if msg.unset:                       # the server's defaults, where the client left a field out
                unknown = sorted(set(msg.unset) - set(SamplingParams.names()) - {"max_tokens"})
                if unknown:
                    raise FermoeError(f"unset names {', '.join(unknown)}: not sampling fields (or max_tokens)")
                msg.sampling = with_defaults(msg.sampling, msg.unset, self.opts.sampling_defaults)
                if "max_tokens" in msg.unset and self.opts.n_predict is not None:
                    msg.max_tokens = self.opts.n_predict
            if msg.reasoning_budget is not None and msg.reasoning_budget < -1:
                raise FermoeError(f"reasoning_budget must be >= 0 (or -1: no limit, null: the server's), "
                                  f"got {msg.reasoning_budget}")
            if msg.messages is not None:        # --chat-template-kwargs under the request's own, then the
                                                # server's --reasoning default where neither says
                msg.chat_template_kwargs = reasoning_kwargs(
                    {**self.opts.chat_template_kwargs, **(msg.chat_template_kwargs or {})}, self.opts.reasoning,
                    self.opts.reasoning_budget)
            tokens, chat = self._prompt_tokens(msg)        # (msg.sampling was checked as it was decoded; images
                                                           # from their headers only)
            outside = [t for t, _ in msg.sampling.logit_bias if t >= self.model.config.n_vocab]
            if outside:
                raise FermoeError(f"logit_bias: token ids must be in [0, {self.model.config.n_vocab}), got {outside[:8]}")
            if msg.logprobs is not None and not 0 <= msg.logprobs <= MAX_TOP_LOGPROBS:
                raise FermoeError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (or null: none), got {msg.logprobs}")
            if msg.max_tokens is not None and msg.max_tokens < 0:
                raise FermoeError(f"max_tokens must be >= 0 (or null: until the end of the context), "
                                  f"got {msg.max_tokens}")
            if msg.request_id in self.requests:
                raise FermoeError(f"request_id {msg.request_id!r} is already running")
            # compiled here, once: a grammar that does not compile is refused before queueing
            grammar = None if msg.grammar is None else compile_constraint(
                msg.grammar, tokens, self.tokenizer, self.model.config.n_vocab)
        except FermoeError as e:
            self.reply(client, P.Error(message=str(e), request_id=msg.request_id, **getattr(e, "wire_fields", {})))
            return
        if self.unavailable:
            self.reply(client, P.Error(message=self.unavailable, request_id=msg.request_id, code=UNAVAILABLE))
            return
        if msg.max_queue is not None:
            waiting = sum(r.client == client and r.first_token is None for r in self.requests.values())
            if waiting >= msg.max_queue:
                self.reply(client, P.Error(message=f"{waiting} requests are already waiting (--max-queue "
                                                   f"{msg.max_queue}); retry later", request_id=msg.request_id,
                                           code="queue_full"))
                return
        seed = msg.sampling.seed if msg.sampling.seed is not None else random.getrandbits(63)
        req = Request(client, msg, tokens, msg.sampling.replace(seed=seed), TextStream(self.tokenizer, msg.stop),
                      grammar=grammar, marks=turn_marks(self.tokenizer, tokens) if msg.messages is not None else [])
        req.thinking = msg.messages is not None and reasoning_open(tokens, self.tokenizer)
        self.requests[req.rid] = req
        if chat is not None and chat.data:      # queued once its images are decoded (images_decoded)
            req.phase, req.chat = Phase.DECODING, chat
            self.images.submit(req, chat.data, self.vision, self.image_limits)
            return
        self.queue.append(req.rid)

    def images_decoded(self) -> None:
        """Requests whose images are decoded: queued with their cache keys, or refused (a bad
        image) as a bad request is at arrival: one Error, no Done."""
        for req, decoded, error in self.images.finished():
            if self.requests.get(req.rid) is not req:
                continue                        # ended meanwhile (cancelled, its client gone)
            try:
                if error is not None:
                    raise error
                chat = req.chat.prompt(decoded)
            except FermoeError as e:
                log.info("request %s refused: %s", req.rid, e)
                del self.requests[req.rid]
                self.reply(req.client, P.Error(message=str(e), request_id=req.rid, **getattr(e, "wire_fields", {})))
                continue
            req.images = [P.ImageInput(data=im.data, start=s.start, rows=s.rows, cols=s.cols)
                          for im, s in zip(chat.images, chat.spans)]
            req.key, req.chat, req.phase = chat.cache_key(), None, Phase.QUEUED
            self.queue.append(req.rid)

    def _prompt_tokens(self, msg: P.Generate):
        """(the prompt's token ids, its ChatPlan with the images or None)."""
        given = [x is not None for x in (msg.prompt, msg.tokens, msg.messages)]
        if sum(given) != 1:
            raise FermoeError("give exactly one of prompt, tokens, messages")
        chat = None
        if msg.tokens is not None:
            tokens = msg.tokens
        elif msg.prompt is not None:
            tokens = self.tokenizer.encode(msg.prompt)
        else:
            chat = plan(self.tokenizer, msg.messages, msg.tools, msg.chat_template_kwargs, self.vision,
                        self.image_limits, max_image_bytes=P.MAX_IMAGE_BYTES,
                        continue_final=msg.continue_final_message, add_generation_prompt=msg.add_generation_prompt)
            tokens = chat.tokens
        n_vocab = self.model.config.n_vocab
        if not tokens:
            raise FermoeError("the prompt has no tokens")
        if not all(0 <= t < n_vocab for t in tokens):
            raise FermoeError(f"token ids must be in [0, {n_vocab})")
        if len(tokens) > self.max_model_len:
            limit = (f"the model's context length of {self.max_model_len}"
                     if self.max_model_len == self.model.config.n_ctx_train else f"--max-model-len {self.max_model_len}")
            raise PromptTooLong(f"the prompt is {len(tokens)} tokens, longer than {limit}", len(tokens),
                                self.max_model_len)
        return tokens, chat

    def handle_cancel(self, client: bytes, msg: P.Cancel) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or req.client != client:
            self.reply(client, P.Error(message=f"no running request {msg.request_id!r}", request_id=msg.request_id))
            return
        self.end(req, "cancelled")

    def handle_status(self, client: bytes, msg: P.Status) -> None:
        infos = [P.WorkerInfo(worker_id=w.worker_id, pid=w.pid, threads=w.threads, running=len(w.requests),
                              alive=w.alive and w.ready, kind=w.kind, device=w.device,
                              prefill_tok_s=round(w.prefill_tok_s, 1), decode_tok_s=round(w.decode_tok_s, 1),
                              vision_tok_s=round(w.vision_tok_s, 1))
                 for w in self.workers.values()]
        stats = {k: int(v) for k, v in {**self.index.stats(), **(self.disk.status() if self.disk else {})}.items()}
        waiting = len(self.queue) + sum(r.phase is Phase.DECODING for r in self.requests.values())
        self.reply(client, P.StatusReply(model=self.opts.model_path, workers=infos, queued=waiting,
                                         running=len(self.requests) - waiting, snapshots=stats,
                                         name=self.opts.alias or self.opts.model,
                                         fingerprint=self.model.fingerprint,
                                         max_request_size=P.max_message_bytes(), n_ctx=self.max_model_len,
                                         max_sequences=self.opts.max_sequences, vision=self.vision is not None,
                                         unavailable=self.unavailable or "", reasoning=self.opts.reasoning,
                                         reasoning_budget=self.opts.reasoning_budget,
                                         sampling_defaults=msgspec.to_builtins(self.sampling_defaults()),
                                         n_predict=self.opts.n_predict or -1,
                                         chat_template=self.opts.chat_template or "",
                                         chat_template_kwargs=self.opts.chat_template_kwargs,
                                         sleeping=self.supervisor.asleep))

    def client_gone(self, client: bytes) -> None:
        for req in [r for r in self.requests.values() if r.client == client]:
            log.info("client of %s is gone: cancelling", req.rid)
            self.end(req, "cancelled", notify=False)

    # ---- workers --------------------------------------------------------------
    def send_worker(self, worker_id: str, msg, data: list = ()) -> None:
        self.workers_sock.send_multipart([worker_id.encode(), P.encode(msg), *data])

    def handle_worker_frames(self, frames: list[bytes]) -> None:
        """[worker id, message, data...]: data frames come only with the SnapshotWritten
        of a worker without the arena (the snapshot itself)."""
        wid = frames[0].decode(errors="replace")
        try:
            msg = P.decode(frames[1], P.FROM_WORKER) if len(frames) > 1 else None
            if msg is None:
                raise ProtocolError("no message frame")
            if len(frames) > 2 and not isinstance(msg, P.SnapshotWritten):
                raise ProtocolError(f"{type(msg).__name__} came with {len(frames) - 2} data frames")
        except ProtocolError as e:
            log.error("worker %s sent a bad message: %s", wid, e)
            return
        self.last_seen[wid] = time.monotonic()
        try:
            if isinstance(msg, P.Hello):
                self.handle_hello(wid, msg)
            elif wid in self.workers:               # (a stranger says hello first)
                self.worker_handlers[type(msg)](wid, msg, frames[2:])
        except Exception:                  # a bug met by one message must not stop the daemon
            log.exception("worker %s: handling its %s failed", wid, type(msg).__name__)

    def handle_hello(self, wid: str, msg: P.Hello) -> None:
        if wid in self.workers:                 # a new process under a known id: the old one is gone, and
            log.warning("worker %s said hello again (a new process): its predecessor's requests are replayed", wid)
            self.drop_worker(wid)               # what it ran with it (the new one never heard of it)
            self.last_seen[wid] = time.monotonic()
        if msg.fingerprint != self.model.fingerprint:
            log.error("worker %s runs another model (%s); sending it away", wid, msg.fingerprint)
            self.send_worker(wid, P.Shutdown())
            return
        self.workers[wid] = WorkerView(wid, alive=True, ready=False, threads=msg.threads, pid=msg.pid, kind=msg.kind,
                                       device=msg.device, prefill_tok_s=msg.prefill_tok_s,
                                       prefill_fixed_ms=msg.prefill_fixed_ms, decode_tok_s=msg.decode_tok_s,
                                       mailbox=msg.mailbox)
        arena = self.arena
        self.send_worker(wid, P.Welcome(arena=arena.name if arena else "", slot_bytes=arena.slot_bytes if arena else 0,
                                        n_slots=arena.n_slots if arena else 0,
                                        state_slot_bytes=arena.state_slot_bytes if arena else 0,
                                        n_state_slots=arena.n_state_slots if arena else 0, block=self.opts.block,
                                        kv_cache_dtype=self.opts.kv_cache_dtype, max_model_len=self.max_model_len))
        log.info("%s worker %s (pid %d, %s) joined: prefill %.0f ms + %.0f tok/s", msg.kind, wid, msg.pid,
                 msg.device or f"{msg.threads} threads", msg.prefill_fixed_ms, msg.prefill_tok_s)

    def handle_attached(self, wid: str, msg: P.Attached, data=()) -> None:
        view = self.workers[wid]
        view.ready, view.arena = True, msg.arena and self.arena is not None
        if self.arena is not None and not msg.arena:
            log.info("worker %s has no access to the snapshot arena: its snapshots travel as message frames", wid)
        self.pair_hybrid()

    def handle_hybrid_mailbox(self, wid: str, msg: P.HybridMailbox, data=()) -> None:
        """A CPU worker whose GPU worker was lost opened a new mailbox: paired again when one is ready."""
        view = self.workers[wid]
        view.mailbox, view.hybrid_with = msg.mailbox, ""
        self.pair_hybrid()

    def pair_hybrid(self) -> None:
        """--decode hybrid or auto: each ready CPU worker with a mailbox gets a ready GPU worker to run
        its decode steps' dense part (scheduler.hybrid_pairs: the least loaded). A mailbox is served
        once: a CPU worker whose GPU worker is lost opens another (HybridMailbox), paired again here."""
        if getattr(self.opts, "decode", "cpu") == "cpu":
            return
        for cpu_id, gpu_id in hybrid_pairs(self.workers):
            cpu, gpu = self.workers[cpu_id], self.workers[gpu_id]
            cpu.hybrid_with = gpu_id
            self.send_worker(gpu_id, P.HybridPeer(worker_id=cpu_id, mailbox=cpu.mailbox, pid=cpu.pid))
            self.send_worker(cpu_id, P.HybridReady(pid=gpu.pid))
            log.info("%s decodes with %s: the dense part there, the routed experts here", cpu_id, gpu_id)

    def handle_heartbeat(self, wid: str, msg: P.Heartbeat, data=()) -> None:
        pass                                    # last_seen is updated for every message

    def handle_error(self, wid: str, msg: P.Error, data=()) -> None:
        log.error("worker %s: %s", wid, msg.message)

    def handle_sampled(self, wid: str, msg: P.Sampled, data=()) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or req.worker != wid:
            return                               # ended meanwhile (cancel raced the token)
        now = time.monotonic()
        if req.first_token is None:
            if self.disk is not None:           # the prompt's snapshots, written: behind the arena to disk
                self.disk.persist(req.cache_tokens, [len(req.tokens), *req.marks])
            req.first_token = now       # a worker that does not report its prefill: the time since dispatch
            req.prefill_ms = msg.prefill_ms if msg.prefill_ms is not None else 1000 * (now - req.dispatched)
            prefilled = len(req.tokens) - (req.resume.position if req.resume else 0)
            view = self.workers[wid]
            if prefilled > 0 and req.prefill_ms > 0:
                view.prefill_tok_s = update_rate(view.prefill_tok_s, 1000 * prefilled / req.prefill_ms)
            if msg.vision_tokens > 0 and msg.vision_ms > 0:
                view.vision_tok_s = update_rate(view.vision_tok_s, 1000 * msg.vision_tokens / msg.vision_ms)
        req.last_token, req.sampled = now, req.sampled + 1
        if req.skip:
            req.skip -= 1                        # a replay re-samples what was already sent
            return
        req.generated.append(msg.token)
        if msg.token in self.tokenizer.eos_ids and not req.msg.ignore_eos:
            return
        if req.msg.messages is not None:        # usage's reasoning tokens: a <think> block's, its tags included
            if not req.thinking and msg.token == self.tokenizer.token_to_id.get("<think>"):
                req.thinking = True
            if req.thinking:
                req.reasoning_tokens += 1
                req.thinking = msg.token != self.tokenizer.token_to_id.get("</think>")
        text = req.stream.feed(msg.token)
        req.sent += 1
        token = P.Token(request_id=req.rid, token=msg.token, text=text, logprob=msg.logprob,
                        top_logprobs=msg.top_logprobs)
        if self.reply(req.client, token) and req.stream.stopped:
            self.end(req, "stop")

    def handle_progress(self, wid: str, msg: P.Progress, data=()) -> None:
        req = self.requests.get(msg.request_id)
        if req is not None and req.worker == wid:
            self.progress(req, msg.processed, msg.time_ms)

    def progress(self, req: Request, processed: int, time_ms: float) -> None:
        """Forwarded while it grows: a replay after a worker's death repeats passes already told."""
        if req.msg.return_progress and processed > req.progress:
            req.progress = processed
            self.reply(req.client, P.Progress(request_id=req.rid, processed=processed, time_ms=round(time_ms, 3)))

    def handle_snapshotwritten(self, wid: str, msg: P.SnapshotWritten, data: list = ()) -> None:
        req = self.requests.get(msg.request_id)
        if req is not None and req.worker == wid:
            self.intake.written(req, wid, msg, data, attached=self.workers[wid].arena)

    def handle_finished(self, wid: str, msg: P.Finished, data=()) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or req.worker != wid:
            self.unfinished.stopped(msg.request_id, wid)    # one that ended here first: its slots are free now
            return
        # its timings are not taken: Request.timings, from the tokens, serves every finish reason alike
        if msg.completion_tokens:
            req.decode_device = "hybrid" if msg.hybrid_steps else "cpu"
        self.end(req, msg.finish_reason, error=msg.error, worker_done=True)

    # ---- lifecycle ------------------------------------------------------------
    def schedule(self) -> None:
        if self.queue and self.unavailable:
            for rid in list(self.queue):      # nobody will ever run them: refuse, never hang
                self.end(self.requests[rid], "error", error=self.unavailable, refuse=UNAVAILABLE)
            return
        while self.queue:
            if self.disk is not None and self._load_from_disk(self.requests[self.queue[0]]):
                continue
            placed = self.gpu.place(self.requests[self.queue[0]])
            if placed == "wait":
                return
            if placed == "gpu":
                self.announce(self.requests[self.queue.pop(0)])
                continue
            wid = pick_worker(self.workers, self.opts.max_sequences)
            if wid is None:
                return
            req = self.requests[self.queue.pop(0)]
            try:
                self.assign(req, wid)
                self.announce(req)
            except Exception as e:         # a bug met by one request ends that request only
                log.exception("assigning request %s to worker %s failed", req.rid, wid)
                self.end(req, "error", error=f"internal error: {type(e).__name__}: {e}")

    def _load_from_disk(self, req: Request) -> bool:
        """A request's first turn at the queue's head: when the disk tier reaches further into
        its prompt than the arena, it waits aside while those snapshots load (True)."""
        if req.disk_checked or req.attempts or req.phase is not Phase.QUEUED:
            return False
        req.disk_checked = True
        job = self.disk.plan_load(req.rid, req.cache_tokens)
        if job is None:
            return False
        self.queue.pop(0)
        self.loading[req.rid] = job
        return True

    def snapshots_loaded(self) -> None:
        """Loads from the disk tier done: their requests go back to the queue's head, where the
        lookup finds what was loaded."""
        for job in self.disk.finished():
            self.loading.pop(job.rid, None)
            req = self.requests.get(job.rid)
            if req is None:
                continue                        # ended meanwhile: what was loaded stays cached
            req.disk_ms = job.ms if job.ok else 0.0
            log.log(logging.INFO if job.ok else logging.WARNING, "request %s: %s", req.rid,
                    f"{job.nbytes / 2**20:.1f} MiB of snapshots up to position {job.position} loaded from disk "
                    f"in {job.ms:.0f} ms" if job.ok else "its snapshots on disk could not be loaded: prefilling")
            self.queue.insert(0, req.rid)

    def announce(self, req: Request) -> None:
        """The prompt's size and cached part, once, as soon as its first lookup is made."""
        if not req.started:
            req.started = True
            self.reply(req.client, P.Started(request_id=req.rid, prompt_tokens=len(req.tokens),
                                             cached_prompt_tokens=req.cached_tokens))
            if req.msg.return_progress:         # llama-server's first report: the cached part, processed
                req.progress = req.cached_tokens
                self.reply(req.client, P.Progress(request_id=req.rid, processed=req.cached_tokens, time_ms=0.0))

    def handle_prefilled(self, wid: str, msg: P.Prefilled, data=()) -> None:
        req = self.gpu.prefilled(wid, msg)
        if req is not None:                             # to a CPU worker next, before anything queued after it
            self.queue.insert(0, req.rid)
            if req.handoff is not None:                 # the GPU's one pass over the prompt
                self.progress(req, req.handoff.position, msg.prefill_ms)

    def assign(self, req: Request, wid: str) -> None:
        cache = self.arena is not None
        replay = req.attempts > 0               # its own snapshots, not a client-visible cache hit
        if req.phase is Phase.HANDED_OFF:
            resume, req.handoff = req.handoff, None
        else:
            resume = self.index.lookup(req.cache_tokens, replay=replay) if cache else None
        req.resume = resume
        if not replay:
            req.cached_tokens = resume.position if resume else 0
        asked = req.msg.max_tokens
        wanted = DECODE_SLOTS if asked is None else min(DECODE_SLOTS, asked // self.opts.block + 2)
        # the decode pairs first: the state of the generation's end, where the next turn resumes,
        # must not find every state taken by the prompt's own snapshots, not yet written
        if cache:
            self.index.keep(req.cache_tokens, req.marks)     # turn starts a later turn may rewrite from
        req.decode_slots = self.index.reserve(wanted) if cache and asked != 0 else []
        req.planned = self.index.plan(req.cache_tokens, resume.position if resume else 0, req.marks) if cache else []
        if req.prefill_device != "gpu":
            req.prefill_device = "cpu" if not resume or resume.position < len(req.tokens) else None
        req.worker, req.attempts, req.phase = wid, req.attempts + 1, Phase.RUNNING
        req.dispatched, req.prefill_ms, req.first_token, req.last_token, req.sampled = \
            time.monotonic(), None, None, None, 0
        self.workers[wid].requests.add(req.rid)
        m = req.msg
        until_context_end = self.max_model_len - len(req.tokens) + 1
        refs, data = resume_refs(resume, self.arena, self.workers[wid].arena)
        self.send_worker(wid, P.Assign(
            request_id=req.rid, tokens=req.tokens, resume=refs, snapshots=planned_refs(req.planned),
            # every position up to max_model_len is run; the last token is sampled from the last one
            max_tokens=min(until_context_end if m.max_tokens is None else m.max_tokens, until_context_end),
            sampling=req.sampling, ignore_eos=m.ignore_eos, decode_slots=req.decode_slots, logprobs=m.logprobs,
            grammar=req.grammar, images=req.images, progress=m.return_progress, **self._reasoning_budget(req)), data)

    def _reasoning_budget(self, req: Request) -> dict:
        """Assign's reasoning_budget and reasoning_end: the request's budget, else the server's,
        for a chat whose prompt leaves <think> open; the end forced is `</think>` and the blank
        line the chat template writes after it (its enable_thinking=false prompt ends so)."""
        budget = req.msg.reasoning_budget if req.msg.reasoning_budget is not None else self.opts.reasoning_budget
        if req.msg.messages is None or budget < 0 or not reasoning_open(req.tokens, self.tokenizer):
            return {}
        return {"reasoning_budget": budget, "reasoning_end": self.tokenizer.encode("</think>\n\n")}

    def end(self, req: Request, reason: str, error: str | None = None, notify: bool = True,
            worker_done: bool = False, refuse: str | None = None) -> None:
        """Free everything the request holds, log it and tell the client (unless it is gone):
        its Done, or with `refuse` (a code) an Error, for one that has sent nothing yet."""
        now = time.monotonic()
        prefill_ms, decode_tok_s = req.timings(now)
        self._log_finished(req, reason, error, prefill_ms, decode_tok_s, now)
        self.requests.pop(req.rid, None)
        self.loading.pop(req.rid, None)
        if self.disk is not None and reason in ("stop", "length") and req.generated:
            tokens = list(req.cache_tokens) + req.generated     # where the next turn resumes (the last
            self.disk.persist(tokens, [len(tokens) - 1, len(tokens)])   # token may not have run)
        if req.phase is Phase.DECODING:
            self.images.cancel(req)
        if req.rid in self.queue:
            self.queue.remove(req.rid)
        if req.worker in self.workers:
            self.workers[req.worker].requests.discard(req.rid)
            if reason in ("cancelled", "stop") and self.workers[req.worker].alive:
                self.send_worker(req.worker, P.Stop(request_id=req.rid))
            if not worker_done:             # it may still write this request's slots: they wait for it
                self.unfinished.hold(req)
        req.release(self.index)
        if not notify:
            return
        if refuse is not None and req.sent == 0:
            self.reply(req.client, P.Error(message=error or reason, request_id=req.rid, code=refuse))
            return
        tail = req.stream.flush()
        if tail:
            self.reply(req.client, P.Token(request_id=req.rid, token=-1, text=tail))
        self.reply(req.client, P.Done(request_id=req.rid, finish_reason=reason, error=error,
                                      prompt_tokens=len(req.tokens), cached_prompt_tokens=req.cached_tokens,
                                      completion_tokens=req.sent, reasoning_tokens=req.reasoning_tokens,
                                      prefill_ms=round(prefill_ms, 3),
                                      decode_tok_s=round(decode_tok_s, 3), stop_reason=req.stream.stopped_by,
                                      prefill_device=req.prefill_device, decode_device=req.decode_device,
                                      prefill_estimates_ms={k: round(v, 1) for k, v in req.estimates.items()},
                                      prefill_batch=req.prefill_batch, disk_ms=round(req.disk_ms, 3)))

    @staticmethod
    def _log_finished(req: Request, reason: str, error: str | None, prefill_ms: float, decode_tok_s: float,
                      now: float) -> None:
        """One line per request, as llama-server and vLLM print: what it was, why it
        ended, how fast its prompt and its tokens went."""
        n_prompt = len(req.tokens)
        if req.prefill_device == "gpu":           # the CPU worker resumed from the GPU worker's last snapshot
            prefilled = n_prompt - req.cached_tokens
        else:
            prefilled = n_prompt - (req.resume.position if req.resume else req.cached_tokens)
        prefill_tok_s = prefilled / prefill_ms * 1000 if prefill_ms > 0 and req.first_token is not None else 0.0
        why = reason if req.stream.stopped_by is None else f"{reason}: stop string {req.stream.stopped_by!r}"
        first = req.first_dispatch if req.first_dispatch is not None else req.dispatched
        queued = (first if first is not None else now) - req.arrived
        log.log(logging.WARNING if reason == "error" else logging.INFO,
                "request %s finished (%s): prompt %d tokens (%d cached), %d generated; prefill %d tokens in "
                "%.0f ms (%.1f tok/s), decode %.1f tok/s; total %.0f ms (%.0f ms queued)%s",
                req.rid, why, n_prompt, req.cached_tokens, req.sent, prefilled, prefill_ms, prefill_tok_s,
                decode_tok_s, 1000 * (now - req.arrived), 1000 * queued, f"; error: {error}" if error else "")

    # ---- sleep (--sleep-idle-seconds) ---------------------------------------------
    def doze(self) -> None:
        """Idle that long: the workers we started stop, and with them the memory that holds the
        model (the snapshot store, ours, is kept); the next request starts them again. Workers
        that joined by hand are not ours to stop."""
        now = time.monotonic()
        if self.requests:
            self.idle_since = now
        if self.opts.sleep_idle_seconds < 0 or self.supervisor.asleep or self.requests \
                or now - self.idle_since < self.opts.sleep_idle_seconds:
            return
        ours = self.supervisor.sleep()
        for wid in ours:
            if wid in self.workers:
                self.send_worker(wid, P.Shutdown())
        log.info("idle for %d s: asleep, workers %s stopped; the next request starts them again",
                 self.opts.sleep_idle_seconds, ", ".join(ours) or "(none of ours)")

    def wake(self) -> None:
        log.info("a request came: waking, starting the workers again")
        self.idle_since = time.monotonic()
        self.supervisor.wake()

    # ---- faults -----------------------------------------------------------------
    def supervise(self) -> None:
        now = time.monotonic()
        dead = set(self.supervisor.reap())
        dead |= {w for w, seen in self.last_seen.items() if now - seen > WORKER_TIMEOUT_S and w in self.workers}
        for wid in dead:
            self.worker_died(wid)
        self._check_available()
        if self.http:
            self.http.poll()

    def _check_available(self) -> None:
        """Every CPU worker of ours given up and none joined by hand: nothing can decode, so
        requests are refused at once (the front end answers 503 and /health says why)."""
        decoders = any(w.kind == "cpu" for w in self.workers.values())
        unavailable = NO_DECODER if self.supervisor.all_given_up and not decoders else None
        if unavailable != self.unavailable:
            if unavailable:
                log.error("%s: requests are refused until a CPU worker joins (cpu_worker --connect %s)",
                          unavailable, self.worker_endpoint)
            else:
                log.info("a CPU worker joined: requests are served again")
            self.unavailable = unavailable

    def worker_died(self, wid: str) -> None:
        log.error("worker %s died", wid)
        self.drop_worker(wid)
        self.supervisor.restart(wid)

    def handle_goodbye(self, wid: str, msg: P.Goodbye, data=()) -> None:
        log.info("worker %s left", wid)        # one of ours that exits is restarted when reaped
        self.drop_worker(wid)

    def drop_worker(self, wid: str) -> None:
        """Forget a worker; its requests go back to the front of the queue, to be replayed."""
        view = self.workers.pop(wid, None)
        self.last_seen.pop(wid, None)
        self.unfinished.worker_lost(wid)                 # it writes nothing more
        if view is not None and view.mailbox:            # a killed CPU worker cannot remove its own
            from shared.shm_arena import SnapshotArena
            SnapshotArena.remove_stale(MAILBOX_PREFIX)
        for cpu in self.workers.values():                # CPU workers it ran decode steps for: alone for now
            if cpu.hybrid_with == wid:
                cpu.mailbox = cpu.hybrid_with = ""       # until the new mailbox each opens
                self.send_worker(cpu.worker_id, P.HybridLost())
        for rid in list(view.requests if view else []):
            req = self.requests[rid]
            if req.phase is Phase.PREFILLING:            # its prompt runs on a CPU worker now
                log.warning("request %s was prefilling on %s: prefilling it on a CPU worker", rid, wid)
                self.gpu.fail_over(req)
            else:                                        # RUNNING: replayed from its snapshots
                req.release(self.index)
                req.phase = Phase.QUEUED
            if req.attempts >= MAX_ATTEMPTS:
                self.end(req, "error", error=f"worker {wid} died {req.attempts} times running this request")
                continue
            req.worker, req.skip = None, req.sent      # replay: same seed, same tokens, resent none
            self.queue.insert(0, rid)

    def shutdown(self) -> None:
        for rid in list(self.requests):
            self.end(self.requests[rid], "error", error="the coordinator is shutting down")
        if self.http:
            self.http.stop()
        for wid in list(self.workers):
            self.send_worker(wid, P.Shutdown())
        self.supervisor.stop_all()
        if self.images:
            self.images.close()
        if self.disk:
            self.disk.close()                   # what was queued is written before the arena goes
        self._close_security()
        self.clients.close()
        self.workers_sock.close()
        if self.keys is not None:
            self.ctx.destroy(linger=0)  # our own context (the shared instance is left to the process)
        for segment in (self.arena, self.experts):
            if segment is not None:
                segment.close()
                segment.unlink()


def run_coordinator(opts) -> int:
    coordinator = Coordinator(opts)

    def stop(signum, frame):
        coordinator.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        coordinator.event_loop()
    finally:
        coordinator.shutdown()
        log.info("stopped")
    return 0


def main(argv=None) -> int:
    from .options import parse_options
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        return run_coordinator(parse_options(argv))
    except FermoeError as e:
        print(f"coordinator: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
