"""Scripts that drive things outside the router: the real vLLM engines on CPU (vllm_cpu)."""
