"""Fully asynchronous training (verl's fully-async policy): a rollouter streaming prompt groups from a
pool of its own into a bounded queue, and a trainer updating on them, syncing its weights to the
rollouter every few updates. :mod:`.main` builds it; the entry point is
``python -m hybridflow.trainer.fully_async_main``."""
