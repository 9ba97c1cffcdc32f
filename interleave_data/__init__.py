"""Text in, interleaving examples out. Knows nothing of models."""
