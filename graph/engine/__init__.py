"""The engine: runs a Plan (graph/plan/) step by step on a device, with the residency ledger, the budget, the cost
profile and the output cache; `planning.py` is its torch-free half (a prompt validated, estimated and planned).

Nothing is imported here: `graph.engine.planning` and `graph.engine.budget` import without torch."""
