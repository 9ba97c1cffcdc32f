"""Policy, GRPO loss, alignment metric and callbacks for word-interleaving training."""
