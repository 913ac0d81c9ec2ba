"""The worker of an engine core without torch: a GGUF model run by the native kernels alone
(`model`, its RoPE tables in `rope`) behind the shared step logic (`runner`);
`engine/native_core.py` decides when it serves and builds it."""
