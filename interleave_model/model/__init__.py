"""Build the policy (the tiny Llama or a model folder, LoRA, the reference), save its run state, bring older
checkpoints to today's layout, export it."""
