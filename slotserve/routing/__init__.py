"""Request routing across engine replicas (pure Python; no Ray)."""
