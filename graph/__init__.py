"""The graph engine, in four rooms (arrows point down; each room imports only the rooms below it):

    graph/engine/    runs a plan: executor, run state, output cache, residency ledger, budget, cost profiles, devices,
                     settings to engine
    graph/draw/      a plan's picture (the timeline SVG and its JSON numbers)
    graph/workflow/  saved workflows: parsing, UI to API, validation, estimates, queue merging, roles, errors
    graph/plan/      the planner: plain data in (sizes, costs, budget), a Plan out; no torch, no node module

Nothing is imported here, so each room imports on its own (tests/test_layers.py checks the arrows).
"""
