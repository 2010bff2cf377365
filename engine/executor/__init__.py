"""Runs the model on one process or, under tensor parallelism, on one process per rank: `build_model_runner`
picks; `MultiprocExecutor` drives the ranks (rank 0 in the engine core's process, the others in worker
processes that it spawns and watches)."""
