"""The planner: a pure function from sizes, costs and a budget to a Plan of Load, Unload and Run steps.

Plain data in and out; it imports neither torch nor any node module (node types only under TYPE_CHECKING).
`planner.plan` is the entry point; `types` holds its inputs and output."""
