"""bench decode's and bench kernels' foreign_cpu_fraction: other processes' share of the
CPUs while a benchmark ran, from /proc/stat less this process's own time."""
import pytest

from bench import decode
from bench.decode import ForeignCpu, cpu_jiffies
from tests.support.bench_keys import assert_keys_documented


def _stat(path, busy_user, idle):
    # user nice system idle iowait irq softirq steal
    path.write_text(f"cpu  {busy_user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")


def test_cpu_jiffies_counts_idle_and_iowait_as_not_busy(tmp_path):
    p = tmp_path / "stat"
    p.write_text("cpu  10 2 3 100 5 1 1 0 0 0\n")
    assert cpu_jiffies(str(p)) == (17, 122)
    assert cpu_jiffies(str(tmp_path / "absent")) is None


def test_foreign_share_is_busy_time_less_our_own(tmp_path, monkeypatch):
    p = tmp_path / "stat"
    own = iter([50.0, 80.0])                            # this process: 30 ticks in between
    monkeypatch.setattr(ForeignCpu, "_own", staticmethod(lambda: next(own)))
    _stat(p, 1000, 5000)
    with ForeignCpu(str(p)) as f:
        _stat(p, 1000 + 30 + 120, 5000 + 50)            # 150 busy ticks of 200: 120 not ours
    assert f.fraction == pytest.approx(0.6)


def test_foreign_share_unknown_without_proc_stat(tmp_path):
    with ForeignCpu(str(tmp_path / "absent")) as f:
        pass
    assert f.fraction is None


def test_bench_decode_reports_it(tiny_q4_path):
    out = decode.run(str(tiny_q4_path), threads=1, prompt_tokens=4, decode_tokens=2)
    assert out["foreign_cpu_fraction"] is None or 0.0 <= out["foreign_cpu_fraction"] <= 1.0
    assert_keys_documented(out, decode)
