"""G completions per prompt, from the own sampler or a colocated vLLM engine."""
