"""Serving many requests at once (continuous batching): ``sequence.py`` (a request's state), ``scheduler.py``
(waiting queue, KV slots), ``executor.py`` (:class:`~specdecode.batch.executor.BatchEngine`, the step loop)."""
