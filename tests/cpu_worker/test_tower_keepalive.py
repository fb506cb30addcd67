"""A CPU worker running the vision tower keeps beating: a large image on a few cores can
take longer than the coordinator's heartbeat timeout, after which a silent worker is
declared dead and its requests replayed."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import zmq

from cpu_worker.worker import CPUWorker
from shared import protocol as P
from shared.sampling import SamplingParams
from shared.worker_link import HEARTBEAT_S

TOWER_S = 3.5 * HEARTBEAT_S          # the stand-in tower's time: several heartbeats long


def test_heartbeats_go_on_while_the_tower_runs(tiny_q4_path, monkeypatch, tmp_path):
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker = CPUWorker(str(tiny_q4_path), f"tcp://127.0.0.1:{port}", "w", threads=1, mmproj=str(tmp_path / "t"))
    try:
        import shared.vision.prompt as prompt_module
        import cpu_worker.vision_engine as vision_engine

        def slow_tower(n_tokens, images, n_embd, encoder, start):
            time.sleep(TOWER_S)
            return "media"
        monkeypatch.setattr(prompt_module, "media_of_images", slow_tower)
        monkeypatch.setattr(vision_engine, "image_encoder", lambda *a: SimpleNamespace(tokens=0, seconds=0.0))
        msg = P.Assign(request_id="r", tokens=[1, 2, 3], resume=[], snapshots=[], max_tokens=1,
                       sampling=SamplingParams(seed=1), images=[P.ImageInput(data=b"png", start=0, rows=1, cols=1)])
        t0 = time.monotonic()
        assert worker.media(msg, 0)[0] == "media"
        assert time.monotonic() - t0 >= TOWER_S
        beats = []
        while router.poll(0):
            _, frame = router.recv_multipart()
            beats += [m for m in [P.decode(frame, P.FROM_WORKER)] if isinstance(m, P.Heartbeat)]
        assert len(beats) >= 3, f"{len(beats)} heartbeats in {TOWER_S} s"
    finally:
        worker.link.close()
        worker.engine.close()
        router.close()

