"""Policy, GRPO loss, alignment metric and callbacks for word-interleaving training."""

from interleave_model.shield import shield_broken_addons

shield_broken_addons()
