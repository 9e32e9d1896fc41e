"""The split-KV decoding kernel family (KV-cache attention): kernels.py, engine.py."""
