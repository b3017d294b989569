"""specpilot's contract: what the engine plugin and the controller share, below both.

The wire's records (``records``) and what both sides check them against (``validation``,
``classes``, ``buckets``), the one step-pricing formula (``pricing``), the engine stream's
converters between records and protobuf (``engine_stream``), TLS (``tls``), the settings-doc
helpers (``fielddocs``) and the package's version (``version``). It imports neither the
controller nor the plugin: the plugin loads this and ``specpilot.v1``, never the controller's
brain. Pure apart from ``tls`` (certificate files) and ``engine_stream`` (protobuf).
"""
