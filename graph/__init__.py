"""The engine: workflow parsing, validation, estimation, planning, execution."""
