"""The ``specpilot demo`` helpers: local model preparation, prompts and corpora."""
