"""What one update computes: rewards -> advantages -> log-probs -> clipped loss -> a guarded optimizer step."""
