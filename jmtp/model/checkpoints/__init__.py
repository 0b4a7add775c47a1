"""Checkpoint I/O: GGUF and HF safetensors readers, FP8 checkpoints, the converted-weights cache,
MTP-head files, the tokenizer, and the public loaders (:mod:`~jmtp.model.checkpoints.loader`).
Everything here turns files into the parameter tree :mod:`jmtp.model.schema` describes; the
math lives one floor up, in :mod:`jmtp.model`."""
