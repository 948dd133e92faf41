"""Where a profiled window of training steps leaves the GPU idle: the gaps between kernels in a torch.profiler
chrome trace (`train.profile_after` writes <out_dir>/profile/trace.json; `gpu_demo.sh cache_speed` brings it back
gzipped), largest first, each with the kernels on either side and the host calls that were running when it began.

  PYTHONPATH=src python3 benchmarks/trace_gaps.py TRACE.json[.gz] [--min-us 20] [--top 25] [--settle-ms 2]

Prints the device's share of the window in kernels (the union over streams), the idle time by gap size, the kernels
by total time, and the largest gaps: those of the window's first milliseconds apart (the profiler synchronizes when
it starts: on 2026-12-07 every gap over 20 us of a 20-step window fell in its first millisecond), then the rest.
Reads the trace only; runs on any machine.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json

from dflash_train.training.profiling import merge_intervals


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def busy_intervals(kernels: list[dict]) -> list[tuple[float, float, dict, dict]]:
    """Merged [start, end) spans of kernel time (microseconds; profiling.merge_intervals), each with the kernel
    that starts it and the one that ends it."""
    first, last = {}, {}  # a span's first kernel by its start, its last by its end
    for k in kernels:
        start, end = k["ts"], k["ts"] + k.get("dur", 0)
        first.setdefault(start, k)
        last[end] = k
    return [(a, b, first[a], last[b])
            for a, b in merge_intervals([(k["ts"], k["ts"] + k.get("dur", 0)) for k in kernels])]


def host_calls_at(events: list[dict], t: float) -> list[str]:
    """Names of host events (operators, runtime calls) spanning time t, outermost first."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation",
                                                                           "python_function")
             and e["ts"] <= t < e["ts"] + e.get("dur", 0)]
    return [f"{e['name'][:60]} (tid {e.get('tid')})" for e in sorted(spans, key=lambda e: e["ts"])]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=20.0, help="gaps shorter than this are not listed")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--settle-ms", type=float, default=2.0,
                    help="gaps beginning this soon after the first kernel are listed apart: the profiler synchronizes "
                         "the device when it starts, so the first step's launches find it idle")
    args = ap.parse_args(argv)
    events = load(args.trace)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        raise SystemExit(f"{args.trace}: no kernels in the trace (a CPU run, or CUPTI recorded none)")
    spans = busy_intervals(kernels)
    first, last = spans[0][0], spans[-1][1]
    busy = sum(b - a for a, b, _, _ in spans)
    gaps = [(spans[i + 1][0] - spans[i][1], spans[i][1], spans[i][3], spans[i + 1][2]) for i in range(len(spans) - 1)]
    print(f"window {(last - first) / 1e3:.2f} ms from the first kernel to the last: in kernels {busy / 1e3:.2f} ms "
          f"({busy / (last - first):.1%}), idle {(last - first - busy) / 1e3:.2f} ms in {len(gaps)} gaps")
    by_size = collections.Counter()
    for g, *_ in gaps:
        bucket = next(f"< {b} us" for b in (5, 20, 100, 500, 2000, float("inf")) if g < b)
        by_size[bucket] += g
    print("idle by gap size: " + ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in by_size.items()))
    streams = collections.Counter()
    names = collections.Counter()
    for k in kernels:
        streams[k.get("args", {}).get("stream", k.get("tid"))] += k.get("dur", 0)
        names[k["name"][:90]] += k.get("dur", 0)
    print("kernel time by stream: " + ", ".join(f"{s}: {d / 1e3:.2f} ms" for s, d in streams.most_common()))
    print("kernels by total time:")
    for n, d in names.most_common(15):
        print(f"  {d / 1e3:8.2f} ms  {n}")
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset")]
    settle = first + 1e3 * args.settle_ms
    for title, part in ((f"in the first {args.settle_ms:g} ms", [x for x in gaps if x[1] < settle]),
                        ("after it", [x for x in gaps if x[1] >= settle])):
        listed = [x for x in sorted(part, key=lambda x: -x[0])[:args.top] if x[0] >= args.min_us]
        print(f"largest gaps (>= {args.min_us:g} us) {title}: idle {sum(x[0] for x in part) / 1e3:.2f} ms in "
              f"{len(part)} gaps{'' if listed else ', none listed'}")
        for g, t, before, after in listed:
            print(f"  {g:8.1f} us at +{(t - first) / 1e3:.3f} ms: after {before['name'][:50]} -> {after['name'][:50]}")
            for call in host_calls_at(host, t)[-4:]:
                print(f"      host: {call}")


if __name__ == "__main__":
    main()
