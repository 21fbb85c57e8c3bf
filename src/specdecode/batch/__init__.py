"""The engine's one decode step, for one request or many (continuous batching): ``sequence.py`` (a request's
state), ``scheduler.py`` (waiting queue, KV slots), ``rows.py`` (a forward's row layout), ``costs.py`` (row
padding, step costs) and ``executor.py`` (:class:`~specdecode.batch.executor.BatchEngine`, the step)."""
