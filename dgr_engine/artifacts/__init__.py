"""Model artifacts: the hashed manifest of a single or split GGUF (``manifest``). Provisioning,
resumable verification and the storage policy come next (issue 14)."""
