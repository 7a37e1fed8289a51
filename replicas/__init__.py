"""A replica server: an engine (models and scheduler) around one KVCacheManager, with an
OpenAI-compatible API and ``probe_reuse``. See docs/ for the pieces."""
