"""Execution: the model runner, executors (in process and one process per rank), the
distributed state and the parallel layouts built on them."""
