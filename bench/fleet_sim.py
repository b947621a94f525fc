"""A fleet on paper: 100 workers, 10,000 prompts over several model sets, with the H200's measured costs;
model-aware consumption (server/fleet_worker.py's own `choose`, batches of up to 16) against first-come.

    python3 bench/fleet_sim.py [--workers 100] [--prompts 10000] [--out bench/results/fleet_sim.json]

Pure and deterministic (a seeded random stream; no GPU, no broker). The costs, each from a measured file:
- a warm 1024² 4-step klein-4B prompt, models resident: load_probe.json engine.warm (0.689 s);
- loading a 4B set (text encoder 5.80 GiB + transformer 7.22 GiB + VAE 0.16 GiB) from its files:
  load_probe.json engine.cold minus engine.warm (5.377 - 0.689 s), i.e. 0.356 s per GiB; sets load at that rate;
- 9B sets: not measured here; sized by parameter count (transformer 9.1 B, Qwen3-8B layers 0..26: 16.9 + 11.8 +
  0.16 GiB) and their prompt time scaled from anchors-h200.json (the sampler's share, 4 x 0.0833 s, times 2.3);
  marked "estimated" in the report.
The GPU holds at most `capacity` GiB of weights (H200: 139.8 GiB less room for 1024² activations); the least
recently used set leaves when a new one does not fit. Sets share no files here (a set is a unit).

Policies: `first_come` (ComfyUI's distributed mode: an idle worker takes the oldest prompt, one at a time),
`first_come_batched` (the oldest prompt and the others of its set waiting, up to 16: batching without model
awareness), `model_aware` (fleet_worker.choose: the sets it holds first, a set nobody holds when it holds
nothing or after `grace`, another worker's set only after `steal_after`; up to 16 at once).
Scenarios: prompts arriving at 70% of the fleet's warm capacity (Poisson), or all waiting at once (a backlog);
H200 capacity, and a card that holds one set at a time.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # run with vramgraph importable (as the other bench/ scripts)
RESULTS = ROOT / "bench" / "results"
# one klein-4B transformer step at 1024² on the H200, bf16: the project's reference measurements
# (shared/reference/anchors-h200.json, transformer_step_1024.median_s; that file is not in this repository)
TRANSFORMER_STEP_1024_S = 0.0833


def costs() -> dict:
    probe = json.loads((RESULTS / "load_probe.json").read_text())["engine"]
    warm, cold = probe["warm"]["seconds"], probe["cold"]["seconds"]
    gib_4b = 5.80 + 7.22 + 0.16
    per_gib = (cold - warm) / gib_4b
    step = TRANSFORMER_STEP_1024_S
    gib_9b = 16.9 + 11.8 + 0.16
    return {"prompt_4b_s": warm, "load_s_per_gib": round(per_gib, 4), "set_4b_gib": gib_4b, "set_9b_gib": gib_9b,
            "prompt_9b_s": round(warm + 4 * step * 1.3, 4), "h200_weights_capacity_gib": 139.8 - 24.0,
            "sources": {"prompt_4b_s": "bench/results/load_probe.json engine.warm",
                        "load_s_per_gib": "bench/results/load_probe.json engine.cold - engine.warm, over 13.18 GiB",
                        "prompt_9b_s": "estimated: + 1.3 x the sampler's 4 steps (reference/anchors-h200.json "
                                       "transformer_step_1024 = 0.0833 s) for 2.3x the parameters",
                        "set_9b_gib": "estimated from parameter counts",
                        "h200_weights_capacity_gib": "139.8 GiB less 24 GiB, the 1024² peak in speed.json"}}


@dataclass
class SimWorker:
    ident: int
    capacity: float
    resident: OrderedDict = field(default_factory=OrderedDict)  # set -> GiB, least recently used first
    busy_until: float = 0.0
    busy: bool = False
    loads: int = 0
    gib_loaded: float = 0.0
    last_used: dict = field(default_factory=dict)


def simulate(policy: str, sets: dict[str, dict], arrivals: list[tuple[float, str]], workers: int, capacity: float,
             c: dict, max_batch: int = 16, grace: float = 1.0, steal_after: float = 30.0) -> dict:
    from vramgraph.server.fleet_worker import choose

    fleet = [SimWorker(i, capacity) for i in range(workers)]
    queues: dict[str, deque] = {s: deque() for s in sets}
    fifo: deque = deque()  # (arrival, set, idx) for first_come
    waiting: dict[str, float] = {}
    holders: dict[str, int] = dict.fromkeys(sets, 0)
    events: list = [(t, 0, "arrive", i) for i, (t, _) in enumerate(arrivals)]
    heapq.heapify(events)
    seq = len(events)
    done_at = [0.0] * len(arrivals)
    resident_hits = 0
    taken_set = [False] * len(arrivals)
    tick_pending = False
    now = 0.0

    def take(w: SimWorker, s: str, idxs: list[int]) -> None:
        nonlocal seq, resident_hits
        held = s in w.resident
        resident_hits += len(idxs) * held
        t = 0.0
        if held:
            w.resident.move_to_end(s)
        else:
            gib = sets[s]["gib"]
            while w.resident and sum(w.resident.values()) + gib > w.capacity:
                old, _ = w.resident.popitem(last=False)
                holders[old] -= 1
            w.resident[s] = gib
            holders[s] += 1
            w.loads += 1
            w.gib_loaded += gib
            t += gib * c["load_s_per_gib"]
        t += len(idxs) * sets[s]["prompt_s"]
        w.busy, w.busy_until, w.last_used[s] = True, now + t, now
        for i in idxs:
            done_at[i] = now + t
            taken_set[i] = True
        seq += 1
        heapq.heappush(events, (now + t, seq, "done", w.ident))

    def dispatch() -> None:
        nonlocal seq, tick_pending
        idle = [w for w in fleet if not w.busy]
        for w in idle:
            if policy == "model_aware":
                counts = {s: len(q) for s, q in queues.items() if q}
                if not counts:
                    break
                holds = sorted(w.resident, key=lambda s: -w.last_used.get(s, 0.0))
                others = {s: n - (s in w.resident) for s, n in holders.items() if n - (s in w.resident) > 0}
                s = choose(counts, holds, others, waiting, now, grace, steal_after, max_batch)
                if s is None:
                    continue
                q = queues[s]
                idxs = [q.popleft()[2] for _ in range(min(max_batch, len(q)))]
                if not q:
                    waiting.pop(s, None)
                take(w, s, idxs)
            else:
                while fifo and taken_set[fifo[0][2]]:
                    fifo.popleft()
                if not fifo:
                    break
                _, s, i = fifo.popleft()
                idxs = [i]
                q = queues[s]  # the same prompts by set (entries already taken are skipped)
                while policy == "first_come_batched" and q and len(idxs) < max_batch:
                    j = q.popleft()[2]
                    if not taken_set[j] and j != i:
                        idxs.append(j)
                for j in idxs:
                    taken_set[j] = True
                take(w, s, idxs)
        if policy == "model_aware" and any(queues.values()) and any(not w.busy for w in fleet) and not tick_pending:
            tick_pending = True  # idle workers look again (grace and steal_after run out while nothing happens)
            seq += 1
            heapq.heappush(events, (now + 0.25, seq, "tick", None))

    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == "arrive":
            s = arrivals[what][1]
            if policy == "model_aware":
                if not queues[s]:
                    waiting[s] = now
                queues[s].append((now, s, what))
            else:
                fifo.append((now, s, what))
                queues[s].append((now, s, what))
        elif kind == "done":
            fleet[what].busy = False
        else:
            tick_pending = False
        dispatch()

    latency = sorted(done_at[i] - arrivals[i][0] for i in range(len(arrivals)))
    loads = [w.loads for w in fleet]
    return {"total_s": round(max(done_at), 2), "model_loads": sum(loads), "loads_per_worker_mean": sum(loads) / workers,
            "loads_per_worker_max": max(loads), "gib_loaded": round(sum(w.gib_loaded for w in fleet), 1),
            "resident_share": round(resident_hits / len(arrivals), 4),
            "latency_mean_s": round(sum(latency) / len(latency), 2),
            "latency_p95_s": round(latency[int(0.95 * (len(latency) - 1))], 2)}


def model_sets(c: dict) -> dict[str, dict]:
    """Ten sets: six of klein-4B size (the distilled and base models, four fine-tunes), four of klein-9B size."""
    sets = {}
    for i in range(6):
        sets[f"4b-{i}"] = {"gib": c["set_4b_gib"], "prompt_s": c["prompt_4b_s"]}
    for i in range(4):
        sets[f"9b-{i}"] = {"gib": c["set_9b_gib"], "prompt_s": c["prompt_9b_s"], "estimated": True}
    return sets


def workload(sets: dict, n: int, rate: float | None, seed: int = 0) -> list[tuple[float, str]]:
    """n prompts over the sets by a Zipf-like popularity (weight 1/rank), arriving at `rate` per second (Poisson),
    or all at t = 0 (rate None)."""
    rng = random.Random(seed)
    names = list(sets)
    rng.shuffle(names)
    weights = [1 / (k + 1) for k in range(len(names))]
    t, out = 0.0, []
    for _ in range(n):
        if rate:
            t += rng.expovariate(rate)
        out.append((t, rng.choices(names, weights)[0]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=10000)
    ap.add_argument("--out", default=str(RESULTS / "fleet_sim.json"))
    args = ap.parse_args(argv)
    c = costs()
    sets = model_sets(c)
    mix = workload(sets, args.prompts, None)
    mean_prompt = sum(sets[s]["prompt_s"] for _, s in mix) / len(mix)
    rate = 0.7 * args.workers / mean_prompt
    scenarios = {"h200_arrivals_70pct": (c["h200_weights_capacity_gib"], rate),
                 "h200_backlog": (c["h200_weights_capacity_gib"], None),
                 "one_set_card_arrivals_70pct": (c["set_9b_gib"], rate),
                 "one_set_card_backlog": (c["set_9b_gib"], None)}
    report: dict = {"workers": args.workers, "prompts": args.prompts, "costs": c,
                    "sets": {s: v["gib"] for s, v in sets.items()}, "arrival_rate_per_s": round(rate, 2),
                    "scenarios": {}}
    for name, (capacity, r) in scenarios.items():
        arrivals = workload(sets, args.prompts, r)
        report["scenarios"][name] = {"capacity_gib": capacity, **{
            p: simulate(p, sets, arrivals, args.workers, capacity, c)
            for p in ("first_come", "first_come_batched", "model_aware")}}
        row = report["scenarios"][name]
        print(f"{name}: " + "; ".join(f"{p} {row[p]['total_s']} s, {row[p]['model_loads']} loads, "
                                      f"{row[p]['resident_share']:.0%} resident"
                                      for p in ("first_come", "first_come_batched", "model_aware")))
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
