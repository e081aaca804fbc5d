"""Model artifacts: the hashed manifest of a single or split GGUF (``manifest``) and where
artifacts may live (``storage``). Provisioning and resumable verification come next (issue 14)."""
