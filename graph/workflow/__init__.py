"""Workflows before they run: parsing (API and UI format), validation, estimates from shapes, queue merging,
the roles of the shipped workflows' nodes, model-family recognition and the errors. Torch-free."""
