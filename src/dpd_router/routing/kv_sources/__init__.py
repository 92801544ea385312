"""Where engines say their KV cache is: sources routing asks besides its own prefix index."""
