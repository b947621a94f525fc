# A copy of the project's shared/tools/plan_bound.py (the steering repository's tool, kept here so that the tests
# read nothing outside this repository); the oracle of tests/test_planner.py and tests/test_plan_gaps.py.
"""Lower bounds for model residency plans, from the H200 anchors (../reference/anchors-h200.json).

For a sequence of node runs, each needing some models resident plus activation memory, find the plan
that moves the fewest bytes host->GPU under a budget, by dynamic programming over residency states.
Two granularities: whole models, and block-granular (any fraction of a model may stay resident, in
steps of 1/GRAN). Unloads are free (a pinned host copy stays); loads cost bytes / pinned bandwidth.
Prints, per scenario, the uncapped time, the whole-model optimum and the block-granular optimum, as
ratios to uncapped: the physical floor any planner can reach with these costs.
"""
import itertools
import json

GiB = 2**30
BW = 55.3e9  # pinned H2D, bytes/s
W = {"te": 5.80, "dit": 7.22, "vae": 0.09}  # GiB resident weights (TE: layers 0..26 only; VAE decoder)
# activation GiB and compute seconds by side (measured at 512/1024/1536; 2048 extrapolated x4 from 1024)
ACT = {512: {"te": 0.2, "dit": 0.22, "vae": 0.60}, 1024: {"te": 0.2, "dit": 0.57, "vae": 2.38},
       1536: {"te": 0.2, "dit": 1.2, "vae": 5.35}, 2048: {"te": 0.2, "dit": 2.3, "vae": 9.5}}
SEC = {512: {"te": 0.033, "dit": 4 * 0.039, "vae": 0.022}, 1024: {"te": 0.033, "dit": 4 * 0.083, "vae": 0.086},
       1536: {"te": 0.033, "dit": 4 * 0.17, "vae": 0.205}, 2048: {"te": 0.033, "dit": 4 * 0.33, "vae": 0.40}}
GRAN = 20
CONTEXT = 0.6  # GiB of a real card taken by the CUDA context and the like


def nodes_for(side, images, queued):
    one = ["te", "dit", "vae"]
    if queued:
        return [m for m in one for _ in range(images)]
    return one * images


def best(seq, side, budget, gran):
    """Min bytes loaded over the sequence; state = tuple of resident fractions (in 1/gran units)."""
    models = list(W)
    levels = range(gran + 1) if gran > 1 else (0, 1)
    full = gran if gran > 1 else 1
    states = list(itertools.product(levels, repeat=len(models)))

    def mem(st):
        return sum(W[m] * st[i] / full for i, m in enumerate(models))

    cost = {tuple(0 for _ in models): 0.0}  # cold start: nothing resident
    for need in seq:
        k = models.index(need)
        nxt = {}
        for st in states:
            if st[k] != full:
                continue
            if mem(st) + ACT[side][need] > budget:
                continue
            c = min(prev_c + sum(max(0, st[i] - p[i]) * W[m] / full for i, m in enumerate(models))
                    for p, prev_c in cost.items())
            nxt[st] = c
        if not nxt:
            return None
        cost = nxt
    return min(cost.values())


def run():
    rows = []
    for side in (1024, 2048):
        for images, queued in ((1, False), (2, False), (8, False), (8, True)):
            seq = nodes_for(side, images, queued)
            compute = sum(SEC[side][n] for n in seq)
            unc = best(seq, side, 1e9, 1) * GiB / BW + compute
            for card in (24, 16, 12, 10, 8):
                budget = card - CONTEXT
                row = {"side": side, "images": images, "queued": queued, "card_gib": card}
                for name, gran in (("whole", 1), ("blocks", GRAN)):
                    b = best(seq, side, budget, gran)
                    row[name] = None if b is None else round((b * GiB / BW + compute) / unc, 3)
                    row[name + "_gib_moved"] = None if b is None else round(b, 2)
                rows.append(row)
                print(json.dumps(row))
    return rows


if __name__ == "__main__":
    run()
