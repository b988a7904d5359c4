"""CPU kernels that XLA calls as FFI custom calls (built for the host on first use)."""
