"""`fermoe bench restart` on the built-in model: the disk tier's benchmark runs through, its
JSON documented, and its cached counts are the ones a working disk tier gives (timings are
the benchmark's to report, not this test's to judge)."""
from __future__ import annotations

import subprocess
import sys
import json

import bench.restart
from tests.support.bench_keys import assert_keys_documented

PROMPT, TURN = 120, 24


def test_bench_restart_resumes_from_disk_after_a_stop_and_after_a_kill():
    """Guards: the benchmark timing something else than it says: its restarted prompt not
    resumed from disk (cached 0), its turn not resuming at the prompt's end, the kill's
    snapshots lost, or a key left undocumented."""
    r = subprocess.run([sys.executable, "-m", "fermoe.cli", "bench", "restart", "tiny", "--prompt", str(PROMPT),
                        "--turn", str(TURN), "--snapshot-mem", "64MiB"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert_keys_documented(out, bench.restart)
    assert out["cached_tokens"] == {"cold": 0, "warm_memory": PROMPT, "after_restart": PROMPT,
                                    "turn_after_restart": PROMPT, "after_kill": PROMPT}
    assert out["disk_load_ms"]["after_restart"] > 0 and out["disk_load_ms"]["turn_after_restart"] == 0
    assert out["disk_load_ms"]["after_kill"] > 0 and out["disk_bytes"] > 0
