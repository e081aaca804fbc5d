"""Model artifacts: the hashed manifest of a single or split GGUF (``manifest``), where artifacts
may live (``storage``), where their bytes come from (``sources``), fetching and verifying them
resumably (``provision``, its progress in ``state``), file operations in the root that never
follow a link (``rootdir``), the hash a worker runs at load (``content``) and what a shard of a
layer range reads (``shard``)."""
