"""Every benchmark script imports against the current code (a bench is run by hand, seldom: a
name it imports that was renamed would otherwise surface only then)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py")))
def test_bench_script_imports(name):
    module = importlib.import_module(f"bench.{name}")
    assert module.__doc__  # each says what it measures and how


def test_the_sweep_says_why_each_request_missed():
    from bench.common import misses, requests

    detailed = {
        "ttfts": [0.1, 0.5, 0.1, 0.1, 0.5, None],
        "itls": [[0.01, 0.02], [0.01], [0.3, 0.01], [0.01, 0.2], [0.3], []],
        "errors": ["", "", "", "", "", "connection reset"],
    }
    per_request = requests(detailed)
    assert per_request[2] == {
        "ttft_ms": 100.0, "gap_1_2_ms": 300.0, "max_gap_ms": 300.0, "max_gap_at": 0, "error": "",
        "start_s": None, "max_gap_end_s": None,
    }  # fmt: skip
    assert per_request[3]["max_gap_at"] == 1
    assert misses(per_request, (200, 100)) == {"failed": 1, "ttft": 1, "gap": 2, "gap_at_1_2": 1, "both": 1}


def test_a_stream_cut_short_by_an_error_event_counts_as_failed():
    """vLLM's client counts a stream with any token as a success (it reads no later error event):
    with --ignore-eos, fewer tokens than asked is a failure, and a miss for every SLO pair."""
    from bench.common import attainment, mark_cut_streams, misses, requests

    detailed = {
        "ttfts": [0.1, 0.1, None],
        "itls": [[0.01] * 7, [0.01] * 2, []],
        "errors": ["", "", "connection reset"],
        "output_lens": [8, 3, 0],
        "completed": 2,
        "failed": 1,
    }
    mark_cut_streams(detailed, 8)
    assert detailed["errors"][1] == "the stream ended after 3 of 8 tokens"
    assert (detailed["completed"], detailed["failed"]) == (1, 2)
    assert set(attainment(detailed).values()) == {1 / 3}
    assert misses(requests(detailed), (200, 100))["failed"] == 2

    from bench.serve import WORKLOADS
    from bench.serve_sweep import median_points, scaled

    workload = WORKLOADS["interference"]
    decode_side = workload["itl_stream"]
    bigger = scaled(workload, 0.5, min_requests=150)
    assert bigger["streams"][decode_side]["prompts"] >= 150
    for name, stream in bigger["streams"].items():
        assert stream["rate"] == round(workload["streams"][name]["rate"] * 0.5, 3)
    runs = [
        {"scale": 1.0, "offered_rps": 2.0, "attainment": {"a": a}, "goodput_rps": g, "failed": f,
         "client_cpu_share": 0.1, "misses": {"ttft": 1}, "requests": [{}] * 3}
        for a, g, f in ((0.2, 1.0, 0), (0.9, None, 1), (0.5, 2.0, 0))
    ]  # fmt: skip
    (point,) = median_points(runs)
    assert point["attainment"] == {"a": 0.5} and point["spread"] == {"a": (0.2, 0.9)}
    assert point["goodput_rps"] == 1.5 and point["failed"] == 1 and point["misses"] == {"ttft": 3}
    assert point["requests"] == 9 and point["repeats"] == 3


def test_each_point_of_a_setups_life_asks_its_own_prompts():
    """A setup serves every scale of a sweep in one life: a point that replayed an earlier
    point's prompts (same seeds) would hit the prefix cache that point filled (sweep run 31's
    second scale: the long prompts' TTFT p50 95 ms against 525 ms at the first)."""
    from bench.serve import WARM_UP_SEED, WORKLOADS
    from bench.serve_sweep import scaled

    workload = WORKLOADS["interference"]
    points = [scaled(workload, scale, point=i) for i, scale in enumerate((0.15, 0.3, 0.6))]
    for name, stream in workload["streams"].items():
        seeds = [p["streams"][name]["seed"] for p in points]
        assert seeds[0] == stream["seed"]  # the first point: the workload's own prompts
        assert len(set(seeds)) == len(seeds)
        assert stream["seed"] + WARM_UP_SEED not in seeds  # nor the warm-up's


def test_stalls_that_hold_several_streams_at_once_are_one_event():
    """Late gaps that overlap in time are one engine stall; each event is set against what the
    cluster was doing then (a long request's handoff or prefill, a local prefill), and the
    attainment is pooled over every request of every repeat."""
    from bench.common import requests
    from bench.stalls import summary

    # decode-side: A stalls over 10.10-10.25 s and B over 10.20-10.30 (one event); C alone over
    # 20.02-20.10; D never stalls. Clocks: request starts (perf_counter), gaps in seconds.
    decode_side = requests({
        "start_times": [10.0, 10.1, 20.0, 30.0],
        "ttfts": [0.05, 0.05, 0.02, 0.05],
        "itls": [[0.05, 0.15, 0.1], [0.05, 0.1, 0.01], [0.08, 0.01], [0.01]],
        "errors": [""] * 4,
    })  # fmt: skip
    # long: prefill 9.9 -> 10.35 (token 1), handoff 10.35 -> 10.36; the other far away
    long = requests({"start_times": [9.9, 40.0], "ttfts": [0.45, 0.2], "itls": [[0.01, 0.01], [0.01]]})
    assert decode_side[0]["max_gap_end_s"] == 10.25 and decode_side[1]["max_gap_end_s"] == 10.3
    run = {
        "requests": decode_side,
        "attainment": {"ttft<=1000ms,gap<=50ms": 0.25},
        "others": {"long": {"requests": long}},
    }
    s = summary([run, run], "ttft<=1000ms,gap<=50ms", 50)
    assert s["hits"] == 6 and s["events"] == 4  # A and B overlap: 2 events of 3 stalls, per repeat
    assert s["handoff"] == 0 and s["long_prefill"] == 2 and s["local_prefill"] == 2 and s["none"] == 2
    assert s["pooled"]["requests"] == 8 and s["pooled"]["met"] == 2
    assert s["pooled"]["low"] < 0.25 < s["pooled"]["high"]
    assert 0 < s["long_prefill_time_share"] < 1 and round(s["longest_ms"]) == 200
    # one-token answers have no gaps: the run ends at their first tokens, and nothing stalled
    single = requests({"start_times": [5.0, 6.0], "ttfts": [0.1, 0.2], "itls": [[], []]})
    quiet = summary([{"requests": single, "attainment": {}, "others": {}}], "ttft<=1000ms,gap<=50ms", 50)
    assert quiet["events"] == 0 and quiet["timed"] and abs(quiet["seconds"] - 1.2) < 1e-9


def test_the_load_generator_gets_its_priority_across_sessions(tmp_path, monkeypatch):
    """With the kernel's autogroups, nice counts only within a session: the load generator must
    run in a session (autogroup) of its own at its nice, or the cluster's session keeps it off
    the CPU regardless (bench/results/2026-12-03-serve-sweep-probe-autogroup.md). A process in a
    cgroup of its own (a container's) is scheduled by that cgroup and shows no autogroup; there
    the session and the nice are still checked."""
    from bench import serve

    monkeypatch.setitem(serve.LOAD_GENERATOR, "nice", 5)  # positive: no privilege needed
    out = tmp_path / "generator"
    probe = "import os, pathlib; g = pathlib.Path('/proc/self/autogroup'); "
    probe += "print(os.getsid(0), os.nice(0), g.read_text().strip() if g.exists() else '', sep='|')"
    with out.open("wb") as log:
        proc = serve.start_generator([sys.executable, "-c", probe], log)
        assert proc.wait(30) == 0
    session, niceness, group = out.read_text().strip().split("|")
    assert int(session) != os.getsid(0) and int(niceness) == min(os.nice(0) + 5, 19)  # nice is relative
    ours = Path("/proc/self/autogroup")
    ours = ours.read_text().strip() if ours.exists() else ""
    if ours:  # this process is autogroup-scheduled: the generator's autogroup is another, at nice 5
        assert group.endswith("nice 5") and group.split()[0] != ours.split()[0]


def test_the_router_profile_counts_routes_per_point():
    """A point's routes are the router's decisions during it (counters' differences), by path."""
    from bench.serve_profile import profile

    before = {"pdcluster_route_decisions_total[pd]": 5.0, "pdcluster_route_decisions_total[local_prefill]": 2.0}
    after = dict(before, **{"pdcluster_route_decisions_total[pd]": 9.0})
    after["pdcluster_route_decisions_total[local_queue]"] = 3.0
    assert profile(before, after)["routes"] == {"pd": 4.0, "local_queue": 3.0}


def test_the_sweep_reads_the_first_token_paths_own_stream():
    """The workload's other stream (interference: the long prompts, on the P/D path) is read per
    request: when token 2 came is TTFT plus the 1 -> 2 gap, over every repeat; the router's handoff
    gaps over the budget are summed."""
    from bench.serve_profile import profile
    from bench.serve_sweep import median_points, point

    workload = {"itl_stream": "decode", "streams": {"decode": {"rate": 1.0}, "long": {"rate": 1.0}}}
    cpu = {"cpu_s": {"x": 1.0}}
    runs = []
    for first, gap, n in ((0.2, 0.01, 2), (0.3, 0.06, 1)):
        results = {
            "decode": {"ttfts": [0.1], "itls": [[0.01]], "errors": [""]},
            "long": {"ttfts": [first] * n, "itls": [[gap, 0.005]] * n, "errors": [""] * n},
        }
        run = {"scale": 1.0, **point(results, workload, cpu)}
        gaps = {"pdcluster_handoff_gap_seconds_count": 2.0, "handoff_gap_within_budget": 2.0 if gap < 0.05 else 1.0}
        run["router"] = profile({}, gaps)
        runs.append(run)
    (merged,) = median_points(runs)
    long = merged["others"]["long"]
    assert long["requests"] == 3 and long["attainment"]["ttft<=1000ms,gap<=50ms"] == 0.5  # median of 1.0 and 0.0
    assert long["token_2_p50_ms"] == 210.0 and long["token_2_p99_ms"] == 360.0
    assert long["gap_1_2_p50_ms"] == 10.0 and long["ttft_p50_ms"] == 200.0
    assert long["router_handoff_gaps"] == 4 and long["router_handoff_gaps_over_50ms"] == 1


def test_the_sweep_shows_each_repeats_handoff_stages():
    """Per repeat, from the cluster's counters: a repeat whose pulls waited for a CPU stands out,
    and so does one whose decode engine read nothing one-sided (it fell back to the shm ring); a
    setup without pulls (aggregated) has no row."""
    from bench.serve_profile import profile
    from bench.serve_sweep import handoff_table

    def run(repeat, pull_s, runqueue_s, one_sided):
        counters = {
            "pdcluster_kv_pulls_total[decode-0][ok]": 10.0,
            "pdcluster_kv_pulls_one_sided_total[decode-0]": one_sided,
            "pdcluster_kv_pull_seconds_total": pull_s,
            "pdcluster_kv_pull_cpu_seconds_total": 0.01,
            "pdcluster_kv_pull_runqueue_seconds_total": runqueue_s,
        }
        return {"scale": 0.3, "repeat": repeat, "router": profile({}, counters)}

    raw = {"pd": {"interference": [run(0, 0.02, 0.005, 9.0), run(1, 0.3, 0.25, 0.0)]}, "aggregated": {"interference": [{"scale": 0.3, "repeat": 0, "router": profile({}, {})}]}}  # fmt: skip
    rows = [line for line in handoff_table(raw, "interference") if line.startswith("| pd |")]
    assert len(rows) == 2 and not any("aggregated" in line for line in handoff_table(raw, "interference"))
    assert "| 2.0 | 1.0 / 0.5 | 0.90 |" in rows[0] and "| 30.0 | 1.0 / 25.0 | 0.00 |" in rows[1]


def test_the_sweep_takes_each_repeats_ttft_apart_in_the_engine_that_computed_it():
    """vLLM's own timings per engine role (counters' differences), next to the router's: pd's row
    reads the prefill engine's (its first token), aggregated's its replicas'; what the engine did
    not see is taken over the same requests (pd: the prefill phase, not the router's TTFT, which
    also covers the prompts decode computed)."""
    from bench.serve_profile import profile
    from bench.serve_sweep import ttft_table

    def counters(role_sums: dict[str, tuple[float, float, float]], n: float, router_ttft_s: float) -> dict:
        out = {"pdcluster_ttft_seconds_sum": router_ttft_s * n, "pdcluster_ttft_seconds_count": n}
        for role, (ttft, queue, steps) in role_sums.items():
            for key, value in (("ttft", ttft), ("queue", queue), ("prefill", steps)):
                out[f"engine[{role}]:{key}_sum"] = value * n
                out[f"engine[{role}]:{key}_count"] = n
        return out

    before = counters({"prefill": (1.0, 0.0, 1.0), "decode": (1.0, 0.0, 1.0)}, 10, 2.0)
    before.update(pdcluster_prefill_seconds_sum=10.0, pdcluster_prefill_seconds_count=10.0)
    after = counters({"prefill": (0.025, 0.001, 0.02), "decode": (0.05, 0.01, 0.03)}, 20, 0.02)
    after.update(pdcluster_prefill_seconds_sum=0.056 * 16, pdcluster_prefill_seconds_count=16.0)
    for key in after:  # 10 more requests (8 of them through the prefill), each with the second timings
        after[key] = before[key] + after[key] / 2
    pd = profile(before, after)
    assert pd["engine_ms"]["prefill"] == pytest.approx({"ttft": 25.0, "queue": 1.0, "prefill": 20.0})
    assert pd["engine_ms"]["decode"]["ttft"] == pytest.approx(50.0)
    agg = profile({}, counters({"aggregated": (0.03, 0.0, 0.02)}, 4, 0.04))
    requests = [{"ttft_ms": t} for t in (10.0, 30.0, 50.0)]
    raw = {
        "pd": {"steady": [{"scale": 1.0, "repeat": 0, "router": pd, "requests": requests}]},
        "aggregated": {"steady": [{"scale": 1.0, "repeat": 0, "router": agg, "requests": requests}]},
        "vllm-pd": {"steady": [{"scale": 1.0, "repeat": 0, "router": profile({}, {}), "requests": requests}]},
    }
    rows = [line for line in ttft_table(raw, "steady") if line.startswith("| ") and not line.startswith("| setup")]
    assert rows == [
        "| pd | 1 | 0 | 30.0 | 20.0 | 56.0 | prefill | 25.0 | 1.0 | 20.0 | 31.0 |",
        "| aggregated | 1 | 0 | 30.0 | 40.0 | - | aggregated | 30.0 | 0.0 | 20.0 | 10.0 |",
    ]


def test_tokens_that_come_with_the_first_count_as_gaps_of_zero():
    """A first chunk carrying two tokens: the second token's gap is 0, and the next chunk's gap
    is the next token's (it was read as the 1 -> 2 gap, and one token's gap went missing)."""
    import http.server
    import json
    import threading

    import httpx

    from bench.common import stream_completion

    chunks = [2, 3, 4]  # completion_tokens after each chunk

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for count in chunks:
                event = {"choices": [{"text": "x"}], "usage": {"completion_tokens": count}}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.server_address[1]}", timeout=10) as client:
            timing = stream_completion(client, "tiny", "hi", 4)
    finally:
        server.shutdown()
    assert timing.ok and timing.tokens == 4
    assert len(timing.itls) == 3 and timing.itls[0] == 0.0 and all(g > 0 for g in timing.itls[1:])


def test_the_paired_first_token_bench_takes_the_gain_apart_per_pair():
    """first_token_paired's decomposition: per path, the prefill phase and what followed it until
    token 1; per pair, continued - classic prefill phase with the sign test's interval."""
    from bench.first_token_paired import median_interval, report

    pairs = []
    for i in range(20):
        continued = {"ttft_ms": 104.0 + i, "gap_1_2_ms": 12.0, "prefill_phase_ms": 100.0 + i}
        classic = {"ttft_ms": 118.0 + i, "gap_1_2_ms": 6.0, "prefill_phase_ms": 96.0 + i}
        continued |= {"prefill_cpu_ms": 90.0, "prefill_wait_ms": 5.0}
        classic |= {"prefill_cpu_ms": 90.0, "prefill_wait_ms": 2.0 + (i % 3)}
        pairs.append({"continued": continued, "classic": classic, "first": "classic"})
    text = report([{"pairs": pairs, "counted": {}}])
    assert "| continued | 109.5 | 4.0 | 90.0 | 5.0 |" in text
    assert "| classic | 105.5 | 22.0 | 90.0 | 3.0 |" in text
    assert "prefill phase **4.0 ms** [95 % 4.0 to 4.0]" in text
    assert "median **14.0 ms** [95 % 14.0 to 14.0]" in text
    # the sign test's interval: of 20 values, the 7th smallest and the 7th largest
    assert median_interval([float(v) for v in range(20)]) == (9.5, 6.0, 13.0)


def test_an_engine_threads_schedstat_grows_while_it_runs():
    """The paired bench reads engine threads' time from the kernel: a thread that spins gains CPU time."""
    import threading
    import time

    from bench.first_token_paired import thread_times

    me = (os.getpid(), threading.get_native_id())
    if not os.path.exists(f"/proc/{me[0]}/task/{me[1]}/schedstat"):
        pytest.skip("this kernel keeps no per-thread schedstat")
    before, _ = thread_times([me])
    # Spin until the thread was on a CPU for 20 ms by the kernel's count (or 10 s passed): a fixed
    # 50 ms of wall time got only 15 ms of CPU while the other test lane kept both cores busy.
    after, deadline = before, time.perf_counter() + 10
    while after - before < 0.02 and time.perf_counter() < deadline:
        end = time.perf_counter() + 0.01
        while time.perf_counter() < end:
            pass
        after, _ = thread_times([me])
    assert after - before >= 0.02
